"""One fake swarm side for the tests of the loop's round: ``node.outer.seam.SwarmSide`` with no sockets.

The loop's tests (the outer round, the trainer's round end, a session that hands the loop a state)
script it: each round's decision comes from ``decide``, a state handed over answers the loop's join or
its next round, every call is logged, and every snapshot the loop serves is kept.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from node.outer.seam import (
    Adopt,
    AdoptedState,
    Averaged,
    JoinAnswer,
    JoinRequest,
    NextShard,
    RoundDecision,
    RoundOutcome,
    RoundRequest,
    RoundStats,
    StartAnswer,
)
from protocol.statesync.snapshot import Snapshot


@dataclass
class ScriptedSwarm:
    """A scripted swarm side. A round's decision is ``decide(Δ, request)``, reported as a round of two
    peers; without ``decide`` it is a swarm of one, whose mean of one vector is itself. A state given
    to :meth:`hand` answers the loop's next call instead: its join (the joiner adopts it) or its next
    round (``Adopt``: it missed that round). A call made while another runs fails: the seam is not
    re-entrant."""

    decide: Callable[[torch.Tensor, RoundRequest], RoundDecision] | None = None
    join_answer: JoinAnswer = field(default_factory=JoinAnswer)
    shard: tuple[int, int] | None = None
    """What ``after_step`` answers: the data shard of the round's group (None: it stays)."""
    start_answer: StartAnswer = field(default_factory=StartAnswer)
    """What the start barrier answers (``await_start_peers``)."""
    spare_lane: int | None = None
    """What ``after_adopt`` answers: the spare data lane to read until the next round (None: none)."""
    end_phase: bool = False
    peer_due: bool = False
    forming: Callable[[], bool] = lambda: False
    """What ``round_forming`` answers, asked at each step boundary: a peer is ready for the next round."""
    peer_steps: tuple[float, float] | None = None
    """What ``step_seconds_range`` answers: the shortest and longest step time our lineage's peers
    announce."""
    num_adoptions: int = 0
    """States adopted, as ``SwarmSession`` counts them: at the join, and at each ``after_adopt``."""
    calls: list[str] = field(default_factory=list)
    requests: list[RoundRequest] = field(default_factory=list)
    served: list[Snapshot] = field(default_factory=list)
    prepared: list[Snapshot] = field(default_factory=list)
    """The snapshots ``prepare_publish`` was given (built on the averaging thread, overlap)."""
    rates: list[float] = field(default_factory=list)
    """The throughputs the loop advertised during its phases (``advertise_rate``)."""
    lifted: list[int] = field(default_factory=list)
    """The rounds the loop asked to send the rest at full rate (``lift_pace``), in order."""
    join_request: JoinRequest | None = None
    _handed: AdoptedState | None = None
    _busy: threading.Lock = field(default_factory=threading.Lock)

    def hand(self, state: AdoptedState) -> None:
        """The loop adopts ``state`` at its join, or at its next round's end."""
        self._handed = state

    def _take(self) -> AdoptedState | None:
        state, self._handed = self._handed, None
        return state

    def _enter(self, name: str) -> None:
        assert self._busy.acquire(blocking=False), f"{name} called while another call into the swarm runs"
        self.calls.append(name)
        self._busy.release()

    def join(self, request: JoinRequest) -> JoinAnswer:
        self._enter("join")
        self.join_request = request
        state = self._take()
        if state is None:
            return self.join_answer
        self.num_adoptions += 1
        return JoinAnswer(state)

    def await_start_peers(self) -> StartAnswer:
        self._enter("await_start_peers")
        return self.start_answer

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        self._enter("average")
        self.requests.append(request)
        state = self._take()
        if state is not None:
            return RoundOutcome(Adopt(state), RoundStats(num_peers=0))
        if self.decide is None:
            return RoundOutcome(Averaged(vector))
        decision = self.decide(vector, request)
        return RoundOutcome(
            decision, RoundStats(num_peers=0 if isinstance(decision, Adopt) else 2, members=("a", "b"))
        )

    def after_step(self, members: tuple[str, ...]) -> NextShard | None:
        self._enter("after_step")
        if self.shard is None:
            return None
        # The phase counts as read as each read it (its count, its batches): the position each reached.
        return NextShard(
            shard_index=self.shard[0], num_shards=self.shard[1], phase_shards=None, phase_tokens=0
        )

    def after_adopt(self, state: AdoptedState) -> int | None:
        self._enter("after_adopt")
        self.num_adoptions += 1
        return self.spare_lane

    def moved_spare_lane(self) -> int | None:
        return None  # nobody else reads a lane here

    def prepare_publish(self, snapshot: Snapshot) -> None:
        # On the averaging thread beside the loop's calls (overlap), as SwarmSession's: nothing to build.
        self.prepared.append(snapshot)

    def publish(self, snapshot: Snapshot, *, tokens_per_s: float) -> None:
        self._enter("publish")
        self.served.append(snapshot)

    def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
        # Thread-safe in the real swarm (a record edit under the registry's lock), so called beside an
        # overlapped round: not one of the calls that must not overlap.
        self.rates.append(tokens_per_s)

    def lift_pace(self, round_index: int) -> None:
        # Beside an overlapped round, as SwarmSession's (it only tells the swarm's loop).
        self.lifted.append(round_index)

    def phase_should_end(self) -> bool:
        return self.end_phase

    def lineage_peer_due(self) -> bool:
        return self.peer_due

    def round_forming(self) -> bool:
        return self.forming()

    def await_round_forming(self, seconds: float) -> bool:
        return self.forming()

    def step_seconds_range(self) -> tuple[float, float] | None:
        return self.peer_steps

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._enter("load_state_dict")
