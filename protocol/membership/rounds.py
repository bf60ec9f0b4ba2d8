"""Round formation: how the ready peers of one lineage agree on ONE group for an outer round.

One :class:`RoundFormation` per local peer per round. It is a pure state machine: events go in
(``start``, ``on_view`` with a DHT snapshot, ``on_message`` with a decoded peer message,
``tick``), each with the current clock time ``now``, and actions (``actions.py``) come out:
publish this, send that, start the all-reduce with this group, give up. Nothing blocks; every
wait has a deadline that the daemon learns from :meth:`RoundFormation.next_deadline` and honours
by calling ``tick``. Round ``r`` is formed by peers holding the global params ``(r - 1,
param_hash)`` (``lineage.py``); the messages are in ``messages.py``. The fields live in
``formation_state.py`` and the leader's and member's moves in ``formation_roles.py``; this module
has the events and the decision procedure run after each.

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
   sends a ``Proposal`` to the ready peers and collects ``Accept`` / ``Reject`` until all answered or ``proposal_timeout``. With ``>= min_peers`` accepted
   (itself included) it fixes the :class:`~protocol.membership.messages.GroupSpec` (members
   sorted by id, weights = tokens from their Accepts, parts from ``parts.py``) and sends it in
   ``Begin``; with fewer it cancels, suspects the silent and proposes again later.
3. Member: accepts a proposal of its round and lineage, then waits for ``Begin`` until
   ``begin_timeout``. On Begin it is locked: ``StartAllReduce(group)``. No Begin in time, or the
   leader's record gone: it withdraws, suspects that leader and re-evaluates (step 1). A leader
   that stays silent for a join window plus a begin timeout while enough peers are ready is
   suspected too.
4. A peer that learns that a group of its round and lineage began without it (a ``Cancel`` or
   ``Reject`` saying so) has missed the round: ``MissedRound``; it re-syncs from that group once
   it published its new params, and joins the next round. A leader that learns it while
   collecting cancels its proposal the same way, so no second group forms for the round.
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

from protocol.membership.actions import Action, Publish, Resync, Send, reply_without_formation
from protocol.membership.config import RoundConfig, TooFewPolicy
from protocol.membership.formation_roles import FormationRoles
from protocol.membership.formation_state import Phase, _seconds
from protocol.membership.lineage import decide_lineage
from protocol.membership.messages import (
    Accept,
    Cancel,
    JoinRequest,
    Message,
    Proposal,
    Reason,
    Reject,
    Withdraw,
)
from protocol.membership.records import PeerRecord, SwarmView, check_peer_id

__all__ = ["RoundConfig", "RoundFormation", "TooFewPolicy"]

log = logging.getLogger(__name__)


class RoundFormation(FormationRoles):
    """The local peer's side of forming round ``local.round + 1`` (see the module docstring)."""

    # --- events ---

    def start(self, view: SwarmView, now: float) -> list[Action]:
        """The local peer is ready for the round: publish it and act on ``view``."""
        assert not self._started, "start() is called once"
        self._started = True
        self._view, self._now = view, now
        decision = decide_lineage(view.peers, self.local)
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
        decision = decide_lineage(self._view.peers, self.local)
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

    def _choose_role(self, now: float) -> list[Action]:
        actions: list[Action] = []
        # Each pass returns or suspects one more peer, so this ends (we never suspect ourselves).
        while True:
            deferred = sorted(leader for leader in self._deferred if leader not in self._suspected)
            if deferred:  # a leader already waits for our answer: joining it is the fastest group
                return actions + self._accept(deferred[0], self._deferred[deferred[0]], now)
            lineage_peers = self._lineage_peers()
            ready = [peer.peer_id for peer in lineage_peers if peer.ready_for_round == self.round]
            # A client (accepts no connections) never leads: its members could not reach it.
            ready_servers = [
                peer.peer_id
                for peer in lineage_peers
                if peer.ready_for_round == self.round and not peer.client
            ]
            if not ready_servers:
                return actions + self._await_server(lineage_peers)
            leader = ready_servers[0]
            if leader == self.peer_id:
                self.phase = Phase.GATHERING
                self._watched_leader = None
                requesters = self._requesters - self._suspected - self._unavailable
                candidates = sorted(set(ready) | requesters)
                not_ready = {peer.peer_id for peer in lineage_peers} - set(candidates) | set(
                    self._joiners_due()
                )
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
            if len(ready) < self.config.min_peers:
                self._watched_leader = None  # the leader cannot propose yet; max_wait bounds this
                return actions
            if leader != self._watched_leader:
                self._watched_leader = leader
                self._leader_deadline = now + _seconds(self.config.join_window + self.config.begin_timeout)
            if now < self._leader_deadline:
                return actions
            # Enough peers were ready for a whole join window and the leader stayed silent.
            self._suspected.add(leader)
            self._watched_leader = None

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
        return {
            peer.peer_id: peer.ready_at
            for peer in self._view.syncing
            if (peer.round, peer.param_hash) == (self.local.round, self.local.param_hash)
            and peer.ready_at is not None
            and self._now - window < peer.ready_at <= self.started_at + window
            and peer.peer_id not in excluded
        }

    def _may_propose(self, now: float, candidates: list[str], not_ready: set[str]) -> bool:
        if now < self._retry_at or len(candidates) < self.config.min_peers:
            return False
        return not not_ready or now >= self.started_at + _seconds(self.config.join_window)
