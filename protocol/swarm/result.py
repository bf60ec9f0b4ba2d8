"""What one ``SwarmNode.run_round`` came to: one of four typed results, matched on by the caller.

==================  ==========================================================================
result              meaning
==================  ==========================================================================
GroupAveraged       a group formed and ran its all-reduce (which may still have ``fell_back``)
RoundMissed         the lineage's round formed without us (we were late)
RoundNotFormed      no group formed (too few peers ready, a formation deadline)
LineageResync       our (round, param_hash) is not the swarm's: fetch its state from ``decision``
==================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.allreduce.allreduce import AllReduceResult
from protocol.membership.actions import MissedRound, Resync, RoundFailed
from protocol.membership.lineage import LineageDecision, decide_lineage
from protocol.membership.messages import GroupSpec
from protocol.membership.records import PeerRecord, SwarmView


@dataclass(frozen=True, kw_only=True)
class GroupAveraged:
    """The agreed group ran its all-reduce; ``allreduce.fell_back`` says whether it finished."""

    round: int  # the round formed (our lineage's round + 1)
    group: GroupSpec
    allreduce: AllReduceResult
    seconds_forming: float = 0.0


@dataclass(frozen=True, kw_only=True)
class RoundMissed:
    """The lineage's round formed without us."""

    round: int
    reason: str
    seconds_forming: float = 0.0
    told_by: str | None = None
    """The peer that said the round began without us (``MissedRound.told_by``)."""


@dataclass(frozen=True, kw_only=True)
class RoundNotFormed:
    """No group formed (too few ready peers, a deadline, the swarm's loop out of time)."""

    round: int
    reason: str
    seconds_forming: float = 0.0


@dataclass(frozen=True, kw_only=True)
class LineageResync:
    """We are off the swarm's lineage: ``decision`` names the canonical state and its sources."""

    round: int
    decision: LineageDecision
    seconds_forming: float = 0.0


RoundResult = GroupAveraged | RoundMissed | RoundNotFormed | LineageResync


def not_averaged(
    outcome: Resync | MissedRound | RoundFailed,
    view: SwarmView,
    local: PeerRecord,
    *,
    round: int,
    seconds_forming: float,
) -> RoundResult:
    """A formation that ended without an all-reduce of ours, as a round result (``view``: the
    driver's last, which the formation decided on)."""
    if isinstance(outcome, Resync):
        decision = decide_lineage(view.peers, local)
        return LineageResync(round=round, decision=decision, seconds_forming=seconds_forming)
    if isinstance(outcome, MissedRound):
        return RoundMissed(
            round=round, reason=str(outcome.reason), seconds_forming=seconds_forming, told_by=outcome.told_by
        )
    return RoundNotFormed(round=round, reason=str(outcome.reason), seconds_forming=seconds_forming)


def result_name(result: RoundResult) -> str:
    """A short name of the result for logs, JSON reports and metrics labels (never to branch on)."""
    match result:
        case GroupAveraged():
            return "averaged"
        case RoundMissed():
            return "missed"
        case RoundNotFormed():
            return "failed"
        case LineageResync():
            return "resync"
