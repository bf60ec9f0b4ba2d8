"""Codecs: how a flat fp32 tensor becomes bytes on the wire, and back.

Every codec maps a 1-D fp32 tensor of `n` numbers to a uint8 tensor of exactly
`encoded_num_bytes(n)` bytes and back, is keyed by the wire enum `CodecKind`, and states a
per-element error bound `error_bound(x)` such that |decode(encode(x)) - x| <= error_bound(x):

    none  fp32 as is                               bound 0
    fp16  IEEE half, clamped to +-65504            |x| * 2^-11 (relative), 2^-25 near zero, plus the clamp
    bf16  bfloat16, round to nearest even          |x| * 2^-8 (relative), 2^-134 near zero
    int8  blockwise absmax, scale = absmax / 127   absmax_block * (1/254 + 2^-20)
    int4  blockwise absmax, scale = absmax / 7     absmax_block * (1/14 + 2^-20)

The blockwise codecs follow the absmax quantization of Dettmers et al. 2022 ("8-bit Optimizers via
Block-wise Quantization", arXiv:2110.02861): each block of `block_size` numbers carries its own fp32
scale, so one outlier only costs precision inside its own block. The 2^-20 slack covers the float32
rounding of the scale, of x / scale and of code * scale. Payload layout for a chunk of n numbers in
b = ceil(n / block_size) blocks: b fp32 scales, then the codes (int8: n bytes; int4: ceil(n / 2)
bytes, code + 8 in a nibble, even element in the low nibble).

All work is vectorized torch on whole chunks (numpy only for checking a chunk's few scales); there is
no per-element Python.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from protocol.gen.dtnode.v1 import allreduce_pb2 as pb

# Payloads arrive as immutable `bytes`; we only ever read them through torch.frombuffer, so torch's
# warning about a non-writable buffer is noise. The filter only covers warnings raised from this module.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)

Payload = bytes | bytearray | memoryview | torch.Tensor

FP16_MAX = 65504.0
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
QUANT_ROUNDING_SLACK = 2.0**-20


class CodecError(ValueError):
    """A payload does not decode: wrong length, or it holds non-finite numbers."""


def as_uint8(payload: Payload) -> torch.Tensor:
    """View any bytes-like payload as a 1-D uint8 tensor without copying."""
    if isinstance(payload, torch.Tensor):
        if payload.dtype != torch.uint8 or payload.dim() != 1:
            raise CodecError(f"payload tensor must be 1-D uint8, got {payload.dtype} {tuple(payload.shape)}")
        return payload
    if len(payload) == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(payload, dtype=torch.uint8)


def fp32_view(values: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D fp32 tensor, without copying; valid while nobody writes to it."""
    if values.dtype != torch.float32 or values.dim() != 1 or not values.is_contiguous():
        raise ValueError(
            f"expected a contiguous 1-D float32 tensor, got {values.dtype} {tuple(values.shape)}"
        )
    return values.numpy().data.cast("B")


def wire_bytes(payload: bytes | memoryview) -> bytes:
    """A payload as protobuf's bytes fields take it (a view is copied, one chunk at a time)."""
    return payload if isinstance(payload, bytes) else bytes(payload)


def all_finite(values: torch.Tensor) -> bool:
    """True if no element is NaN or +-inf (min/max propagate NaN; one fused pass, no bool temporary)."""
    if values.numel() == 0:
        return True
    low, high = torch.aminmax(values)
    return bool(torch.isfinite(low) and torch.isfinite(high))


