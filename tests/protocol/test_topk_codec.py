"""The top-k codecs (``topk``, 2-bit values, and ``topk4``, 4-bit): the numbers they keep and their
values against an independent reference, the byte layout by hand, error feedback of what they drop,
and refusal of malformed (and fuzzed) payloads."""

from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codecs import (
    MAX_TOPK_BLOCK_SIZE,
    CodecError,
    TopK2Codec,
    TopK4Codec,
    TopKCodec,
    codec_from_spec,
    get_codec,
    pack_bits,
    unpack_bits,
)
from protocol.error_feedback import ErrorFeedback
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb

TOPK_CODECS = [TopK2Codec, TopK4Codec]
TOPK_IDS = ["topk", "topk4"]


def reference_decoded(values: torch.Tensor, block_size: int, kept: int, value_bits: int) -> torch.Tensor:
    """torch.topk of |x| on each block, then the value by hand in float64: sign, and the nearest of
    the 2^(value_bits - 1) evenly spaced levels from the block's smallest to its largest kept magnitude
    (2 bits: the nearer of the two)."""
    steps = (1 << (value_bits - 1)) - 1
    out = torch.zeros_like(values)
    for start in range(0, values.numel(), block_size):
        block = values[start : start + block_size]
        block_kept = math.ceil(kept * block.numel() / block_size)
        positions = torch.topk(block.abs(), block_kept).indices
        lo, hi = float(block[positions].abs().min()), float(block[positions].abs().max())
        for position in positions.tolist():
            value = float(block[position])
            level = round((abs(value) - lo) / (hi - lo) * steps) if hi > lo else 0
            out[start + position] = math.copysign(lo + level * (hi - lo) / steps, value)
    return out


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
@pytest.mark.parametrize(
    ("block_size", "kept", "num_elements"),
    [
        (4096, 62, 3 * 4096),
        (4096, 62, 2 * 4096 + 1000),
        (64, 30, 640 + 13),
        (100, 3, 1000),
        (8, 8, 20),
        (256, 1, 300),
    ],
)
def test_decode_matches_torch_topk_and_hand_quantization(
    codec_type: type[TopKCodec], block_size: int, kept: int, num_elements: int
) -> None:
    codec = codec_type(block_size, kept)
    values = torch.randn(num_elements, generator=torch.Generator().manual_seed(num_elements))
    decoded = codec.decode(codec.encode(values).numpy().tobytes(), num_elements)
    expected = reference_decoded(values, block_size, kept, codec_type.value_bits)
    assert torch.equal(decoded != 0, expected != 0)  # the same numbers kept
    torch.testing.assert_close(decoded, expected, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("name", TOPK_IDS)
@pytest.mark.parametrize("kind", ["ties", "zeros", "one spike"])
def test_ties_still_keep_k_of_the_largest(kind: str, name: str) -> None:
    """Ties defeat the group prefilter's count (it finds more than k); torch.topk then decides."""
    codec = get_codec(name)
    generator = torch.Generator().manual_seed(5)
    values = {
        "ties": torch.randint(-3, 4, (3 * 4096,), generator=generator).float(),
        "zeros": torch.zeros(3 * 4096),
        "one spike": torch.zeros(3 * 4096).index_fill_(0, torch.tensor([7, 5000]), -2.5),
    }[kind]
    scales, parsed = codec._parse(codec.encode(values).numpy().tobytes(), values.numel())  # type: ignore[attr-defined]
    offsets = parsed[0][0]  # (3, 62): every block sends exactly k
    assert offsets.shape == (3, 62)
    blocks = values.view(3, 4096).abs()
    kept = torch.zeros_like(blocks, dtype=torch.bool).scatter_(1, offsets, True)
    for block, mask in zip(blocks, kept, strict=True):
        assert float(block[mask].min()) >= float(block[~mask].max())
    decoded = codec.decode(codec.encode(values), values.numel())
    assert torch.equal(decoded, values) if kind != "ties" else bool((decoded.abs() <= 3).all())


@pytest.mark.parametrize("name", TOPK_IDS)
def test_non_finite_input_is_refused_on_the_fast_path_too(name: str) -> None:
    values = torch.randn(4 * 4096)
    values[5000] = math.nan
    with pytest.raises(ValueError, match="non-finite"):
        get_codec(name).encode(values)


def test_offsets_layout_by_hand() -> None:
    """Block 8, 2 kept: 3-bit offsets (6 bits < an 8-bit bitmap)."""
    codec = TopK2Codec(8, 2)
    assert codec.positions == "offsets" and codec.offset_bits == 3
    values = torch.tensor([0.1, -4.0, 0.0, 3.0, 0.2, 0.0, 0.0, 1.0])
    # kept: offset 1 (-4: sign 1, level hi -> code 0b11) and offset 3 (3: sign 0, level lo -> 0b00)
    # offsets 1 = 001, 3 = 011, least significant bit first: bits 1,0,0,1,1,0 -> 0b00011001
    expected = struct.pack("<ff", 3.0, 4.0) + bytes([0b00011001, 0b0000_0011])
    assert codec.encode(values).numpy().tobytes() == expected
    assert codec.decode(expected, 8).tolist() == [0.0, -4.0, 0.0, 3.0, 0.0, 0.0, 0.0, 0.0]


def test_bitmap_layout_by_hand() -> None:
    """Block 8, 4 kept: an 8-bit bitmap (< 4 x 3 bits of offsets)."""
    codec = TopK2Codec(8, 4)
    assert codec.positions == "bitmap"
    values = torch.tensor([0.5, -2.0, 0.0, 1.0, 0.0, 0.0, -1.5, 0.25])
    # kept 0, 1, 3, 6 -> bitmap 0b01001011; lo 0.5, hi 2: codes 0.5 -> 00, -2 -> 11, 1 -> 00, -1.5 -> 11
    expected = struct.pack("<ff", 0.5, 2.0) + bytes([0b01001011, 0b11_00_11_00])
    assert codec.encode(values).numpy().tobytes() == expected
    assert codec.decode(expected, 8).tolist() == [0.5, -2.0, 0.0, 0.5, 0.0, 0.0, -2.0, 0.0]


def test_4_bit_layout_by_hand() -> None:
    """Block 8, 4 kept: the bitmap, then 4-bit codes, two to a byte, the first in the low nibble."""
    codec = TopK4Codec(8, 4)
    assert codec.positions == "bitmap"
    values = torch.tensor([0.5, -2.0, 0.0, 1.0, 0.0, 0.0, -1.5, 0.25])
    # kept 0, 1, 3, 6 -> bitmap 0b01001011; lo 0.5, hi 2, seven steps of 1.5 / 7 = 0.2143:
    # 0.5 -> level 0 (0b0000); -2 -> sign, level 7 (0b1111); 1 -> 0.5 / 0.2143 = 2.33, level 2
    # (0b0010); -1.5 -> 1 / 0.2143 = 4.67, sign, level 5 (0b1101)
    expected = struct.pack("<ff", 0.5, 2.0) + bytes([0b01001011, 0b1111_0000, 0b1101_0010])
    assert codec.encode(values).numpy().tobytes() == expected
    assert codec.encoded_num_bytes(8) == 8 + 1 + 2
    step = 1.5 / 7
    torch.testing.assert_close(
        codec.decode(expected, 8),
        torch.tensor([0.5, -2.0, 0.0, 0.5 + 2 * step, 0.0, 0.0, -(0.5 + 5 * step), 0.0]),
        rtol=1e-6,
        atol=0.0,
    )


def test_4_bit_values_are_finer_at_the_same_kept_numbers_and_2_bits_dearer() -> None:
    """The same numbers kept as topk's, each within (hi - lo) / 14 of its value (topk: (hi - lo) / 2),
    for exactly 2 bits more per kept number."""
    values = torch.randn(3 * 4096, generator=torch.Generator().manual_seed(3))
    two, four = TopK2Codec(4096, 62), TopK4Codec(4096, 62)
    decoded_two = two.decode(two.encode(values), values.numel())
    decoded_four = four.decode(four.encode(values), values.numel())
    assert torch.equal(decoded_two != 0, decoded_four != 0)
    kept = decoded_four != 0
    for block in range(3):
        in_block = kept[block * 4096 : (block + 1) * 4096]
        magnitudes = values[block * 4096 : (block + 1) * 4096][in_block].abs()
        spread = float(magnitudes.max() - magnitudes.min())
        error = (decoded_four - values)[block * 4096 : (block + 1) * 4096][in_block].abs()
        assert float(error.max()) <= spread / 14 * (1 + 1e-5)
    assert (
        float((decoded_four - values)[kept].abs().mean())
        < float((decoded_two - values)[kept].abs().mean()) / 4
    )
    assert four.encoded_num_bytes(3 * 4096) - two.encoded_num_bytes(3 * 4096) == 3 * 62 * 2 // 8


def bit_string_bytes(fields: list[tuple[int, int]]) -> bytes:
    """(value, width) fields written least significant bit first, zero-padded to a whole byte."""
    bits = "".join(format(value, f"0{width}b")[::-1] for value, width in fields)
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))


