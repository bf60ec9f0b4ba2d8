"""Codecs: how a flat fp32 tensor becomes bytes on the wire, and back.

Every codec maps a 1-D fp32 tensor of `n` numbers to a uint8 tensor of exactly
`encoded_num_bytes(n)` bytes and back, is keyed by the wire enum `CodecKind`, and states a
per-element error bound `error_bound(x)` such that |decode(encode(x)) - x| <= error_bound(x):

    none  fp32 as is                               bound 0
    fp16  IEEE half, clamped to +-65504            |x| * 2^-11 (relative), 2^-25 near zero, plus the clamp
    bf16  bfloat16, round to nearest even          |x| * 2^-8 (relative), 2^-134 near zero
    int8  blockwise absmax, scale = absmax / 127   absmax_block * (1/254 + 2^-20)
    int4  blockwise absmax, scale = absmax / 7     absmax_block * (1/14 + 2^-20)
    topk  each block's k largest |x|, 2 bits each  |x| where not sent, (hi - lo)/2 + hi * 2^-20 where sent
    topk4 the same, 4 bits each                    |x| where not sent, (hi - lo)/14 + hi * 2^-20 where sent

The blockwise codecs follow the absmax quantization of Dettmers et al. 2022 ("8-bit Optimizers via
Block-wise Quantization", arXiv:2110.02861): each block of `block_size` numbers carries its own fp32
scale, so one outlier only costs precision inside its own block. The 2^-20 slack covers the float32
rounding of the scale, of x / scale and of code * scale. Payload layout for a chunk of n numbers in
b = ceil(n / block_size) blocks: b fp32 scales, then the codes (int8: n bytes; int4: ceil(n / 2)
bytes, code + 8 in a nibble, even element in the low nibble).

The top-k codecs (``TopKCodec``: ``topk``, ``topk4``) are the sparse ones: decoding writes zeros where
they sent nothing, so they are meant to run with error feedback (``protocol.error_feedback``); the
layout is in ``TopKCodec``'s docstring.

All work is vectorized torch on whole chunks (numpy for checking a chunk's few scales and, in top-k,
for numpy's vectorized partition and the few thousand kept numbers of a chunk, where torch's per-call
cost would dominate); there is no per-element Python.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from typing import ClassVar, Literal

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
MAX_TOPK_BLOCK_SIZE = 1 << 16


class CodecError(ValueError):
    """A payload does not decode: wrong length, non-finite numbers, or (top-k) positions that are out of
    range, repeated or out of order."""


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


def _bit_period(width: int) -> tuple[int, int]:
    """(values, bytes) after which a stream of width-bit values starts again at a byte boundary."""
    num_values = 8 // math.gcd(width, 8)
    return num_values, num_values * width // 8


def _word_type(width: int) -> type[np.unsignedinteger]:
    """An unsigned integer type that holds a width-bit value shifted by up to 7 bits."""
    return np.uint32 if width <= 25 else np.uint64


def pack_bits(values: torch.Tensor | np.ndarray, width: int) -> torch.Tensor:
    """Pack non-negative integers (1-D, each < 2^width, width <= 56) into one bit stream, value i at
    bits [i * width, (i + 1) * width), least significant bit first within each byte, zero-padded to
    whole bytes: ceil(len * width / 8) uint8.

    The stream repeats its byte alignment every _bit_period values, so it is built one period column
    at a time (numpy: the arrays are a chunk's few thousand values, where torch's per-call cost would
    dominate).
    """
    values = values.numpy() if isinstance(values, torch.Tensor) else values
    word = _word_type(width)
    per_period, period_bytes = _bit_period(width)
    num_periods = math.ceil(values.size / per_period)
    slots = np.zeros((num_periods, per_period), dtype=word)  # (periods, values a period)
    slots.reshape(-1)[: values.size] = values
    stream = np.zeros((num_periods, period_bytes), dtype=word)
    for slot in range(per_period):
        first_byte, shift = divmod(slot * width, 8)
        shifted = slots[:, slot] << word(shift)
        stream[:, first_byte] |= shifted
        for byte in range(1, math.ceil((shift + width) / 8)):
            stream[:, first_byte + byte] |= shifted >> word(8 * byte)
    num_bytes = math.ceil(values.size * width / 8)
    return torch.from_numpy(stream.astype(np.uint8).reshape(-1)[:num_bytes])  # the cast keeps the low byte


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The first `count` width-bit integers of a stream written by pack_bits, as int64 (count,)."""
    word = _word_type(width)
    per_period, period_bytes = _bit_period(width)
    num_periods = math.ceil(count / per_period)
    stream = np.zeros((num_periods, period_bytes), dtype=word)  # (periods, bytes a period)
    available = min(packed.numel(), stream.size)
    stream.reshape(-1)[:available] = packed[:available].numpy()
    slots = np.empty((num_periods, per_period), dtype=np.int64)
    mask = word((1 << width) - 1)
    for slot in range(per_period):
        first_byte, shift = divmod(slot * width, 8)
        value = stream[:, first_byte] >> word(shift)
        for byte in range(1, math.ceil((shift + width) / 8)):
            value |= stream[:, first_byte + byte] << word(8 * byte - shift)
        slots[:, slot] = value & mask
    return torch.from_numpy(slots.reshape(-1)[:count])


