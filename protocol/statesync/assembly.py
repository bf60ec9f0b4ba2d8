"""The fetcher's bookkeeping, with no sockets: how tensors are cut into ranges, and where bytes land.

Three sizes matter, from large to small:

  range  what one FetchRange asks one source for: a whole number of blocks (the last range of a
         tensor ends at the tensor's end); the unit of work handed out to sources.
  block  the unit of verification: the manifest advertises a SHA-256 per block of `block_bytes`.
  chunk  one streamed message; chunks need not line up with blocks.

Because ranges start on block boundaries and a stream is checked block by block as it arrives, the
part of a range a failed source did not deliver is again a block-aligned range (`remaining_after`):
it starts at the first block not yet verified, and the few bytes of a half-received block are simply
fetched again. So every block is written and checked with bytes from exactly one source, and a block
that fails its check convicts that source.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from protocol.statesync.config import RANGES_PER_SOURCE
from protocol.statesync.manifest import Manifest
from protocol.statesync.snapshot import TensorEntry


@dataclass(frozen=True)
class ByteRange:
    """Bytes [start, end) of tensor `tensor`; start is on a block boundary."""

    tensor: str
    start: int
    end: int

    @property
    def num_bytes(self) -> int:
        return self.end - self.start

    def remaining_after(self, verified_end: int) -> ByteRange | None:
        """What is left once bytes [start, verified_end) are verified; None if nothing is."""
        assert self.start <= verified_end <= self.end
        return ByteRange(self.tensor, verified_end, self.end) if verified_end < self.end else None


def range_bytes_for(
    requested: int, *, block_bytes: int, max_range_bytes: int, num_bytes: int, num_sources: int
) -> int:
    """Bytes per range: `requested`, at most what every source serves and at most a
    RANGES_PER_SOURCE-th share of the snapshot's `num_bytes` per source (so every source sends part of
    it), rounded down to whole blocks (>= 1)."""
    share = num_bytes // max(1, num_sources * RANGES_PER_SOURCE)
    limit = min(requested, max_range_bytes, share)
    return max(block_bytes, limit // block_bytes * block_bytes)


def split_ranges(manifest: Manifest, range_bytes: int) -> list[ByteRange]:
    """Every tensor cut into ranges of `range_bytes` (a multiple of block_bytes), tensors interleaved.

    Interleaving (first range of every tensor, then the second ones, ...) keeps all tensors moving,
    so none is left to a single slow source at the end.
    """
    assert range_bytes > 0 and range_bytes % manifest.block_bytes == 0
    per_tensor = [
        [
            ByteRange(name, start, min(start + range_bytes, entry.num_bytes))
            for start in range(0, entry.num_bytes, range_bytes)
        ]
        for name, entry in manifest.entries.items()
    ]
    longest = max((len(ranges) for ranges in per_tensor), default=0)
    return [ranges[i] for i in range(longest) for ranges in per_tensor if i < len(ranges)]


class Assembly:
    """Preallocated buffers that fetched bytes are written into, and the block and tensor checks.

    Each tensor gets one uninitialised uint8 buffer of its size; writes copy a chunk straight into
    place, and `tensors()` reinterprets the buffers as their dtypes without another copy.

    The whole-tensor SHA-256 must consume the bytes in order, but blocks are verified in whatever
    order sources deliver them. So verified blocks wait in a backlog, and the fetcher repeatedly
    takes the verified span right after what the tensor hash has consumed (`take_hash_span`) and
    feeds it (`hash_span`, in a thread) while the transfer goes on; at the end only the last span is
    left to hash, not a whole pass over the state.
    """

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._buffers = {
            name: torch.empty(entry.num_bytes, dtype=torch.uint8) for name, entry in manifest.entries.items()
        }
        self._views = {name: buffer.numpy() for name, buffer in self._buffers.items()}  # share memory
        self.num_bytes_verified = 0
        self._tensor_hashers = {name: hashlib.sha256() for name in manifest.entries}
        self._hash_taken_end = dict.fromkeys(manifest.entries, 0)
        self._backlog: dict[str, dict[int, int]] = {name: {} for name in manifest.entries}  # start -> end

    @property
    def num_bytes(self) -> int:
        return self.manifest.num_bytes

    def entry(self, name: str) -> TensorEntry:
        return self.manifest.entries[name]

    def write(self, name: str, offset: int, data: bytes) -> None:
        """Copy `data` into tensor `name` at byte `offset` (the caller checked the bounds)."""
        self._views[name][offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)

    def block_end(self, name: str, start: int) -> int:
        """End of the block that starts at byte `start` of tensor `name`."""
        return min(start + self.manifest.block_bytes, self.manifest.entries[name].num_bytes)

    def block_matches(self, name: str, start: int) -> bool:
        """Whether the block at byte `start` hashes to the manifest's value (thread-safe; releases the GIL)."""
        block_index, misalignment = divmod(start, self.manifest.block_bytes)
        assert misalignment == 0
        data = self._views[name][start : self.block_end(name, start)]
        return hashlib.sha256(data.data).digest() == self.manifest.entries[name].block_sha256[block_index]

    def mark_verified(self, name: str, start: int, end: int) -> None:
        """Block [start, end) of tensor `name` matched its hash: queue it for the tensor hash."""
        self._backlog[name][start] = end
        self.num_bytes_verified += end - start

    def take_hash_span(self, name: str) -> tuple[int, int] | None:
        """The verified bytes right after those the tensor hash has taken so far, or None.

        Only one hashing task per tensor may take spans, and it must hash each span before taking
        the next, so the hasher sees the bytes in order.
        """
        backlog, start = self._backlog[name], self._hash_taken_end[name]
        end = start
        while end in backlog:
            end = backlog.pop(end)
        if end == start:
            return None
        self._hash_taken_end[name] = end
        return start, end

    def hash_span(self, name: str, start: int, end: int) -> None:
        """Feed bytes [start, end) of tensor `name` to its hash (in a thread; hashlib releases the GIL)."""
        self._tensor_hashers[name].update(self._views[name][start:end].data)

    def tensor_sha256(self, name: str) -> bytes:
        """SHA-256 of the whole tensor, once every span of it has been hashed."""
        assert self._hash_taken_end[name] == self.manifest.entries[name].num_bytes, name
        return self._tensor_hashers[name].digest()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Name -> flat tensor of its dtype, sharing the buffers."""
        return {name: self._buffers[name].view(entry.dtype) for name, entry in self.manifest.entries.items()}