def test_elias_fano_layout_by_hand() -> None:
    """Block 64, 8 kept: Elias-Fano (L = 3: 8 x 3 low bits + 8 + 64 / 8 high bits = 40) beats 8 x 6 bits
    of offsets and a 64-bit bitmap."""
    codec = TopK2Codec(64, 8)
    assert codec.positions == "elias_fano"
    kept = [1, 5, 9, 20, 21, 40, 50, 63]
    values = torch.full((64,), 0.01)
    for i, offset in enumerate(kept):
        values[offset] = -2.0 if i % 2 else 2.0
    # high parts o >> 3: 0 0 1 2 2 5 6 7 -> unary bits h_i + i: 0 1 3 5 6 10 12 14 of 8 + 8 = 16 bits
    high = [(1 if bit in (0, 1, 3, 5, 6, 10, 12, 14) else 0, 1) for bit in range(16)]
    low = [(offset & 7, 3) for offset in kept]  # 1 5 1 4 5 0 2 7
    codes = [((i % 2) << 1, 2) for i in range(8)]  # lo = hi = 2: level 0, the sign in the high bit
    expected = (
        struct.pack("<ff", 2.0, 2.0)
        + bit_string_bytes(high)
        + bit_string_bytes(low)
        + bit_string_bytes(codes)
    )
    assert codec.encode(values).numpy().tobytes() == expected
    assert codec.encoded_num_bytes(64) == 8 + 2 + 3 + 2
    decoded = codec.decode(expected, 64)
    assert decoded.nonzero().view(-1).tolist() == kept
    assert decoded[kept].tolist() == [2.0, -2.0] * 4


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_default_layout_is_elias_fano_and_decodes_as_offsets_would(codec_type: type[TopKCodec]) -> None:
    """The same kept numbers and values whichever position code carries them."""
    elias_fano, offsets = codec_type(4096, 62), codec_type(4096, 62)
    offsets.positions = "offsets"
    for num_elements in (3 * 4096, 2 * 4096 + 1000, 5, 4096 + 63):
        values = torch.randn(num_elements, generator=torch.Generator().manual_seed(num_elements))
        payload = elias_fano.encode(values)
        assert payload.numel() < offsets.encode(values).numel() or num_elements < 100
        assert torch.equal(
            elias_fano.decode(payload, num_elements), offsets.decode(offsets.encode(values), num_elements)
        )


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_elias_fano_high_bits_with_the_wrong_count_are_refused(codec_type: type[TopKCodec]) -> None:
    codec = codec_type(64, 8)
    payload = valid_payload(codec, 64)  # scales 8 bytes, then 2 bytes of high bits
    payload[8] |= 0xFF  # nine or more marks
    refused(codec, bytes(payload), 64, "high bits")
    payload[8], payload[9] = 0, 0  # none
    refused(codec, bytes(payload), 64, "high bits")


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_elias_fano_offset_past_a_short_tail_block_is_refused(codec_type: type[TopKCodec]) -> None:
    """A tail of 40 numbers keeps 5 with L = 3 and 5 + 40 / 8 = 10 high bits; marks at bits 0-3 and 9 make
    the fifth high part 9 - 4 = 5, i.e. an offset of at least 5 * 8 = 40, past the tail."""
    codec = codec_type(64, 8)
    num_elements = 64 + 40
    payload = valid_payload(codec, num_elements)
    tail_high = 16 + 2 + 3  # after the scales (2 blocks) and the full block's high and low pieces
    payload[tail_high], payload[tail_high + 1] = 0b0000_1111, 0b10
    refused(codec, bytes(payload), num_elements, "outside its block")


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7, 9, 12, 13, 16, 17])
def test_bit_streams_match_a_string_of_bits(width: int) -> None:
    values = torch.randint(0, 1 << width, (37,), generator=torch.Generator().manual_seed(width))
    bits = "".join(format(int(v), f"0{width}b")[::-1] for v in values)  # least significant bit first
    bits += "0" * (-len(bits) % 8)
    expected = bytes(int(bits[i : i + 8][::-1], 2) for i in range(0, len(bits), 8))
    packed = pack_bits(values, width)
    assert packed.numpy().tobytes() == expected
    assert torch.equal(unpack_bits(packed, width, values.numel()), values)


