"""Stage C of a tiered all-reduce: the slices of a round's mean a member holds for others to pull.

In a tiered round (`tiers.py`) column i averages slice i of the group means with a flat round, so
every column-i member holds the same encoded bytes of slice i of the swarm's mean (the flat round's
``AllReduceResult.payloads``). The other members of its group, and of groups whose column-i member
is gone, then pull those bytes from it (PullSlice) and decode them: every node decodes identical
bytes, so every node ends bit-identical, as after a flat round.

A holder keeps each slice for the members allowed to pull it (its ``pullers``: with a closed swarm
the channel is authenticated, and this list is the authorization) until a deadline, and at most
``max_held`` slices at once (holding one more drops the oldest). A pull may come before the slice:
it waits, bounded in time and in number of waiters, as a message for a round not opened yet does
(`registry.py`). A pull for a slice whose time here is over, or that will never be held here
(``abandon``), is answered NOT_FOUND at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from protocol.allreduce.parts import Pulse
from protocol.codecs import Codec
from protocol.errors import ProtocolError

PLAN_DIGEST_NUM_BYTES = 32
"""A tiered round's plan is named by its SHA-256 (`TierPlan.digest`)."""

_MAX_GONE_REMEMBERED = 1024
"""Keys whose time is over that a store still answers NOT_FOUND at once (older ones: after a wait)."""


@dataclass(frozen=True, kw_only=True)
class SliceKey:
    """Which slice: slice ``slice_index`` of tiered round ``round_id``, whose plan hashes to ``plan_digest``."""

    round_id: int
    plan_digest: bytes
    slice_index: int


@dataclass(frozen=True, kw_only=True)
class HeldSlice:
    """A slice of a round's mean as its column decoded it: chunk i is ``chunk_sizes[i]`` numbers,
    encoded with ``codec`` as ``payloads[i]``."""

    codec: Codec
    chunk_sizes: tuple[int, ...]
    payloads: tuple[bytes | memoryview, ...]
    """The encoded chunks, unchanged; with the fp32 codec they may be views of the column's result,
    which nobody may write while the slice is held."""
    weight_sum: float
    """The weights of the slice's mean summed (the column's), finite; 0 where the holder does not
    know it. Pullers are told it in the header; nothing is computed from it."""

    def __post_init__(self) -> None:
        if len(self.chunk_sizes) != len(self.payloads):
            raise ValueError(f"{len(self.chunk_sizes)} chunk sizes for {len(self.payloads)} payloads")
        for size, payload in zip(self.chunk_sizes, self.payloads, strict=True):
            if size <= 0:
                raise ValueError(f"chunk sizes must be positive, got {size}")
            if len(payload) != self.codec.encoded_num_bytes(size):
                raise ValueError(
                    f"a {self.codec.name} chunk of {size} numbers is {self.codec.encoded_num_bytes(size)} "
                    f"bytes, got {len(payload)}"
                )
        if not (math.isfinite(self.weight_sum) and self.weight_sum >= 0):
            raise ValueError(f"weight_sum must be finite and >= 0, got {self.weight_sum}")

    @property
    def num_elements(self) -> int:
        return sum(self.chunk_sizes)

    def decode_into(self, out: torch.Tensor) -> torch.Tensor:
        """Decode the slice into the 1-D fp32 tensor ``out`` of ``num_elements`` numbers; return it."""
        if out.numel() != self.num_elements:
            raise ValueError(f"out has {out.numel()} numbers, the slice {self.num_elements}")
        offset = 0
        for size, payload in zip(self.chunk_sizes, self.payloads, strict=True):
            self.codec.decode_into(payload, out[offset : offset + size])
            offset += size
        return out


@dataclass(frozen=True, kw_only=True)
class PulledSlice:
    """What a pull of a slice got (its numbers went into the caller's tensor)."""

    num_elements: int
    weight_sum: float
    """The header's weight sum: the column's, as the holder holds it."""
    bytes_sent: int
    """Wire bytes (serialized messages) the pull sent: its request."""
    bytes_recv: int
    """Wire bytes it received: heartbeats, the header and the chunks."""
    codec: Codec | None = None
    """What the chunks were encoded with (the header's codec)."""
    chunks: tuple[tuple[int, int, bytes], ...] = ()
    """(offset, numbers, payload) of each chunk, in order, as received."""


@dataclass
class _Entry:
    held: HeldSlice
    pullers: frozenset[str]
    until: float
    bytes_served: int = 0  # wire bytes sent serving this slice so far


