"""Range planning and the assembly buffers, without sockets."""

from __future__ import annotations

import torch

from protocol.statesync import Snapshot
from protocol.statesync.assembly import Assembly, ByteRange, range_bytes_for, split_ranges
from protocol.statesync.config import default_block_bytes
from protocol.statesync.manifest import parse_manifest, to_manifest


def _manifest(sizes: dict[str, int], block_bytes: int = 1000):  # noqa: ANN202
    tensors = {name: torch.randint(0, 256, (size,), dtype=torch.uint8) for name, size in sizes.items()}
    snapshot = Snapshot(round_id=0, state_id="s", tensors=tensors, metadata=b"", block_bytes=block_bytes)
    return snapshot, parse_manifest(to_manifest(snapshot, max_range_bytes=10**9, max_chunk_bytes=10**6))


def test_ranges_cover_every_tensor_exactly_on_block_boundaries_and_interleave() -> None:
    _, manifest = _manifest({"a": 10_500, "b": 3000, "c": 0, "d": 999})
    ranges = split_ranges(manifest, 4000)
    for name, size in {"a": 10_500, "b": 3000, "d": 999}.items():
        mine = [r for r in ranges if r.tensor == name]
        covered = sorted((r.start, r.end) for r in mine)
        assert covered[0][0] == 0 and covered[-1][1] == size
        assert all(left[1] == right[0] for left, right in zip(covered, covered[1:], strict=False))
        assert all(r.start % 1000 == 0 and r.num_bytes <= 4000 for r in mine)
    assert not [r for r in ranges if r.tensor == "c"]
    assert [r.tensor for r in ranges] == ["a", "b", "d", "a", "a"]


def test_range_bytes_are_whole_blocks_within_every_sources_limit() -> None:
    big = {"num_bytes": 10**9, "num_sources": 1}
    assert range_bytes_for(32_500, block_bytes=1000, max_range_bytes=10**6, **big) == 32_000
    assert range_bytes_for(32_500, block_bytes=1000, max_range_bytes=7_999, **big) == 7_000
    assert range_bytes_for(10, block_bytes=1000, max_range_bytes=10**6, **big) == 1000


def test_range_bytes_leave_every_source_a_share_of_a_small_snapshot() -> None:
    """Two sources of 100,000 bytes: ranges of at most 100,000 / (2 x 4), whole blocks."""
    assert (
        range_bytes_for(32_500, block_bytes=1000, max_range_bytes=10**6, num_bytes=100_000, num_sources=2)
        == 12_000
    )
    assert (
        range_bytes_for(32_500, block_bytes=1000, max_range_bytes=10**6, num_bytes=100_000, num_sources=1)
        == 25_000
    )
    assert (
        range_bytes_for(32_500, block_bytes=1000, max_range_bytes=10**6, num_bytes=3000, num_sources=3)
        == 1000
    )


def test_a_snapshot_picks_blocks_of_about_a_32nd_of_it_from_64_kib_to_4_mib() -> None:
    assert default_block_bytes(934_056) == 64 * 1024  # 29,189 a 32nd: the 64 KiB floor
    assert default_block_bytes(7_357_440) == 128 * 1024  # the nano state: 229,920 a 32nd
    assert default_block_bytes(1 << 40) == 4 << 20
    assert default_block_bytes(0) == 64 * 1024
    tensors = {"a": torch.zeros(1_000_000)}  # 4 MB: 125,000 a 32nd -> 64 KiB
    assert Snapshot(round_id=0, state_id="x", tensors=tensors, metadata=b"").block_bytes == 64 * 1024


def test_remaining_after_keeps_the_unverified_tail() -> None:
    byte_range = ByteRange("a", 2000, 6000)
    assert byte_range.remaining_after(2000) == byte_range
    assert byte_range.remaining_after(5000) == ByteRange("a", 5000, 6000)
    assert byte_range.remaining_after(6000) is None


def test_assembly_checks_blocks_and_returns_the_exact_tensors() -> None:
    params = torch.randn(2600)  # 10 400 bytes: 10 full blocks and a short one
    scales = torch.randn(7).to(torch.bfloat16)
    snapshot = Snapshot(
        round_id=0, state_id="s", tensors={"p": params, "s": scales}, metadata=b"", block_bytes=1000
    )
    manifest = parse_manifest(to_manifest(snapshot, max_range_bytes=10**9, max_chunk_bytes=10**6))
    assembly = Assembly(manifest)
    raw = params.numpy().tobytes()
    for start in range(0, len(raw), 333):  # chunks that do not line up with blocks
        assembly.write("p", start, raw[start : start + 333])
    assembly.write("s", 0, scales.view(torch.uint8).numpy().tobytes())
    assert all(assembly.block_matches("p", start) for start in range(0, len(raw), 1000))
    assert assembly.block_end("p", 10_000) == 10_400
    # Blocks verified out of order still reach the tensor hash in order.
    spans = []
    for start in (3000, 1000, 0, 2000, 10_000, 4000, 5000, 6000, 7000, 9000, 8000):
        assembly.mark_verified("p", start, assembly.block_end("p", start))
        while (span := assembly.take_hash_span("p")) is not None:
            spans.append(span)
            assembly.hash_span("p", *span)
    assert spans == [
        (0, 2000),
        (2000, 4000),
        (4000, 5000),
        (5000, 6000),
        (6000, 7000),
        (7000, 8000),
        (8000, 10_400),
    ]
    assert assembly.num_bytes_verified == 10_400
    assembly.mark_verified("s", 0, 14)
    assembly.hash_span("s", *assembly.take_hash_span("s"))  # type: ignore[misc]
    assert assembly.tensor_sha256("p") == snapshot.sha256("p")
    assert assembly.tensor_sha256("s") == snapshot.sha256("s")
    tensors = assembly.tensors()
    assert torch.equal(tensors["p"], params) and torch.equal(
        tensors["s"].view(torch.int16), scales.view(torch.int16)
    )
    assembly.write("p", 4321, b"\x00\x01")
    assert not assembly.block_matches("p", 4000)
    assert assembly.block_matches("p", 3000) and assembly.block_matches("p", 5000)
