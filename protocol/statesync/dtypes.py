"""The tensor dtypes the wire can name, and their proto enum values (TensorDtype)."""

from __future__ import annotations

import torch

from protocol.gen.dtnode.v1 import statesync_pb2 as pb

_CODE_OF_DTYPE: dict[torch.dtype, int] = {
    torch.float32: pb.TENSOR_DTYPE_FLOAT32,
    torch.float16: pb.TENSOR_DTYPE_FLOAT16,
    torch.bfloat16: pb.TENSOR_DTYPE_BFLOAT16,
    torch.float64: pb.TENSOR_DTYPE_FLOAT64,
    torch.int64: pb.TENSOR_DTYPE_INT64,
    torch.int32: pb.TENSOR_DTYPE_INT32,
    torch.int16: pb.TENSOR_DTYPE_INT16,
    torch.int8: pb.TENSOR_DTYPE_INT8,
    torch.uint8: pb.TENSOR_DTYPE_UINT8,
    torch.bool: pb.TENSOR_DTYPE_BOOL,
}
_DTYPE_OF_CODE = {code: dtype for dtype, code in _CODE_OF_DTYPE.items()}

WIRE_DTYPES = tuple(_CODE_OF_DTYPE)
"""Every dtype a snapshot may hold."""


def dtype_code(dtype: torch.dtype) -> int:
    """The TensorDtype value of a torch dtype; ValueError for one the wire cannot name."""
    if dtype not in _CODE_OF_DTYPE:
        raise ValueError(f"state sync cannot send {dtype}; supported: {', '.join(map(str, WIRE_DTYPES))}")
    return _CODE_OF_DTYPE[dtype]


def dtype_of(code: int) -> torch.dtype | None:
    """The torch dtype of a TensorDtype value; None for UNSPECIFIED or a value this build does not know."""
    return _DTYPE_OF_CODE.get(code)
