"""Membership messages survive the wire exactly, and every malformed envelope is a ValueError.

The reference for the wire format is the .proto itself: each message is compared with an envelope
built here by hand from the proto's field names, so a field swapped symmetrically in both directions
of ``wire.py`` (which a round trip alone would not notice) still fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.membership.messages import (
    MAX_GROUP_SIZE,
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
from protocol.membership.records import MAX_COUNTER, MAX_ID_CHARS, MAX_PEER_ID_CHARS
from protocol.membership.wire import from_envelope, to_envelope
from tests.protocol.membership.fake_swarm import H0, fake_hash

SENDER = "peer-a"
VERSION = 3
H1 = fake_hash("other params")


def _member(peer_id: str, bandwidth: float, num_tokens: int = 10) -> GroupMember:
    return GroupMember(
        peer_id=peer_id,
        grpc_address=f"10.0.0.{len(peer_id)}:50{len(peer_id)}",
        num_tokens=num_tokens,
        bandwidth_bytes_per_s=bandwidth,
    )


GROUP = GroupSpec(
    round=7,
    group_id="peer-a/7/2",
    leader_id="peer-a",
    param_hash=H0,
    vector_length=1000,
    members=(_member("peer-a", 1e6, 5), _member("peer-bb", 2.5e6, 0), _member("peer-ccc", 0.5, MAX_COUNTER)),
    part_boundaries=(0, 300, 999, 1000),
)

# Each message with the envelope the proto says it must become (built from the proto's names only).
EXAMPLES: list[tuple[Message, pb.MembershipEnvelope]] = [
    (
        JoinRequest(round=7, param_hash=H0),
        pb.MembershipEnvelope(join_request=pb.JoinRequest(round=7, param_hash=H0)),
    ),
    (
        Proposal(round=7, proposal_id="peer-a/7/2", param_hash=H1, members=("peer-a", "peer-bb")),
        pb.MembershipEnvelope(
            proposal=pb.Proposal(
                round=7, proposal_id="peer-a/7/2", param_hash=H1, members=["peer-a", "peer-bb"]
            )
        ),
    ),
    (
        Accept(
            round=MAX_COUNTER,
            proposal_id="p1",
            grpc_address="[::1]:65535",
            num_tokens=123456789,
            bandwidth_bytes_per_s=1.25e7,
        ),
        pb.MembershipEnvelope(
            accept=pb.Accept(
                round=MAX_COUNTER,
                proposal_id="p1",
                grpc_address="[::1]:65535",
                num_tokens=123456789,
                bandwidth_bytes_per_s=1.25e7,
            )
        ),
    ),
    (
        Reject(round=2, proposal_id="p2", reason=Reason.LINEAGE_MISMATCH),
        pb.MembershipEnvelope(reject=pb.Reject(round=2, proposal_id="p2", reason=pb.REASON_LINEAGE_MISMATCH)),
    ),
    (
        Withdraw(round=3, proposal_id="p3", reason=Reason.SWITCHED_LEADER),
        pb.MembershipEnvelope(
            withdraw=pb.Withdraw(round=3, proposal_id="p3", reason=pb.REASON_SWITCHED_LEADER)
        ),
    ),
    (
        Cancel(round=4, proposal_id="p4", reason=Reason.ROUND_STARTED),
        pb.MembershipEnvelope(cancel=pb.Cancel(round=4, proposal_id="p4", reason=pb.REASON_ROUND_STARTED)),
    ),
    (
        Begin(group=GROUP),
        pb.MembershipEnvelope(
            begin=pb.Begin(
                group=pb.GroupSpec(
                    round=7,
                    group_id="peer-a/7/2",
                    leader_id="peer-a",
                    param_hash=H0,
                    vector_length=1000,
                    members=[
                        pb.GroupMember(
                            peer_id="peer-a",
                            grpc_address="10.0.0.6:506",
                            num_tokens=5,
                            bandwidth_bytes_per_s=1e6,
                        ),
                        pb.GroupMember(
                            peer_id="peer-bb",
                            grpc_address="10.0.0.7:507",
                            num_tokens=0,
                            bandwidth_bytes_per_s=2.5e6,
                        ),
                        pb.GroupMember(
                            peer_id="peer-ccc",
                            grpc_address="10.0.0.8:508",
                            num_tokens=MAX_COUNTER,
                            bandwidth_bytes_per_s=0.5,
                        ),
                    ],
                    part_boundaries=[0, 300, 999, 1000],
                )
            )
        ),
    ),
    (  # a ranked Accept (rank 0 is set on the wire: unset means unranked)
        Accept(
            round=1, proposal_id="p1", grpc_address="a:1", num_tokens=0, bandwidth_bytes_per_s=0.0, rank=0
        ),
        pb.MembershipEnvelope(
            accept=pb.Accept(round=1, proposal_id="p1", grpc_address="a:1", num_tokens=0, rank=0)
        ),
    ),
]


def _with_sender(envelope: pb.MembershipEnvelope, sender_id: str = SENDER) -> pb.MembershipEnvelope:
    full = pb.MembershipEnvelope(sender_id=sender_id, protocol_version=VERSION)
    full.MergeFrom(envelope)
    return full


def _over_the_wire(envelope: pb.MembershipEnvelope) -> pb.MembershipEnvelope:
    return pb.MembershipEnvelope.FromString(envelope.SerializeToString())


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("message", "expected"), EXAMPLES, ids=lambda value: type(value).__name__)
def test_every_message_type_matches_the_proto_and_round_trips(
    message: Message, expected: pb.MembershipEnvelope
) -> None:
    envelope = to_envelope(message, sender_id=SENDER, protocol_version=VERSION)
    assert envelope == _with_sender(expected)
    sender_id, decoded = from_envelope(_over_the_wire(envelope))
    assert sender_id == SENDER
    assert decoded == message and type(decoded) is type(message)


@pytest.mark.timeout(10)
def test_the_three_notices_stay_distinct() -> None:
    """Reject, Withdraw and Cancel share their fields; the oneof case alone tells them apart."""
    notices = [
        cls(round=5, proposal_id="p", reason=Reason.NOT_AVAILABLE) for cls in (Reject, Withdraw, Cancel)
    ]
    cases = [to_envelope(n, sender_id=SENDER, protocol_version=1).WhichOneof("message") for n in notices]
    assert cases == ["reject", "withdraw", "cancel"]
    for notice in notices:
        decoded = from_envelope(to_envelope(notice, sender_id=SENDER, protocol_version=1))[1]
        assert type(decoded) is type(notice) and decoded == notice


@pytest.mark.timeout(10)
@pytest.mark.parametrize("reason", list(Reason))
def test_every_reason_has_its_own_named_wire_value(reason: Reason) -> None:
    envelope = to_envelope(
        Reject(round=1, proposal_id="p", reason=reason), sender_id=SENDER, protocol_version=1
    )
    assert pb.Reason.Name(envelope.reject.reason) == f"REASON_{reason.name}"
    assert from_envelope(envelope)[1] == Reject(round=1, proposal_id="p", reason=reason)


@pytest.mark.timeout(10)
def test_the_proto_has_no_reason_python_lacks() -> None:
    wire_names = {name for name in pb.Reason.keys() if name != "REASON_UNSPECIFIED"}
    assert wire_names == {f"REASON_{reason.name}" for reason in Reason}


# --- hypothesis: random valid messages round-trip -----------------------------------------------------

_TOKEN_CHARS = st.characters(min_codepoint=ord("!"), max_codepoint=ord("~"))
_peer_ids = st.text(_TOKEN_CHARS, min_size=1, max_size=MAX_PEER_ID_CHARS)
_ids = st.text(_TOKEN_CHARS, min_size=1, max_size=MAX_ID_CHARS)
_hashes = st.text("0123456789abcdef", min_size=64, max_size=64)
_rounds = st.integers(min_value=1, max_value=MAX_COUNTER)
_counts = st.integers(min_value=0, max_value=MAX_COUNTER)
_rates = (
    st.floats(min_value=0.0, allow_nan=False, allow_infinity=False) | st.integers(0, 10**12) | st.just(-0.0)
)
_addresses = st.builds(
    lambda host, port: f"{host}:{port}",
    st.sampled_from(["127.0.0.1", "[::1]", "node-7.example.org", "a"]),
    st.integers(min_value=1, max_value=65535),
)
_ranks = st.none() | st.integers(min_value=0, max_value=2**31 - 1)
_members = st.builds(
    GroupMember, peer_id=_peer_ids, grpc_address=_addresses, num_tokens=_counts, bandwidth_bytes_per_s=_rates,
    rank=_ranks,
)  # fmt: skip


@st.composite
def _groups(draw: st.DrawFn) -> GroupSpec:
    members = draw(st.lists(_members, min_size=1, max_size=12, unique_by=lambda member: member.peer_id))
    members.sort(key=lambda member: member.order)
    extra_streams = draw(st.integers(min_value=0, max_value=3))  # every member opens the same number
    members = [
        replace(
            member,
            stream_addresses=tuple(
                draw(st.lists(_addresses, min_size=extra_streams, max_size=extra_streams))
            ),
        )
        for member in members
    ]
    vector_length = draw(st.integers(min_value=0, max_value=MAX_COUNTER))
    inner = draw(
        st.lists(st.integers(0, vector_length), min_size=len(members) - 1, max_size=len(members) - 1)
    )
    return GroupSpec(
        round=draw(_rounds),
        group_id=draw(_ids),
        leader_id=draw(st.sampled_from(members)).peer_id,
        param_hash=draw(_hashes),
        vector_length=vector_length,
        members=tuple(members),
        part_boundaries=(0, *sorted(inner), vector_length),
    )


_notice = st.sampled_from([Reject, Withdraw, Cancel])
_messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(JoinRequest, round=_rounds, param_hash=_hashes),
    st.builds(
        Proposal,
        round=_rounds,
        proposal_id=_ids,
        param_hash=_hashes,
        members=st.lists(_peer_ids, min_size=1, max_size=12).map(tuple),
    ),
    st.builds(
        Accept,
        round=_rounds,
        proposal_id=_ids,
        grpc_address=_addresses,
        num_tokens=_counts,
        bandwidth_bytes_per_s=_rates,
        stream_addresses=st.lists(_addresses, max_size=4).map(tuple),
        rank=_ranks,
    ),
    _notice.flatmap(
        lambda cls: st.builds(cls, round=_rounds, proposal_id=_ids, reason=st.sampled_from(Reason))
    ),
    st.builds(Begin, group=_groups()),
)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(_messages, _peer_ids, st.integers(min_value=0, max_value=2**31 - 1))
def test_random_messages_round_trip_exactly(message: Message, sender_id: str, version: int) -> None:
    envelope = _over_the_wire(to_envelope(message, sender_id=sender_id, protocol_version=version))
    assert envelope.protocol_version == version
    sender, decoded = from_envelope(envelope)
    assert sender == sender_id and decoded == message and type(decoded) is type(message)
    # The float's sign too (== would let -0.0 pass for 0.0).
    if isinstance(message, Accept):
        assert isinstance(decoded, Accept)
        assert math.copysign(1, decoded.bandwidth_bytes_per_s) == math.copysign(
            1, message.bandwidth_bytes_per_s
        )


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(st.sampled_from([envelope for _, envelope in EXAMPLES]), st.data())
def test_corrupted_bytes_are_a_value_error_or_a_valid_message(
    clean: pb.MembershipEnvelope, data: st.DataObject
) -> None:
    """Flip bytes of a real envelope: gRPC's decoder or from_envelope refuses it, or it is a valid message."""
    raw = bytearray(_with_sender(clean).SerializeToString())
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        envelope = pb.MembershipEnvelope.FromString(bytes(raw))
    except DecodeError:
        return  # never reaches the servicer: gRPC fails the call itself
    try:
        sender, message = from_envelope(envelope)
    except ValueError:
        return
    again = from_envelope(_over_the_wire(to_envelope(message, sender_id=sender, protocol_version=0)))
    assert again == (sender, message)


