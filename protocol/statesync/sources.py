"""Step 1 of a fetch: ask every source for its manifest and keep those that serve the snapshot we want.

Which snapshot: the one with `expected_state_id` if the caller names it (the daemon knows the swarm's
current param_hash from membership), otherwise the newest one offered (highest round). Sources agree
on a snapshot only if their manifests have the same content digest; if they disagree about the same
state (a buggy or lying source), the larger group wins and ties go to the smaller digest, so every
fetcher that sees the same answers picks the same snapshot.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import grpc.aio

from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.gen.dtnode.v1 import statesync_pb2_grpc as pb_grpc
from protocol.statesync.errors import StateSyncError
from protocol.statesync.manifest import Manifest, parse_manifest

INITIAL_BUSY_BACKOFF = timedelta(milliseconds=50)
"""A source that answered RESOURCE_EXHAUSTED is asked again after this long, doubling each time..."""
MAX_BUSY_BACKOFF = timedelta(seconds=2)
"""...up to this long."""


@dataclass(eq=False)
class Source:
    """One source during a fetch: its stub, its manifest, and how it has done so far."""

    address: str
    stub: pb_grpc.StateSyncStub
    manifest: Manifest | None = None
    num_in_flight: int = 0
    """FetchRange streams open to it right now."""
    num_bytes_verified: int = 0
    """Bytes it delivered that passed their block check."""
    num_ranges_started: int = 0
    excluded: str = ""
    """Why we stopped asking it ("" while it is usable)."""
    busy_until: float = 0.0
    """time.monotonic() before which we do not ask it (it said RESOURCE_EXHAUSTED)."""
    busy_backoff: float = field(default=INITIAL_BUSY_BACKOFF.total_seconds())
    max_in_flight: int | None = None
    """How many of our streams it accepts at once, once it told us (None: not yet known)."""
    last_message_at: float = 0.0
    """time.monotonic() when a message of any of our streams from it last arrived (0: none yet)."""

    def usable(self, now: float) -> bool:
        if self.excluded or self.busy_until > now:
            return False
        return self.max_in_flight is None or self.num_in_flight < self.max_in_flight

    def mark_busy(self, now: float) -> None:
        """It answered RESOURCE_EXHAUSTED (call after taking the refused stream off num_in_flight).

        With other streams of ours open to it, our own streams fill it: ask it for no more than that
        many at once from now on. Otherwise others keep it busy: wait, longer each time.
        """
        if self.num_in_flight > 0:
            self.max_in_flight = self.num_in_flight
            return
        if self.busy_until <= now:  # concurrent refusals of one busy spell back off once
            self.busy_until = now + self.busy_backoff
            self.busy_backoff = min(2 * self.busy_backoff, MAX_BUSY_BACKOFF.total_seconds())

    def mark_served(self) -> None:
        """A stream completed: reset the backoff, and probe for one more stream at once (additive increase)."""
        self.busy_backoff = INITIAL_BUSY_BACKOFF.total_seconds()
        if self.max_in_flight is not None:
            self.max_in_flight += 1


async def get_manifest(source: Source, state_id: str, timeout: float) -> None:
    """Ask one source for its manifest; on any failure record why in `source.excluded`."""
    try:
        message = await source.stub.GetManifest(pb.GetManifestRequest(state_id=state_id), timeout=timeout)
    except grpc.aio.AioRpcError as error:
        source.excluded = f"GetManifest: {error.code().name}: {error.details()}"
        return
    try:
        source.manifest = parse_manifest(message)
    except ValueError as error:
        source.excluded = f"malformed manifest: {error}"


async def get_manifests(
    sources: list[Source], state_id: str, stall_timeout: timedelta, deadline: float
) -> None:
    """Ask every source at once; each call is bounded by the stall timeout and the fetch's deadline."""
    timeout = max(0.001, min(stall_timeout.total_seconds(), deadline - time.monotonic()))
    await asyncio.gather(*(get_manifest(source, state_id, timeout) for source in sources))


def choose_snapshot(sources: list[Source], expected_state_id: str | None) -> Manifest:
    """Pick the snapshot to fetch among the sources' manifests; exclude every source not serving it.

    StateSyncError if no source serves a suitable snapshot (the message lists why, source by source).
    """
    offered = [source for source in sources if not source.excluded and source.manifest is not None]
    if expected_state_id is not None:
        for source in offered:
            assert source.manifest is not None
            if source.manifest.state_id != expected_state_id:
                source.excluded = f"serves {source.manifest.state_id!r}, not {expected_state_id!r}"
    elif offered:
        newest = max(source.manifest.round_id for source in offered if source.manifest is not None)
        for source in offered:
            assert source.manifest is not None
            if source.manifest.round_id != newest:
                source.excluded = f"serves round {source.manifest.round_id}; round {newest} is newer"
    candidates = [source for source in offered if not source.excluded]
    if not candidates:
        wanted = repr(expected_state_id) if expected_state_id is not None else "any snapshot"
        raise StateSyncError(f"no source serves {wanted}: {describe_exclusions(sources)}")
    votes = Counter(source.manifest.content_digest for source in candidates if source.manifest is not None)
    winner = min(votes, key=lambda digest: (-votes[digest], digest))
    chosen: Manifest | None = None
    for source in candidates:
        assert source.manifest is not None
        if source.manifest.content_digest == winner:
            chosen = source.manifest
        else:
            source.excluded = (
                f"its manifest of {source.manifest.state_id!r} disagrees with the other sources'"
            )
    assert chosen is not None
    return chosen


def describe_exclusions(sources: list[Source]) -> str:
    """One line: every excluded source and why."""
    reasons = [f"{source.address}: {source.excluded}" for source in sources if source.excluded]
    return "; ".join(reasons) or "no source was excluded"
