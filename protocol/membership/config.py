"""Round-formation settings: one frozen dataclass, durations as ``timedelta``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from protocol.membership.records import check_int

TooFewPolicy = Literal["fail", "proceed_alone"]


@dataclass(frozen=True, kw_only=True)
class RoundConfig:
    """Round-formation settings (the same on every peer of a run)."""

    min_peers: int = 2
    """Fewest members a group may have, the leader included."""
    join_window: timedelta = timedelta(seconds=30)
    """How long a leader waits, from when it became ready, for the rest of its lineage to be ready."""
    max_wait: timedelta = timedelta(minutes=3)
    """How long a peer tries to get into a group before it gives up on the round."""
    proposal_timeout: timedelta = timedelta(seconds=5)
    """How long a leader collects answers to a proposal (also its pause before proposing again)."""
    begin_timeout: timedelta = timedelta(seconds=10)
    """How long a member waits for Begin after accepting; more than proposal_timeout, since the
    leader may wait that long for the others' answers before it sends Begin."""
    on_too_few: TooFewPolicy = "fail"
    """At max_wait with fewer than min_peers ready: "fail" (RoundFailed) or "proceed_alone" (a
    solo group: local SGD for one round; the lineage rule re-syncs the swarm afterwards)."""
    tier_group_size: int = 0
    """As a leader: a group of more members than this runs its all-reduce tiered, in groups of at
    most this many (``protocol/allreduce/tiers.py``: each member then talks to at most 2(G - 1)
    others while the group has at most G² members); 0: always one flat round. Members follow
    their leader's (``GroupSpec.tier_group_size``)."""

    def __post_init__(self) -> None:
        check_int("min_peers", self.min_peers, minimum=1)
        check_int("tier_group_size", self.tier_group_size)
        if self.tier_group_size == 1:
            raise ValueError("tier_group_size must be 0 (flat rounds) or at least 2")
        for name in ("join_window", "max_wait", "proposal_timeout", "begin_timeout"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"{name} must be a positive timedelta, got {value!r}")
        if self.begin_timeout <= self.proposal_timeout:
            raise ValueError("begin_timeout must exceed proposal_timeout")
        if self.max_wait < self.join_window:
            raise ValueError("max_wait must be at least join_window")
        if self.on_too_few not in ("fail", "proceed_alone"):
            raise ValueError(f"on_too_few must be 'fail' or 'proceed_alone', got {self.on_too_few!r}")