# --- malformed envelopes ------------------------------------------------------------------------------


def _valid(index: int) -> pb.MembershipEnvelope:
    return _with_sender(EXAMPLES[index][1])


def _mutated(index: int, mutate: Callable[[pb.MembershipEnvelope], Any]) -> pb.MembershipEnvelope:
    envelope = _valid(index)
    mutate(envelope)
    return envelope


JOIN, PROPOSAL, ACCEPT, REJECT, WITHDRAW, CANCEL, BEGIN = range(7)


def _set_members(envelope: pb.MembershipEnvelope, ids: list[str]) -> None:
    group = envelope.begin.group
    template = pb.GroupMember()
    template.CopyFrom(group.members[0])
    del group.members[:]
    for peer_id in ids:
        group.members.add().CopyFrom(template)
        group.members[-1].peer_id = peer_id
    del group.part_boundaries[:]
    group.part_boundaries.extend([0] * len(ids) + [group.vector_length])


MALFORMED: list[tuple[str, pb.MembershipEnvelope, str]] = [
    ("no message", pb.MembershipEnvelope(sender_id=SENDER, protocol_version=VERSION), "no message"),
    ("no sender", _mutated(JOIN, lambda e: e.ClearField("sender_id")), "sender_id"),
    ("long sender", _mutated(JOIN, lambda e: setattr(e, "sender_id", "s" * 129)), "sender_id"),
    ("sender with space", _mutated(JOIN, lambda e: setattr(e, "sender_id", "a b")), "sender_id"),
    ("round 0", _mutated(JOIN, lambda e: setattr(e.join_request, "round", 0)), "round"),
    ("round past int64", _mutated(JOIN, lambda e: setattr(e.join_request, "round", 2**63)), "round"),
    ("short hash", _mutated(JOIN, lambda e: setattr(e.join_request, "param_hash", "abc")), "param_hash"),
    ("upper hash", _mutated(JOIN, lambda e: setattr(e.join_request, "param_hash", H0.upper())), "param_hash"),
    ("empty proposal", _mutated(PROPOSAL, lambda e: e.proposal.ClearField("members")), "members"),
    (
        "proposal of 1025",
        _mutated(PROPOSAL, lambda e: e.proposal.members.extend(f"x{i}" for i in range(1023))),
        "members",
    ),
    (
        "long proposal id",
        _mutated(PROPOSAL, lambda e: setattr(e.proposal, "proposal_id", "p" * 257)),
        "proposal_id",
    ),
    ("long member id", _mutated(PROPOSAL, lambda e: e.proposal.members.append("m" * 129)), "member id"),
    ("no port", _mutated(ACCEPT, lambda e: setattr(e.accept, "grpc_address", "10.0.0.1")), "grpc_address"),
    (
        "long address",
        _mutated(ACCEPT, lambda e: setattr(e.accept, "grpc_address", "h" * 252 + ":5000")),
        "grpc_address",
    ),
    (
        "NaN bandwidth",
        _mutated(ACCEPT, lambda e: setattr(e.accept, "bandwidth_bytes_per_s", math.nan)),
        "bandwidth",
    ),
    (
        "inf bandwidth",
        _mutated(ACCEPT, lambda e: setattr(e.accept, "bandwidth_bytes_per_s", math.inf)),
        "bandwidth",
    ),
    (
        "negative bandwidth",
        _mutated(ACCEPT, lambda e: setattr(e.accept, "bandwidth_bytes_per_s", -1.0)),
        "bandwidth",
    ),
    (
        "tokens past int64",
        _mutated(ACCEPT, lambda e: setattr(e.accept, "num_tokens", 2**64 - 1)),
        "num_tokens",
    ),
    ("unspecified reason", _mutated(REJECT, lambda e: setattr(e.reject, "reason", 0)), "unspecified"),
    ("unknown reason", _mutated(WITHDRAW, lambda e: setattr(e.withdraw, "reason", 99)), "unknown"),
    ("unspecified cancel", _mutated(CANCEL, lambda e: e.cancel.ClearField("reason")), "unspecified"),
    ("begin without group", _mutated(BEGIN, lambda e: e.begin.ClearField("group")), "no group"),
    (
        "bad group hash",
        _mutated(BEGIN, lambda e: setattr(e.begin.group, "param_hash", "z" * 64)),
        "param_hash",
    ),
    (
        "unsorted members",
        _mutated(BEGIN, lambda e: _set_members(e, ["peer-a", "peer-ccc", "peer-bb"])),
        "sorted",
    ),
    ("duplicate members", _mutated(BEGIN, lambda e: _set_members(e, ["peer-a", "peer-a"])), "sorted"),
    (
        "leader not a member",
        _mutated(BEGIN, lambda e: setattr(e.begin.group, "leader_id", "peer-z")),
        "leader",
    ),
    ("no members", _mutated(BEGIN, lambda e: _set_members(e, [])), "members"),
    (
        "group of 1025",
        _mutated(
            BEGIN, lambda e: _set_members(e, sorted(f"peer-a{i:04d}" for i in range(MAX_GROUP_SIZE + 1)))
        ),
        "members",
    ),
    (
        "long member peer id",
        _mutated(BEGIN, lambda e: setattr(e.begin.group.members[2], "peer_id", "peer-d" * 30)),
        "peer_id",
    ),
    ("long group id", _mutated(BEGIN, lambda e: setattr(e.begin.group, "group_id", "g" * 257)), "group_id"),
    (
        "member NaN bandwidth",
        _mutated(BEGIN, lambda e: setattr(e.begin.group.members[1], "bandwidth_bytes_per_s", math.nan)),
        "bandwidth",
    ),
    ("one boundary short", _mutated(BEGIN, lambda e: e.begin.group.part_boundaries.pop()), "part_boundaries"),
    (
        "boundaries not from 0",
        _mutated(BEGIN, lambda e: e.begin.group.part_boundaries.__setitem__(0, 1)),
        "part_boundaries",
    ),
    (
        "boundaries not to the end",
        _mutated(BEGIN, lambda e: e.begin.group.part_boundaries.__setitem__(3, 999)),
        "part_boundaries",
    ),
    (
        "decreasing boundaries",
        _mutated(BEGIN, lambda e: e.begin.group.part_boundaries.__setitem__(1, 1000)),
        "part_boundaries",
    ),
    (
        "boundary past the vector",
        _mutated(BEGIN, lambda e: e.begin.group.part_boundaries.__setitem__(2, 1001)),
        "part_boundaries",
    ),
    (
        "too many boundaries",
        _mutated(BEGIN, lambda e: e.begin.group.part_boundaries.extend([1000] * 5000)),
        "part_boundaries",
    ),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("envelope", "match"), [(e, m) for _, e, m in MALFORMED], ids=[n for n, _, _ in MALFORMED]
)
def test_malformed_envelopes_are_value_errors(envelope: pb.MembershipEnvelope, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_envelope(_over_the_wire(envelope))


@pytest.mark.timeout(10)
def test_the_error_names_the_message_kind() -> None:
    with pytest.raises(ValueError, match=r"^invalid begin: .*sorted"):
        from_envelope(MALFORMED[[n for n, _, _ in MALFORMED].index("unsorted members")][1])


@pytest.mark.timeout(10)
def test_to_envelope_checks_its_own_arguments() -> None:
    join = JoinRequest(round=1, param_hash=H0)
    with pytest.raises(ValueError, match="sender_id"):
        to_envelope(join, sender_id="", protocol_version=1)
    with pytest.raises(ValueError, match="protocol_version"):
        to_envelope(join, sender_id=SENDER, protocol_version=-1)
    with pytest.raises(ValueError, match="protocol_version"):
        to_envelope(join, sender_id=SENDER, protocol_version=2**31)
    with pytest.raises(TypeError, match="GroupSpec"):
        to_envelope(GROUP, sender_id=SENDER, protocol_version=1)  # type: ignore[arg-type]


def test_ranked_members_come_first_by_rank_and_a_group_in_another_order_is_refused() -> None:
    """The member order (rank, then unranked by peer id) is the all-reduce's and the shards' order;
    rank 0 is a rank (set on the wire), not "unranked" (unset)."""
    ranked = [
        replace(_member("peer-z", 1.0), rank=0),
        replace(_member("peer-a", 1.0), rank=1),
        _member("peer-b", 1.0),
    ]
    group = replace(GROUP, leader_id="peer-z", members=tuple(ranked), part_boundaries=(0, 300, 600, 1000))
    envelope = to_envelope(Begin(group=group), sender_id=SENDER, protocol_version=VERSION)
    _, decoded = from_envelope(_over_the_wire(envelope))
    assert isinstance(decoded, Begin) and decoded.group == group
    assert [member.rank for member in decoded.group.members] == [0, 1, None]
    with pytest.raises(ValueError, match="sorted by"):
        replace(group, members=tuple(sorted(ranked, key=lambda member: member.peer_id)))
