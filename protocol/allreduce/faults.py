"""Deterministic fault injection: a peer kills or freezes itself at a named point of a round.

Fault tests must not rely on sleeps ("kill the peer 0.3 s in") because what the peer was doing at
that moment varies from run to run. Instead the peer checks a `FaultPlan` at fixed points of the
protocol and acts exactly there. Points, in the order a round reaches them:

    round_open     the round is open locally, nothing sent yet              (before reduce-scatter)
    push_chunk     this peer has just written contribution chunk `chunk`    (during reduce-scatter)
    reduce_done    this owner has reduced its part, replica not yet sent    (between the phases)
    replica_chunk  this owner has just written replica chunk `chunk`        (during the hand-off)
    votes_done     this owner's replicas are held by a majority, its voters
                   not yet told the part is committed                       (end of the hand-off)
    serve_chunk    this owner has just served average chunk `chunk`         (during all-gather)
    pull_chunk     this peer has just received average chunk `chunk`        (during all-gather)
    round_done     this peer has its result, before allreduce() returns     (after all-gather)

A plan is written as "POINT:ROUND[:CHUNK][:ACTION]", e.g. "push_chunk:0:1:kill" or "round_open:2".
ACTION is "kill" (SIGKILL, the default: the process vanishes mid-write) or "stall" (SIGSTOP: the
process freezes with its sockets open, like a hung peer).
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass

FAULT_POINTS = (
    "round_open",
    "push_chunk",
    "reduce_done",
    "replica_chunk",
    "votes_done",
    "serve_chunk",
    "pull_chunk",
    "round_done",
)
FAULT_ACTIONS = ("kill", "stall")


@dataclass(frozen=True, kw_only=True)
class FaultPlan:
    """Where and how this process fails."""

    point: str
    """One of FAULT_POINTS."""
    round_id: int
    """The round in which to fail."""
    chunk_index: int = 0
    """For the *_chunk points: fail right after this chunk (0-based); ignored by the other points."""
    action: str = "kill"
    """"kill" (SIGKILL) or "stall" (SIGSTOP)."""

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; choose one of {FAULT_POINTS}")
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; choose one of {FAULT_ACTIONS}")

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Parse "POINT:ROUND[:CHUNK][:ACTION]"."""
        fields = spec.split(":")
        if not 2 <= len(fields) <= 4:
            raise ValueError(f"fault spec must be POINT:ROUND[:CHUNK][:ACTION], got {spec!r}")
        action = fields.pop() if fields[-1] in FAULT_ACTIONS else "kill"
        try:
            numbers = [int(x) for x in fields[1:]]
        except ValueError as error:
            raise ValueError(f"fault spec {spec!r}: ROUND and CHUNK must be integers") from error
        chunk_index = numbers[1] if len(numbers) > 1 else 0
        return cls(point=fields[0], round_id=numbers[0], chunk_index=chunk_index, action=action)

    def check(self, point: str, round_id: int, chunk_index: int = 0) -> None:
        """Act if the process has reached this plan's point; otherwise return at once."""
        assert point in FAULT_POINTS, point
        if point != self.point or round_id != self.round_id:
            return
        if point.endswith("_chunk") and chunk_index != self.chunk_index:
            return
        # The signal goes to this thread, not to the process: one sent to the process is taken by its main
        # thread, and until the scheduler runs that thread (tens of ms on a busy machine) this one went on
        # past the point (an owner frozen "at votes_done" could still tell its voters). A thread stops or
        # dies before its own signal call returns; SIGSTOP and SIGKILL still act on the whole process.
        signal.pthread_kill(
            threading.get_ident(), signal.SIGKILL if self.action == "kill" else signal.SIGSTOP
        )


def check_fault(plan: FaultPlan | None, point: str, round_id: int, chunk_index: int = 0) -> None:
    """Shorthand for `plan.check(...)` that accepts no plan."""
    if plan is not None:
        plan.check(point, round_id, chunk_index)