def test_payload_size_is_fixed_by_the_element_count() -> None:
    codec = get_codec("topk")
    assert isinstance(codec, TopK2Codec) and codec.kept_per_block == 62  # ceil(0.015 * 4096)
    # 8 bytes of scales + Elias-Fano positions (62 x 6 low bits + 62 + 64 high bits = 498 bits) + 62 codes
    # of 2 bits, per 4096 numbers
    assert codec.positions == "elias_fano"
    assert (
        codec.encoded_num_bytes(1 << 18)
        == 64 * 8 + math.ceil(64 * 126 / 8) + 64 * 62 * 6 // 8 + 64 * 62 * 2 // 8
    )
    assert get_codec("int8").encoded_num_bytes(1 << 18) / codec.encoded_num_bytes(1 << 18) > 48
    four = get_codec("topk4")
    assert isinstance(four, TopK4Codec) and four.kept_per_block == 62 and four.positions == "elias_fano"
    # the same scales and positions, then 62 codes of 4 bits per 4096 numbers
    assert (
        four.encoded_num_bytes(1 << 18)
        == 64 * 8 + math.ceil(64 * 126 / 8) + 64 * 62 * 6 // 8 + 64 * 62 * 4 // 8
    )
    for seed in range(3):
        values = torch.randn(10_000, generator=torch.Generator().manual_seed(seed)) * 10**seed
        assert codec.encode(values).numel() == codec.encoded_num_bytes(10_000)
        assert four.encode(values).numel() == four.encoded_num_bytes(10_000)


