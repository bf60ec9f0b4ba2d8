"""Paced sends: one member's cap on the bytes per second its round writes to the wire.

A round sent at full link rate fills a capped uplink for as long as its bytes take, then leaves it
idle. When the caller has time to spare before it needs the mean (a fragment's round overlapped
with the next τ inner steps, Streaming DiLoCo, Douillard et al. 2025), it can spread the same bytes
over that time instead, so the link's busiest second carries a fraction of its capacity.

`SendPace` is a token bucket shared by every chunk this member writes in one round: contributions
it pushes to owners, replicas it hands to the holders of its part, and averages it serves to
pullers (headers, heartbeats and receipts are not paced: they are small and some carry the round's
liveness). Each chunk waits for its bytes' tokens, which accrue at the pace's rate up to one burst;
concurrent writers queue in FIFO order, so the rate caps their sum, not each stream.

The pace never makes the round miss a deadline:

    relaxation  it plans the bytes it has yet to send (`total_bytes`, from `member_send_bytes`) to be
                written by `finish_by`, a point well inside the reduce-scatter phase; whenever those
                bytes would not fit before it at the pace's rate, the rate is raised to what fits
                (remaining bytes / time left), and from `finish_by` on nothing waits at all;
    stall guard one chunk never waits longer than `max_wait` (a fraction of the stall timeout), so a
                paced stream never looks stalled to its receiver, whatever the rate;
    write deadline a wait never runs past the deadline of the write it delays;
    lift        `lift()` ends the pacing for the rest of the round at once (the caller now waits on
                the round: spreading its bytes would only make it wait longer).

`finish_by` sits before the reduce-scatter deadline, so contributions (sent first) meet theirs,
and the served averages, which may only go after it, meet the all-gather deadline unpaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from protocol.allreduce.group import GroupSpec
from protocol.allreduce.reducer import chunk_sizes
from protocol.allreduce.sparse import is_sparse
from protocol.codecs import Codec

PACE_FINISH_FRACTION = 0.8
"""A paced round plans its bytes to be sent by this fraction of its reduce-scatter phase (started +
0.8 x (reduce-scatter deadline - started)): the last fifth of the phase is the margin in which the
owners fold the last contributions before their deadline."""

PACE_MAX_WAIT_FRACTION = 0.25
"""One chunk waits at most this fraction of the stall timeout (a receiver drops a sender that sends
nothing for a whole stall timeout)."""


def member_send_bytes(group: GroupSpec, my_index: int, codec: Codec, chunk_num_elements: int) -> int:
    """The payload bytes member ``my_index`` writes in a round of ``group`` when nobody fails: its
    contribution to every other member's part, and its own part's average to each other member (as a
    replica or pulled). A dense codec's average is one encoding of the part; a sparse codec's is the
    bundle of the contributors' payloads (``sparse.py``), at most one per member. Framing is left out
    (about 20 bytes a chunk). The bytes a pace spreads: ``SendPace(rate = this / window)``."""

    def encoded(part_index: int) -> int:
        sizes = chunk_sizes(group.part_num_elements(part_index), chunk_num_elements)
        return sum(codec.encoded_num_bytes(size) for size in sizes)

    contributions = sum(encoded(k) for k in range(group.num_members) if k != my_index)
    average = encoded(my_index) * (group.num_members if is_sparse(codec) else 1)
    return contributions + (group.num_members - 1) * average


class SendPace:
    """A token bucket over one member's chunk writes in one round, relaxed to meet ``finish_by``.

    ``rate``: bytes per second (the cap while there is time); ``total_bytes``: what the member will
    write in the round (``member_send_bytes``), so that the bytes still to go can be planned against
    ``finish_by`` (a ``time.monotonic()`` instant); ``burst_bytes``: the tokens that may accrue while
    nothing is written (one chunk's worth lets a writer start at once); ``max_wait``: the longest one
    chunk waits. ``clock`` is injected for tests.
    """

    def __init__(
        self,
        *,
        rate: float,
        total_bytes: int,
        finish_by: float,
        burst_bytes: int,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not rate > 0:
            raise ValueError(f"a send pace needs a positive rate (bytes per second), got {rate}")
        if total_bytes < 0 or burst_bytes < 0 or max_wait < 0:
            raise ValueError("total_bytes, burst_bytes and max_wait must be >= 0")
        self.rate = rate
        self.total_bytes = total_bytes
        self.finish_by = finish_by
        self.burst_bytes = burst_bytes
        self.max_wait = max_wait
        self._clock = clock
        self._tokens = float(burst_bytes)
        self._refilled = clock()
        self._admitted = 0  # bytes let through so far
        self._queue = asyncio.Lock()  # writers wait their turn in FIFO order
        self._lifted = asyncio.Event()
        self.seconds_waited = 0.0  # summed over the writes it delayed (the round's report)

    @property
    def lifted(self) -> bool:
        return self._lifted.is_set()

    @property
    def bytes_admitted(self) -> int:
        return self._admitted

    def lift(self) -> None:
        """Stop pacing: every write from now on goes at once, and the ones waiting go now."""
        self._lifted.set()

    def rate_now(self, num_bytes: int) -> float | None:
        """The rate a write of ``num_bytes`` is paced at now: the cap, or higher when the bytes still
        to go (these included) would not fit before ``finish_by`` at it; None: not paced (lifted, or
        ``finish_by`` passed)."""
        left = self.finish_by - self._clock()
        if self.lifted or left <= 0:
            return None
        remaining = max(self.total_bytes - self._admitted, num_bytes)
        return max(self.rate, remaining / left)

    async def admit(self, num_bytes: int, deadline: float) -> None:
        """Return once a write of ``num_bytes`` may go (within ``deadline``, a ``time.monotonic()``
        instant, and ``max_wait``)."""
        async with self._queue:
            now = self._clock()
            rate = self.rate_now(num_bytes)
            if rate is not None:
                self._tokens = min(self.burst_bytes, self._tokens + (now - self._refilled) * rate)
                wait = min((num_bytes - self._tokens) / rate, self.max_wait, deadline - now)
                if wait > 0:
                    await self._sleep(wait)
                    self.seconds_waited += self._clock() - now
                    self._tokens += (self._clock() - now) * rate
                self._tokens = max(self._tokens - num_bytes, 0.0)  # (a cut-short wait leaves no debt)
            self._refilled = self._clock()
            self._admitted += num_bytes

    async def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, or until lifted."""
        with contextlib.suppress(TimeoutError):  # (the usual case: the wait ran its length)
            await asyncio.wait_for(self._lifted.wait(), seconds)
