from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CodecKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_KIND_UNSPECIFIED: _ClassVar[CodecKind]
    CODEC_KIND_NONE: _ClassVar[CodecKind]
    CODEC_KIND_FP16: _ClassVar[CodecKind]
    CODEC_KIND_BF16: _ClassVar[CodecKind]
    CODEC_KIND_INT8: _ClassVar[CodecKind]
    CODEC_KIND_INT4: _ClassVar[CodecKind]
    CODEC_KIND_TOPK: _ClassVar[CodecKind]
    CODEC_KIND_TOPK4: _ClassVar[CodecKind]
CODEC_KIND_UNSPECIFIED: CodecKind
CODEC_KIND_NONE: CodecKind
CODEC_KIND_FP16: CodecKind
CODEC_KIND_BF16: CodecKind
CODEC_KIND_INT8: CodecKind
CODEC_KIND_INT4: CodecKind
CODEC_KIND_TOPK: CodecKind
CODEC_KIND_TOPK4: CodecKind

class CodecSpec(_message.Message):
    __slots__ = ("kind", "block_size", "kept_per_block")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KEPT_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    kind: CodecKind
    block_size: int
    kept_per_block: int
    def __init__(self, kind: _Optional[_Union[CodecKind, str]] = ..., block_size: _Optional[int] = ..., kept_per_block: _Optional[int] = ...) -> None: ...

class RoundRef(_message.Message):
    __slots__ = ("round_id", "group_digest", "sender_index", "sender_peer_id")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SENDER_INDEX_FIELD_NUMBER: _ClassVar[int]
    SENDER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    group_digest: bytes
    sender_index: int
    sender_peer_id: str
    def __init__(self, round_id: _Optional[int] = ..., group_digest: _Optional[bytes] = ..., sender_index: _Optional[int] = ..., sender_peer_id: _Optional[str] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("offset", "num_elements", "payload")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    offset: int
    num_elements: int
    payload: bytes
    def __init__(self, offset: _Optional[int] = ..., num_elements: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ContributionHeader(_message.Message):
    __slots__ = ("round", "part_index", "codec", "num_elements", "weight")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    round: RoundRef
    part_index: int
    codec: CodecSpec
    num_elements: int
    weight: float
    def __init__(self, round: _Optional[_Union[RoundRef, _Mapping]] = ..., part_index: _Optional[int] = ..., codec: _Optional[_Union[CodecSpec, _Mapping]] = ..., num_elements: _Optional[int] = ..., weight: _Optional[float] = ...) -> None: ...

class ContributionMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ContributionHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[ContributionHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class SendChunks(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AlreadyDecided(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContributionReceipt(_message.Message):
    __slots__ = ("num_elements_received",)
    NUM_ELEMENTS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    num_elements_received: int
    def __init__(self, num_elements_received: _Optional[int] = ...) -> None: ...

class ContributionReply(_message.Message):
    __slots__ = ("send_chunks", "already_decided", "receipt", "still_working")
    SEND_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_DECIDED_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    STILL_WORKING_FIELD_NUMBER: _ClassVar[int]
    send_chunks: SendChunks
    already_decided: AlreadyDecided
    receipt: ContributionReceipt
    still_working: StillWorking
    def __init__(self, send_chunks: _Optional[_Union[SendChunks, _Mapping]] = ..., already_decided: _Optional[_Union[AlreadyDecided, _Mapping]] = ..., receipt: _Optional[_Union[ContributionReceipt, _Mapping]] = ..., still_working: _Optional[_Union[StillWorking, _Mapping]] = ...) -> None: ...

class PullAverageRequest(_message.Message):
    __slots__ = ("round", "part_index")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    round: RoundRef
    part_index: int
    def __init__(self, round: _Optional[_Union[RoundRef, _Mapping]] = ..., part_index: _Optional[int] = ...) -> None: ...

class AverageHeader(_message.Message):
    __slots__ = ("part_index", "producer_index", "contributor_indices", "codec", "num_elements", "weight_sum", "contributor_weights")
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_INDEX_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_INDICES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SUM_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    part_index: int
    producer_index: int
    contributor_indices: _containers.RepeatedScalarFieldContainer[int]
    codec: CodecSpec
    num_elements: int
    weight_sum: float
    contributor_weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, part_index: _Optional[int] = ..., producer_index: _Optional[int] = ..., contributor_indices: _Optional[_Iterable[int]] = ..., codec: _Optional[_Union[CodecSpec, _Mapping]] = ..., num_elements: _Optional[int] = ..., weight_sum: _Optional[float] = ..., contributor_weights: _Optional[_Iterable[float]] = ...) -> None: ...

class StillWorking(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AverageMessage(_message.Message):
    __slots__ = ("still_working", "header", "chunk")
    STILL_WORKING_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    still_working: StillWorking
    header: AverageHeader
    chunk: TensorChunk
    def __init__(self, still_working: _Optional[_Union[StillWorking, _Mapping]] = ..., header: _Optional[_Union[AverageHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("round", "average", "committed")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    round: RoundRef
    average: AverageHeader
    committed: bool
    def __init__(self, round: _Optional[_Union[RoundRef, _Mapping]] = ..., average: _Optional[_Union[AverageHeader, _Mapping]] = ..., committed: _Optional[bool] = ...) -> None: ...

class ReplicaMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ReplicaReceipt(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaReply(_message.Message):
    __slots__ = ("send_chunks", "receipt", "still_working")
    SEND_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    STILL_WORKING_FIELD_NUMBER: _ClassVar[int]
    send_chunks: SendChunks
    receipt: ReplicaReceipt
    still_working: StillWorking
    def __init__(self, send_chunks: _Optional[_Union[SendChunks, _Mapping]] = ..., receipt: _Optional[_Union[ReplicaReceipt, _Mapping]] = ..., still_working: _Optional[_Union[StillWorking, _Mapping]] = ...) -> None: ...

class RoundFinished(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: RoundRef
    def __init__(self, round: _Optional[_Union[RoundRef, _Mapping]] = ...) -> None: ...

class RoundFinishedReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PullSliceRequest(_message.Message):
    __slots__ = ("round_id", "plan_digest", "slice_index", "sender_peer_id")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SLICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SENDER_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    plan_digest: bytes
    slice_index: int
    sender_peer_id: str
    def __init__(self, round_id: _Optional[int] = ..., plan_digest: _Optional[bytes] = ..., slice_index: _Optional[int] = ..., sender_peer_id: _Optional[str] = ...) -> None: ...
