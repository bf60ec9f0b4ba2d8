"""The rounds a peer currently knows, with bounded memory.

Messages may arrive before this peer has entered their round (a faster member already started), so a
request for a round newer than any we opened waits, bounded in time and in number of waiters, for the
round to open. Rounds only move forward: a request for an older round we no longer hold is refused
as expired. A round we finished stays servable for slower members until `linger` after its deadline,
at most `max_rounds_kept` rounds are held at once, and a finished round is forgotten as soon as every
other member of it has returned from it: it told us so (RoundFinished, sent by each member as its
all-reduce returns), or it sent us a message of a later round (a member runs its rounds one after the
other). It will not ask for the round's parts again. That frees a round's buffers (with the fp32
codec, views that pin the whole result) as the round ends, not after its linger.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.memory import release_free_memory
from protocol.allreduce.parts import Pulse
from protocol.allreduce.round import RoundState
from protocol.errors import ProtocolError


class RoundRegistry:
    """Maps round ids to RoundState; the servicer looks rounds up here, allreduce() opens them."""

    def __init__(self, config: AllReduceConfig) -> None:
        self._config = config
        self._rounds: dict[int, RoundState] = {}
        self._highest_opened = -1
        self._opened = Pulse()
        self._num_waiting = 0
        self._latest_round_of: dict[str, int] = {}  # peer id -> the newest round it sent us a message of
        self._finished_round_of: dict[str, int] = {}  # peer id -> the newest round it told us it finished

    def open(self, state: RoundState) -> None:
        """Register a new round; round ids must increase."""
        if state.round_id <= self._highest_opened:
            raise ValueError(
                f"round {state.round_id} is not newer than round {self._highest_opened}; round ids must increase"
            )
        self.evict()
        finished = sorted(r for r, s in self._rounds.items() if s.local_done)
        while len(self._rounds) >= self._config.max_rounds_kept and finished:
            self._forget(finished.pop(0))
        if len(self._rounds) >= self._config.max_rounds_kept:
            raise ValueError(f"already running {len(self._rounds)} rounds (max_rounds_kept)")
        self._rounds[state.round_id] = state
        self._highest_opened = state.round_id
        self._opened.notify()

    @property
    def highest_opened(self) -> int:
        return self._highest_opened

    def rewind(self) -> None:
        """Forget every round and accept lower round ids again.

        For a daemon that switched to another lineage, whose rounds may be numbered lower than
        ours: nothing of our old rounds is of use to its members (their group digests differ).
        """
        for round_id in list(self._rounds):
            self._forget(round_id)
        self._highest_opened = -1
        self._latest_round_of.clear()
        self._finished_round_of.clear()

    def finished(self, state: RoundState) -> None:
        """allreduce() returned for this round; forget it once no other member needs it, or its linger
        time is over."""
        state.finish_locally()
        self._forget_superseded()
        release_free_memory()
        delay = max(0.0, state.retain_until - time.monotonic())
        asyncio.get_running_loop().call_later(delay, self.evict)

    def evict(self) -> None:
        """Forget rounds whose retention time is over."""
        now = time.monotonic()
        for round_id in [r for r, s in self._rounds.items() if s.retain_until <= now]:
            self._forget(round_id)

    def note_member_seen(self, peer_id: str, round_id: int) -> None:
        """Member `peer_id` sent us a message of round `round_id` (it has returned from every earlier one)."""
        if round_id > self._latest_round_of.get(peer_id, -1):
            self._latest_round_of[peer_id] = round_id
            self._forget_superseded()

    def note_member_finished(self, peer_id: str, round_id: int) -> None:
        """Member `peer_id` told us it returned from round `round_id` (and so from every earlier one)."""
        if round_id > self._finished_round_of.get(peer_id, -1):
            self._finished_round_of[peer_id] = round_id
            self._forget_superseded()

    def _forget_superseded(self) -> None:
        """Forget the rounds we finished whose other members have all returned from them."""
        for round_id, state in list(self._rounds.items()):
            # Nobody dials a client member: once it returned it serves no one, so it waits for nobody.
            client = state.group.members[state.my_index].client
            others = (
                []
                if client
                else [m.peer_id for i, m in enumerate(state.group.members) if i != state.my_index]
            )
            if state.local_done and all(
                self._latest_round_of.get(p, -1) > round_id or self._finished_round_of.get(p, -1) >= round_id
                for p in others
            ):
                self._forget(round_id)

    def _forget(self, round_id: int) -> None:
        self._rounds.pop(round_id).close()

    def get(self, round_id: int) -> RoundState | None:
        return self._rounds.get(round_id)

    async def wait_for_round(self, round_id: int, timeout: float) -> RoundState:
        """The round's state, waiting up to `timeout` seconds for it to open (raises ProtocolError)."""
        state = self._rounds.get(round_id)
        if state is not None:
            return state
        if round_id <= self._highest_opened:
            raise ProtocolError(
                grpc.StatusCode.FAILED_PRECONDITION, f"round {round_id} expired or was skipped"
            )
        if self._num_waiting >= self._config.max_waiting_requests:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests wait for rounds to open"
            )
        self._num_waiting += 1
        try:
            await self._opened.wait_for(lambda: self._highest_opened >= round_id, timeout)
        finally:
            self._num_waiting -= 1
        state = self._rounds.get(round_id)
        if state is None:
            raise ProtocolError(grpc.StatusCode.NOT_FOUND, f"round {round_id} is unknown here")
        return state

    def close(self) -> None:
        for round_id in list(self._rounds):
            self._forget(round_id)
