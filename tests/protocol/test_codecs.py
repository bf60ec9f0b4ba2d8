"""Codecs: exact payload sizes, the stated error bounds, the wire layout, and rejection of bad payloads."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from protocol.codecs import (
    CODEC_NAMES,
    CodecError,
    Int4Codec,
    Int8Codec,
    codec_from_spec,
    get_codec,
)
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb

LENGTHS = [0, 1, 2, 63, 64, 65, 255, 256, 257, 1000, 4099]


def awkward_values(num_elements: int, seed: int) -> torch.Tensor:
    """Normal numbers whose magnitude spans 1e-6..1e6, with an all-zero stretch and sign flips."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(num_elements, generator=generator)
    values *= torch.logspace(-6, 6, max(num_elements, 1))[:num_elements]
    values[num_elements // 3 : num_elements // 3 + 70] = 0.0
    return values


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("num_elements", LENGTHS)
def test_roundtrip_within_stated_bound(name: str, num_elements: int) -> None:
    codec = get_codec(name)
    values = awkward_values(num_elements, seed=num_elements)
    payload = codec.encode(values)
    assert payload.dtype == torch.uint8 and payload.numel() == codec.encoded_num_bytes(num_elements)
    decoded = codec.decode(bytes(payload.numpy().tobytes()), num_elements)
    error = (decoded - values).abs()
    assert torch.all(error <= codec.error_bound(values)), (error - codec.error_bound(values)).max()


@pytest.mark.parametrize("name", ["int8", "int4", "fp16", "bf16"])
def test_bound_is_not_vacuous(name: str) -> None:
    """The bound is within a factor 4 of the worst error actually seen on random data."""
    codec = get_codec(name)
    values = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    error = (codec.decode(codec.encode(values), values.numel()) - values).abs()
    ratio = (error / codec.error_bound(values)).max()
    assert 0.25 < ratio <= 1.0


def test_none_is_exact_and_fp16_clamps() -> None:
    values = torch.tensor([1e-30, -3.5, 1e30, 70000.0, -1e9])
    assert torch.equal(get_codec("none").decode(get_codec("none").encode(values), 5), values)
    fp16 = get_codec("fp16")
    decoded = fp16.decode(fp16.encode(values), 5)
    assert torch.isfinite(decoded).all()
    assert decoded[3] == 65504.0 and decoded[4] == -65504.0
    bf16 = get_codec("bf16")
    huge = torch.tensor([3.4e38, -3.4e38])
    assert torch.isfinite(bf16.decode(bf16.encode(huge), 2)).all()


def test_int8_layout_matches_a_hand_computed_payload() -> None:
    codec = Int8Codec(block_size=4)
    values = torch.tensor([1.0, -2.0, 0.5, 0.0, 254.0, 127.0])  # blocks [1,-2,.5,0] and [254,127]
    payload = codec.encode(values).numpy().tobytes()
    scales = struct.unpack("<2f", payload[:8])
    codes = list(np.frombuffer(payload[8:], dtype=np.int8))
    assert scales == (np.float32(2.0 / 127), 2.0)
    assert codes == [64, -127, 32, 0, 127, 64]  # 1 * 127/2 = 63.5 -> 64 (half to even), 127/2 -> 64


def test_int4_layout_matches_a_hand_computed_payload() -> None:
    codec = Int4Codec(block_size=8)
    values = torch.tensor([7.0, -7.0, 0.0, 3.5, 1.0])  # one block, absmax 7 -> scale 1
    payload = codec.encode(values).numpy().tobytes()
    assert struct.unpack("<f", payload[:4]) == (1.0,)
    # codes 7, -7, 0, 4 (3.5 rounds half to even), 1 -> stored +8: 15, 1, 8, 12, 9, pad 8
    assert list(payload[4:]) == [15 | (1 << 4), 8 | (12 << 4), 9 | (8 << 4)]
    assert codec.decode(payload, 5).tolist() == [7.0, -7.0, 0.0, 4.0, 1.0]


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_wrong_length_is_rejected(name: str) -> None:
    codec = get_codec(name)
    payload = codec.encode(torch.randn(100)).numpy().tobytes()
    with pytest.raises(CodecError, match="bytes"):
        codec.decode(payload[:-1], 100)
    with pytest.raises(CodecError, match="bytes"):
        codec.validate(payload + b"\0", 100)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_non_finite_payload_is_rejected(name: str) -> None:
    codec = get_codec(name)
    payload = bytearray(codec.encode(torch.randn(100)).numpy().tobytes())
    if name == "none":
        payload[0:4] = struct.pack("<f", math.nan)
    elif name in ("fp16", "bf16"):
        payload[2:4] = b"\x00\x7c" if name == "fp16" else b"\x80\x7f"  # +inf
    else:
        payload[0:4] = struct.pack("<f", math.inf)  # first block's scale
    with pytest.raises(CodecError, match="non-finite"):
        codec.validate(bytes(payload), 100)
    with pytest.raises(CodecError, match="non-finite"):
        codec.decode(bytes(payload), 100)


def test_blockwise_encode_refuses_non_finite_input() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        get_codec("int8").encode(torch.tensor([1.0, math.nan]))


def test_encode_refuses_wrong_dtype() -> None:
    with pytest.raises(ValueError, match="float32"):
        get_codec("int8").encode(torch.zeros(4, dtype=torch.float64))


def test_registry_and_specs() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        get_codec("zstd")
    with pytest.raises(ValueError, match="no blocks"):
        get_codec("fp16", block_size=8)
    assert get_codec("int8", block_size=32).block_size == 32
    for name in CODEC_NAMES:
        codec = get_codec(name)
        again = codec_from_spec(codec.spec())
        assert type(again) is type(codec) and again.block_size == codec.block_size
    with pytest.raises(CodecError, match="unknown codec kind"):
        codec_from_spec(pb.CodecSpec(kind=pb.CODEC_KIND_UNSPECIFIED))