@pytest.mark.parametrize("name", TOPK_IDS)
def test_error_feedback_sends_everything_over_rounds(name: str) -> None:
    """Round r sends x_r plus the residual: the sum of what arrived is the sum of the inputs less one
    residual, so its relative error falls like 1/R; without feedback it never falls."""
    codec = get_codec(name, block_size=1024)
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(8192, generator=generator)
    feedback = ErrorFeedback(8192)
    total, arrived, arrived_without = torch.zeros(8192), torch.zeros(8192), torch.zeros(8192)
    errors = {}
    for round_index in range(1, 201):
        values = base + torch.randn(8192, generator=generator)
        total += values
        arrived += codec.decode(feedback.encode(codec, values, 0), 8192)
        arrived_without += codec.decode(codec.encode(values), 8192)
        torch.testing.assert_close(arrived + feedback.residual, total, rtol=0, atol=1e-3)
        errors[round_index] = float((arrived - total).norm() / total.norm())
    assert errors[200] < errors[50] / 2.5 and errors[200] < 0.2
    assert float((arrived_without - total).norm() / total.norm()) > 0.85


def valid_payload(codec: TopKCodec, num_elements: int) -> bytearray:
    return bytearray(
        codec.encode(torch.randn(num_elements, generator=torch.Generator().manual_seed(1))).numpy().tobytes()
    )


