from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodePhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_PHASE_UNSPECIFIED: _ClassVar[NodePhase]
    NODE_PHASE_STARTING: _ClassVar[NodePhase]
    NODE_PHASE_TRAINING: _ClassVar[NodePhase]
    NODE_PHASE_FORMING: _ClassVar[NodePhase]
    NODE_PHASE_ALLREDUCE: _ClassVar[NodePhase]
    NODE_PHASE_SYNCING: _ClassVar[NodePhase]
NODE_PHASE_UNSPECIFIED: NodePhase
NODE_PHASE_STARTING: NodePhase
NODE_PHASE_TRAINING: NodePhase
NODE_PHASE_FORMING: NodePhase
NODE_PHASE_ALLREDUCE: NodePhase
NODE_PHASE_SYNCING: NodePhase

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerStatus(_message.Message):
    __slots__ = ("peer_id", "grpc_address", "round", "param_hash", "ready_for_round", "tokens_per_s", "bandwidth_bytes_per_s", "seconds_since_heartbeat", "seconds_until_expiry", "in_group", "is_self")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    READY_FOR_ROUND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_UNTIL_EXPIRY_FIELD_NUMBER: _ClassVar[int]
    IN_GROUP_FIELD_NUMBER: _ClassVar[int]
    IS_SELF_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    grpc_address: str
    round: int
    param_hash: str
    ready_for_round: int
    tokens_per_s: float
    bandwidth_bytes_per_s: float
    seconds_since_heartbeat: float
    seconds_until_expiry: float
    in_group: bool
    is_self: bool
    def __init__(self, peer_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., round: _Optional[int] = ..., param_hash: _Optional[str] = ..., ready_for_round: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., bandwidth_bytes_per_s: _Optional[float] = ..., seconds_since_heartbeat: _Optional[float] = ..., seconds_until_expiry: _Optional[float] = ..., in_group: _Optional[bool] = ..., is_self: _Optional[bool] = ...) -> None: ...

class LostPeer(_message.Message):
    __slots__ = ("peer_id", "seconds_since_seen")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    seconds_since_seen: float
    def __init__(self, peer_id: _Optional[str] = ..., seconds_since_seen: _Optional[float] = ...) -> None: ...

class SyncingPeer(_message.Message):
    __slots__ = ("peer_id", "grpc_address", "round", "param_hash", "has_estimate", "seconds_until_ready")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    HAS_ESTIMATE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_UNTIL_READY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    grpc_address: str
    round: int
    param_hash: str
    has_estimate: bool
    seconds_until_ready: float
    def __init__(self, peer_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., round: _Optional[int] = ..., param_hash: _Optional[str] = ..., has_estimate: _Optional[bool] = ..., seconds_until_ready: _Optional[float] = ...) -> None: ...

class GroupStatus(_message.Message):
    __slots__ = ("round", "group_id", "leader_id", "member_ids")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBER_IDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    group_id: str
    leader_id: str
    member_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., group_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., member_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("run_name", "protocol_version", "peer_id", "grpc_address", "published", "round", "param_hash", "phase", "phase_round", "seconds_in_phase", "rounds_formed", "group", "peers", "lost_peers", "view_age_seconds", "record_ttl_seconds", "syncing_peers", "round_vector")
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAM_HASH_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_ROUND_FIELD_NUMBER: _ClassVar[int]
    SECONDS_IN_PHASE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FORMED_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LOST_PEERS_FIELD_NUMBER: _ClassVar[int]
    VIEW_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECORD_TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SYNCING_PEERS_FIELD_NUMBER: _ClassVar[int]
    ROUND_VECTOR_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    protocol_version: int
    peer_id: str
    grpc_address: str
    published: bool
    round: int
    param_hash: str
    phase: NodePhase
    phase_round: int
    seconds_in_phase: float
    rounds_formed: int
    group: GroupStatus
    peers: _containers.RepeatedCompositeFieldContainer[PeerStatus]
    lost_peers: _containers.RepeatedCompositeFieldContainer[LostPeer]
    view_age_seconds: float
    record_ttl_seconds: float
    syncing_peers: _containers.RepeatedCompositeFieldContainer[SyncingPeer]
    round_vector: str
    def __init__(self, run_name: _Optional[str] = ..., protocol_version: _Optional[int] = ..., peer_id: _Optional[str] = ..., grpc_address: _Optional[str] = ..., published: _Optional[bool] = ..., round: _Optional[int] = ..., param_hash: _Optional[str] = ..., phase: _Optional[_Union[NodePhase, str]] = ..., phase_round: _Optional[int] = ..., seconds_in_phase: _Optional[float] = ..., rounds_formed: _Optional[int] = ..., group: _Optional[_Union[GroupStatus, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerStatus, _Mapping]]] = ..., lost_peers: _Optional[_Iterable[_Union[LostPeer, _Mapping]]] = ..., view_age_seconds: _Optional[float] = ..., record_ttl_seconds: _Optional[float] = ..., syncing_peers: _Optional[_Iterable[_Union[SyncingPeer, _Mapping]]] = ..., round_vector: _Optional[str] = ...) -> None: ...
