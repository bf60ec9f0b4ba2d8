"""What a round-formation state machine asks the daemon to do (``rounds.py`` emits these).

The daemon executes them in order: ``Send`` through the gRPC client (with its own deadline),
``Publish`` as a DHT store of the local record, and the terminal outcomes by moving on: run the
all-reduce, re-sync, or train on and form the next round.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.membership.lineage import Lineage
from protocol.membership.messages import (
    Accept,
    Begin,
    Cancel,
    GroupSpec,
    Message,
    Proposal,
    Reason,
    Reject,
    Withdraw,
)


@dataclass(frozen=True)
class Publish:
    """Store the local record again with this ``ready_for_round`` (None: no longer forming)."""

    ready_for_round: int | None


@dataclass(frozen=True)
class Send:
    """Send ``message`` to peer ``to`` (best effort, with the transport's own deadline)."""

    to: str
    message: Message


@dataclass(frozen=True)
class StartAllReduce:
    """Terminal: this peer is locked into ``group``; run the all-reduce with it."""

    group: GroupSpec


@dataclass(frozen=True)
class MissedRound:
    """Terminal: a group of this round formed without this peer, or none included it by max_wait.

    The daemon waits for the group to publish its new params after its all-reduce, then adopts
    them (``protocol/swarm/participation.py``, ``MissedRoundWait``); the lineage rule then sends it
    to re-sync.
    """

    round: int
    reason: Reason
    told_by: str | None = None
    """The peer that said the round began without us (``ROUND_STARTED``, ``ALREADY_IN_GROUP``): most
    often a member of that group, whose record stays on our lineage while its all-reduce runs. None
    when we gave up at max_wait."""


@dataclass(frozen=True)
class RoundFailed:
    """Terminal: fewer than min_peers were ready by max_wait; train on and try the round again."""

    round: int
    reason: Reason


@dataclass(frozen=True)
class Resync:
    """Terminal: the local global params are not the canonical lineage's; fetch them from ``sources``."""

    round: int
    canonical: Lineage
    sources: tuple[str, ...]


@dataclass(frozen=True)
class GroupMemberLost:
    """After StartAllReduce: a member of our group withdrew; the all-reduce should drop it now."""

    round: int
    peer_id: str
    reason: Reason


Outcome = StartAllReduce | MissedRound | RoundFailed | Resync
Action = Publish | Send | StartAllReduce | MissedRound | RoundFailed | Resync | GroupMemberLost


def reply_without_formation(sender: str, message: Message) -> list[Action]:
    """The answer for a message about a round the local peer is not forming (not ready, or past it).

    A proposal gets a Reject and a Begin a Withdraw, so their senders need not wait for a
    deadline; an Accept gets a Cancel; other messages concern nothing we hold and need no answer.
    """
    if isinstance(message, Proposal):
        reason = Reason.NOT_AVAILABLE
        return [Send(sender, Reject(round=message.round, proposal_id=message.proposal_id, reason=reason))]
    if isinstance(message, Begin):
        group = message.group
        return [
            Send(sender, Withdraw(round=group.round, proposal_id=group.group_id, reason=Reason.NOT_BOUND))
        ]
    if isinstance(message, Accept):
        reason = Reason.STALE_PROPOSAL
        return [Send(sender, Cancel(round=message.round, proposal_id=message.proposal_id, reason=reason))]
    return []
