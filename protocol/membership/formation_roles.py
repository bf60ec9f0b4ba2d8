"""The moves of round formation: the leader's, the member's, and how a formation ends.

A leader proposes to the ready peers, closes its proposal once all answered or its timeout passed
(Begin to the group, or Cancel and retry later), calls it off when it steps down, and handles
JoinRequests, Accepts, Rejects and Withdraws. A member accepts a proposal (or defers, or switches to a
smaller leader), withdraws from it, and checks and honours the Begin it is bound to. Every formation
ends locked into a group (``StartAllReduce``) or giving up, after freeing everyone who waits on it.
:class:`~protocol.membership.rounds.RoundFormation` (where the protocol is described) calls these from
its events and its decision procedure.
"""

from __future__ import annotations

import logging
import math

from protocol.membership.actions import (
    Action,
    GroupMemberLost,
    MissedRound,
    Publish,
    Resync,
    RoundFailed,
    Send,
    StartAllReduce,
)
from protocol.membership.formation_state import FormationState, Phase, _seconds
from protocol.membership.messages import (
    Accept,
    Begin,
    Cancel,
    GroupMember,
    GroupSpec,
    JoinRequest,
    Proposal,
    Reason,
    Reject,
    Withdraw,
)
from protocol.membership.proposals import OpenProposal, solo_group

log = logging.getLogger(__name__)


# Rejections that say the peer will not join any group of ours this round.
_UNAVAILABLE = frozenset(
    {Reason.ALREADY_IN_GROUP, Reason.NOT_AVAILABLE, Reason.LINEAGE_MISMATCH, Reason.WRONG_ROUND}
)


class FormationRoles(FormationState):
    """What a leader and a member do, and how the formation ends (see the module docstring)."""

    # --- leader ---

    def _propose(self, now: float, candidates: list[str]) -> list[Action]:
        self._attempt += 1
        proposal = Proposal(
            round=self.round,
            proposal_id=f"{self.peer_id}/{self.round}/{self._attempt}",
            param_hash=self.local.param_hash,
            members=tuple(candidates),
        )
        deadline = min(now + _seconds(self.config.proposal_timeout), self.max_deadline)
        self._open = OpenProposal(proposal, deadline, invited=set(candidates) - {self.peer_id})
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
            group = open_proposal.build_group(leader=self._own_entry(), vector_length=self.vector_length)
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
            return actions + self._finish(MissedRound(self.round, Reason.ROUND_STARTED), Reason.ROUND_STARTED)
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
        )

    def _accept(self, leader: str, proposal: Proposal, now: float) -> list[Action]:
        self._deferred.pop(leader, None)
        self._bound = (leader, proposal.proposal_id)
        self._bound_leader_seen = leader in self._view
        self._begin_deadline = now + _seconds(self.config.begin_timeout)
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
            return self._finish(MissedRound(self.round, Reason.ROUND_STARTED), Reason.ROUND_STARTED)
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
