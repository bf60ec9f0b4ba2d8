"""How long one peer's uplink takes to send a message to each of many peers, and the waits that follow.

A round's leader sends one ``Proposal`` to each of its K candidates and one ``Begin`` to each of
its K members. Both list every member (a Begin carries the whole ``GroupSpec``: each member's id,
address, tokens, bandwidth and part), so a formation puts about ``K × (54 + 91) bytes × K`` on the
leader's one uplink: 145 MB for 1,000 members, 2 s at 557 Mbit/s, 29 s at 40 Mbit/s. Every wait
of the formation was fixed: the driver cut each send at ``message_timeout`` (3 s), the leader
collected answers for ``proposal_timeout`` (5 s) and a member waited ``begin_timeout`` (10 s) for
its Begin. So a leader on a slow uplink got only the first few seconds' worth of Begins out, the
members behind them withdrew and suspected it, and the round split or was missed (BENCHMARKS.md,
"Swarm simulator (issue 33)", "A slow leader's uplink"). The waits now grow with the bytes the
leader has to send, at the rate its record announces (``bandwidth_bytes_per_s``):

- a send's deadline is ``message_timeout`` plus the bytes queued on our uplink before and with it
  (:func:`send_timeout`; the driver counts what it has in flight);
- a leader collects answers for ``proposal_timeout`` plus its proposals' fan-out;
- a member waits for its Begin ``begin_timeout`` plus the leader's proposals' and Begins' fan-out,
  and for a silent would-be leader a join window and a begin timeout plus the same.

Sizes are bounds from the protobuf encoding of each field (``protos/dtnode/v1/membership.proto``)
computed from the fields, not by encoding the message (a Begin to a thousand members would be
encoded a thousand times); a member does not know the others' addresses and takes its own as their
size. A peer whose announced bandwidth is unknown (0) adds nothing; one that announces more than
its link moves gets the old, too short waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocol.membership.messages import Accept, Begin, GroupMember, GroupSpec, Message, Proposal

ENVELOPE_BYTES = 8 + 128 + 3
"""The envelope's own fields around a message: its tags, a sender id (at most 128 characters),
the protocol version and the message's length."""
_VARINT = 10  # the most bytes a uint64 takes
_LENGTH = 3  # tag and length of a string or submessage up to 16 KiB long (a bound)
_FIXED_FIELDS = 4 * (_VARINT + 1) + 4 * _LENGTH + 256 + 128 + 64
"""A message's fields besides its member list: round, vector length, reason and a group's tier
size (varints), a
proposal or group id (at most 256 characters), a leader id (128) and the param_hash (64 hex
characters), each string's tag and length, and the tag and length of the packed part boundaries."""


def _string(text: str) -> int:
    return _LENGTH + len(text)


def member_entry_bytes(member: GroupMember) -> int:
    """The most one member's entry in a ``GroupSpec`` takes: id, address, tokens, bandwidth, stream
    addresses, client, rank, its part boundary, and the entry's own tag and length."""
    streams = sum(_string(address) for address in member.stream_addresses)
    scalars = (1 + _VARINT) + (1 + 8) + 2 + (1 + _VARINT)  # tokens, bandwidth (double), client, rank
    return _LENGTH + _string(member.peer_id) + _string(member.grpc_address) + streams + scalars + _VARINT


def message_bytes(message: Message) -> int:
    """A bound on ``message``'s envelope on the wire (what it costs its sender's uplink)."""
    if isinstance(message, Begin):
        return group_bytes(message.group)
    if isinstance(message, Proposal):
        return proposal_bytes(message.members)
    if isinstance(message, Accept):
        addresses = (message.grpc_address, *message.stream_addresses)
        return ENVELOPE_BYTES + _FIXED_FIELDS + 4 * (_VARINT + 1) + sum(_string(a) for a in addresses)
    return ENVELOPE_BYTES + _FIXED_FIELDS  # a JoinRequest, Reject, Withdraw or Cancel


def wire_sizes(messages: Sequence[Message]) -> list[int]:
    """:func:`message_bytes` of each of ``messages``, a Begin's group (one object for every member of
    a fan-out) sized once."""
    by_object: dict[int, int] = {}
    sizes = []
    for message in messages:
        key = id(message.group) if isinstance(message, Begin) else id(message)
        if key not in by_object:
            by_object[key] = message_bytes(message)
        sizes.append(by_object[key])
    return sizes


def proposal_bytes(member_ids: Sequence[str]) -> int:
    """A bound on a ``Proposal`` listing ``member_ids``."""
    return ENVELOPE_BYTES + _FIXED_FIELDS + sum(_string(peer_id) for peer_id in member_ids)


def group_bytes(group: GroupSpec) -> int:
    """A bound on a ``Begin`` carrying ``group``."""
    return ENVELOPE_BYTES + _FIXED_FIELDS + _VARINT + sum(member_entry_bytes(m) for m in group.members)


def begin_bytes_estimate(member_ids: Sequence[str], like: GroupMember) -> int:
    """A ``Begin`` to the members ``member_ids``, each entry taken as large as ``like``'s (a member's
    own: it knows the others' ids from the proposal, not their addresses)."""
    entry = member_entry_bytes(like) - len(like.peer_id)
    return ENVELOPE_BYTES + _FIXED_FIELDS + _VARINT + sum(entry + len(peer_id) for peer_id in member_ids)


def send_seconds(num_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """How long ``num_bytes`` take on an uplink of ``bandwidth_bytes_per_s`` (0: unknown, no time)."""
    return num_bytes / bandwidth_bytes_per_s if bandwidth_bytes_per_s > 0 else 0.0


def fan_out_seconds(num_bytes: int, num_receivers: int, bandwidth_bytes_per_s: float) -> float:
    """One message of ``num_bytes`` to each of ``num_receivers`` peers, one uplink."""
    return send_seconds(num_bytes * max(num_receivers, 0), bandwidth_bytes_per_s)


def formation_fan_out_seconds(member_ids: Sequence[str], like: GroupMember, leader_bandwidth: float) -> float:
    """How long a leader's uplink takes to send its Proposal and then its Begin to every other one of
    ``member_ids`` (the leader among them): the time a member may wait for its Begin beyond the
    fixed ``begin_timeout``."""
    receivers = len(member_ids) - 1
    proposals = fan_out_seconds(proposal_bytes(member_ids), receivers, leader_bandwidth)
    begins = fan_out_seconds(begin_bytes_estimate(member_ids, like), receivers, leader_bandwidth)
    return proposals + begins


def send_timeout(message_timeout: float, queued_bytes: int, bandwidth_bytes_per_s: float) -> float:
    """The deadline (seconds) of a send that leaves once ``queued_bytes`` (the sends before it and
    itself, or a whole fan-out sent at once, which shares the uplink) are out: the fixed message
    timeout plus the time our uplink takes to move them."""
    return message_timeout + send_seconds(queued_bytes, bandwidth_bytes_per_s)
