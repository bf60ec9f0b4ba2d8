"""Client-mode peers in membership: records say so, parts skip them, they never lead, a round of
clients only cannot form, the flag survives the wire, and nobody syncs from them."""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import timedelta

import pytest

from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.membership.actions import RoundFailed, Send
from protocol.membership.lineage import decide_lineage
from protocol.membership.messages import Accept, Begin, GroupMember, GroupSpec, JoinRequest
from protocol.membership.parts import part_boundaries
from protocol.membership.records import PeerRecord
from protocol.membership.rounds import RoundConfig
from protocol.membership.wire import from_envelope, to_envelope
from tests.protocol.membership.fake_swarm import FakeSwarm, fake_hash, make_record

CONFIG = RoundConfig(
    min_peers=2,
    join_window=timedelta(seconds=30),
    max_wait=timedelta(seconds=180),
    proposal_timeout=timedelta(seconds=5),
    begin_timeout=timedelta(seconds=10),
)


def client_record(peer_id: str, **kwargs: object) -> PeerRecord:
    return replace(make_record(peer_id, **kwargs), client=True)  # type: ignore[arg-type]


def test_clients_own_nothing_and_the_servers_share_the_vector_as_without_them() -> None:
    bounds = part_boundaries([1.0, 7.0, 3.0, 5.0], 1000, [False, True, False, True])
    assert bounds[2] - bounds[1] == 0 and bounds[4] - bounds[3] == 0
    servers_alone = part_boundaries([1.0, 3.0], 1000)
    assert (bounds[1] - bounds[0], bounds[3] - bounds[2]) == (
        servers_alone[1],
        servers_alone[2] - servers_alone[1],
    )
    assert part_boundaries([1.0, 2.0], 10, [False, False]) == part_boundaries([1.0, 2.0], 10)
    with pytest.raises(ValueError, match="client-mode members only cannot form"):
        part_boundaries([1.0, 2.0], 10, [True, True])
    with pytest.raises(ValueError, match="client flags"):
        part_boundaries([1.0, 2.0], 10, [True])


def test_a_client_never_leads_and_is_in_the_group_with_an_empty_part() -> None:
    # "a" has the smallest id, so without client mode it would lead.
    records = [client_record("a", port=5000), make_record("b", port=5001), make_record("c", port=5002)]
    swarm = FakeSwarm(CONFIG, records, vector_length=600)
    for peer_id in "abc":
        swarm.make_ready(peer_id)
    swarm.run_until(CONFIG.max_wait.total_seconds())
    groups = swarm.groups()
    assert sorted(groups) == ["a", "b", "c"], swarm.outcomes
    group = groups["a"].group
    assert all(outcome.group == group for outcome in groups.values())
    assert group.leader_id == "b"
    assert [m.client for m in group.members] == [True, False, False]
    assert group.part("a") == (0, 0) and group.part("b") == (0, 300) and group.part("c") == (300, 600)
    # The client asked the server that leads; no one asked the client to lead.
    assert any(
        isinstance(a, Send) and a.to == "b" and isinstance(a.message, JoinRequest) for a in swarm.sent_by("a")
    )
    for peer_id in "bc":
        assert not any(isinstance(a, Send) and a.to == "a" and isinstance(a.message, JoinRequest)
                       for a in swarm.sent_by(peer_id))  # fmt: skip


def test_clients_alone_cannot_form_a_round_and_say_why(caplog: pytest.LogCaptureFixture) -> None:
    swarm = FakeSwarm(CONFIG, [client_record("a"), client_record("b")])
    with caplog.at_level(logging.WARNING, logger="protocol.membership.rounds"):
        swarm.make_ready("a")
        swarm.make_ready("b")
        swarm.run_until(CONFIG.max_wait.total_seconds() + 1)
    assert not swarm.groups()
    assert all(isinstance(outcome, RoundFailed) for outcome in swarm.outcomes.values()), swarm.outcomes
    assert sorted(swarm.outcomes) == ["a", "b"]
    assert "every peer of our lineage is in client mode" in caplog.text
    assert "without --client-mode" in caplog.text


def _member(peer_id: str, *, client: bool = False) -> GroupMember:
    return GroupMember(
        peer_id=peer_id, grpc_address="10.0.0.1:5000", num_tokens=10, bandwidth_bytes_per_s=1e6, client=client
    )


def test_the_client_flag_survives_the_wire_and_a_client_cannot_lead() -> None:
    accept = Accept(
        round=3,
        proposal_id="b/3/1",
        grpc_address="10.0.0.9:1",
        num_tokens=5,
        bandwidth_bytes_per_s=1.0,
        client=True,
    )
    members = (_member("a", client=True), _member("b"))
    group = GroupSpec(
        round=3, group_id="b/3/1", leader_id="b", param_hash=fake_hash("x"), vector_length=10,
        members=members, part_boundaries=part_boundaries([1e6, 1e6], 10, [True, False]),
    )  # fmt: skip
    for message in (accept, Begin(group=group)):
        wire = pb.MembershipEnvelope.FromString(
            to_envelope(message, sender_id="b", protocol_version=1).SerializeToString()
        )
        assert from_envelope(wire)[1] == message
    assert (
        from_envelope(to_envelope(replace(accept, client=False), sender_id="b", protocol_version=1))[1]
        != accept
    )
    assert group.has_expected_parts()
    assert not replace(group, members=(_member("a"), _member("b"))).has_expected_parts()
    with pytest.raises(ValueError, match="is a client"):
        replace(group, leader_id="a")
    with pytest.raises(ValueError, match="client-mode members only"):
        replace(group, members=(_member("a", client=True), _member("b", client=True)))


def test_records_say_a_peer_is_a_client_and_older_records_are_servers() -> None:
    server, client = make_record("s"), client_record("c")
    assert "client" not in server.to_dict()  # what peers without client mode store and read
    assert client.to_dict()["client"] is True
    assert PeerRecord.from_dict(client.to_dict()) == client
    assert PeerRecord.from_dict(server.to_dict()).client is False
    with pytest.raises(ValueError, match="client must be a bool"):
        PeerRecord.from_dict({**server.to_dict(), "client": "yes"})


def test_nobody_syncs_from_a_client() -> None:
    canonical = fake_hash("canonical")
    peers = [client_record("a", param_hash=canonical), make_record("b", param_hash=canonical),
             client_record("c", param_hash=canonical)]  # fmt: skip
    decision = decide_lineage(peers, make_record("z"))
    assert not decision.in_canonical and decision.canonical.param_hash == canonical
    assert decision.sync_sources == ("b",)
