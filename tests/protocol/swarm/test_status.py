"""The Status service: the pure status builder (hand-computed ages), the wire round trip, the servicer
on a real grpc.aio server (port 0) with the blocking client's deadline, and one real SwarmNode's phases.
"""

from __future__ import annotations

import asyncio
import gc
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol.discovery.dht_node import DhtConfig
from protocol.membership.config import RoundConfig
from protocol.membership.messages import GroupMember, GroupSpec
from protocol.membership.records import PeerRecord, SwarmView
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig
from protocol.swarm.node import SwarmNode
from protocol.swarm.result import GroupAveraged
from protocol.swarm.server import OPERATOR_SERVICES
from protocol.swarm.status import (
    GroupStatus,
    LostPeer,
    NodePhase,
    NodeStatus,
    PhaseState,
    StatusServicer,
    StatusUnavailable,
    add_status_to_server,
    build_status,
    from_proto,
    get_status,
    to_proto,
)

pytestmark = pytest.mark.timeout(30)

TTL = timedelta(seconds=20)
NOW = 1_000_000.0  # DHT clock
HASH_A, HASH_B = "a" * 64, "b" * 64


def record(
    peer_id: str, *, round: int, param_hash: str, expires_at: float, ready: bool = False
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        grpc_address=f"10.0.0.{len(peer_id)}:7000",
        protocol_version=PROTOCOL_VERSION,
        round=round,
        param_hash=param_hash,
        ready_for_round=round + 1 if ready else None,
        tokens_per_s=1500.0,
        bandwidth_bytes_per_s=12.5e6,
        status="active",
        expires_at=expires_at,
    )


