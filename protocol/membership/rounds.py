"""Round formation: how the ready peers of one lineage agree on ONE group for an outer round.

One :class:`RoundFormation` per local peer per round. It is a pure state machine: events go in
(``start``, ``on_view`` with a DHT snapshot, ``on_message`` with a decoded peer message,
``tick``), each with the current clock time ``now``, and actions (``actions.py``) come out:
publish this, send that, start the all-reduce with this group, give up. Nothing blocks; every
wait has a deadline that the daemon learns from :meth:`RoundFormation.next_deadline` and honours
by calling ``tick``. Round ``r`` is formed by peers holding the global params ``(r - 1,
param_hash)`` (``lineage.py``); the messages are in ``messages.py``. The class holds the fields
of one formation, its events, the decision procedure run after each, and the moves that procedure
makes: the leader's (propose, close or call off a proposal), the member's (accept, defer or switch,
withdraw, check and honour a Begin), and the endings (locked into a group, or giving up after
freeing everyone who waits on us).

Protocol
--------
1. A peer that finished its inner steps publishes ``ready_for_round = r``. Among the live peers
   of its lineage that are ready for ``r`` (itself included, suspects excluded) the one with the
   smallest peer id is the *would-be leader*; the others send it a ``JoinRequest`` (again every
   ``proposal_timeout`` while they wait, as a request or its answer may be lost).
2. Leader: gathers until every live peer of its lineage is ready, or the join window (counted
   from when it became ready) is over, provided at least ``min_peers`` are ready (peers known
   from their JoinRequest count even if the DHT view lacks them); otherwise it keeps waiting
   until ``max_wait``. A joiner still fetching the lineage's state (a ``syncing`` record) that
   expects to hold it before the window ends is waited for too: it needs one inner step after
   its fetch, and otherwise would miss the round by seconds and wait a whole inner phase. It
   sends a ``Proposal`` to the ready peers and collects ``Accept`` / ``Reject`` until all
   answered or ``proposal_timeout`` plus the time its uplink takes to send every proposal
   (``fan_out.py``: a proposal lists every candidate, so K of them are O(K^2) bytes on one link;
   a peer that asks again meanwhile gets no second copy). With ``>= min_peers`` accepted
   (itself included) it fixes the :class:`~protocol.membership.messages.GroupSpec` (members
   in the member order: by rank, then id; weights = tokens from their Accepts, parts from ``parts.py``) and sends it in
   ``Begin``; with fewer it cancels, suspects the silent and proposes again later.
3. Member: accepts a proposal of its round and lineage, then waits for ``Begin`` until
   ``begin_timeout`` plus the time the leader's announced uplink takes to send every proposal
   and every Begin (each lists every member). On Begin it is locked: ``StartAllReduce(group)``.
   No Begin in time, or the leader's record gone: it withdraws, suspects that leader and
   re-evaluates (step 1). A leader that stays silent for a join window plus a begin timeout
   (plus its fan-out, as above) while enough peers are ready is suspected too.
4. A peer that learns that a group of its round and lineage began without it (a ``Cancel`` or
   ``Reject`` saying so) has missed the round: ``MissedRound``, naming the peer that said so
   (``told_by``); it re-syncs from that group once it published its new params (however long its
   all-reduce runs: ``protocol/swarm/participation.py``), and joins the next round. A leader
   that learns it while collecting cancels its proposal the same way, so no second group forms
   for the round.
5. ``max_wait`` after becoming ready, a peer in no group gives up: ``MissedRound`` if enough
   peers were ready (a group may have formed out of its sight), else ``RoundFailed`` (or, if the
   policy says so, a solo group).
6. On every event the lineage rule is applied to the view: a peer outside the canonical lineage
   stops with ``Resync``; it never joins or leads a round of the wrong params.

::

    A (smallest ready id)              B                              C
    |-- Publish(ready=r)               |-- Publish(ready=r)           |-- Publish(ready=r)
    |<---------------------- JoinRequest                              |
    |<------------------------------------------------------------ JoinRequest
    |   gather: all ready, or the join window is over (>= min_peers ready)
    |-- Proposal(r, "A/r/1") --------->|                              |
    |-- Proposal(r, "A/r/1") ------------------------------------------>|
    |<------------------------- Accept |                              |
    |<------------------------------------------------------------ Accept
    |-- Begin(group) ----------------->| locked                       |
    |-- Begin(group) -------------------------------------------------->| locked
    StartAllReduce(group)              StartAllReduce(group)          StartAllReduce(group)

Holes in the first sketch of this protocol, and what closes them
----------------------------------------------------------------
- *A DHT view lags.* The leader's view may miss a ready peer, and a late peer cannot tell a
  silent leader (dead) from a busy one (already in its all-reduce), so late peers would end up
  forming a second group of their own. The ``JoinRequest`` closes both: a leader includes every
  requester, and a locked peer answers it with ``Cancel(ROUND_STARTED)`` so the late peer misses
  the round at once, as it should.
- *Two would-be leaders* (B does not see A). A peer bound to B that receives A's proposal
  (A < B) switches (``Withdraw`` to B, ``Accept`` to A); a collecting leader that receives a
  smaller leader's proposal *steps down* (``Cancel`` to its invitees, ``Accept`` to A); one that
  receives a larger leader's proposal rejects it and invites that peer instead. So the smaller
  id wins whenever the proposals meet before a collection ends; if B's group begins first, A's
  invitees answer ``ALREADY_IN_GROUP`` and A misses the round: one group either way.
- *A re-elected leader's proposal reaches peers still waiting on the dead one.* A bound member
  defers a proposal from a larger id and answers it later (``Accept`` when it gives up on its
  leader, ``Reject`` when it locks or gives up), so re-election costs no extra retry.
- *A proposal from a larger id to a peer that is not bound yet*: it accepts. The proposer's
  window is closed, so joining is the fastest way to one group; a smaller leader's later
  proposal still takes the peer over.
- *Weights*: the DHT record only has a throughput estimate, so each Accept carries the tokens the
  member actually processed; the leader copies them into the group.
- *No peer in two groups*: a member honours only the Begin of the proposal it is bound to at that
  moment; any other Begin gets a ``Withdraw``, which a locked leader reports as
  ``GroupMemberLost`` so its all-reduce can shrink at once.
- *Trust*: members check the Begin (their own entry, lineage, vector length, recomputed parts).
- What remains: there is no consensus step (it would cost a round trip on every round to rule
  out a rare race), so crossing messages can still let two disjoint groups begin one round.
  Each is internally consistent, and the lineage rule (``lineage.py``) keeps the larger and
  re-syncs the other, so this costs work, never correctness.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from datetime import timedelta
from enum import StrEnum

from protocol.membership.actions import (
    Action,
    GroupMemberLost,
    MissedRound,
    Outcome,
    Publish,
    Resync,
    RoundFailed,
    Send,
    StartAllReduce,
    reply_without_formation,
)
from protocol.membership.config import RoundConfig, TooFewPolicy
from protocol.membership.fan_out import fan_out_seconds, formation_fan_out_seconds, proposal_bytes
from protocol.membership.lineage import decide_lineage
from protocol.membership.messages import (
    Accept,
    Begin,
    Cancel,
    GroupMember,
    GroupSpec,
    JoinRequest,
    Message,
    Proposal,
    Reason,
    Reject,
    Withdraw,
    check_stream_addresses,
)
from protocol.membership.proposals import OpenProposal, solo_group
from protocol.membership.records import LineagePeers, PeerRecord, SwarmView, check_int, check_peer_id

__all__ = ["Phase", "RoundConfig", "RoundFormation", "TooFewPolicy"]

log = logging.getLogger(__name__)


class Phase(StrEnum):
    """Where the local peer stands in forming the round."""

    WAITING = "waiting"  # member, unbound: waiting for the would-be leader's proposal
    GATHERING = "gathering"  # would-be leader: waiting for readiness or the end of the join window
    COLLECTING = "collecting"  # leader: proposal out, collecting answers
    BOUND = "bound"  # member: accepted a proposal, waiting for Begin
    LOCKED = "locked"  # in a group: StartAllReduce emitted
    DONE = "done"  # gave up: MissedRound, RoundFailed or Resync emitted


def _seconds(duration: timedelta) -> float:
    return duration.total_seconds()


# Rejections that say the peer will not join any group of ours this round.
_UNAVAILABLE = frozenset(
    {Reason.ALREADY_IN_GROUP, Reason.NOT_AVAILABLE, Reason.LINEAGE_MISMATCH, Reason.WRONG_ROUND}
)


class _Readiness:
    """The ready peers of our lineage as :meth:`RoundFormation._lineage_peers` lists them (our own
    record in place of the view's copy, the peers we exclude left out), answered from the view's
    index of that lineage (``SwarmView.of_lineage``, built once per view) instead of a scan of every
    peer on every event. A member asks only who leads and how many are ready: that costs the
    excluded peers, not the swarm."""

    def __init__(self, lineage: LineagePeers, *, local: PeerRecord, excluded: set[str]) -> None:
        self._lineage = lineage
        self._local = local
        self._excluded = excluded  # ourselves included: the view's copy of us does not count

    def first_server(self) -> str | None:
        """The smallest ready peer id that accepts connections (the would-be leader), or None."""
        first = next(
            (peer_id for peer_id in self._lineage.ready_server_ids if peer_id not in self._excluded), None
        )
        if self._local.client:
            return first
        return self._local.peer_id if first is None else min(first, self._local.peer_id)

    def num_ready(self) -> int:
        excluded_ready = sum(1 for peer_id in self._excluded if peer_id in self._lineage.ready_set)
        return len(self._lineage.ready_ids) - excluded_ready + 1

    def ready_ids(self) -> set[str]:
        return set(self._lineage.ready_set - self._excluded) | {self._local.peer_id}

    def peer_ids(self) -> set[str]:
        """Every peer of the lineage that may still join us, ready or not, ourselves included."""
        return set(self._lineage.peer_ids - self._excluded) | {self._local.peer_id}


class RoundFormation:
    """The local peer's side of forming round ``local.round + 1`` (see the module docstring)."""

    # --- fields ---

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

    # --- events ---

    def start(self, view: SwarmView, now: float) -> list[Action]:
        """The local peer is ready for the round: publish it and act on ``view``."""
        assert not self._started, "start() is called once"
        self._started = True
        self._view, self._now = view, now
        decision = decide_lineage(view, self.local)
        if not decision.in_canonical:  # never announce readiness with params the swarm discards
            return self._finish(Resync(self.round, decision.canonical, decision.sync_sources))
        return [Publish(self.round), *self._evaluate(now)]

    def on_view(self, view: SwarmView, now: float) -> list[Action]:
        """A fresh DHT snapshot."""
        assert self._started, "start() comes first"
        if self.outcome is not None:
            return []
        self._view, self._now = view, now
        return self._evaluate(now)

    def tick(self, now: float) -> list[Action]:
        """Time passed (call at :meth:`next_deadline` at the latest)."""
        assert self._started, "start() comes first"
        if self.outcome is not None:
            return []
        self._now = now
        return self._evaluate(now)

    def on_message(self, sender: str, message: Message, now: float) -> list[Action]:
        """A message from ``sender`` (authenticated by the transport)."""
        assert self._started, "start() comes first"
        check_peer_id(sender, "sender")
        if sender == self.peer_id:
            raise ValueError("a peer does not send round messages to itself")
        self._now = now
        if message.round != self.round:
            if isinstance(message, Proposal):
                reject = Reject(
                    round=message.round, proposal_id=message.proposal_id, reason=Reason.WRONG_ROUND
                )
                return [Send(sender, reject)]
            return reply_without_formation(sender, message)
        if isinstance(message, JoinRequest):
            actions = self._on_join_request(sender, message)
        elif isinstance(message, Proposal):
            actions = self._on_proposal(sender, message, now)
        elif isinstance(message, Accept):
            actions = self._on_accept(sender, message)
        elif isinstance(message, Reject):
            actions = self._on_reject(sender, message)
        elif isinstance(message, Withdraw):
            actions = self._on_withdraw(sender, message)
        elif isinstance(message, Cancel):
            actions = self._on_cancel(sender, message)
        else:
            actions = self._on_begin(sender, message)
        return actions + (self._evaluate(now) if self.outcome is None else [])

    def next_deadline(self) -> float | None:
        """The next clock time at which :meth:`tick` may change something (None once done)."""
        if self.outcome is not None:
            return None
        deadlines = [self.max_deadline]
        if self.phase is Phase.COLLECTING:
            assert self._open is not None
            deadlines.append(self._open.deadline)
        elif self.phase is Phase.BOUND:
            deadlines.append(self._begin_deadline)
        elif self.phase is Phase.GATHERING:
            window = _seconds(self.config.join_window)
            stale_at = [ready_at + window for ready_at in self._joiners_due().values()]
            deadlines += [self._retry_at, self.started_at + window, *stale_at]
        elif self.phase is Phase.WAITING:
            deadlines += [self._leader_deadline, self._ask_again_at]
        future = [deadline for deadline in deadlines if deadline > self._now]
        return min(future) if future else self._now

    # --- the decision procedure, run after every event ---

    def _evaluate(self, now: float) -> list[Action]:
        actions: list[Action] = []
        decision = decide_lineage(self._view, self.local)
        if not decision.in_canonical:
            return self._finish(Resync(self.round, decision.canonical, decision.sync_sources))
        if self._open is not None and (self._open.all_answered() or now >= self._open.deadline):
            actions += self._close_proposal(now)
            if self.outcome is not None:
                return actions
        if self._bound is not None:
            leader = self._bound[0]
            self._bound_leader_seen |= leader in self._view
            # A leader we never saw in the DHT may just be newer than our view; one we saw vanish is gone.
            leader_gone = leader in self._view.left_peer_ids or (
                self._bound_leader_seen and leader not in self._view
            )
            if leader_gone or now >= self._begin_deadline:
                self._suspected.add(leader)
                actions += self._unbind(Reason.LEADER_GONE if leader_gone else Reason.BEGIN_TIMEOUT)
        if now >= self.max_deadline:
            return actions + self._give_up()
        if self.phase in (Phase.WAITING, Phase.GATHERING):
            actions += self._choose_role(now)
        return actions

    def _lineage_peers(self) -> list[PeerRecord]:
        """Live peers of our lineage that may still join us, ourselves included, sorted by id."""
        excluded = self._suspected | self._unavailable
        return [
            peer
            for peer in self._view.with_local(self.local)
            if peer.round == self.local.round
            and peer.param_hash == self.local.param_hash
            and (peer.peer_id == self.peer_id or peer.peer_id not in excluded)
        ]

    def _readiness(self) -> _Readiness:
        """Who of :meth:`_lineage_peers` is ready, from the view's index of its lineages."""
        return _Readiness(
            self._view.of_lineage(self.local.round, self.local.param_hash),
            local=self.local,
            excluded=self._suspected | self._unavailable | {self.peer_id},
        )

    def _choose_role(self, now: float) -> list[Action]:
        actions: list[Action] = []
        # Each pass returns or suspects one more peer, so this ends (we never suspect ourselves).
        while True:
            deferred = sorted(leader for leader in self._deferred if leader not in self._suspected)
            if deferred:  # a leader already waits for our answer: joining it is the fastest group
                return actions + self._accept(deferred[0], self._deferred[deferred[0]], now)
            readiness = self._readiness()
            # A client (accepts no connections) never leads: its members could not reach it.
            leader = readiness.first_server()
            if leader is None:
                return actions + self._await_server(self._lineage_peers())
            if leader == self.peer_id:
                self.phase = Phase.GATHERING
                self._watched_leader = None
                requesters = self._requesters - self._suspected - self._unavailable
                candidates = sorted(readiness.ready_ids() | requesters)
                not_ready = readiness.peer_ids() - set(candidates) | set(self._joiners_due())
                if self._may_propose(now, candidates, not_ready):
                    actions += self._propose(now, candidates)
                return actions
            self.phase = Phase.WAITING
            if leader != self._asked or now >= self._ask_again_at:
                # Asked again every proposal_timeout: a request or its answer may be lost, and a
                # leader that locked in the meantime answers that the round started.
                self._asked = leader
                self._ask_again_at = now + _seconds(self.config.proposal_timeout)
                actions.append(Send(leader, JoinRequest(round=self.round, param_hash=self.local.param_hash)))
            if readiness.num_ready() < self.config.min_peers:
                self._watched_leader = None  # the leader cannot propose yet; max_wait bounds this
                return actions
            if leader != self._watched_leader:
                self._watched_leader = leader
                sending = formation_fan_out_seconds(
                    sorted(readiness.ready_ids()), self._own_entry(), self._bandwidth_of(leader)
                )
                self._leader_deadline = (
                    now + _seconds(self.config.join_window + self.config.begin_timeout) + sending
                )
            if now < self._leader_deadline:
                return actions
            # Enough peers were ready for a whole join window and the leader stayed silent.
            self._suspected.add(leader)
            self._watched_leader = None

    def _bandwidth_of(self, peer_id: str) -> float:
        """The uplink ``peer_id``'s record announces; 0 (unknown) if our view lacks it."""
        record = self._view.get(peer_id)
        return record.bandwidth_bytes_per_s if record is not None else 0.0

    def _await_server(self, lineage_peers: list[PeerRecord]) -> list[Action]:
        """We are a client and no peer of our lineage that accepts connections is ready: wait for
        one (``max_wait`` bounds this). Said once, and plainly if there is none at all."""
        self.phase = Phase.WAITING
        self._watched_leader = None
        if not self._said_no_server:
            self._said_no_server = True
            if all(peer.client for peer in lineage_peers):
                log.warning(
                    "round %d cannot form: every peer of our lineage is in client mode; a round needs at "
                    "least one node that accepts connections (one without --client-mode)",
                    self.round,
                )
        return []

    def _joiners_due(self) -> dict[str, float]:
        """Peers fetching our lineage's state to join it that expect to hold it before our join
        window ends, with that time: a leader waits for them as for a lineage peer still training.
        An estimate a whole window old is stale (a fetch that progresses renews it every second): a
        stuck joiner holds up no round for longer than that."""
        window = _seconds(self.config.join_window)
        excluded = self._suspected | self._unavailable | {self.peer_id}
        syncing = self._view.syncing_of(self.local.round, self.local.param_hash)
        return {
            peer.peer_id: peer.ready_at
            for peer in syncing.due(self._now - window, self.started_at + window)
            if peer.ready_at is not None and peer.peer_id not in excluded
        }

    def _may_propose(self, now: float, candidates: list[str], not_ready: set[str]) -> bool:
        if now < self._retry_at or len(candidates) < self.config.min_peers:
            return False
        return not not_ready or now >= self.started_at + _seconds(self.config.join_window)

    # --- leader ---

    def _propose(self, now: float, candidates: list[str]) -> list[Action]:
        self._attempt += 1
        proposal = Proposal(
            round=self.round,
            proposal_id=f"{self.peer_id}/{self.round}/{self._attempt}",
            param_hash=self.local.param_hash,
            members=tuple(candidates),
        )
        # Our uplink sends the proposal to each candidate in turn: answers are due that much later.
        sending = fan_out_seconds(
            proposal_bytes(candidates), len(candidates) - 1, self.local.bandwidth_bytes_per_s
        )
        deadline = min(now + _seconds(self.config.proposal_timeout) + sending, self.max_deadline)
        self._open = OpenProposal(
            proposal, deadline, invited=set(candidates) - {self.peer_id}, sent_until=now + sending
        )
        self.phase = Phase.COLLECTING
        actions: list[Action] = [Send(peer_id, proposal) for peer_id in sorted(self._open.invited)]
        if not self._open.invited:  # min_peers == 1 and nobody else ready: a group of one
            actions += self._close_proposal(now)
        return actions

    def _close_proposal(self, now: float) -> list[Action]:
        assert self._open is not None
        open_proposal, self._open = self._open, None
        self._suspected |= open_proposal.silent()
        if 1 + len(open_proposal.accepts) >= self.config.min_peers:
            group = open_proposal.build_group(
                leader=self._own_entry(),
                vector_length=self.vector_length,
                tier_group_size=self.config.tier_group_size,
            )
            begins: list[Action] = [
                Send(peer_id, Begin(group=group)) for peer_id in group.member_ids if peer_id != self.peer_id
            ]
            return begins + self._lock(group)
        cancel = Cancel(
            round=self.round, proposal_id=open_proposal.proposal_id, reason=Reason.TOO_FEW_ACCEPTED
        )
        self.phase = Phase.GATHERING
        self._retry_at = now + _seconds(self.config.proposal_timeout)
        return [Send(peer_id, cancel) for peer_id in sorted(open_proposal.accepts)]

    def _own_entry(self) -> GroupMember:
        return GroupMember(
            peer_id=self.peer_id,
            grpc_address=self.local.grpc_address,
            num_tokens=self.num_tokens,
            bandwidth_bytes_per_s=self.local.bandwidth_bytes_per_s,
            stream_addresses=self.stream_addresses,
            client=self.local.client,
            rank=self.local.rank,
        )

    def _cancel_proposal(self, reason: Reason) -> list[Action]:
        """Call our proposal off for every invitee that may still count on it."""
        assert self._open is not None
        open_proposal, self._open = self._open, None
        cancel = Cancel(round=self.round, proposal_id=open_proposal.proposal_id, reason=reason)
        return [Send(peer_id, cancel) for peer_id in open_proposal.not_declined()]

    def _on_join_request(self, sender: str, request: JoinRequest) -> list[Action]:
        if request.param_hash != self.local.param_hash:
            log.debug("round %d: join request from %s of another lineage", self.round, sender)
            return []  # not ours to include; its own lineage check will send it to re-sync
        if self.group is not None:  # it is late: tell it at once instead of letting it wait for us
            started = Cancel(round=self.round, proposal_id=self.group.group_id, reason=Reason.ROUND_STARTED)
            return [Send(sender, started)]
        if self.outcome is not None:
            return []  # we gave up and published that we are no longer ready
        self._suspected.discard(sender)
        self._unavailable.discard(sender)
        self._requesters.add(sender)
        if self._open is not None and sender not in self._open.accepts:
            if self._open.on_the_way(sender, self._now):
                return []  # it asks again before our uplink got to it: one copy is enough
            return [Send(sender, self._open.invite(sender))]  # new, or our proposal to it was lost
        return []  # a gathering leader counts it in _choose_role; a member keeps it for when it leads

    def _on_accept(self, sender: str, accept: Accept) -> list[Action]:
        if accept.num_streams != 1 + len(self.stream_addresses):
            # Its shards are not ours: it cannot be in our group (it is told why; same next round).
            if self._open is not None and accept.proposal_id == self._open.proposal_id:
                self._open.decline(sender)
            self._unavailable.add(sender)
            mismatch = Cancel(
                round=self.round, proposal_id=accept.proposal_id, reason=Reason.STREAMS_MISMATCH
            )
            return [Send(sender, mismatch)]
        if self._open is not None and self._open.accept(sender, accept):
            return []
        if (
            self.group is not None
            and self.group.group_id == accept.proposal_id
            and sender in self.group.member_ids
        ):
            return []  # a duplicate of an answer we already used
        reason = Reason.ROUND_STARTED if self.group is not None else Reason.STALE_PROPOSAL
        return [Send(sender, Cancel(round=self.round, proposal_id=accept.proposal_id, reason=reason))]

    def _on_reject(self, sender: str, reject: Reject) -> list[Action]:
        if reject.reason in _UNAVAILABLE:
            self._unavailable.add(sender)
        actions = self._drop_answer(sender, reject.proposal_id, reject.reason)
        if reject.reason is Reason.ALREADY_IN_GROUP and self.outcome is None:
            # The sender is locked into a group of our round and lineage (it checks both first).
            missed = MissedRound(self.round, Reason.ROUND_STARTED, told_by=sender)
            return actions + self._finish(missed, Reason.ROUND_STARTED)
        return actions

    def _on_withdraw(self, sender: str, withdraw: Withdraw) -> list[Action]:
        return self._drop_answer(sender, withdraw.proposal_id, withdraw.reason)

    def _drop_answer(self, sender: str, proposal_id: str, reason: Reason) -> list[Action]:
        if self._open is not None and proposal_id == self._open.proposal_id:
            self._open.decline(sender)
            return []
        if self.group is not None and self.group.group_id == proposal_id and sender in self.group.member_ids:
            return [GroupMemberLost(self.round, sender, reason)]
        log.debug("round %d: %s from %s about closed proposal %s", self.round, reason, sender, proposal_id)
        return []  # an answer about a proposal we already closed or cancelled: nothing depends on it

    # --- member ---

    def _on_proposal(self, sender: str, proposal: Proposal, now: float) -> list[Action]:
        def reject(reason: Reason) -> list[Action]:
            return [
                Send(sender, Reject(round=proposal.round, proposal_id=proposal.proposal_id, reason=reason))
            ]

        if proposal.param_hash != self.local.param_hash:
            # Which of us must re-sync is the lineage rule's call, made on our view in _evaluate.
            return reject(Reason.LINEAGE_MISMATCH)
        if self.group is not None:
            return reject(Reason.ALREADY_IN_GROUP)
        if self.outcome is not None or sender in self._view.left_peer_ids:
            return reject(Reason.NOT_AVAILABLE)
        self._suspected.discard(sender)  # it is alive and ready for our round
        self._unavailable.discard(sender)
        if self._open is not None:  # we are collecting answers to our own proposal
            if sender < self.peer_id:  # a smaller leader is forming this round: follow it
                return self._cancel_proposal(Reason.STEPPED_DOWN) + self._accept(sender, proposal, now)
            return [*reject(Reason.SMALLER_LEADER), Send(sender, self._open.invite(sender))]
        if self._bound is not None:
            leader, bound_id = self._bound
            if sender == leader:
                if proposal.proposal_id == bound_id:
                    return [Send(sender, self._accept_message(bound_id))]  # a resend: answer again
                return self._accept(sender, proposal, now)  # the leader's newer attempt
            if sender < leader:
                withdraw = Withdraw(round=self.round, proposal_id=bound_id, reason=Reason.SWITCHED_LEADER)
                return [Send(leader, withdraw), *self._accept(sender, proposal, now)]
            # A larger leader: hold its proposal; answer once our leader locks us in or fails.
            self._deferred[sender] = proposal
            return []
        return self._accept(sender, proposal, now)

    def _accept_message(self, proposal_id: str) -> Accept:
        return Accept(
            round=self.round,
            proposal_id=proposal_id,
            grpc_address=self.local.grpc_address,
            num_tokens=self.num_tokens,
            bandwidth_bytes_per_s=self.local.bandwidth_bytes_per_s,
            stream_addresses=self.stream_addresses,
            client=self.local.client,
            rank=self.local.rank,
        )

    def _accept(self, leader: str, proposal: Proposal, now: float) -> list[Action]:
        self._deferred.pop(leader, None)
        self._bound = (leader, proposal.proposal_id)
        self._bound_leader_seen = leader in self._view
        # The leader sends every candidate its proposal, then every member its Begin, on one uplink.
        sending = formation_fan_out_seconds(proposal.members, self._own_entry(), self._bandwidth_of(leader))
        self._begin_deadline = now + _seconds(self.config.begin_timeout) + sending
        self._watched_leader = None
        self.phase = Phase.BOUND
        return [Send(leader, self._accept_message(proposal.proposal_id))]

    def _unbind(self, reason: Reason) -> list[Action]:
        assert self._bound is not None
        leader, proposal_id = self._bound
        self._bound = None
        self._begin_deadline = math.inf
        self.phase = Phase.WAITING
        return [Send(leader, Withdraw(round=self.round, proposal_id=proposal_id, reason=reason))]

    def _on_cancel(self, sender: str, cancel: Cancel) -> list[Action]:
        if self._bound == (sender, cancel.proposal_id):
            self._bound = None  # the leader knows: no Withdraw needed
            self._begin_deadline = math.inf
            self.phase = Phase.WAITING
        elif sender in self._deferred and self._deferred[sender].proposal_id == cancel.proposal_id:
            del self._deferred[sender]
        if cancel.reason is Reason.ROUND_STARTED and self.outcome is None:
            return self._finish(
                MissedRound(self.round, Reason.ROUND_STARTED, told_by=sender), Reason.ROUND_STARTED
            )
        return []

    def _on_begin(self, sender: str, begin: Begin) -> list[Action]:
        group = begin.group

        def withdraw(reason: Reason) -> list[Action]:
            return [Send(sender, Withdraw(round=group.round, proposal_id=group.group_id, reason=reason))]

        if self.group is not None:
            return [] if group == self.group else withdraw(Reason.ALREADY_IN_GROUP)
        if self._bound != (sender, group.group_id):
            return withdraw(Reason.NOT_BOUND)
        problem = group.problem_for(
            self._own_entry(),
            leader_id=sender,
            param_hash=self.local.param_hash,
            vector_length=self.vector_length,
        )
        if problem is not None:
            log.warning("round %d: invalid Begin from %s: %s", self.round, sender, problem)
            self._suspected.add(sender)
            return self._unbind(Reason.INVALID_GROUP)
        return self._lock(group)

    # --- endings ---

    def _lock(self, group: GroupSpec) -> list[Action]:
        actions: list[Action] = [
            Send(
                leader,
                Reject(round=self.round, proposal_id=proposal.proposal_id, reason=Reason.ALREADY_IN_GROUP),
            )
            for leader, proposal in sorted(self._deferred.items())
        ]
        self._deferred.clear()
        self.phase = Phase.LOCKED
        self.outcome = StartAllReduce(group)
        return [*actions, self.outcome]

    def _give_up(self) -> list[Action]:
        """max_wait is over and we are in no group."""
        # Suspects count here: enough peers were ready, so a group may well have formed without us.
        ready = [
            peer
            for peer in self._view.with_local(self.local)
            if peer.round == self.local.round
            and peer.param_hash == self.local.param_hash
            and peer.ready_for_round == self.round
        ]
        # Peers in client mode only (none accepts connections) cannot form a group: none missed.
        formable = any(not peer.client for peer in ready)
        if len(ready) >= self.config.min_peers and formable:
            return self._finish(MissedRound(self.round, Reason.MAX_WAIT))
        if self.config.on_too_few == "proceed_alone":
            solo = solo_group(
                member=self._own_entry(),
                round=self.round,
                param_hash=self.local.param_hash,
                vector_length=self.vector_length,
            )
            return self._release(Reason.NOT_AVAILABLE) + self._lock(solo)
        return self._finish(RoundFailed(self.round, Reason.TOO_FEW_PEERS))

    def _release(self, cancel_reason: Reason) -> list[Action]:
        """Free everyone who waits on us: our leader, our invitees, deferred proposers."""
        actions: list[Action] = []
        if self._bound is not None:
            actions += self._unbind(Reason.NOT_AVAILABLE)
        if self._open is not None:
            actions += self._cancel_proposal(cancel_reason)
        actions += [
            Send(
                leader,
                Reject(round=self.round, proposal_id=proposal.proposal_id, reason=Reason.NOT_AVAILABLE),
            )
            for leader, proposal in sorted(self._deferred.items())
        ]
        self._deferred.clear()
        return actions

    def _finish(
        self, outcome: MissedRound | RoundFailed | Resync, cancel_reason: Reason = Reason.NOT_AVAILABLE
    ) -> list[Action]:
        """Give up on the round: free the others, take back our readiness, report ``outcome``.

        ``cancel_reason`` is what our invitees hear; ``ROUND_STARTED`` makes them miss the round too.
        """
        actions = self._release(cancel_reason)
        self.phase = Phase.DONE
        self.outcome = outcome
        return [*actions, Publish(None), outcome]
