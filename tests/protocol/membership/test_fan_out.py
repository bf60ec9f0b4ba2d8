"""fan_out.py's sizes are bounds of the real protobuf encoding (``wire.to_envelope``), tight enough
that the waits they stretch stay near the real sending time, and its deadlines add up by hand."""

from __future__ import annotations

import hashlib

import pytest

from protocol.membership.fan_out import (
    begin_bytes_estimate,
    fan_out_seconds,
    formation_fan_out_seconds,
    message_bytes,
    send_timeout,
    wire_sizes,
)
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
)
from protocol.membership.parts import part_boundaries
from protocol.membership.wire import to_envelope

PARAM_HASH = hashlib.sha256(b"params").hexdigest()


def peer_id(index: int) -> str:
    """As long as a libp2p Ed25519 peer id (52 characters)."""
    return "12D3KooW" + hashlib.sha256(str(index).encode()).hexdigest()[:44]


def member(index: int, *, streams: int = 1) -> GroupMember:
    host = f"10.0.{index // 256}.{index % 256}"
    return GroupMember(
        peer_id=peer_id(index),
        grpc_address=f"{host}:31337",
        num_tokens=2**40 + index,
        bandwidth_bytes_per_s=1.25e6 + index,
        stream_addresses=tuple(f"{host}:{31338 + s}" for s in range(streams - 1)),
        rank=None if index % 2 else index,
    )


def group(num_members: int, *, streams: int = 1) -> GroupSpec:
    members = sorted((member(i, streams=streams) for i in range(num_members)), key=lambda m: m.order)
    vector_length = 100_000_000
    return GroupSpec(
        round=12345,
        group_id=f"{members[0].peer_id}/12345/3",
        leader_id=members[0].peer_id,
        param_hash=PARAM_HASH,
        vector_length=vector_length,
        members=tuple(members),
        part_boundaries=part_boundaries(
            [m.bandwidth_bytes_per_s for m in members], vector_length, [False] * len(members)
        ),
    )


def encoded(message: Message) -> int:
    return to_envelope(message, sender_id=peer_id(0), protocol_version=7).ByteSize()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("num_members", [1, 2, 100, 1000])
@pytest.mark.parametrize("streams", [1, 4])
def test_the_sizes_bound_the_protobuf_encoding(num_members: int, streams: int) -> None:
    spec = group(num_members, streams=streams)
    proposal = Proposal(
        round=12345, proposal_id=spec.group_id, param_hash=PARAM_HASH, members=spec.member_ids
    )
    for message in (Begin(group=spec), proposal):
        true = encoded(message)
        assert true <= message_bytes(message) <= 1.4 * true + 600, type(message).__name__
    # A member that knows only its own entry bounds the Begin when the others' are like it.
    like = member(num_members + 1, streams=streams)
    assert encoded(Begin(group=spec)) <= begin_bytes_estimate(spec.member_ids, like)
    accept = Accept(
        round=12345,
        proposal_id=spec.group_id,
        grpc_address="10.0.0.1:31337",
        num_tokens=2**40,
        bandwidth_bytes_per_s=1.25e6,
        stream_addresses=tuple(f"10.0.0.1:{31338 + s}" for s in range(streams - 1)),
        rank=3,
    )
    small = (accept, JoinRequest(round=12345, param_hash=PARAM_HASH))
    for message in (*small, Cancel(round=12345, proposal_id=spec.group_id, reason=Reason.ROUND_STARTED)):
        assert encoded(message) <= message_bytes(message)


def test_a_fan_out_of_one_begin_is_sized_once_per_group() -> None:
    spec = group(50)
    begins = [Begin(group=spec) for _ in range(3)]  # three Begins, one group object
    other = Begin(group=group(2))
    sizes = wire_sizes([*begins, other])
    assert sizes == [message_bytes(begins[0])] * 3 + [message_bytes(other)]


def test_deadlines_by_hand() -> None:
    # 10 Mbit/s = 1.25e6 bytes/s: 2.5 MB queued take 2 s on top of the 3 s message timeout.
    assert send_timeout(3.0, 2_500_000, 1.25e6) == pytest.approx(5.0)
    assert send_timeout(3.0, 2_500_000, 0.0) == 3.0  # an uplink nobody announced adds nothing
    assert fan_out_seconds(1000, 999, 1e6) == pytest.approx(0.999)
    assert fan_out_seconds(1000, 0, 1e6) == 0.0


@pytest.mark.timeout(60)
def test_a_thousand_member_formation_takes_what_its_bytes_take() -> None:
    """The leader's proposals and Begins to 999 others, from the true encodings: ~145 MB, ~116 s at
    10 Mbit/s (BENCHMARKS.md measured 145 MB for 964-1000 members)."""
    spec = group(1000)
    proposal = Proposal(
        round=12345, proposal_id=spec.group_id, param_hash=PARAM_HASH, members=spec.member_ids
    )
    true_bytes = 999 * (encoded(proposal) + encoded(Begin(group=spec)))
    assert 140e6 < true_bytes < 150e6
    estimate = formation_fan_out_seconds(spec.member_ids, member(1001), 1.25e6)
    assert true_bytes / 1.25e6 <= estimate <= 1.3 * true_bytes / 1.25e6