def refused(codec: TopKCodec, payload: bytes, num_elements: int, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        codec.validate(payload, num_elements)
    with pytest.raises(CodecError, match=match):
        codec.decode(payload, num_elements)


@pytest.mark.parametrize(
    ("lo", "hi", "match"),
    [
        (math.nan, 1.0, "non-finite"),
        (0.0, math.inf, "non-finite"),
        (-1.0, 1.0, "lo <= hi"),
        (2.0, 1.0, "lo <= hi"),
    ],
)
@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_bad_scales_are_refused(codec_type: type[TopKCodec], lo: float, hi: float, match: str) -> None:
    codec = codec_type(100, 3)
    payload = valid_payload(codec, 1000)
    payload[8 * 4 : 8 * 5] = struct.pack("<ff", lo, hi)  # block 4
    refused(codec, bytes(payload), 1000, match)


def with_offsets(codec: TopKCodec, payload: bytearray, num_elements: int, offsets: list[int]) -> bytes:
    """The payload with its first offsets replaced (the codec keeps kept_per_block in every block)."""
    scale_bytes = 8 * math.ceil(num_elements / codec.block_size)
    num_kept = codec.kept_per_block * math.ceil(num_elements / codec.block_size)
    position_bytes = math.ceil(num_kept * codec.offset_bits / 8)
    positions = torch.tensor(payload[scale_bytes : scale_bytes + position_bytes], dtype=torch.uint8)
    all_offsets = unpack_bits(positions, codec.offset_bits, num_kept)
    all_offsets[: len(offsets)] = torch.tensor(offsets)
    packed = pack_bits(all_offsets, codec.offset_bits).numpy().tobytes()
    return bytes(payload[:scale_bytes]) + packed + bytes(payload[scale_bytes + position_bytes :])


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([5, 100, 7], "outside its block"),
        ([5, 127, 7], "outside its block"),
        ([5, 5, 7], "increasing"),
        ([7, 5, 9], "increasing"),
    ],
)
@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_bad_offsets_are_refused(codec_type: type[TopKCodec], offsets: list[int], match: str) -> None:
    codec = codec_type(100, 3)  # 7-bit offsets can say 100..127, past the block
    payload = valid_payload(codec, 1000)
    good = with_offsets(codec, payload, 1000, [5, 6, 7])
    codec.validate(good, 1000)
    refused(codec, with_offsets(codec, payload, 1000, offsets), 1000, match)


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_offset_past_a_short_tail_block_is_refused(codec_type: type[TopKCodec]) -> None:
    codec = codec_type(64, 1)  # 1000 = 15 blocks of 64 + a tail of 40 that keeps 1
    payload = valid_payload(codec, 1000)
    scale_bytes = 8 * 16
    offsets = unpack_bits(torch.tensor(payload[scale_bytes:], dtype=torch.uint8), 6, 16)
    offsets[15] = 50
    patched = (
        bytes(payload[:scale_bytes])
        + pack_bits(offsets, 6).numpy().tobytes()
        + bytes(payload[scale_bytes + 12 :])
    )
    refused(codec, patched, 1000, "outside its block")


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
def test_bitmap_with_the_wrong_count_is_refused(codec_type: type[TopKCodec]) -> None:
    codec = codec_type(8, 4)
    payload = valid_payload(codec, 16)  # two blocks: scales 16 bytes, bitmap 2 bytes, then the codes
    payload[16] = 0b00000111  # three marked
    refused(codec, bytes(payload), 16, "bitmap")
    payload[16] = 0xFF  # eight marked
    refused(codec, bytes(payload), 16, "bitmap")


