"""What one ``SwarmNode.run_round`` came to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from protocol.allreduce.allreduce import AllReduceResult
from protocol.membership.actions import MissedRound, Resync, RoundFailed
from protocol.membership.lineage import LineageDecision, decide_lineage
from protocol.membership.messages import GroupSpec
from protocol.membership.records import PeerRecord, SwarmView

RoundKind = Literal["averaged", "missed", "failed", "resync"]


@dataclass(frozen=True, kw_only=True)
class RoundResult:
    """What one ``run_round`` came to."""

    kind: RoundKind
    round: int
    group: GroupSpec | None = None
    """The agreed group (``averaged`` only)."""
    allreduce: AllReduceResult | None = None
    """The all-reduce's result (``averaged`` only; it may still have ``fell_back``)."""
    resync: LineageDecision | None = None
    """Where to fetch the canonical state from (``resync`` only)."""
    reason: str = ""
    seconds_forming: float = 0.0


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
        return RoundResult(
            kind="resync", round=round, resync=decision, reason="lineage", seconds_forming=seconds_forming
        )
    kind: RoundKind = "missed" if isinstance(outcome, MissedRound) else "failed"
    return RoundResult(kind=kind, round=round, reason=str(outcome.reason), seconds_forming=seconds_forming)