class SliceStore:
    """The slices a member holds for others to pull; the AllReduce servicer serves PullSlice from it.

    Used on the peer's event loop only. ``clock`` is ``time.monotonic`` but for tests: ``until``
    deadlines are read on it (waits are bounded in real seconds).
    """

    def __init__(
        self, *, max_held: int, max_waiting: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_held < 1 or max_waiting < 1:
            raise ValueError("max_held and max_waiting must be >= 1")
        self._max_held = max_held
        self._max_waiting = max_waiting
        self._clock = clock
        self._entries: dict[SliceKey, _Entry] = {}  # in the order they were held: oldest first
        self._gone: dict[SliceKey, None] = {}  # keys whose time is over, oldest first
        self._first_kept_round = 0  # drop_before's: rounds before it are over
        self._changed = Pulse()
        self._num_waiting = 0
        self._closed = False
        self.bytes_sent = 0
        """Wire bytes sent serving pulls (headers and chunks; not the few bytes of heartbeats), since
        the store was made."""
        self.bytes_recv = 0
        """Wire bytes of the pulls' requests, since the store was made."""

    def __len__(self) -> int:
        return len(self._entries)

    def count_served(self, key: SliceKey, num_bytes: int) -> None:
        """``num_bytes`` more sent serving ``key`` (the store's total and the slice's own)."""
        self.bytes_sent += num_bytes
        entry = self._entries.get(key)
        if entry is not None:
            entry.bytes_served += num_bytes

    def bytes_served(self, key: SliceKey) -> int:
        """Wire bytes sent so far serving ``key`` (0 once it is dropped or if never held)."""
        entry = self._entries.get(key)
        return 0 if entry is None else entry.bytes_served

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def hold(self, key: SliceKey, held: HeldSlice, *, pullers: frozenset[str], until: float) -> None:
        """Serve ``held`` as ``key`` to ``pullers`` until ``until`` (on the store's clock); a store
        that holds ``max_held`` slices drops its oldest first."""
        if self._closed:
            raise ValueError("the store is closed (its peer is stopping)")
        if key.round_id < self._first_kept_round:
            raise ValueError(f"round {key.round_id} is over here (dropped before {self._first_kept_round})")
        if key in self._entries:
            raise ValueError(f"{key} is already held")
        self.evict()
        while len(self._entries) >= self._max_held:
            self._forget(next(iter(self._entries)))
        self._gone.pop(key, None)
        self._entries[key] = _Entry(held, pullers, until)
        self._changed.notify()

    def abandon(self, key: SliceKey) -> None:
        """This slice will not be held here (any more): its pulls, waiting or to come, get NOT_FOUND."""
        if key in self._entries:
            self._forget(key)
        else:
            self._mark_gone(key)
        self._changed.notify()

    def evict(self) -> None:
        """Drop the slices whose time is over."""
        now = self._clock()
        for key in [k for k, entry in self._entries.items() if entry.until <= now]:
            self._forget(key)

    def drop_before(self, round_id: int) -> None:
        """Drop every slice of the rounds before ``round_id``; pulls for them get NOT_FOUND at once."""
        self._first_kept_round = max(self._first_kept_round, round_id)
        for key in [k for k in self._entries if k.round_id < round_id]:
            self._entries.pop(key)
        for key in [k for k in self._gone if k.round_id < round_id]:
            self._gone.pop(key)
        self._changed.notify()

    def rewind(self) -> None:
        """Forget every slice and accept lower round ids again (the peer's rounds rewound:
        `RoundRegistry.rewind`)."""
        self._entries.clear()
        self._gone.clear()
        self._first_kept_round = 0
        self._changed.notify()

    def close(self) -> None:
        """Drop every slice and answer every pull, waiting or to come, NOT_FOUND (the peer stops)."""
        self._closed = True
        for key in list(self._entries):
            self._forget(key)
        self._changed.notify()

    async def wait(self, key: SliceKey, peer_id: str, timeout: float) -> HeldSlice:
        """The slice ``peer_id`` asks for, waiting up to ``timeout`` seconds for it to be held
        (raises ProtocolError: NOT_FOUND, PERMISSION_DENIED or RESOURCE_EXHAUSTED)."""
        self.evict()
        if not self._settled(key):
            if self._num_waiting >= self._max_waiting:
                raise ProtocolError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many pulls wait for slices")
            self._num_waiting += 1
            try:
                await self._changed.wait_for(lambda: self._settled(key), timeout)
            finally:
                self._num_waiting -= 1
            self.evict()
        entry = self._entries.get(key)
        if entry is None:
            if self._closed:
                why = "this peer is stopping"
            elif self._is_gone(key):
                why = "its time here is over"
            else:
                why = f"it did not come within {timeout:.1f}s"
            raise ProtocolError(
                grpc.StatusCode.NOT_FOUND, f"slice {key.slice_index} of round {key.round_id}: {why}"
            )
        if peer_id not in entry.pullers:
            raise ProtocolError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{peer_id!r} may not pull slice {key.slice_index} of round {key.round_id} here",
            )
        return entry.held

    def _settled(self, key: SliceKey) -> bool:
        return key in self._entries or self._is_gone(key)

    def _is_gone(self, key: SliceKey) -> bool:
        return self._closed or key.round_id < self._first_kept_round or key in self._gone

    def _forget(self, key: SliceKey) -> None:
        self._entries.pop(key)
        self._mark_gone(key)

    def _mark_gone(self, key: SliceKey) -> None:
        self._gone[key] = None
        while len(self._gone) > _MAX_GONE_REMEMBERED:
            self._gone.pop(next(iter(self._gone)))