TOPK_GROUP_SIZE = 8
"""Top-k first keeps the k of the block's 8-number groups with the largest maximum (see
_top_offsets): 8 balances the groups' m / 8 maxima against the 8k candidates they leave."""


def _top_offsets(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Offsets (blocks, k), ascending, of the k largest of each row of magnitude (blocks, m).

    torch.topk's CPU kernel costs ~5 ns a number here (it heap-sorts pairs when k <= m / 64), more than
    all the rest of the codec. Instead:

      1. cut a block into G = m / 8 groups (numbers j, j + G, ..., j + 7G, so that their maxima are
         one vectorized reduction) and find the k-th largest group maximum t_g (numpy's partition of
         values, a vectorized selection);
      2. the k groups whose maximum is >= t_g hold every top-k number: a number of another group is at
         most its group's maximum, so at most each of the k maxima kept, which are k numbers already;
      3. the k-th largest of those 8k candidates is the block's threshold t; the candidates >= t are
         the answer. Candidates are laid out (8, k) with ascending groups, so they, and the answer,
         come in ascending offsets.

    Ties (two groups with the same maximum, or an all-zero block) can make a step find more than k;
    then, as for blocks too small to prefilter, torch.topk decides.
    """
    num_blocks, width = magnitude.shape
    ways = TOPK_GROUP_SIZE
    groups = width // ways
    if width % ways == 0 and 2 * ways * k <= width:
        # (blocks, 8, G) -> (blocks, G): group j is numbers j, j + G, ..., j + 7G of the block
        group_max_np = magnitude.view(num_blocks, ways, groups).amax(dim=1).numpy()
        group_threshold = np.partition(group_max_np, groups - k, axis=1)[:, groups - k]  # (blocks,)
        top_groups = np.flatnonzero(group_max_np >= group_threshold[:, None])
        if top_groups.size == num_blocks * k:
            first = torch.from_numpy(top_groups).view(num_blocks, 1, k).remainder_(groups)
            candidates = (first + torch.arange(0, width, groups).view(1, ways, 1)).view(num_blocks, ways * k)
            values = magnitude.gather(1, candidates).numpy()  # (blocks, 8k)
            threshold = np.partition(values, (ways - 1) * k, axis=1)[:, (ways - 1) * k]  # (blocks,)
            chosen = np.flatnonzero(values >= threshold[:, None])
            if chosen.size == num_blocks * k:
                return candidates.view(-1)[torch.from_numpy(chosen)].view(num_blocks, k)
    return magnitude.topk(k, dim=1, sorted=False).indices.sort(dim=1).values


PositionScheme = Literal["bitmap", "offsets", "elias_fano"]


def _elias_fano_widths(width: int, kept: int) -> tuple[int, int]:
    """Elias-Fano of `kept` increasing offsets below `width`: (L low bits per offset, high bits per block).

    L = floor(log2(width / kept)) (0 when kept > width / 2); offset o splits into o mod 2^L and
    h = o >> L; the block's high bits are a unary code of the h's: the i-th smallest offset sets bit
    h_i + i of kept + ceil(width / 2^L) bits (Elias 1974, Fano 1971; within 2 bits a number of the
    log2(C(width, kept)) bits any code of the positions needs)."""
    low_bits = max(0, (width // kept).bit_length() - 1)
    return low_bits, kept + -(-width // (1 << low_bits))


def _position_scheme(block_size: int, kept: int, offset_bits: int) -> PositionScheme:
    """The smallest of the three fixed-size codes of a full block's kept positions (ties: the first)."""
    low_bits, high_bits = _elias_fano_widths(block_size, kept)
    sizes: dict[PositionScheme, int] = {
        "bitmap": block_size,
        "offsets": kept * offset_bits,
        "elias_fano": kept * low_bits + high_bits,
    }
    return min(sizes, key=lambda scheme: sizes[scheme])


def _elias_fano_encode(offsets: torch.Tensor, width: int, kept: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A run of blocks' offsets (blocks, kept) ascending -> (high-bits piece, low-bits piece), each a
    uint8 bit stream (pack_bits) padded to whole bytes; the low piece is empty when L = 0."""
    low_bits, high_bits = _elias_fano_widths(width, kept)
    num_blocks = offsets.shape[0]
    marks = np.zeros((num_blocks, high_bits), dtype=np.uint8)
    np.put_along_axis(marks, (offsets.bitwise_right_shift(low_bits) + torch.arange(kept)).numpy(), 1, axis=1)
    high_piece = torch.from_numpy(np.packbits(marks.reshape(-1), bitorder="little"))  # as pack_bits(., 1)
    if low_bits == 0:
        return high_piece, torch.empty(0, dtype=torch.uint8)
    return high_piece, pack_bits(offsets.bitwise_and((1 << low_bits) - 1).view(-1), low_bits)


class TopKCodec(Codec):
    """Chunked top-k: each block of block_size numbers sends only its kept_per_block largest in
    magnitude, as a sign and a (value_bits - 1)-bit level between the block's smallest and largest
    kept magnitude; decoding writes zeros everywhere else.

    This is the compressor of SparseLoCo (Sarfi et al. 2025, arXiv:2508.15706): at 1-3% density with
    2-bit values it is meant to run with error feedback (``protocol.error_feedback``), whose residual
    then holds everything a round did not send, so the dropped numbers go out in later rounds.

    Per block: ``lo``/``hi`` = min/max kept magnitude, ``step = (hi - lo) / (levels - 1)``, a kept
    value v is sent as sign(v) and ``q = round((|v| - lo) / step)``, and decodes to
    ``sign * (lo + q * step)``. Kept positions go as a bitmap per block, as w-bit offsets, or
    Elias-Fano coded (``_elias_fano_widths``), whichever is smallest for (block_size, kept_per_block):
    all three sizes are fixed by the two numbers, so the choice is the same for every block and every
    chunk, and a payload's length depends only on the number of elements, as the all-reduce needs. At
    the default 62 of 4096, Elias-Fano takes 498 bits a block where offsets took 744 (8.0 bits a kept
    number instead of 12; the entropy bound log2 C(4096, 62) is 464). The layout is documented field by field with
    ``CODEC_KIND_TOPK`` (and ``CODEC_KIND_TOPK4``) in ``protos/dtnode/v1/allreduce.proto``.
    """

    value_bits: ClassVar[int]

    def __init__(self, block_size: int, kept_per_block: int) -> None:
        if not 2 <= block_size <= MAX_TOPK_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [2, {MAX_TOPK_BLOCK_SIZE}], got {block_size}")
        if not 1 <= kept_per_block <= block_size:
            raise ValueError(f"kept_per_block must be in [1, block_size={block_size}], got {kept_per_block}")
        super().__init__(block_size)
        self.kept_per_block = kept_per_block
        self.offset_bits = max(1, (block_size - 1).bit_length())  # w: bits of one offset in a block
        self.positions = _position_scheme(block_size, kept_per_block, self.offset_bits)
        self.levels = 1 << (self.value_bits - 1)

    @property
    def density(self) -> float:
        """The fraction of a full block's numbers that is sent."""
        return self.kept_per_block / self.block_size

    def spec(self) -> pb.CodecSpec:
        return pb.CodecSpec(kind=self.kind, block_size=self.block_size, kept_per_block=self.kept_per_block)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size}, kept_per_block={self.kept_per_block})"

    # Sizes. A chunk is full blocks, then at most one shorter tail block.

    def _blocks(self, num_elements: int) -> tuple[int, int, int]:
        """(full blocks, tail length, numbers the tail sends)."""
        num_full, tail = divmod(num_elements, self.block_size)
        return num_full, tail, math.ceil(self.kept_per_block * tail / self.block_size)

    def _section_sizes(self, num_elements: int) -> tuple[int, int, int]:
        """Bytes of the scales, positions and codes sections."""
        num_full, tail, tail_kept = self._blocks(num_elements)
        num_blocks = num_full + (tail > 0)
        num_kept = num_full * self.kept_per_block + tail_kept
        if self.positions == "bitmap":
            position_bytes = math.ceil(num_elements / 8)
        elif self.positions == "offsets":
            position_bytes = math.ceil(num_kept * self.offset_bits / 8)
        else:
            position_bytes = sum(high + low for high, low in self._elias_fano_pieces(num_elements))
        return 8 * num_blocks, position_bytes, math.ceil(num_kept * self.value_bits / 8)

    def _elias_fano_pieces(self, num_elements: int) -> list[tuple[int, int]]:
        """Per run of blocks (``_groups``): bytes of its high-bits piece and of its low-bits piece."""
        pieces = []
        for _, num_blocks, width, kept in self._groups(num_elements):
            low_bits, high_bits = _elias_fano_widths(width, kept)
            pieces.append(
                (math.ceil(num_blocks * high_bits / 8), math.ceil(num_blocks * kept * low_bits / 8))
            )
        return pieces

    def encoded_num_bytes(self, num_elements: int) -> int:
        return sum(self._section_sizes(num_elements))

    # Encoding.

    def _groups(self, num_elements: int) -> list[tuple[int, int, int, int]]:
        """Runs of equal blocks: (first element, blocks, numbers a block, numbers it sends) for the
        full blocks, then the tail."""
        num_full, tail, tail_kept = self._blocks(num_elements)
        groups = [(0, num_full, self.block_size, self.kept_per_block)] if num_full else []
        if tail:
            groups.append((num_full * self.block_size, 1, tail, tail_kept))
        return groups

    def _select(self, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per run of blocks (``_groups``): (offsets (blocks, k) ascending int64, kept values (blocks, k))."""
        selected = []
        for start, num_blocks, width, kept in self._groups(values.numel()):
            blocks = values[start : start + num_blocks * width].view(num_blocks, width)  # (blocks, m)
            offsets = _top_offsets(blocks.abs(), kept)  # (blocks, k) ascending
            selected.append((offsets, blocks.gather(1, offsets)))
        return selected

    def _quantize(self, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """kept values (blocks, k) fp32 -> (lo (blocks,), hi (blocks,), codes (blocks, k) uint64)."""
        magnitude = np.abs(kept)
        lo, hi = magnitude.min(axis=1), magnitude.max(axis=1)
        if not np.isfinite(hi).all():  # NaN and inf are among the largest magnitudes, so hi shows them
            raise ValueError(f"{self.name} cannot encode non-finite numbers")
        spread = hi - lo
        # All-equal blocks get a zero multiplier (every code 0, i.e. lo) instead of a division by zero.
        divisor = np.where(spread > 0, spread, np.float32(1))
        inverse = np.where(spread > 0, np.float32(self.levels - 1) / divisor, np.float32(0))
        level = np.rint((magnitude - lo[:, None]) * inverse[:, None])  # round half to even, as torch
        np.clip(level, 0, self.levels - 1, out=level)
        codes = level.astype(np.uint64) | (kept < 0).astype(np.uint64) << np.uint64(self.value_bits - 1)
        return lo, hi, codes

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        _check_input(values)
        num_elements = values.numel()
        payload = torch.empty(self.encoded_num_bytes(num_elements), dtype=torch.uint8)
        if num_elements == 0:
            return payload
        groups, selected = self._groups(num_elements), self._select(values)
        quantized = [self._quantize(kept.numpy()) for _, kept in selected]
        scale_bytes, position_bytes, _ = self._section_sizes(num_elements)
        scales = np.concatenate([np.stack([lo, hi], axis=1) for lo, hi, _ in quantized])  # (blocks, 2)
        payload[:scale_bytes].numpy().view(np.float32)[:] = scales.reshape(-1)
        if self.positions == "bitmap":
            bitmap = torch.zeros(num_elements, dtype=torch.int64)
            for (start, num_blocks, width, _), (offsets, _) in zip(groups, selected, strict=True):
                bitmap[start : start + num_blocks * width].view(num_blocks, width).scatter_(1, offsets, 1)
            positions = pack_bits(bitmap, 1)
        elif self.positions == "offsets":
            positions = pack_bits(torch.cat([offsets.view(-1) for offsets, _ in selected]), self.offset_bits)
        else:
            positions = torch.cat(
                [
                    piece
                    for (_, num_blocks, width, kept), (offsets, _) in zip(groups, selected, strict=True)
                    for piece in _elias_fano_encode(offsets, width, kept)
                ]
            )
        payload[scale_bytes : scale_bytes + position_bytes] = positions
        codes = np.concatenate([codes.reshape(-1) for _, _, codes in quantized])
        payload[scale_bytes + position_bytes :] = pack_bits(codes, self.value_bits)
        return payload

    # Decoding.

    def _parse(
        self, payload: Payload, num_elements: int
    ) -> tuple[np.ndarray, list[tuple[torch.Tensor, np.ndarray]]]:
        """Check a payload; return its scales (blocks, 2) fp32 and, per run of blocks (``_groups``),
        (offsets (blocks, k) int64, codes (blocks, k) int64). CodecError if it is malformed."""
        raw = as_uint8(payload)
        self._check_length(raw, num_elements)
        scale_bytes, position_bytes, _ = self._section_sizes(num_elements)
        # A chunk has ~64 blocks: numpy checks their scales in microseconds (see _BlockwiseCodec).
        scales = raw[:scale_bytes].numpy().view(np.float32).reshape(-1, 2)
        if not np.isfinite(scales).all():
            raise CodecError(f"{self.name} payload holds non-finite scales")
        if not ((scales[:, 0] >= 0) & (scales[:, 0] <= scales[:, 1])).all():
            raise CodecError(f"{self.name} payload has a scale pair without 0 <= lo <= hi")
        groups = self._groups(num_elements)
        num_kept = sum(num_blocks * kept for _, num_blocks, _, kept in groups)
        packed = raw[scale_bytes : scale_bytes + position_bytes]
        codes = unpack_bits(raw[scale_bytes + position_bytes :], self.value_bits, num_kept).numpy()
        if self.positions == "bitmap":
            bitmap = unpack_bits(packed, 1, num_elements)
        elif self.positions == "offsets":
            all_offsets = unpack_bits(packed, self.offset_bits, num_kept)
        else:
            pieces, first_byte = [], 0
            for high_bytes, low_bytes in self._elias_fano_pieces(num_elements):
                high_end = first_byte + high_bytes
                pieces.append((packed[first_byte:high_end], packed[high_end : high_end + low_bytes]))
                first_byte += high_bytes + low_bytes
        parsed, first_kept = [], 0
        for run, (start, num_blocks, width, kept) in enumerate(groups):
            if self.positions == "bitmap":
                marks = bitmap[start : start + num_blocks * width].view(num_blocks, width)
                if not bool((marks.sum(dim=1) == kept).all()):
                    raise CodecError(f"{self.name} payload's bitmap does not mark {kept} numbers in a block")
                offsets = marks.nonzero()[:, 1].view(num_blocks, kept)  # row-major: ascending in a row
            else:
                if self.positions == "offsets":
                    offsets = all_offsets[first_kept : first_kept + num_blocks * kept].view(num_blocks, kept)
                else:
                    offsets = self._elias_fano_decode(*pieces[run], num_blocks, width, kept)
                offsets_np = offsets.numpy()
                if offsets_np.max() >= width:
                    raise CodecError(f"{self.name} payload holds an offset outside its block")
                if kept > 1 and not (offsets_np[:, 1:] > offsets_np[:, :-1]).all():
                    raise CodecError(f"{self.name} payload's offsets are not strictly increasing in a block")
            parsed.append(
                (offsets, codes[first_kept : first_kept + num_blocks * kept].reshape(num_blocks, kept))
            )
            first_kept += num_blocks * kept
        return scales, parsed

    def _elias_fano_decode(
        self, high_piece: torch.Tensor, low_piece: torch.Tensor, num_blocks: int, width: int, kept: int
    ) -> torch.Tensor:
        """Offsets (blocks, kept) int64 of a run of blocks from its Elias-Fano pieces; CodecError when a
        block's high bits do not mark exactly `kept` numbers (range and order are checked by the caller)."""
        low_bits, high_bits = _elias_fano_widths(width, kept)
        # unpack_bits(high_piece, 1, ...) as bools: numpy finds the marks of a bool array ~10x faster
        # than of uint8 (or torch's nonzero).
        marks = np.unpackbits(high_piece.numpy(), count=num_blocks * high_bits, bitorder="little").view(bool)
        if not (marks.reshape(num_blocks, high_bits).sum(axis=1, dtype=np.int64) == kept).all():
            raise CodecError(f"{self.name} payload's high bits do not mark {kept} numbers in a block")
        # The i-th mark of a block sits at high_i + i (row-major: ascending in a row).
        high = torch.from_numpy(np.flatnonzero(marks) % high_bits).view(num_blocks, kept) - torch.arange(kept)
        if low_bits == 0:
            return high
        low = unpack_bits(low_piece, low_bits, num_blocks * kept).view(num_blocks, kept)
        return high.bitwise_left_shift_(low_bits).bitwise_or_(low)

    def validate(self, payload: Payload, num_elements: int) -> None:
        self._parse(payload, num_elements)

    def max_magnitude(self, payload: Payload, num_elements: int) -> float:
        """The largest kept magnitude of a payload (its blocks' largest ``hi``; 0 with no blocks): what it
        decodes to is at most this in magnitude, up to float32 rounding. Checks only the length."""
        raw = as_uint8(payload)
        self._check_length(raw, num_elements)
        scale_bytes, _, _ = self._section_sizes(num_elements)
        highs = raw[:scale_bytes].numpy().view(np.float32)[1::2]
        return float(np.abs(highs).max()) if highs.size else 0.0

    def _sent(self, payload: Payload, num_elements: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per run of blocks (``_groups``): (offsets (blocks, k) int64, decoded values (blocks, k) fp32)."""
        scales, parsed = self._parse(payload, num_elements)
        sent, first_block = [], 0
        for (_, num_blocks, _, _), (offsets, codes) in zip(self._groups(num_elements), parsed, strict=True):
            lo, hi = scales[first_block : first_block + num_blocks].T  # (blocks,) each
            step = (hi - lo) / np.float32(self.levels - 1)
            magnitudes = lo[:, None] + step[:, None] * np.arange(self.levels, dtype=np.float32)  # (blocks, L)
            # A code is sign * L + level: index a per-block table of the 2L values.
            table = np.concatenate([magnitudes, -magnitudes], axis=1)  # (blocks, 2L)
            sent.append((offsets, torch.from_numpy(np.take_along_axis(table, codes, axis=1))))
            first_block += num_blocks
        return sent

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        out.zero_()
        for (start, num_blocks, width, _), (offsets, values) in zip(
            self._groups(out.numel()), self._sent(payload, out.numel()), strict=True
        ):
            out[start : start + num_blocks * width].view(num_blocks, width).scatter_(1, offsets, values)
        return out

    def add_into(self, payload: Payload, out: torch.Tensor, weight: float) -> torch.Tensor:
        """``out += decode(payload).mul_(weight)`` in float32, bit for bit, touching only the numbers sent.

        Elsewhere the dense sum adds +0, which leaves any number but -0 as it is; a sum that starts at
        +0 never becomes -0 (x + (-x) is +0), so the sparse round's sums may skip those adds."""
        for (start, num_blocks, width, _), (offsets, values) in zip(
            self._groups(out.numel()), self._sent(payload, out.numel()), strict=True
        ):
            rows = out[start : start + num_blocks * width].view(num_blocks, width)
            rows.scatter_add_(1, offsets, values.mul_(weight))  # one add per number: offsets are unique
        return out

    def error_bound(self, values: torch.Tensor) -> torch.Tensor:
        """|x| where x is not sent; half a level's step (plus float rounding) where it is."""
        bound = values.abs()
        for (start, num_blocks, width, _), (offsets, kept) in zip(
            self._groups(values.numel()), self._select(values.float()), strict=True
        ):
            lo, hi, _ = self._quantize(kept.numpy())
            rounding = torch.from_numpy((hi - lo) / (2 * (self.levels - 1)) + hi * QUANT_ROUNDING_SLACK)
            rows = bound[start : start + num_blocks * width].view(num_blocks, width)
            rows.scatter_(1, offsets, rounding[:, None].expand_as(offsets).contiguous())
        return bound


class TopK2Codec(TopKCodec):
    """Top-k with 2-bit values (sign and one of two levels): about 1/48 of int8 at 1.5% density."""

    kind = pb.CODEC_KIND_TOPK
    name = "topk"
    value_bits = 2


class TopK4Codec(TopKCodec):
    """Top-k with 4-bit values (sign and one of eight levels): a kept number costs 2 bits more than
    ``topk``'s (13.1 instead of 11.1 with its position and its share of the scales, 62 of 4096), so at
    equal bytes it keeps ~5/6 as many numbers, each 7x finer (the block's [lo, hi] in 7 steps instead
    of 1). Issue 30 asked whether that pays; BENCHMARKS.md ("Top-k with 4-bit values") measures it."""

    kind = pb.CODEC_KIND_TOPK4
    name = "topk4"
    value_bits = 4


DEFAULT_BLOCK_SIZES = {"int8": 256, "int4": 64, "topk": 4096, "topk4": 4096}
DEFAULT_TOPK_DENSITY = 0.015
"""Top-k's fraction of numbers sent: 62 of each 4096 (SparseLoCo runs 1-3%; Covenant-72B sent 1.56%)."""
_CODECS_BY_NAME: dict[str, type[Codec]] = {
    "none": NoneCodec,
    "fp16": Float16Codec,
    "bf16": BFloat16Codec,
    "int8": Int8Codec,
    "int4": Int4Codec,
    "topk": TopK2Codec,
    "topk4": TopK4Codec,
}
CODEC_NAMES = tuple(_CODECS_BY_NAME)


def kept_per_block(density: float, block_size: int) -> int:
    """Numbers a top-k block of block_size sends at this density: ceil(density * block_size)."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"top-k density must be in (0, 1], got {density}")
    # The rounding forgives float noise such as 0.01 * 300 = 3.0000000000000004.
    return max(1, math.ceil(round(density * block_size, 9)))


def takes_density(name: str) -> bool:
    """True for the codecs that send a fraction of the numbers (get_codec's density applies)."""
    return name in _CODECS_BY_NAME and issubclass(_CODECS_BY_NAME[name], TopKCodec)


def get_codec(name: str, block_size: int | None = None, density: float | None = None) -> Codec:
    """Build a codec by name ("none", "fp16", "bf16", "int8", "int4", "topk", "topk4"); block_size only
    for int8/int4/topk/topk4, density (the fraction of numbers sent, default DEFAULT_TOPK_DENSITY) only
    for the top-k codecs."""
    if name not in _CODECS_BY_NAME:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_NAMES)}")
    cls = _CODECS_BY_NAME[name]
    if issubclass(cls, TopKCodec):
        size = block_size or DEFAULT_BLOCK_SIZES[name]
        return cls(size, kept_per_block(DEFAULT_TOPK_DENSITY if density is None else density, size))
    if density is not None:
        raise ValueError(f"codec {name!r} sends every number; density must be unset")
    if name in DEFAULT_BLOCK_SIZES:
        return cls(block_size or DEFAULT_BLOCK_SIZES[name])  # type: ignore[call-arg]
    if block_size:
        raise ValueError(f"codec {name!r} has no blocks; block_size must be unset")
    return cls()


def codec_from_spec(spec: pb.CodecSpec) -> Codec:
    """Build the codec a peer announced on the wire; raises CodecError if it is unknown or malformed."""
    for cls in _CODECS_BY_NAME.values():
        if cls.kind == spec.kind:
            try:
                if issubclass(cls, TopKCodec):
                    return cls(spec.block_size, spec.kept_per_block)
                if spec.kept_per_block:
                    raise ValueError(f"{cls.name} sends every number; kept_per_block must be 0")
                return get_codec(cls.name, spec.block_size or None)
            except ValueError as error:
                raise CodecError(f"bad codec spec: {error}") from error
    raise CodecError(f"unknown codec kind {spec.kind}")
