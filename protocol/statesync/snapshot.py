"""Snapshot: the global state one provider serves, frozen, with the hashes a fetcher checks it against.

A snapshot is a round number, a state id, named flat CPU tensors and an opaque metadata blob. The
protocol knows nothing of models: the daemon decides what goes in (global parameters, outer-optimizer
momentum, a JSON blob with the round, the schedule step and the data-loader state).

At construction every tensor is hashed twice over its raw bytes (native order, which must be
little-endian, the wire order):

  * `sha256`: SHA-256 of the whole tensor. The daemon's param_hash is SHA-256 over the global
    parameters as fp32 little-endian bytes, so for a snapshot whose "global_params" tensor holds those
    parameters, `snapshot.sha256("global_params").hex()` equals the node's param_hash; the daemon
    uses that as the state id and a joiner can check what it fetched against the swarm's consensus.
  * `block_sha256`: SHA-256 of every block of `block_bytes` bytes (the last may be shorter), so a
    fetcher that assembles a tensor from several sources can check each block as it arrives and tell
    which source sent wrong bytes (pieces as in BitTorrent, Cohen 2003).

Cost: one copy of the state (unless copy=False) and two SHA-256 passes over it, spread over up to
HASH_THREADS threads; at ~0.5 GB/s per core, about 0.2 s of CPU per 100 MB and pass.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from protocol.statesync.config import MAX_MANIFEST_BYTES, default_block_bytes
from protocol.statesync.dtypes import dtype_code

MAX_METADATA_BYTES = 1 << 20
"""Metadata travels inside the manifest, so it must stay small."""
HASH_THREADS = 4
"""Threads that hash a new snapshot (SHA-256 runs at roughly 0.5 GB/s per core without SHA extensions)."""


@dataclass(frozen=True, kw_only=True)
class TensorEntry:
    """What a manifest says about one tensor: its type, size and hashes."""

    name: str
    dtype: torch.dtype
    num_elements: int
    num_bytes: int
    sha256: bytes
    """SHA-256 of all the tensor's bytes (32 bytes)."""
    block_sha256: tuple[bytes, ...]
    """SHA-256 of each block of the snapshot's block_bytes bytes, in order."""


