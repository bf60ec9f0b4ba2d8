"""A leader's open proposal: who was invited, who answered what, and the group it turns into."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from protocol.membership.messages import Accept, GroupMember, GroupSpec, Proposal
from protocol.membership.parts import part_boundaries


@dataclass
class OpenProposal:
    """The answers to one ``Proposal`` while its leader collects them (until ``deadline``)."""

    proposal: Proposal
    deadline: float
    invited: set[str]
    accepts: dict[str, Accept] = field(default_factory=dict)
    declined: set[str] = field(default_factory=set)
    sent_until: float = -math.inf
    """When the leader's uplink is done sending the proposal to every invitee (``fan_out.py``):
    until then an invitee that asks to join again has its copy still on the way."""

    @property
    def proposal_id(self) -> str:
        return self.proposal.proposal_id

    def invite(self, peer_id: str) -> Proposal:
        """Add ``peer_id`` to the invitees; return the proposal to send it (listing it as a member)."""
        if peer_id not in self.invited:
            self.invited.add(peer_id)
            self.proposal = replace(self.proposal, members=tuple(sorted({*self.proposal.members, peer_id})))
        self.declined.discard(peer_id)
        return self.proposal

    def on_the_way(self, peer_id: str, now: float) -> bool:
        """Our proposal to ``peer_id`` may still be on our uplink: sending it again would only queue
        a second copy behind the first."""
        return peer_id in self.invited and peer_id not in self.declined and now < self.sent_until

    def accept(self, peer_id: str, accept: Accept) -> bool:
        """Record an Accept; False if ``peer_id`` was not invited (the Accept is not for us to use)."""
        if peer_id not in self.invited or accept.proposal_id != self.proposal_id:
            return False
        self.accepts[peer_id] = accept
        self.declined.discard(peer_id)
        return True

    def decline(self, peer_id: str) -> None:
        """A Reject or a Withdraw: the peer is out of this proposal."""
        if peer_id in self.invited:
            self.accepts.pop(peer_id, None)
            self.declined.add(peer_id)

    def all_answered(self) -> bool:
        return self.invited <= self.accepts.keys() | self.declined

    def silent(self) -> set[str]:
        """Invitees that neither accepted nor declined."""
        return self.invited - self.accepts.keys() - self.declined

    def not_declined(self) -> list[str]:
        """Invitees that may still count on this proposal (accepted or silent), sorted."""
        return sorted(self.invited - self.declined)

    def build_group(self, *, leader: GroupMember, vector_length: int, tier_group_size: int = 0) -> GroupSpec:
        """The group of the leader and every accepter, members in the member order (by rank, then
        peer id: ``records.member_order``), parts by bandwidth; its all-reduce tiered in groups of
        ``tier_group_size`` if it has more members (0: flat)."""
        members = [leader] + [
            GroupMember(
                peer_id=peer_id,
                grpc_address=accept.grpc_address,
                num_tokens=accept.num_tokens,
                bandwidth_bytes_per_s=accept.bandwidth_bytes_per_s,
                stream_addresses=accept.stream_addresses,
                client=accept.client,
                rank=accept.rank,
            )
            for peer_id, accept in self.accepts.items()
        ]
        members.sort(key=lambda member: member.order)
        bandwidths = [member.bandwidth_bytes_per_s for member in members]
        clients = [member.client for member in members]
        return GroupSpec(
            round=self.proposal.round,
            group_id=self.proposal_id,
            leader_id=leader.peer_id,
            param_hash=self.proposal.param_hash,
            vector_length=vector_length,
            members=tuple(members),
            part_boundaries=part_boundaries(bandwidths, vector_length, clients),
            tier_group_size=tier_group_size,
        )


def solo_group(*, member: GroupMember, round: int, param_hash: str, vector_length: int) -> GroupSpec:
    """A group of one (the proceed-alone policy): the member owns the whole vector (a client too:
    alone it dials nobody and nobody dials it, so it is its own server)."""
    return GroupSpec(
        round=round,
        group_id=f"{member.peer_id}/{round}/solo",
        leader_id=member.peer_id,
        param_hash=param_hash,
        vector_length=vector_length,
        members=(replace(member, client=False),),
        part_boundaries=(0, vector_length),
    )
