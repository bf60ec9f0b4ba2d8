from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Reason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[Reason]
    REASON_WRONG_ROUND: _ClassVar[Reason]
    REASON_LINEAGE_MISMATCH: _ClassVar[Reason]
    REASON_ALREADY_IN_GROUP: _ClassVar[Reason]
    REASON_SMALLER_LEADER: _ClassVar[Reason]
    REASON_NOT_AVAILABLE: _ClassVar[Reason]
    REASON_SWITCHED_LEADER: _ClassVar[Reason]
    REASON_BEGIN_TIMEOUT: _ClassVar[Reason]
    REASON_LEADER_GONE: _ClassVar[Reason]
    REASON_NOT_BOUND: _ClassVar[Reason]
    REASON_INVALID_GROUP: _ClassVar[Reason]
    REASON_STEPPED_DOWN: _ClassVar[Reason]
    REASON_TOO_FEW_ACCEPTED: _ClassVar[Reason]
    REASON_ROUND_STARTED: _ClassVar[Reason]
    REASON_STALE_PROPOSAL: _ClassVar[Reason]
    REASON_TOO_FEW_PEERS: _ClassVar[Reason]
    REASON_MAX_WAIT: _ClassVar[Reason]
    REASON_STREAMS_MISMATCH: _ClassVar[Reason]
REASON_UNSPECIFIED: Reason
REASON_WRONG_ROUND: Reason
REASON_LINEAGE_MISMATCH: Reason
REASON_ALREADY_IN_GROUP: Reason
REASON_SMALLER_LEADER: Reason
REASON_NOT_AVAILABLE: Reason
REASON_SWITCHED_LEADER: Reason
REASON_BEGIN_TIMEOUT: Reason
REASON_LEADER_GONE: Reason
REASON_NOT_BOUND: Reason
REASON_INVALID_GROUP: Reason
REASON_STEPPED_DOWN: Reason
REASON_TOO_FEW_ACCEPTED: Reason
REASON_ROUND_STARTED: Reason
REASON_STALE_PROPOSAL: Reason
REASON_TOO_FEW_PEERS: Reason
REASON_MAX_WAIT: Reason
REASON_STREAMS_MISMATCH: Reason

class JoinRequest(_message.Message):
    __slots__ = ("round", "param_hash")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    round: int
    param_hash: str
    def __init__(self, round: _Optional[int] = ..., param_hash: _Optional[str] = ...) -> None: ...

class Proposal(_message.Message):
    __slots__ = ("round", "proposal_id", "param_hash", "members")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ID_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposal_id: str
    param_hash: str
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., proposal_id: _Optional[str] = ..., param_hash: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class Accept(_message.Message):
    __slots__ = ("round", "proposal_id", "grpc_address", "num_tokens", "bandwidth_bytes_per_s", "stream_addresses", "client", "rank")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STREAM_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposal_id: str
    grpc_address: str
    num_tokens: int
    bandwidth_bytes_per_s: float
    stream_addresses: _containers.RepeatedScalarFieldContainer[str]
    client: bool
    rank: int
    def __init__(self, round: _Optional[int] = ..., proposal_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., stream_addresses: _Optional[_Iterable[str]] = ..., client: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("round", "proposal_id", "reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposal_id: str
    reason: Reason
    def __init__(self, round: _Optional[int] = ..., proposal_id: _Optional[str] = ..., reason: _Optional[_Union[Reason, str]] = ...) -> None: ...

class Withdraw(_message.Message):
    __slots__ = ("round", "proposal_id", "reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposal_id: str
    reason: Reason
    def __init__(self, round: _Optional[int] = ..., proposal_id: _Optional[str] = ..., reason: _Optional[_Union[Reason, str]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("round", "proposal_id", "reason")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    round: int
    proposal_id: str
    reason: Reason
    def __init__(self, round: _Optional[int] = ..., proposal_id: _Optional[str] = ..., reason: _Optional[_Union[Reason, str]] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("peer_id", "grpc_address", "num_tokens", "bandwidth_bytes_per_s", "stream_addresses", "client", "rank")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    STREAM_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    grpc_address: str
    num_tokens: int
    bandwidth_bytes_per_s: float
    stream_addresses: _containers.RepeatedScalarFieldContainer[str]
    client: bool
    rank: int
    def __init__(self, peer_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., stream_addresses: _Optional[_Iterable[str]] = ..., client: _Optional[bool] = ..., rank: _Optional[int] = ...) -> None: ...

class GroupSpec(_message.Message):
    __slots__ = ("round", "group_id", "leader_id", "param_hash", "vector_length", "members", "part_boundaries", "tier_group_size")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    VECTOR_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    PART_BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    TIER_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    round: int
    group_id: str
    leader_id: str
    param_hash: str
    vector_length: int
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    part_boundaries: _containers.RepeatedScalarFieldContainer[int]
    tier_group_size: int
    def __init__(self, round: _Optional[int] = ..., group_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., param_hash: _Optional[str] = ..., vector_length: _Optional[int] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., part_boundaries: _Optional[_Iterable[int]] = ..., tier_group_size: _Optional[int] = ...) -> None: ...

class Begin(_message.Message):
    __slots__ = ("group",)
    GROUP_FIELD_NUMBER: _ClassVar[int]
    group: GroupSpec
    def __init__(self, group: _Optional[_Union[GroupSpec, _Mapping]] = ...) -> None: ...

class MembershipEnvelope(_message.Message):
    __slots__ = ("sender_id", "protocol_version", "join_request", "proposal", "accept", "reject", "withdraw", "cancel", "begin")
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOIN_REQUEST_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    sender_id: str
    protocol_version: int
    join_request: JoinRequest
    proposal: Proposal
    accept: Accept
    reject: Reject
    withdraw: Withdraw
    cancel: Cancel
    begin: Begin
    def __init__(self, sender_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., join_request: _Optional[_Union[JoinRequest, _Mapping]] = ..., proposal: _Optional[_Union[Proposal, _Mapping]] = ..., accept: _Optional[_Union[Accept, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ..., withdraw: _Optional[_Union[Withdraw, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., begin: _Optional[_Union[Begin, _Mapping]] = ...) -> None: ...

class DeliverReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CollectRequest(_message.Message):
    __slots__ = ("receiver_id", "protocol_version", "wait_ms")
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    receiver_id: str
    protocol_version: int
    wait_ms: int
    def __init__(self, receiver_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class CollectReply(_message.Message):
    __slots__ = ("envelopes",)
    ENVELOPES_FIELD_NUMBER: _ClassVar[int]
    envelopes: _containers.RepeatedCompositeFieldContainer[MembershipEnvelope]
    def __init__(self, envelopes: _Optional[_Iterable[_Union[MembershipEnvelope, _Mapping]]] = ...) -> None: ...