def num_blocks(num_bytes: int, block_bytes: int) -> int:
    """Blocks of block_bytes needed to cover num_bytes (an empty tensor has none)."""
    return -(-num_bytes // block_bytes)


def byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The raw bytes of a flat contiguous CPU tensor as a uint8 numpy array sharing its memory (any dtype)."""
    assert tensor.dim() == 1 and tensor.is_contiguous() and tensor.device.type == "cpu"
    return tensor.view(torch.uint8).numpy()


def sha256_of(data: np.ndarray) -> bytes:
    """SHA-256 of a contiguous array's bytes; hashlib releases the GIL, so this may run in a thread."""
    return hashlib.sha256(data.data).digest()


def hash_tensors(tensors: Mapping[str, torch.Tensor], block_bytes: int) -> dict[str, TensorEntry]:
    """Hash flat contiguous CPU tensors whole and in blocks, on up to HASH_THREADS threads.

    The whole-tensor hashes are sequential by nature, so they are submitted first (largest first)
    and the block hashes fill the other threads around them.
    """
    views = {name: byte_view(tensor) for name, tensor in tensors.items()}  # (num_bytes,) uint8 each
    num_threads = max(1, min(HASH_THREADS, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="snapshot-hash") as pool:
        by_size = sorted(views, key=lambda name: -views[name].size)
        whole = {name: pool.submit(sha256_of, views[name]) for name in by_size}
        blocks = {
            name: [
                pool.submit(sha256_of, view[start : start + block_bytes])
                for start in range(0, view.size, block_bytes)
            ]
            for name, view in views.items()
        }
        return {
            name: TensorEntry(
                name=name,
                dtype=tensor.dtype,
                num_elements=tensor.numel(),
                num_bytes=int(views[name].size),
                sha256=whole[name].result(),
                block_sha256=tuple(future.result() for future in blocks[name]),
            )
            for name, tensor in tensors.items()
        }


def _unchanged(reuse: Snapshot, name: str, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the memory ``reuse`` hashed as ``name``, unwritten since: the same storage,
    start, size and type, and its version counter (shared by every view; any in-place write moves
    it) where it was when ``reuse`` hashed it."""
    before = reuse.tensors.get(name)
    return (
        before is not None
        and before.data_ptr() == tensor.data_ptr()
        and before.dtype == tensor.dtype
        and before.shape == tensor.shape
        and before.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
        and reuse._versions.get(name) == tensor._version
    )


class Snapshot:
    """A frozen global state: round, state id, named flat CPU tensors, metadata, and their hashes.

    The tensors are copied at construction unless `copy=False` (then the caller promises never to
    change them: the daemon updates its parameters in place every outer round, and a snapshot whose
    bytes drift from its hashes would be served as corrupt). Read them, never write them.
    """

    __slots__ = ("_round_id", "_state_id", "_tensors", "_metadata", "_block_bytes", "_entries", "_versions")

    def __init__(
        self,
        *,
        round_id: int,
        state_id: str,
        tensors: Mapping[str, torch.Tensor],
        metadata: bytes,
        block_bytes: int | None = None,
        copy: bool = True,
        reuse: Snapshot | None = None,
    ) -> None:
        """``block_bytes``: the hashed blocks' size, by default ``default_block_bytes`` of the
        tensors' bytes together. ``reuse`` (with ``copy=False``): an earlier snapshot whose hashes
        stand for every tensor given again unchanged, the same memory (``_unchanged``), at the same
        block size: those are not hashed again (a state served in pieces, of which a round changes
        one, hashes that one only)."""
        if sys.byteorder != "little":
            raise RuntimeError("state sync sends native bytes and assumes a little-endian host")
        if round_id < 0:
            raise ValueError(f"round_id must be >= 0, got {round_id}")
        if not state_id:
            raise ValueError("state_id must not be empty (an empty id asks a provider for its newest)")
        if block_bytes is None:
            block_bytes = default_block_bytes(sum(t.numel() * t.element_size() for t in tensors.values()))
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        if len(metadata) > MAX_METADATA_BYTES:
            raise ValueError(
                f"metadata is {len(metadata)} bytes; at most {MAX_METADATA_BYTES} travel in a manifest"
            )
        owned: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if not name:
                raise ValueError("tensor names must not be empty")
            if tensor.dim() != 1 or tensor.device.type != "cpu":
                raise ValueError(
                    f"tensor {name!r} must be flat and on the CPU, got {tuple(tensor.shape)} on {tensor.device}"
                )
            dtype_code(tensor.dtype)  # ValueError for a dtype the wire cannot name
            if not copy and not tensor.is_contiguous():
                raise ValueError(f"tensor {name!r} is not contiguous; pass copy=True")
            owned[name] = tensor.detach().clone() if copy else tensor.detach()
        known = {
            name: reuse.entries[name]
            for name, tensor in owned.items()
            if not copy
            and reuse is not None
            and reuse.block_bytes == block_bytes
            and _unchanged(reuse, name, tensor)
        }
        hashed = hash_tensors({n: t for n, t in owned.items() if n not in known}, block_bytes)
        entries = {name: known[name] if name in known else hashed[name] for name in owned}
        # A manifest carries 32 bytes per block; it must fit in one message.
        if (
            40 * sum(len(entry.block_sha256) for entry in entries.values()) + len(metadata)
            > MAX_MANIFEST_BYTES
        ):
            raise ValueError("too many blocks for one manifest; raise block_bytes")
        self._set(round_id, state_id, owned, bytes(metadata), block_bytes, entries)

    def _set(
        self,
        round_id: int,
        state_id: str,
        tensors: dict[str, torch.Tensor],
        metadata: bytes,
        block_bytes: int,
        entries: dict[str, TensorEntry],
    ) -> None:
        self._round_id = round_id
        self._state_id = state_id
        self._tensors = MappingProxyType(tensors)
        self._metadata = metadata
        self._block_bytes = block_bytes
        self._entries = MappingProxyType(entries)
        # Each tensor's version counter when hashed: ``reuse`` by a later snapshot checks it.
        self._versions = {name: tensor._version for name, tensor in tensors.items()}

    @classmethod
    def from_verified(
        cls,
        *,
        round_id: int,
        state_id: str,
        tensors: dict[str, torch.Tensor],
        metadata: bytes,
        block_bytes: int,
        entries: dict[str, TensorEntry],
    ) -> Snapshot:
        """A snapshot whose tensors the caller has already checked against `entries` (the fetcher's
        end product), so hashing them a second time is skipped. Not for anything unverified."""
        assert tensors.keys() == entries.keys()
        snapshot = cls.__new__(cls)
        snapshot._set(round_id, state_id, tensors, metadata, block_bytes, entries)
        return snapshot

    @property
    def round_id(self) -> int:
        """The number of outer rounds this state has seen."""
        return self._round_id

    @property
    def state_id(self) -> str:
        """The id fetchers ask for (the daemon uses its param_hash)."""
        return self._state_id

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """Name -> flat CPU tensor (read-only mapping; do not write the tensors)."""
        return self._tensors

    @property
    def metadata(self) -> bytes:
        """The opaque metadata blob."""
        return self._metadata

    @property
    def block_bytes(self) -> int:
        """The block size of `TensorEntry.block_sha256`."""
        return self._block_bytes

    @property
    def entries(self) -> Mapping[str, TensorEntry]:
        """Name -> type, size and hashes, in the tensors' order."""
        return self._entries

    @property
    def num_bytes(self) -> int:
        """Bytes of all tensors together (what a fetcher transfers, besides the manifest)."""
        return sum(entry.num_bytes for entry in self._entries.values())

    def sha256(self, name: str) -> bytes:
        """SHA-256 of tensor `name`'s bytes; for "global_params" (fp32) this is the daemon's param_hash."""
        return self._entries[name].sha256

    def __repr__(self) -> str:
        return (
            f"Snapshot(round_id={self._round_id}, state_id={self._state_id!r}, "
            f"tensors={list(self._tensors)}, num_bytes={self.num_bytes}, metadata={len(self._metadata)} bytes)"
        )