def group_of(member_ids: list[str], round: int) -> GroupSpec:
    return GroupSpec(
        round=round,
        group_id=f"{member_ids[0]}/{round}/1",
        leader_id=member_ids[0],
        param_hash=HASH_A,
        vector_length=10,
        members=tuple(
            GroupMember(peer_id=m, grpc_address="10.0.0.1:7000", num_tokens=5, bandwidth_bytes_per_s=1e6)
            for m in member_ids
        ),
        part_boundaries=(0, *[10 * (i + 1) // len(member_ids) for i in range(len(member_ids))]),
    )


def sample_status() -> NodeStatus:
    """A status with every field set, including the optional ones."""
    me = record("me", round=3, param_hash=HASH_A, expires_at=NOW + 15.0)
    other = record("other", round=3, param_hash=HASH_A, expires_at=NOW + 12.5, ready=True)
    joiners = [  # fetching round 3's state: one said when it will hold it, one cannot tell yet
        replace(
            record(peer, round=3, param_hash=HASH_A, expires_at=NOW + 9), status="syncing", ready_at=ready
        )
        for peer, ready in (("new", NOW + 4.0), ("newer", None))
    ]
    view = SwarmView.build([me, other, record("far", round=2, param_hash=HASH_B, expires_at=NOW + 1), *joiners],
                           now=NOW - 2.0, protocol_version=PROTOCOL_VERSION)  # fmt: skip
    return build_status(
        run_name="demo",
        protocol_version=PROTOCOL_VERSION,
        peer_id="me",
        grpc_address="10.0.0.2:7000",
        local=me,
        phase=PhaseState(NodePhase.ALLREDUCE, 4, since=100.0),
        group=group_of(["me", "other"], round=4),
        rounds_formed=3,
        view=view,
        last_seen={"gone": NOW - 30.0, "me": NOW - 2.0, "other": NOW - 2.0},
        record_ttl=TTL,
        now=NOW,
        monotonic_now=107.5,
        round_vector="fragment 2",  # the round averages one fragment of the model (--fragments)
    )


# --- the pure builder ---


def test_build_status_computes_ages_from_expirations_by_hand() -> None:
    status = sample_status()
    assert (status.peer_id, status.round, status.param_hash, status.published) == ("me", 3, HASH_A, True)
    assert (status.phase, status.phase_round, status.seconds_in_phase) == (NodePhase.ALLREDUCE, 4, 7.5)
    assert status.view_age_seconds == 2.0 and status.record_ttl_seconds == 20.0
    assert status.group == GroupStatus(round=4, group_id="me/4/1", leader_id="me", member_ids=("me", "other"))
    by_id = {peer.peer_id: peer for peer in status.peers}
    assert list(by_id) == ["far", "me", "other"]  # the view's order: sorted by peer id
    # Stored at expires_at - ttl: "other" at NOW - 7.5, "me" at NOW - 5, "far" at NOW - 19.
    assert by_id["other"].seconds_since_heartbeat == 7.5 and by_id["other"].seconds_until_expiry == 12.5
    assert by_id["me"].seconds_since_heartbeat == 5.0 and by_id["far"].seconds_since_heartbeat == 19.0
    assert by_id["other"].ready_for_round == 4 and by_id["me"].ready_for_round is None
    assert [p for p in by_id if by_id[p].in_group] == ["me", "other"]
    assert [p for p in by_id if by_id[p].is_self] == ["me"]
    assert (by_id["far"].round, by_id["far"].param_hash) == (2, HASH_B)
    assert status.lost_peers == (LostPeer(peer_id="gone", seconds_since_seen=30.0),)
    assert [(p.peer_id, p.round, p.param_hash, p.seconds_until_ready) for p in status.syncing_peers] == [
        ("new", 3, HASH_A, 4.0),
        ("newer", 3, HASH_A, None),
    ]


def test_build_status_before_publishing_and_while_training() -> None:
    empty = SwarmView(now=NOW, peers=())
    common = dict(run_name="demo", protocol_version=1, peer_id="me", grpc_address="h:1", group=None,
                  rounds_formed=0, view=empty, last_seen={}, record_ttl=TTL, now=NOW, monotonic_now=5.0)  # fmt: skip
    starting = build_status(local=None, phase=PhaseState(NodePhase.STARTING, 0, 1.0), **common)  # type: ignore[arg-type]
    assert (starting.published, starting.round, starting.param_hash, starting.phase_round) == (
        False,
        0,
        "",
        0,
    )
    assert starting.group is None and starting.peers == ()
    local = record("me", round=7, param_hash=HASH_B, expires_at=NOW + 20)
    training = build_status(local=local, phase=PhaseState(NodePhase.TRAINING, 0, 1.0), **common)  # type: ignore[arg-type]
    assert (training.phase, training.phase_round, training.round) == (NodePhase.TRAINING, 8, 7)
    # A joiner's record names the state it fetches, not params it holds: nothing published yet.
    joining = replace(local, status="syncing", ready_at=NOW + 3)
    syncing = build_status(local=joining, phase=PhaseState(NodePhase.SYNCING, 7, 1.0), **common)  # type: ignore[arg-type]
    assert (syncing.published, syncing.round, syncing.param_hash, syncing.phase_round) == (False, 0, "", 7)
    # The part of the state a round carries is said while the round forms or averages, not after.
    for phase, said in (
        (NodePhase.FORMING, "fragment 1"),
        (NodePhase.ALLREDUCE, "fragment 1"),
        (NodePhase.TRAINING, ""),
    ):
        status = build_status(
            local=local, phase=PhaseState(phase, 8, 1.0), round_vector="fragment 1", **common
        )  # type: ignore[arg-type]
        assert status.round_vector == said, phase


def test_proto_round_trip_keeps_every_field() -> None:
    status = sample_status()
    wire = to_proto(status).SerializeToString()
    from protocol.gen.dtnode.v1 import status_pb2 as pb

    assert from_proto(pb.NodeStatus.FromString(wire)) == status
    assert status.syncing_peers and status.peers and status.lost_peers and status.group  # all on the wire
    no_group = NodeStatus(
        **{**status.__dict__, "group": None, "peers": (), "lost_peers": (), "syncing_peers": ()}
    )
    assert from_proto(to_proto(no_group)) == no_group
    unknown_phase = to_proto(status)
    unknown_phase.phase = 99
    with pytest.raises(ValueError, match="unknown phase"):
        from_proto(unknown_phase)


# --- the servicer on a real server ---


@asynccontextmanager
async def serving(snapshot: Callable[[], NodeStatus]) -> AsyncIterator[str]:
    server = grpc.aio.server()
    add_status_to_server(server, StatusServicer(snapshot))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0.1)
        # An aborted call leaves the server in a reference cycle; freed by a later collection in a
        # process forked meanwhile (hivemind's DHT), it would join gRPC's poller thread, which the
        # child does not have, and hang that child. Collect it now, while the thread exists.
        gc.collect()


def test_servicer_answers_the_blocking_client() -> None:
    status = sample_status()

    async def scenario() -> NodeStatus:
        async with serving(lambda: status) as address:
            # The blocking client runs in a thread: the server's loop must stay free to answer.
            return await asyncio.to_thread(get_status, address, timeout=timedelta(seconds=5))

    assert asyncio.run(scenario()) == status


def test_a_failing_snapshot_is_answered_internal() -> None:
    def broken() -> NodeStatus:
        raise RuntimeError("bug")

    async def scenario() -> tuple[grpc.StatusCode, str]:
        async with serving(broken) as address:
            try:
                await asyncio.to_thread(get_status, address, timeout=timedelta(seconds=5))
            except StatusUnavailable as error:
                return error.code, error.details
        raise AssertionError("the call succeeded")

    code, details = asyncio.run(scenario())
    assert code == grpc.StatusCode.INTERNAL and "bug" not in details  # the details stay in the server's log


def test_client_deadline_on_a_silent_or_absent_node() -> None:
    with socket.socket() as listener:  # accepts TCP (the kernel does) but never speaks HTTP/2
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        started = time.monotonic()
        with pytest.raises(StatusUnavailable) as silent:
            get_status(f"127.0.0.1:{listener.getsockname()[1]}", timeout=timedelta(seconds=1))
        elapsed = time.monotonic() - started
    assert silent.value.code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    assert 0.5 < elapsed < 4.0, elapsed
    with socket.socket() as probe:  # a port that was free a moment ago: connection refused
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(StatusUnavailable) as absent:
        get_status(f"127.0.0.1:{port}", timeout=timedelta(seconds=3))
    assert absent.value.code == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - started < 3.5


# --- one real node ---


@pytest.mark.timeout(60)
def test_swarm_node_serves_its_phase_and_view() -> None:
    config = SwarmConfig(
        run_name=f"status-test-{uuid.uuid4().hex[:12]}",
        listen="127.0.0.1:0",
        dht=DhtConfig(listen="127.0.0.1:0"),
        heartbeat=timedelta(seconds=0.5),
        record_ttl=timedelta(seconds=8),
        dht_call_timeout=timedelta(seconds=2),
        view_refresh=timedelta(seconds=0.25),
        rounds=RoundConfig(
            min_peers=1,
            join_window=timedelta(seconds=1),
            max_wait=timedelta(seconds=10),
            proposal_timeout=timedelta(seconds=1),
            begin_timeout=timedelta(seconds=2),
        ),
        codec="none",
    )
    node = SwarmNode(config)
    try:
        status = get_status(node.grpc_address, timeout=timedelta(seconds=5))
        assert (status.peer_id, status.grpc_address, status.run_name) == (
            node.peer_id,
            node.grpc_address,
            config.run_name,
        )
        assert (status.phase, status.published) == (NodePhase.STARTING, False)
        node.publish(round=5, param_hash=HASH_B, tokens_per_s=123.0, snapshot=None)
        deadline = time.monotonic() + 20
        while True:  # the view is the node's last read: refresh it until it holds our own record
            node.view()
            status = get_status(node.grpc_address, timeout=timedelta(seconds=5))
            if status.peers or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert (status.phase, status.phase_round, status.round, status.param_hash) == (
            NodePhase.TRAINING,
            6,
            5,
            HASH_B,
        )
        assert [(p.peer_id, p.round, p.param_hash, p.is_self) for p in status.peers] == [
            (node.peer_id, 5, HASH_B, True)
        ]
        assert status.peers[0].bandwidth_bytes_per_s == config.bandwidth_bytes_per_s
        assert 0.0 <= status.peers[0].seconds_since_heartbeat <= 8.0
        syncing = node.set_phase(NodePhase.SYNCING, round=9)
        status = get_status(node.grpc_address, timeout=timedelta(seconds=5))
        assert (status.phase, status.phase_round) == (syncing.phase, 9)

        # A solo round (min_peers 1). The phase inside the formation and inside the all-reduce is
        # read there, on the loop, by wrapping both; afterwards the node trains with a group of one.
        seen: list[tuple[NodePhase, int, str]] = []
        form, allreduce = node.driver.form, node.server.allreduce.allreduce

        async def observed_form(*args: Any, **kwargs: Any) -> Any:
            seen.append((node.status().phase, node.status().phase_round, node.status().round_vector))
            return await form(*args, **kwargs)

        async def observed_allreduce(*args: Any, **kwargs: Any) -> Any:
            seen.append((node.status().phase, node.status().phase_round, node.status().round_vector))
            return await allreduce(*args, **kwargs)

        node.driver.form = observed_form  # type: ignore[method-assign]
        node.server.allreduce.allreduce = observed_allreduce  # type: ignore[method-assign]
        result = node.run_round(
            torch.ones(10), round=5, param_hash=HASH_B, num_tokens=10, tokens_per_s=1.0, error_feedback=None,
            vector_name="fragment 3",
        )  # fmt: skip
        assert isinstance(result, GroupAveraged), result
        assert seen == [(NodePhase.FORMING, 6, "fragment 3"), (NodePhase.ALLREDUCE, 6, "fragment 3")]
        status = get_status(node.grpc_address, timeout=timedelta(seconds=5))
        assert (status.phase, status.phase_round, status.rounds_formed) == (NodePhase.TRAINING, 6, 1)
        assert status.round_vector == ""  # the round landed: nothing in flight
        assert status.group is not None and (status.group.round, status.group.member_ids) == (
            6,
            (node.peer_id,),
        )
        assert [p.in_group for p in status.peers] == [True]
        with grpc.insecure_channel(node.grpc_address) as channel:
            for service in OPERATOR_SERVICES:
                health = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=5
                )
                assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        node.leave()
        node.close()
