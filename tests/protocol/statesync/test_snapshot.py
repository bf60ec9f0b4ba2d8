"""Snapshot and manifest: hashes against an independent reference, copies, validation, wire round trip."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.statesync import Snapshot
from protocol.statesync.manifest import content_digest, parse_manifest, to_manifest


def _snapshot(**tensors: torch.Tensor) -> Snapshot:
    return Snapshot(round_id=1, state_id="s1", tensors=tensors, metadata=b"{}", block_bytes=1000)


def test_global_params_hash_is_the_daemons_param_hash() -> None:
    params = torch.randn(12_345)
    # The daemon's param_hash: SHA-256 over the params as little-endian fp32 bytes (numpy, not torch).
    param_hash = hashlib.sha256(np.asarray(params.tolist(), dtype="<f4").tobytes()).digest()
    snapshot = _snapshot(global_params=params)
    assert snapshot.sha256("global_params") == param_hash
    blocks = snapshot.entries["global_params"].block_sha256
    raw = np.asarray(params.tolist(), dtype="<f4").tobytes()
    assert blocks == tuple(hashlib.sha256(raw[i : i + 1000]).digest() for i in range(0, len(raw), 1000))
    assert len(blocks) == 50  # 49 380 bytes in blocks of 1000: the last one is shorter


def test_any_wire_dtype_is_hashed_over_its_raw_bytes() -> None:
    tensors = {
        "bf16": torch.randn(301).to(torch.bfloat16),
        "i64": torch.arange(77, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.zeros(0),
    }
    snapshot = _snapshot(**tensors)
    for name, tensor in tensors.items():
        raw = bytes(tensor.view(torch.uint8).tolist())
        assert snapshot.sha256(name) == hashlib.sha256(raw).digest()
        assert snapshot.entries[name].num_bytes == len(raw)
    assert snapshot.entries["empty"].block_sha256 == ()
    assert snapshot.num_bytes == 602 + 616 + 3


def test_snapshot_copies_so_later_in_place_updates_do_not_change_it() -> None:
    params = torch.randn(5000)
    original = params.clone()
    snapshot = _snapshot(global_params=params)
    params.add_(1.0)  # the daemon's outer step updates its parameters in place
    assert torch.equal(snapshot.tensors["global_params"], original)
    raw = original.numpy().astype("<f4").tobytes()
    assert snapshot.sha256("global_params") == hashlib.sha256(raw).digest()


def test_a_snapshot_reuses_the_hashes_of_the_unchanged_tensors_of_the_one_it_follows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reuse``: a tensor given again, the same memory unwritten, keeps its hashes; a new one, or the
    same memory written in place since, is hashed (a state served in fragments rehashes one per round)."""
    import protocol.statesync.snapshot as snapshot_module

    hashed: list[str] = []
    real = snapshot_module.hash_tensors

    def counting(tensors, block_bytes):  # type: ignore[no-untyped-def]
        hashed.extend(tensors)
        return real(tensors, block_bytes)

    monkeypatch.setattr(snapshot_module, "hash_tensors", counting)
    a, b, c = torch.randn(3000), torch.randn(2000), torch.randn(1000)

    def served(tensors: dict[str, torch.Tensor], reuse: Snapshot | None) -> Snapshot:
        return Snapshot(round_id=1, state_id="s", tensors=tensors, metadata=b"", block_bytes=1000, copy=False,
                        reuse=reuse)  # fmt: skip

    first = served({"a": a, "b": b, "c": c}, None)
    assert hashed == ["a", "b", "c"]
    hashed.clear()
    new_b = b + 1.0
    second = served({"a": a, "b": new_b, "c": c}, first)
    assert hashed == ["b"]  # a and c are first's memory, unwritten
    hashed.clear()
    c.mul_(2.0)  # written in place after it was served: its hashes no longer stand
    third = served({"a": a, "b": new_b, "c": c}, second)
    assert hashed == ["c"]
    for snapshot, tensors in ((second, {"a": a, "b": new_b}), (third, {"a": a, "b": new_b, "c": c})):
        for name, tensor in tensors.items():
            raw = tensor.numpy().astype("<f4").tobytes()
            assert snapshot.sha256(name) == hashlib.sha256(raw).digest()
            blocks = tuple(hashlib.sha256(raw[i : i + 1000]).digest() for i in range(0, len(raw), 1000))
            assert snapshot.entries[name].block_sha256 == blocks
    hashed.clear()
    other_blocks = Snapshot(round_id=1, state_id="s", tensors={"a": a}, metadata=b"", block_bytes=500,
                            copy=False, reuse=third)  # fmt: skip
    assert hashed == ["a"] and len(other_blocks.entries["a"].block_sha256) == 24  # another block size
    hashed.clear()
    Snapshot(round_id=1, state_id="s", tensors={"a": a}, metadata=b"", block_bytes=1000, reuse=third)
    assert hashed == ["a"]  # copied: new memory, hashed


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensors": {"x": torch.zeros(2, 2)}}, "flat"),
        ({"tensors": {"x": torch.zeros(4, dtype=torch.complex64)}}, "cannot send"),
        ({"tensors": {"": torch.zeros(4)}}, "empty"),
        ({"state_id": ""}, "state_id"),
        ({"round_id": -1}, "round_id"),
        ({"metadata": b"x" * (2 << 20)}, "metadata"),
        ({"block_bytes": 0}, "block_bytes"),
        ({"tensors": {"x": torch.zeros(8)[::2]}, "copy": False}, "contiguous"),
    ],
)
def test_snapshot_rejects_user_mistakes(kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {
        "round_id": 1,
        "state_id": "s",
        "tensors": {"x": torch.zeros(4)},
        "metadata": b"",
    }
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        Snapshot(**arguments)  # type: ignore[arg-type]


def test_manifest_round_trip_and_digest_ignores_serving_limits() -> None:
    snapshot = _snapshot(a=torch.randn(3000), b=torch.randn(10).to(torch.float16))
    message = to_manifest(snapshot, max_range_bytes=5000, max_chunk_bytes=700)
    wire = pb.StateManifest.FromString(message.SerializeToString())
    manifest = parse_manifest(wire)
    assert (manifest.round_id, manifest.state_id, manifest.metadata) == (1, "s1", b"{}")
    assert manifest.entries == dict(snapshot.entries)
    assert (manifest.max_range_bytes, manifest.max_chunk_bytes, manifest.block_bytes) == (5000, 700, 1000)
    other_limits = to_manifest(snapshot, max_range_bytes=9000, max_chunk_bytes=100)
    assert content_digest(other_limits) == manifest.content_digest
    other_state = to_manifest(_snapshot(a=torch.randn(3000)), max_range_bytes=5000, max_chunk_bytes=700)
    assert content_digest(other_state) != manifest.content_digest


def _mangle(change: str) -> pb.StateManifest:
    message = to_manifest(_snapshot(a=torch.randn(3000)), max_range_bytes=5000, max_chunk_bytes=700)
    tensor = message.tensors[0]
    if change == "num_bytes":
        tensor.num_bytes += 4
    elif change == "short_hash":
        tensor.sha256 = tensor.sha256[:31]
    elif change == "missing_block":
        del tensor.block_sha256[-1]
    elif change == "repeated_name":
        message.tensors.append(tensor)
    elif change == "unknown_dtype":
        tensor.dtype = 99  # type: ignore[assignment]
    elif change == "limits_below_block":
        message.limits.max_range_bytes = 999
    elif change == "no_state_id":
        message.state_id = ""
    return message


@pytest.mark.parametrize(
    "change",
    [
        "num_bytes",
        "short_hash",
        "missing_block",
        "repeated_name",
        "unknown_dtype",
        "limits_below_block",
        "no_state_id",
    ],
)
def test_parse_manifest_refuses_malformed_manifests(change: str) -> None:
    with pytest.raises(ValueError):
        parse_manifest(_mangle(change))
