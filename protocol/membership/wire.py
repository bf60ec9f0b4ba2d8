"""Round-formation messages to and from their protobuf envelope (``protos/dtnode/v1/membership.proto``).

``to_envelope`` wraps one :mod:`~protocol.membership.messages` dataclass, with the sender's peer id
and protocol version, into a ``MembershipEnvelope``; ``from_envelope`` turns a received envelope
back into ``(sender_id, message)``. Every proto field is mapped by hand, both ways, so a field added
to one side and forgotten on the other fails the round-trip tests instead of vanishing silently.

Envelopes come from untrusted peers. ``from_envelope`` builds the dataclasses, whose
``__post_init__`` holds every field to the same rules as a message built in code, and raises
``ValueError`` (naming the message kind and the field) for anything malformed: no message in the
oneof, an unspecified or unknown reason, a Begin without a group, or any field out of its range.
Counts of repeated fields are checked before their elements are converted, so a hostile envelope
costs at most ``MAX_GROUP_SIZE`` member conversions.

The protocol version is *not* checked here: the servicer compares it before parsing, because a peer
of another version may mean something else by the same bytes.
"""

from __future__ import annotations

from typing import Final

from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.membership.messages import (
    MAX_GROUP_SIZE,
    MAX_STREAMS,
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
)
from protocol.membership.records import MAX_PROTOCOL_VERSION, check_int, check_peer_id

# Explicit, not by name: renaming a Python member must not silently change the wire.
_REASON_TO_PB: Final[dict[Reason, pb.Reason]] = {
    Reason.WRONG_ROUND: pb.REASON_WRONG_ROUND,
    Reason.LINEAGE_MISMATCH: pb.REASON_LINEAGE_MISMATCH,
    Reason.ALREADY_IN_GROUP: pb.REASON_ALREADY_IN_GROUP,
    Reason.SMALLER_LEADER: pb.REASON_SMALLER_LEADER,
    Reason.NOT_AVAILABLE: pb.REASON_NOT_AVAILABLE,
    Reason.SWITCHED_LEADER: pb.REASON_SWITCHED_LEADER,
    Reason.BEGIN_TIMEOUT: pb.REASON_BEGIN_TIMEOUT,
    Reason.LEADER_GONE: pb.REASON_LEADER_GONE,
    Reason.NOT_BOUND: pb.REASON_NOT_BOUND,
    Reason.INVALID_GROUP: pb.REASON_INVALID_GROUP,
    Reason.STEPPED_DOWN: pb.REASON_STEPPED_DOWN,
    Reason.TOO_FEW_ACCEPTED: pb.REASON_TOO_FEW_ACCEPTED,
    Reason.ROUND_STARTED: pb.REASON_ROUND_STARTED,
    Reason.STALE_PROPOSAL: pb.REASON_STALE_PROPOSAL,
    Reason.TOO_FEW_PEERS: pb.REASON_TOO_FEW_PEERS,
    Reason.MAX_WAIT: pb.REASON_MAX_WAIT,
    Reason.STREAMS_MISMATCH: pb.REASON_STREAMS_MISMATCH,
}
_REASON_FROM_PB: Final[dict[int, Reason]] = {int(value): reason for reason, value in _REASON_TO_PB.items()}
assert len(_REASON_FROM_PB) == len(_REASON_TO_PB) == len(Reason), "every Reason needs its own wire value"


# --- dataclass -> proto ------------------------------------------------------------------------------


def _member_to_pb(member: GroupMember) -> pb.GroupMember:
    return pb.GroupMember(
        peer_id=member.peer_id,
        grpc_address=member.grpc_address,
        num_tokens=member.num_tokens,
        bandwidth_bytes_per_s=member.bandwidth_bytes_per_s,
        stream_addresses=member.stream_addresses,
        client=member.client,
        rank=member.rank,
    )


def _group_to_pb(group: GroupSpec) -> pb.GroupSpec:
    return pb.GroupSpec(
        round=group.round,
        group_id=group.group_id,
        leader_id=group.leader_id,
        param_hash=group.param_hash,
        vector_length=group.vector_length,
        members=[_member_to_pb(member) for member in group.members],
        part_boundaries=group.part_boundaries,
        tier_group_size=group.tier_group_size,
    )