@pytest.mark.parametrize(
    ("name", "codec_type", "kind"),
    [("topk", TopK2Codec, pb.CODEC_KIND_TOPK), ("topk4", TopK4Codec, pb.CODEC_KIND_TOPK4)],
)
def test_wrong_length_and_bad_specs_are_refused(
    name: str, codec_type: type[TopKCodec], kind: pb.CodecKind
) -> None:
    codec = get_codec(name)
    assert type(codec) is codec_type and isinstance(codec, TopKCodec)
    payload = codec.encode(torch.randn(5000)).numpy().tobytes()
    refused(codec, payload[:-1], 5000, "bytes")
    refused(codec, payload + b"\0", 5000, "bytes")
    spec = codec.spec()
    assert spec.kind == kind and spec.block_size == 4096 and spec.kept_per_block == 62
    again = codec_from_spec(spec)
    assert type(again) is codec_type and isinstance(again, TopKCodec)
    assert again.kept_per_block == 62 and again.spec() == spec
    for kept, block in [(0, 4096), (4097, 4096), (1, 1), (1, MAX_TOPK_BLOCK_SIZE + 1)]:
        with pytest.raises(CodecError, match="bad codec spec"):
            codec_from_spec(pb.CodecSpec(kind=kind, block_size=block, kept_per_block=kept))
    with pytest.raises(CodecError, match="kept_per_block must be 0"):
        codec_from_spec(pb.CodecSpec(kind=pb.CODEC_KIND_INT8, block_size=256, kept_per_block=3))
    with pytest.raises(ValueError, match="density"):
        get_codec("int8", density=0.1)
    with pytest.raises(ValueError, match="density"):
        get_codec("topk", density=0.0)
    assert get_codec("topk", density=0.03).kept_per_block == 123  # type: ignore[attr-defined]
    assert get_codec("topk", block_size=300, density=0.01).kept_per_block == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", TOPK_IDS)
def test_encode_refuses_non_finite_input(name: str) -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="non-finite"):
            get_codec(name).encode(torch.tensor([1.0, bad, 0.0]))


@settings(max_examples=300, deadline=None)
@given(
    codec_type=st.sampled_from(TOPK_CODECS),
    layout=st.sampled_from([(100, 3), (64, 30), (16, 1), (4096, 62), (64, 8), (1024, 16)]),
    num_elements=st.integers(1, 3000),
    edits=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_fuzzed_payloads_are_refused_or_decode_to_finite_sparse_numbers(
    codec_type: type[TopKCodec], layout: tuple[int, int], num_elements: int, edits: list[tuple[int, int]]
) -> None:
    codec = codec_type(*layout)
    payload = valid_payload(codec, num_elements)
    for position, byte in edits:
        payload[position % len(payload)] = byte
    try:
        codec.validate(bytes(payload), num_elements)
    except CodecError:
        with pytest.raises(CodecError):
            codec.decode(bytes(payload), num_elements)
        return
    decoded = codec.decode(bytes(payload), num_elements)
    assert bool(torch.isfinite(decoded).all())
    kept_at_most = sum(
        math.ceil(codec.kept_per_block * min(codec.block_size, num_elements - start) / codec.block_size)
        for start in range(0, num_elements, codec.block_size)
    )
    assert int((decoded != 0).sum()) <= kept_at_most


@pytest.mark.parametrize("codec_type", TOPK_CODECS, ids=TOPK_IDS)
@pytest.mark.parametrize(
    ("block_size", "kept", "num_elements"),
    [(4096, 62, 10_000), (64, 40, 1000), (512, 3, 777)],  # offsets with a tail block; bitmap; tiny tail
)
def test_add_into_is_the_dense_weighted_sum_bit_for_bit(
    codec_type: type[TopKCodec], block_size: int, kept: int, num_elements: int
) -> None:
    """The sparse round sums payloads with add_into; it must equal out += decode(p) * w in float32."""
    codec = codec_type(block_size, kept)
    generator = torch.Generator().manual_seed(5)
    payloads = [codec.encode(torch.randn(num_elements, generator=generator) * 10**i) for i in range(4)]
    payloads.append(codec.encode(torch.zeros(num_elements)))  # lo = hi = 0: kept values decode to +-0
    weights = [1.0, 0.3, 7.5, 1e-3, 2.0]
    dense, sparse = torch.zeros(num_elements), torch.zeros(num_elements)
    for payload, weight in zip(payloads, weights, strict=True):
        dense += codec.decode(payload, num_elements).mul_(weight)
        codec.add_into(payload, sparse, weight)
        assert torch.equal(dense.view(torch.int32), sparse.view(torch.int32))