class Codec(ABC):
    """Turns fp32 chunks into bytes and back; subclasses are stateless and safe to share."""

    kind: ClassVar[pb.CodecKind]
    name: ClassVar[str]
    payload_is_fp32: ClassVar[bool] = False
    """A payload is its numbers' own fp32 bytes: once decoded into a tensor, that tensor's memory holds
    the payload, so a holder may keep a view of the tensor instead of a second copy (``fp32_view``)."""

    def __init__(self, block_size: int = 0) -> None:
        self.block_size = block_size

    @abstractmethod
    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """Encode a 1-D fp32 tensor into a 1-D uint8 tensor of encoded_num_bytes(values.numel()).

        The result may share memory with `values` (the "none" codec does); copy it before mutating
        the input.
        """

    @abstractmethod
    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        """Decode into the 1-D fp32 tensor `out` (its length is the number of elements); return out.

        Raises CodecError if the payload has the wrong length or decodes to non-finite numbers.
        """

    @abstractmethod
    def encoded_num_bytes(self, num_elements: int) -> int:
        """Exact payload length for num_elements numbers."""

    @abstractmethod
    def validate(self, payload: Payload, num_elements: int) -> None:
        """Cheaply check, without decoding, that a payload would decode to num_elements finite numbers.

        Raises CodecError otherwise. A receiver calls this on every chunk as it arrives.
        """

    @abstractmethod
    def error_bound(self, values: torch.Tensor) -> torch.Tensor:
        """Per-element bound on |decode(encode(values)) - values| (fp32, same shape as values)."""

    def decode(self, payload: Payload, num_elements: int) -> torch.Tensor:
        """Decode a payload of num_elements numbers into a new fp32 tensor."""
        return self.decode_into(payload, torch.empty(num_elements, dtype=torch.float32))

    def spec(self) -> pb.CodecSpec:
        """The wire description of this codec."""
        return pb.CodecSpec(kind=self.kind, block_size=self.block_size)

    def _check_length(self, payload: torch.Tensor, num_elements: int) -> None:
        expected = self.encoded_num_bytes(num_elements)
        if payload.numel() != expected:
            raise CodecError(
                f"{self.name} payload for {num_elements} numbers must be {expected} bytes, got {payload.numel()}"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"


def _check_input(values: torch.Tensor) -> None:
    if values.dtype != torch.float32 or values.dim() != 1:
        raise ValueError(f"codecs encode 1-D float32 tensors, got {values.dtype} {tuple(values.shape)}")


class NoneCodec(Codec):
    """fp32 as is: 4 bytes per number, exact."""

    kind = pb.CODEC_KIND_NONE
    name = "none"
    payload_is_fp32 = True

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The bytes of `values` (a view: it shares memory with a contiguous input, no copy)."""
        _check_input(values)
        return values.contiguous().view(torch.uint8)

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        raw = as_uint8(payload)
        self._check_length(raw, out.numel())
        out.copy_(raw.view(torch.float32))
        if not all_finite(out):
            raise CodecError("fp32 payload holds non-finite numbers")
        return out

    def encoded_num_bytes(self, num_elements: int) -> int:
        return 4 * num_elements

    def validate(self, payload: Payload, num_elements: int) -> None:
        raw = as_uint8(payload)
        self._check_length(raw, num_elements)
        if not all_finite(raw.view(torch.float32)):
            raise CodecError("fp32 payload holds non-finite numbers")

    def error_bound(self, values: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(values)


class _HalfCodec(Codec):
    """Shared code of fp16 and bf16: clamp to the format's range, cast, send 2 bytes per number."""

    dtype: ClassVar[torch.dtype]
    max_value: ClassVar[float]
    relative_error: ClassVar[float]
    absolute_error: ClassVar[float]

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        _check_input(values)
        # Clamp first: a finite fp32 above the format's max would otherwise become +-inf.
        return values.clamp(-self.max_value, self.max_value).to(self.dtype).view(torch.uint8)

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        raw = as_uint8(payload)
        self._check_length(raw, out.numel())
        out.copy_(raw.view(self.dtype))
        if not all_finite(out):
            raise CodecError(f"{self.name} payload holds non-finite numbers")
        return out

    def encoded_num_bytes(self, num_elements: int) -> int:
        return 2 * num_elements

    def validate(self, payload: Payload, num_elements: int) -> None:
        raw = as_uint8(payload)
        self._check_length(raw, num_elements)
        if not all_finite(raw.view(self.dtype)):
            raise CodecError(f"{self.name} payload holds non-finite numbers")

    def error_bound(self, values: torch.Tensor) -> torch.Tensor:
        magnitude = values.abs()
        rounding = torch.clamp(magnitude * self.relative_error, min=self.absolute_error)
        return rounding + torch.clamp(magnitude - self.max_value, min=0.0)


class Float16Codec(_HalfCodec):
    """IEEE half precision: 11 significant bits, range +-65504."""

    kind = pb.CODEC_KIND_FP16
    name = "fp16"
    dtype = torch.float16
    max_value = FP16_MAX
    relative_error = 2.0**-11
    absolute_error = 2.0**-25  # half the spacing of fp16 subnormals


class BFloat16Codec(_HalfCodec):
    """bfloat16: fp32's exponent range with 8 significant bits."""

    kind = pb.CODEC_KIND_BF16
    name = "bf16"
    dtype = torch.bfloat16
    max_value = BF16_MAX
    relative_error = 2.0**-8
    absolute_error = 2.0**-134  # half the spacing of bf16 subnormals


class _BlockwiseCodec(Codec):
    """Blockwise absmax quantization to symmetric integer codes in [-max_code, max_code]."""

    max_code: ClassVar[int]

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        super().__init__(block_size)

    def _num_blocks(self, num_elements: int) -> int:
        return math.ceil(num_elements / self.block_size)

    def _block_absmax(self, values: torch.Tensor) -> torch.Tensor:
        """Absolute maximum of each block, shape (num_blocks,)."""
        num_full = values.numel() // self.block_size
        full = values[: num_full * self.block_size].view(num_full, self.block_size)  # (blocks, B)
        # amax and amin avoid materializing |values|, which costs a full-size temporary.
        absmax = torch.maximum(full.amax(dim=1), full.amin(dim=1).neg_())
        if values.numel() > num_full * self.block_size:
            tail = values[num_full * self.block_size :]
            absmax = torch.cat([absmax, tail.abs().amax().reshape(1)])
        return absmax

    def _quantize(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (scales (num_blocks,) fp32, codes (n,) fp32 holding integers in [-max_code, max_code])."""
        _check_input(values)
        absmax = self._block_absmax(values)
        # NaN and inf propagate into the block maxima, so checking the small absmax tensor suffices.
        if not all_finite(absmax):
            raise ValueError(f"{self.name} cannot encode non-finite numbers")
        scales = absmax / self.max_code
        # All-zero blocks get a zero multiplier instead of a division by zero.
        inverse = torch.where(absmax > 0, self.max_code / absmax, torch.zeros_like(absmax))
        codes = torch.empty_like(values)
        num_full = values.numel() // self.block_size
        split = num_full * self.block_size
        torch.mul(
            values[:split].view(num_full, self.block_size),  # (blocks, B)
            inverse[:num_full, None],
            out=codes[:split].view(num_full, self.block_size),
        )
        if values.numel() > split:
            torch.mul(values[split:], inverse[num_full], out=codes[split:])
        return scales, codes.round_()

    def validate(self, payload: Payload, num_elements: int) -> None:
        raw = as_uint8(payload)
        self._check_length(raw, num_elements)
        # Codes are bounded integers: finite scales suffice. The event loop runs this on every chunk
        # it receives, and a chunk has only ~1K scales: numpy checks them in microseconds, where
        # torch's per-call overhead costs ~0.1 ms.
        scales = raw[: 4 * self._num_blocks(num_elements)].numpy().view(np.float32)
        if not np.isfinite(scales).all():
            raise CodecError(f"{self.name} payload holds non-finite scales")

    def _expand(self, scales: torch.Tensor, num_elements: int) -> torch.Tensor:
        return scales.repeat_interleave(self.block_size)[:num_elements]

    def _scales_of(self, raw: torch.Tensor, num_elements: int) -> torch.Tensor:
        num_blocks = self._num_blocks(num_elements)
        scales = raw[: 4 * num_blocks].view(torch.float32)
        if not all_finite(scales):
            raise CodecError(f"{self.name} payload holds non-finite scales")
        return scales

    def _scale_codes_into(self, out: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """out holds the integer codes as fp32; multiply each block by its scale in place."""
        num_elements = out.numel()
        num_full = num_elements // self.block_size
        body = out[: num_full * self.block_size].view(num_full, self.block_size)  # (blocks, B)
        body.mul_(scales[:num_full, None])
        if num_elements > num_full * self.block_size:
            out[num_full * self.block_size :].mul_(scales[num_full])
        return out

    def error_bound(self, values: torch.Tensor) -> torch.Tensor:
        absmax = self._block_absmax(values.float())
        per_block = absmax * (1.0 / (2 * self.max_code) + QUANT_ROUNDING_SLACK)
        return self._expand(per_block, values.numel())


class Int8Codec(_BlockwiseCodec):
    """One byte per number plus one fp32 scale per block: about 4x smaller than fp32."""

    kind = pb.CODEC_KIND_INT8
    name = "int8"
    max_code = 127

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        scales, codes = self._quantize(values)
        num_blocks = scales.numel()
        payload = torch.empty(self.encoded_num_bytes(values.numel()), dtype=torch.uint8)
        payload[: 4 * num_blocks].view(torch.float32).copy_(scales)
        payload[4 * num_blocks :].view(torch.int8).copy_(codes)  # exact: codes are integers in range
        return payload

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        raw = as_uint8(payload)
        self._check_length(raw, out.numel())
        scales = self._scales_of(raw, out.numel())
        out.copy_(raw[4 * scales.numel() :].view(torch.int8))
        return self._scale_codes_into(out, scales)

    def encoded_num_bytes(self, num_elements: int) -> int:
        return 4 * self._num_blocks(num_elements) + num_elements


class Int4Codec(_BlockwiseCodec):
    """Half a byte per number plus one fp32 scale per block: about 8x smaller than fp32."""

    kind = pb.CODEC_KIND_INT4
    name = "int4"
    max_code = 7

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        scales, codes = self._quantize(values)
        num_elements, num_blocks = values.numel(), scales.numel()
        nibbles = torch.full((2 * math.ceil(num_elements / 2),), 8, dtype=torch.uint8)  # 8 encodes 0
        nibbles[:num_elements].copy_(codes.add_(8))
        pairs = nibbles.view(-1, 2)  # (ceil(n/2), 2): even element, odd element
        payload = torch.empty(self.encoded_num_bytes(num_elements), dtype=torch.uint8)
        payload[: 4 * num_blocks].view(torch.float32).copy_(scales)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=payload[4 * num_blocks :])
        return payload

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        raw = as_uint8(payload)
        num_elements = out.numel()
        self._check_length(raw, num_elements)
        scales = self._scales_of(raw, num_elements)
        packed = raw[4 * scales.numel() :]
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).view(-1)  # (2 * ceil(n/2),)
        out.copy_(nibbles[:num_elements]).sub_(8)
        return self._scale_codes_into(out, scales)

    def encoded_num_bytes(self, num_elements: int) -> int:
        return 4 * self._num_blocks(num_elements) + math.ceil(num_elements / 2)


DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 64}
_CODECS_BY_NAME: dict[str, type[Codec]] = {
    "none": NoneCodec,
    "fp16": Float16Codec,
    "bf16": BFloat16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
}
CODEC_NAMES = tuple(_CODECS_BY_NAME)


def get_codec(name: str, block_size: int | None = None) -> Codec:
    """Build a codec by name ("none", "fp16", "bf16", "int8", "int4"); block_size only for int8/int4."""
    if name not in _CODECS_BY_NAME:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    if name in DEFAULT_BLOCK_SIZES:
        return _CODECS_BY_NAME[name](block_size or DEFAULT_BLOCK_SIZES[name])  # type: ignore[call-arg]
    if block_size:
        raise ValueError(f"codec {name!r} has no blocks; block_size must be unset")
    return _CODECS_BY_NAME[name]()


def codec_from_spec(spec: pb.CodecSpec) -> Codec:
    """Build the codec a peer announced on the wire; raises CodecError if it is unknown or malformed."""
    for cls in _CODECS_BY_NAME.values():
        if cls.kind == spec.kind:
            try:
                return get_codec(cls.name, spec.block_size or None)
            except ValueError as error:
                raise CodecError(f"bad codec spec: {error}") from error
    raise CodecError(f"unknown codec kind {spec.kind}")