def to_envelope(message: Message, *, sender_id: str, protocol_version: int) -> pb.MembershipEnvelope:
    """Wrap ``message`` from ``sender_id`` (speaking ``protocol_version``) for ``Membership.Deliver``.

    ``ValueError`` if ``sender_id`` or ``protocol_version`` is invalid (the message itself was
    validated when it was built); ``TypeError`` if ``message`` is not a membership message.
    """
    envelope = pb.MembershipEnvelope(
        sender_id=check_peer_id(sender_id, "sender_id"),
        protocol_version=check_int("protocol_version", protocol_version, maximum=MAX_PROTOCOL_VERSION),
    )
    match message:
        case JoinRequest():
            envelope.join_request.CopyFrom(pb.JoinRequest(round=message.round, param_hash=message.param_hash))
        case Proposal():
            envelope.proposal.CopyFrom(
                pb.Proposal(
                    round=message.round,
                    proposal_id=message.proposal_id,
                    param_hash=message.param_hash,
                    members=message.members,
                )
            )
        case Accept():
            envelope.accept.CopyFrom(
                pb.Accept(
                    round=message.round,
                    proposal_id=message.proposal_id,
                    grpc_address=message.grpc_address,
                    num_tokens=message.num_tokens,
                    bandwidth_bytes_per_s=message.bandwidth_bytes_per_s,
                    stream_addresses=message.stream_addresses,
                    client=message.client,
                    rank=message.rank,
                )
            )
        case Reject():
            envelope.reject.CopyFrom(
                pb.Reject(
                    round=message.round,
                    proposal_id=message.proposal_id,
                    reason=_REASON_TO_PB[message.reason],
                )
            )
        case Withdraw():
            envelope.withdraw.CopyFrom(
                pb.Withdraw(
                    round=message.round,
                    proposal_id=message.proposal_id,
                    reason=_REASON_TO_PB[message.reason],
                )
            )
        case Cancel():
            envelope.cancel.CopyFrom(
                pb.Cancel(
                    round=message.round,
                    proposal_id=message.proposal_id,
                    reason=_REASON_TO_PB[message.reason],
                )
            )
        case Begin():
            envelope.begin.CopyFrom(pb.Begin(group=_group_to_pb(message.group)))
        case _:
            raise TypeError(f"not a membership message: {type(message).__name__}")
    return envelope


# --- proto -> dataclass ------------------------------------------------------------------------------


def _reason_from_pb(value: int) -> Reason:
    if value == pb.REASON_UNSPECIFIED:
        raise ValueError("reason is unspecified")
    reason = _REASON_FROM_PB.get(value)
    if reason is None:  # proto3 enums are open: a newer peer's value arrives as a bare int
        raise ValueError(f"reason {value} is unknown")
    return reason


def _check_count(name: str, count: int, maximum: int = MAX_GROUP_SIZE) -> None:
    """Reject oversized repeated fields before converting their elements one by one."""
    if count > maximum:
        raise ValueError(f"{name} has {count} entries; at most {maximum} are allowed")


def _member_from_pb(member: pb.GroupMember) -> GroupMember:
    _check_count("stream_addresses", len(member.stream_addresses), MAX_STREAMS - 1)
    return GroupMember(
        peer_id=member.peer_id,
        grpc_address=member.grpc_address,
        num_tokens=member.num_tokens,
        bandwidth_bytes_per_s=member.bandwidth_bytes_per_s,
        stream_addresses=tuple(member.stream_addresses),
        client=member.client,
        rank=member.rank if member.HasField("rank") else None,
    )


def _group_from_pb(group: pb.GroupSpec) -> GroupSpec:
    _check_count("members", len(group.members))
    _check_count("part_boundaries", len(group.part_boundaries), MAX_GROUP_SIZE + 1)
    return GroupSpec(
        round=group.round,
        group_id=group.group_id,
        leader_id=group.leader_id,
        param_hash=group.param_hash,
        vector_length=group.vector_length,
        members=tuple(_member_from_pb(member) for member in group.members),
        part_boundaries=tuple(group.part_boundaries),
        tier_group_size=group.tier_group_size,
    )


def _message_from_pb(envelope: pb.MembershipEnvelope, kind: str) -> Message:
    match kind:
        case "join_request":
            join = envelope.join_request
            return JoinRequest(round=join.round, param_hash=join.param_hash)
        case "proposal":
            proposal = envelope.proposal
            _check_count("members", len(proposal.members))
            return Proposal(
                round=proposal.round,
                proposal_id=proposal.proposal_id,
                param_hash=proposal.param_hash,
                members=tuple(proposal.members),
            )
        case "accept":
            accept = envelope.accept
            _check_count("stream_addresses", len(accept.stream_addresses), MAX_STREAMS - 1)
            return Accept(
                round=accept.round,
                proposal_id=accept.proposal_id,
                grpc_address=accept.grpc_address,
                num_tokens=accept.num_tokens,
                bandwidth_bytes_per_s=accept.bandwidth_bytes_per_s,
                stream_addresses=tuple(accept.stream_addresses),
                client=accept.client,
                rank=accept.rank if accept.HasField("rank") else None,
            )
        case "reject":
            reject = envelope.reject
            return Reject(
                round=reject.round, proposal_id=reject.proposal_id, reason=_reason_from_pb(reject.reason)
            )
        case "withdraw":
            withdraw = envelope.withdraw
            return Withdraw(
                round=withdraw.round,
                proposal_id=withdraw.proposal_id,
                reason=_reason_from_pb(withdraw.reason),
            )
        case "cancel":
            cancel = envelope.cancel
            return Cancel(
                round=cancel.round, proposal_id=cancel.proposal_id, reason=_reason_from_pb(cancel.reason)
            )
        case "begin":
            if not envelope.begin.HasField("group"):
                raise ValueError("Begin carries no group")
            return Begin(group=_group_from_pb(envelope.begin.group))
    raise AssertionError(f"the oneof has a case wire.py does not map: {kind!r}")


def from_envelope(envelope: pb.MembershipEnvelope) -> tuple[str, Message]:
    """``(sender_id, message)`` of a received envelope; ``ValueError`` saying what is wrong otherwise."""
    sender_id = check_peer_id(envelope.sender_id, "sender_id")
    kind = envelope.WhichOneof("message")
    if kind is None:
        raise ValueError("the envelope carries no message")
    try:
        return sender_id, _message_from_pb(envelope, kind)
    except ValueError as error:
        raise ValueError(f"invalid {kind}: {error}") from error
