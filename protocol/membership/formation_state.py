"""What one peer knows while it forms a round: its phase, and the state of each role it may play.

:class:`FormationState` holds every field of :class:`~protocol.membership.rounds.RoundFormation` (the
protocol is described there): the view and the clock last seen, the peers suspected or unavailable
this round, the JoinRequests sent and received, the member's binding to a leader (and the proposals
it deferred), and the leader's open proposal. The moves that change these fields are in
``formation_roles.py``; the events and the decision procedure that call them, in ``rounds.py``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta
from enum import StrEnum

from protocol.membership.actions import Outcome, StartAllReduce
from protocol.membership.config import RoundConfig
from protocol.membership.messages import GroupSpec, Proposal, check_stream_addresses
from protocol.membership.proposals import OpenProposal
from protocol.membership.records import PeerRecord, SwarmView, check_int


class Phase(StrEnum):
    WAITING = "waiting"  # member, unbound: waiting for the would-be leader's proposal
    GATHERING = "gathering"  # would-be leader: waiting for readiness or the end of the join window
    COLLECTING = "collecting"  # leader: proposal out, collecting answers
    BOUND = "bound"  # member: accepted a proposal, waiting for Begin
    LOCKED = "locked"  # in a group: StartAllReduce emitted
    DONE = "done"  # gave up: MissedRound, RoundFailed or Resync emitted


def _seconds(duration: timedelta) -> float:
    return duration.total_seconds()


class FormationState:
    """The fields of one peer's formation of round ``local.round + 1``, and its group once locked."""

    def __init__(
        self,
        *,
        config: RoundConfig,
        local: PeerRecord,
        num_tokens: int,
        vector_length: int,
        now: float,
        stream_addresses: tuple[str, ...] = (),
    ) -> None:
        if local.status != "active":
            raise ValueError("a peer that left cannot form a round")
        self.config = config
        self.round = local.round + 1
        self.local = replace(local, ready_for_round=self.round)
        self.peer_id = local.peer_id
        self.num_tokens = check_int("num_tokens", num_tokens)
        self.vector_length = check_int("vector_length", vector_length)
        self.stream_addresses = check_stream_addresses(stream_addresses)  # our streams 1..S-1
        self.started_at = now
        self.max_deadline = now + _seconds(config.max_wait)
        self.phase = Phase.WAITING
        self.outcome: Outcome | None = None
        self._started = False
        self._now = now
        self._view = SwarmView(now=now, peers=())
        self._suspected: set[str] = set()  # silent or gone: neither leader nor candidate this round
        self._unavailable: set[str] = set()  # said it will not join us this round
        self._requesters: set[str] = set()  # sent us a JoinRequest: ready, even if our view lags
        self._asked: str | None = None  # the would-be leader we last sent a JoinRequest
        self._ask_again_at = math.inf
        # member state
        self._bound: tuple[str, str] | None = None  # (leader, proposal_id) we accepted
        self._bound_leader_seen = False
        self._begin_deadline = math.inf
        self._deferred: dict[str, Proposal] = {}  # larger leader -> its unanswered proposal
        self._watched_leader: str | None = None
        self._leader_deadline = math.inf
        self._said_no_server = False  # a client told the user no peer that accepts connections is ready
        # leader state
        self._attempt = 0
        self._open: OpenProposal | None = None
        self._retry_at = -math.inf

    @property
    def group(self) -> GroupSpec | None:
        return self.outcome.group if isinstance(self.outcome, StartAllReduce) else None
