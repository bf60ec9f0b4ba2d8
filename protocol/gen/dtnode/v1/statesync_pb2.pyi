from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TENSOR_DTYPE_UNSPECIFIED: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT32: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_BFLOAT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_FLOAT64: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT64: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT32: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT16: _ClassVar[TensorDtype]
    TENSOR_DTYPE_INT8: _ClassVar[TensorDtype]
    TENSOR_DTYPE_UINT8: _ClassVar[TensorDtype]
    TENSOR_DTYPE_BOOL: _ClassVar[TensorDtype]
TENSOR_DTYPE_UNSPECIFIED: TensorDtype
TENSOR_DTYPE_FLOAT32: TensorDtype
TENSOR_DTYPE_FLOAT16: TensorDtype
TENSOR_DTYPE_BFLOAT16: TensorDtype
TENSOR_DTYPE_FLOAT64: TensorDtype
TENSOR_DTYPE_INT64: TensorDtype
TENSOR_DTYPE_INT32: TensorDtype
TENSOR_DTYPE_INT16: TensorDtype
TENSOR_DTYPE_INT8: TensorDtype
TENSOR_DTYPE_UINT8: TensorDtype
TENSOR_DTYPE_BOOL: TensorDtype

class GetManifestRequest(_message.Message):
    __slots__ = ("state_id",)
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    state_id: str
    def __init__(self, state_id: _Optional[str] = ...) -> None: ...

class StateTensorInfo(_message.Message):
    __slots__ = ("name", "dtype", "num_elements", "num_bytes", "sha256", "block_sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: TensorDtype
    num_elements: int
    num_bytes: int
    sha256: bytes
    block_sha256: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[TensorDtype, str]] = ..., num_elements: _Optional[int] = ..., num_bytes: _Optional[int] = ..., sha256: _Optional[bytes] = ..., block_sha256: _Optional[_Iterable[bytes]] = ...) -> None: ...

class ServingLimits(_message.Message):
    __slots__ = ("max_range_bytes", "max_chunk_bytes")
    MAX_RANGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_range_bytes: int
    max_chunk_bytes: int
    def __init__(self, max_range_bytes: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("round_id", "state_id", "block_bytes", "tensors", "metadata", "limits")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    state_id: str
    block_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[StateTensorInfo]
    metadata: bytes
    limits: ServingLimits
    def __init__(self, round_id: _Optional[int] = ..., state_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[StateTensorInfo, _Mapping]]] = ..., metadata: _Optional[bytes] = ..., limits: _Optional[_Union[ServingLimits, _Mapping]] = ...) -> None: ...

class FetchRangeRequest(_message.Message):
    __slots__ = ("state_id", "tensor_name", "offset", "length", "max_chunk_bytes")
    STATE_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    state_id: str
    tensor_name: str
    offset: int
    length: int
    max_chunk_bytes: int
    def __init__(self, state_id: _Optional[str] = ..., tensor_name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ...) -> None: ...

class StateChunk(_message.Message):
    __slots__ = ("offset", "data")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
