"""Manifests: a snapshot described on the wire, and the fetcher's checked reading of one.

The provider turns its Snapshot into a StateManifest; the fetcher parses what a source sent into a
`Manifest`, refusing anything malformed (a source's manifest decides how much memory the fetcher
allocates and which hashes it trusts). Two sources serve the same snapshot only if their manifests
have the same `content_digest`: SHA-256 over the manifest's deterministic encoding without the
per-provider serving limits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.statesync.dtypes import dtype_code, dtype_of
from protocol.statesync.snapshot import Snapshot, TensorEntry, num_blocks

SHA256_BYTES = 32


def to_manifest(snapshot: Snapshot, *, max_range_bytes: int, max_chunk_bytes: int) -> pb.StateManifest:
    """The manifest a provider sends for `snapshot`, with its own serving limits."""
    return pb.StateManifest(
        round_id=snapshot.round_id,
        state_id=snapshot.state_id,
        block_bytes=snapshot.block_bytes,
        tensors=[
            pb.StateTensorInfo(
                name=entry.name,
                dtype=dtype_code(entry.dtype),  # type: ignore[arg-type]
                num_elements=entry.num_elements,
                num_bytes=entry.num_bytes,
                sha256=entry.sha256,
                block_sha256=entry.block_sha256,
            )
            for entry in snapshot.entries.values()
        ],
        metadata=snapshot.metadata,
        limits=pb.ServingLimits(max_range_bytes=max_range_bytes, max_chunk_bytes=max_chunk_bytes),
    )


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A source's manifest, checked: what the snapshot holds and how the source serves it."""

    round_id: int
    state_id: str
    block_bytes: int
    entries: dict[str, TensorEntry]
    """Name -> dtype, size and hashes, in the manifest's order."""
    metadata: bytes
    max_range_bytes: int
    max_chunk_bytes: int
    content_digest: bytes
    """Equal for two sources exactly when they describe the same snapshot byte for byte."""

    @property
    def num_bytes(self) -> int:
        return sum(entry.num_bytes for entry in self.entries.values())


def content_digest(message: pb.StateManifest) -> bytes:
    """SHA-256 of the manifest without its serving limits (deterministic protobuf encoding)."""
    content = pb.StateManifest()
    content.CopyFrom(message)
    content.ClearField("limits")
    return hashlib.sha256(content.SerializeToString(deterministic=True)).digest()


def parse_manifest(message: pb.StateManifest) -> Manifest:
    """Check a received manifest and read it; ValueError says what is wrong with it."""
    if not message.state_id:
        raise ValueError("manifest has no state_id")
    if message.block_bytes <= 0:
        raise ValueError("manifest has block_bytes = 0")
    if message.limits.max_range_bytes < message.block_bytes or message.limits.max_chunk_bytes <= 0:
        raise ValueError(
            f"source serves ranges of at most {message.limits.max_range_bytes} bytes and chunks of "
            f"{message.limits.max_chunk_bytes}: it cannot serve one block of {message.block_bytes}"
        )
    entries: dict[str, TensorEntry] = {}
    for info in message.tensors:
        dtype = dtype_of(info.dtype)
        if not info.name or info.name in entries:
            raise ValueError(f"tensor name {info.name!r} is empty or repeated")
        if dtype is None:
            raise ValueError(f"tensor {info.name!r} has unknown dtype code {info.dtype}")
        if info.num_bytes != info.num_elements * dtype.itemsize:
            raise ValueError(
                f"tensor {info.name!r}: {info.num_elements} numbers of {dtype} cannot take {info.num_bytes} bytes"
            )
        if len(info.sha256) != SHA256_BYTES or any(len(h) != SHA256_BYTES for h in info.block_sha256):
            raise ValueError(f"tensor {info.name!r}: hashes must be {SHA256_BYTES} bytes")
        if len(info.block_sha256) != num_blocks(info.num_bytes, message.block_bytes):
            raise ValueError(
                f"tensor {info.name!r}: {len(info.block_sha256)} block hashes for {info.num_bytes} bytes"
            )
        entries[info.name] = TensorEntry(
            name=info.name,
            dtype=dtype,
            num_elements=info.num_elements,
            num_bytes=info.num_bytes,
            sha256=info.sha256,
            block_sha256=tuple(info.block_sha256),
        )
    return Manifest(
        round_id=message.round_id,
        state_id=message.state_id,
        block_bytes=message.block_bytes,
        entries=entries,
        metadata=message.metadata,
        max_range_bytes=message.limits.max_range_bytes,
        max_chunk_bytes=message.limits.max_chunk_bytes,
        content_digest=content_digest(message),
    )
