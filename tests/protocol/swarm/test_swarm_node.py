"""SwarmNode in one process: three real nodes on loopback (DHT peers, gRPC servers, formation, all-reduce).

The three nodes are shared by the module (starting a DHT peer costs about a second); each test
publishes the records it needs and waits until every node's DHT view shows them, so the tests do
not depend on each other's order. The pure helpers and the config checks need no node.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol.discovery.dht_node import DhtConfig
from protocol.membership.config import RoundConfig
from protocol.membership.lineage import Lineage, LineageDecision
from protocol.statesync.errors import StateSyncError
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.config import SwarmConfig, routable_host
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.result import GroupAveraged, LineageResync
from protocol.swarm.server import SERVICES, _merged_options
from protocol.swarm.streams import to_allreduce_group
from tests.protocol.allreduce.support import exact_mean

pytestmark = pytest.mark.timeout(60)  # the pure tests; the node tests set their own

NUM_NODES = 3
ROUNDS = RoundConfig(
    min_peers=NUM_NODES,
    join_window=timedelta(seconds=3),
    max_wait=timedelta(seconds=20),
    proposal_timeout=timedelta(seconds=2),
    begin_timeout=timedelta(seconds=4),
)
SEE_RECORDS_WITHIN = timedelta(seconds=15)
FP32_UNIT_ROUNDOFF = 2.0**-24


def node_config(run_name: str, initial_peers: tuple[str, ...]) -> SwarmConfig:
    """Loopback, any free ports, exact averaging, short heartbeats (ttl = 3 x 0.5 s + 2 x 2 s + slack)."""
    return SwarmConfig(
        run_name=run_name,
        listen="127.0.0.1:0",
        dht=DhtConfig(listen="127.0.0.1:0", initial_peers=initial_peers),
        rounds=ROUNDS,
        codec="none",
        round_deadline=timedelta(seconds=20),
        sync_deadline=timedelta(seconds=20),
        heartbeat=timedelta(seconds=0.5),
        record_ttl=timedelta(seconds=8),
        dht_call_timeout=timedelta(seconds=2),
        view_refresh=timedelta(seconds=0.25),
    )


@contextmanager
def started_nodes(count: int, run_name: str) -> Iterator[list[SwarmNode]]:
    """``count`` nodes of one run; the others join through the 1st. Each leaves and closes at the end."""
    started: list[SwarmNode] = []
    with ExitStack() as stack:  # runs every leave / close even if one of them raises
        for _ in range(count):
            bootstrap = tuple(started[0].multiaddrs()) if started else ()
            node = SwarmNode(node_config(run_name, bootstrap))
            stack.callback(node.close)
            stack.callback(node.leave)  # LIFO: leave runs before close
            started.append(node)
        yield started


# One xdist worker takes the whole module: its tests share a running swarm (a module fixture).
pytestmark = pytest.mark.xdist_group("protocol.swarm.test_swarm_node")


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[SwarmNode]]:
    """Three nodes of one run (``started_nodes``)."""
    with started_nodes(NUM_NODES, f"swarm-test-{uuid.uuid4().hex[:12]}") as started:
        yield started


def param_hash_of(params: torch.Tensor) -> str:
    """The daemon's param_hash, computed here on its own: SHA-256 of the fp32 little-endian bytes."""
    return hashlib.sha256(params.to(torch.float32).contiguous().numpy().tobytes()).hexdigest()


def wait_for_lineages(nodes: list[SwarmNode], expected: dict[str, Lineage]) -> None:
    """Until every node's DHT view shows each peer of ``expected`` at its lineage (fail at the deadline)."""
    deadline = time.monotonic() + SEE_RECORDS_WITHIN.total_seconds()
    for node in nodes:
        while True:
            seen = {record.peer_id: Lineage.of(record) for record in node.view()}
            if all(seen.get(peer_id) == lineage for peer_id, lineage in expected.items()):
                break
            if time.monotonic() >= deadline:
                pytest.fail(f"{node.peer_id} sees {seen}, expected {expected}")
            time.sleep(0.1)


# --- one round, three nodes ---


@pytest.mark.timeout(60)
def test_three_nodes_average_to_the_exact_token_weighted_mean(nodes: list[SwarmNode]) -> None:
    param_hash = param_hash_of(torch.arange(8, dtype=torch.float32))
    for node in nodes:
        node.publish(round=0, param_hash=param_hash, tokens_per_s=1000.0, snapshot=None)
    wait_for_lineages(nodes, {node.peer_id: Lineage(0, param_hash) for node in nodes})

    num_elements = 10_007  # odd, so the parts differ in size
    generator = torch.Generator().manual_seed(7)
    vectors = [torch.randn(num_elements, generator=generator) * scale for scale in (1.0, 3.0, 0.01)]
    num_tokens = [1000, 3000, 7]
    rounds_formed_before = [node.rounds_formed for node in nodes]

    def run(index: int) -> RoundResult:
        return nodes[index].run_round(
            vectors[index],
            round=0,
            param_hash=param_hash,
            num_tokens=num_tokens[index],
            tokens_per_s=1000.0,
            error_feedback=None,
        )

    with ThreadPoolExecutor(max_workers=NUM_NODES) as pool:
        results = list(pool.map(run, range(NUM_NODES), timeout=50))

    allreduces = []
    for result in results:
        assert isinstance(result, GroupAveraged), result
        assert result.round == 1
        assert result.group == results[0].group  # one group, agreed by all
        assert result.allreduce is not None and not result.allreduce.fell_back, result.allreduce
        allreduces.append(result.allreduce)
    assert [node.rounds_formed for node in nodes] == [count + 1 for count in rounds_formed_before]
    group = results[0].group
    assert group is not None
    assert group.round == 1 and group.param_hash == param_hash and group.vector_length == num_elements
    tokens_by_peer = {node.peer_id: tokens for node, tokens in zip(nodes, num_tokens, strict=True)}
    assert group.member_ids == tuple(sorted(tokens_by_peer))  # the all-reduce order: by peer id
    assert {m.peer_id: m.num_tokens for m in group.members} == tokens_by_peer  # weights = tokens

    averaged = allreduces[0].averaged
    contributors = allreduces[0].contributors
    assert contributors == [list(group.member_ids)] * NUM_NODES  # every part holds every member
    for allreduce in allreduces:
        assert torch.equal(allreduce.averaged, averaged)  # bit-identical on every member
        assert allreduce.contributors == contributors

    # Exactly what the reducer promises with codec "none": per part, sum(w_i x_i) in fp32 in
    # member order, divided by the fp32 sum of weights (the all-reduce tests' reference).
    index_of = {node.peer_id: index for index, node in enumerate(nodes)}
    member_vectors = [vectors[index_of[peer_id]] for peer_id in group.member_ids]
    member_weights = [float(num_tokens[index_of[peer_id]]) for peer_id in group.member_ids]
    reference = exact_mean(member_vectors, member_weights, to_allreduce_group(group), contributors)
    assert torch.equal(averaged, reference)

    # And independently of that order: the float64 token-weighted mean, within fp32 rounding
    # (a multiply, two adds and a divide: at most 4 roundings of the magnitudes involved; 5 for slack).
    weights64 = torch.tensor(num_tokens, dtype=torch.float64)
    stacked64 = torch.stack(vectors).to(torch.float64)  # (3, E)
    exact64 = (weights64[:, None] * stacked64).sum(dim=0) / weights64.sum()
    magnitude = (weights64[:, None] * stacked64.abs()).sum(dim=0) / weights64.sum()
    error = (averaged.to(torch.float64) - exact64).abs()
    assert torch.all(error <= 5 * FP32_UNIT_ROUNDOFF * magnitude), float((error / magnitude).max())


# --- lineage and state sync ---


@pytest.mark.timeout(60)
def test_minority_lineage_resyncs_from_the_majority_and_fetches_its_snapshot(nodes: list[SwarmNode]) -> None:
    majority, minority = nodes[:2], nodes[2]
    generator = torch.Generator().manual_seed(11)
    global_params = torch.randn(5_003, generator=generator)
    outer_momentum = torch.randn(5_003, generator=generator)
    majority_hash = param_hash_of(global_params)
    minority_hash = param_hash_of(global_params + 1)
    metadata = json.dumps({"round": 5, "step": 250}).encode()
    for node in majority:  # each serves its own copy of the same state, as real nodes do
        snapshot = Snapshot(
            round_id=5,
            state_id=majority_hash,
            tensors={"global_params": global_params, "outer_momentum": outer_momentum},
            metadata=metadata,
        )
        node.publish(round=5, param_hash=majority_hash, tokens_per_s=500.0, snapshot=snapshot)
    minority.publish(round=3, param_hash=minority_hash, tokens_per_s=500.0, snapshot=None)
    wait_for_lineages(
        nodes,
        {
            majority[0].peer_id: Lineage(5, majority_hash),
            majority[1].peer_id: Lineage(5, majority_hash),
            minority.peer_id: Lineage(3, minority_hash),
        },
    )

    for node in majority:
        assert node.lineage(round=5, param_hash=majority_hash).in_canonical
    decision = minority.lineage(round=3, param_hash=minority_hash)
    assert not decision.in_canonical
    assert decision.canonical == Lineage(5, majority_hash) and decision.num_canonical_peers == 2
    assert sorted(decision.sync_sources) == sorted(node.peer_id for node in majority)

    report = minority.fetch_state(decision)
    fetched = report.snapshot
    assert fetched.round_id == 5 and fetched.state_id == majority_hash
    assert fetched.sha256("global_params").hex() == majority_hash
    assert torch.equal(fetched.tensors["global_params"], global_params)
    assert torch.equal(fetched.tensors["outer_momentum"], outer_momentum)
    assert fetched.metadata == metadata
    assert set(report.bytes_by_source) <= {node.grpc_address for node in majority}
    assert sum(report.bytes_by_source.values()) == fetched.num_bytes

    # A state id no source serves is not fetched: sources are held to the hash asked for.
    wrong = LineageDecision(
        canonical=Lineage(5, minority_hash),
        num_canonical_peers=2,
        local=decision.local,
        in_canonical=False,
        sync_sources=decision.sync_sources,
    )
    with pytest.raises(StateSyncError):
        minority.fetch_state(wrong)

    # A round on the minority lineage stops at once with the same advice.
    result = minority.run_round(
        torch.zeros(16),
        round=3,
        param_hash=minority_hash,
        num_tokens=10,
        tokens_per_s=500.0,
        error_feedback=None,
    )
    assert isinstance(result, LineageResync) and result.round == 4
    assert result.decision.canonical == Lineage(5, majority_hash)
    assert sorted(result.decision.sync_sources) == sorted(decision.sync_sources)


# --- one server, every service ---


@pytest.mark.timeout(30)
def test_health_service_reports_every_service_serving(nodes: list[SwarmNode]) -> None:
    assert len(SERVICES) == 3 and all(SERVICES)
    for node in nodes:
        with grpc.insecure_channel(node.grpc_address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", *SERVICES):
                response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert response.status == health_pb2.HealthCheckResponse.SERVING, service
            with pytest.raises(grpc.RpcError) as error:
                stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
            assert error.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.timeout(30)
def test_nodes_advertise_their_loopback_grpc_address(nodes: list[SwarmNode]) -> None:
    addresses = [node.grpc_address for node in nodes]
    assert len(set(addresses)) == NUM_NODES
    for node in nodes:
        host, _, port = node.grpc_address.rpartition(":")
        assert host == "127.0.0.1" and int(port) == node.server.port > 0
        assert all(address.endswith(f"/p2p/{node.peer_id}") for address in node.multiaddrs())


# --- config and pure helpers (no sockets) ---


@pytest.mark.parametrize("listen", ["127.0.0.1", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:65536", ""])
def test_config_rejects_a_bad_listen_address(listen: str) -> None:
    with pytest.raises(ValueError, match="listen"):
        SwarmConfig(run_name="r", listen=listen)


def test_config_rejects_an_unknown_codec() -> None:
    with pytest.raises(ValueError, match="unknown codec"):
        SwarmConfig(run_name="r", codec="gzip")


def test_config_needs_a_ttl_that_outlives_three_missed_heartbeats() -> None:
    def config(record_ttl: timedelta) -> SwarmConfig:
        return SwarmConfig(
            run_name="r",
            heartbeat=timedelta(seconds=2),
            dht_call_timeout=timedelta(seconds=5),
            record_ttl=record_ttl,
        )

    with pytest.raises(ValueError, match="record_ttl"):
        config(timedelta(seconds=15.9))  # < 3 x 2 s + 2 x 5 s
    assert config(timedelta(seconds=16)).record_ttl == timedelta(seconds=16)  # the bound itself is fine


def test_config_rejects_other_user_mistakes() -> None:
    with pytest.raises(ValueError, match="run_name"):
        SwarmConfig(run_name="two words")
    with pytest.raises(ValueError, match="heartbeat"):
        SwarmConfig(run_name="r", heartbeat=timedelta(0))
    with pytest.raises(ValueError, match="bandwidth"):
        SwarmConfig(run_name="r", bandwidth_bytes_per_s=0.0)


def test_config_splits_the_listen_address() -> None:
    wildcard = SwarmConfig(run_name="r", listen=":7000")
    assert (wildcard.listen_host, wildcard.listen_port) == ("0.0.0.0", 7000)
    ipv6 = SwarmConfig(run_name="r", listen="[::1]:0")
    assert (ipv6.listen_host, ipv6.listen_port) == ("[::1]", 0)


@pytest.mark.parametrize(
    ("multiaddrs", "expected"),
    [
        ([], None),
        (["/ip4/127.0.0.1/tcp/4001/p2p/QmA"], None),
        (["/ip4/0.0.0.0/tcp/4001/p2p/QmA", "/ip6/::1/tcp/4001/p2p/QmA"], None),
        (["/ip4/127.0.0.1/tcp/4001/p2p/QmA", "/ip4/10.1.2.3/tcp/4001/p2p/QmA"], "10.1.2.3"),
        (
            ["/ip6/fe80::1/tcp/1/p2p/QmA", "/ip4/192.168.0.9/tcp/1/p2p/QmA", "/ip4/10.0.0.1/tcp/1"],
            "192.168.0.9",
        ),
        (["/dns4/example.org/tcp/4001/p2p/QmA", "/ip4/127.8.8.8/udp/1/quic"], None),
    ],
)
def test_routable_host_is_the_first_non_loopback_ipv4(multiaddrs: list[str], expected: str | None) -> None:
    assert routable_host(multiaddrs) == expected


def test_merged_options_take_the_largest_message_limit_and_the_first_other_value() -> None:
    merged = _merged_options(
        [("grpc.max_send_message_length", 10), ("grpc.keepalive_time_ms", 100)],
        [("grpc.max_receive_message_length", 7), ("grpc.max_send_message_length", 30)],
        [("grpc.keepalive_time_ms", 5), ("grpc.max_receive_message_length", 3), ("grpc.so_reuseport", 0)],
    )
    assert merged == [
        ("grpc.max_send_message_length", 30),
        ("grpc.keepalive_time_ms", 100),
        ("grpc.max_receive_message_length", 7),
        ("grpc.so_reuseport", 0),
    ]
    assert _merged_options() == []


def test_server_options_fit_both_services_messages() -> None:
    config = SwarmConfig(run_name="r")
    allreduce = dict(config.allreduce.grpc_options(server=True))
    statesync = dict(config.statesync.server_options())
    merged = dict(
        _merged_options(config.allreduce.grpc_options(server=True), config.statesync.server_options())
    )
    for key in ("grpc.max_send_message_length", "grpc.max_receive_message_length"):
        assert merged[key] == max(allreduce[key], statesync[key])


# --- a round number used again ---


@pytest.mark.timeout(120)
def test_a_round_formed_again_after_going_back_to_an_older_state_takes_every_contribution() -> None:
    """Two nodes average round 1, go back to the state before it (as a node that adopts an older
    lineage does) and form round 1 again: every member's contribution to the new round is taken, none
    fell back. Each node forgets its old rounds before it can be locked into a group; rewound only once
    locked, a member refused the leader's first pushes to the round it had "already" opened ("round 1
    expired or was skipped"), the leader left them out, and the member, as that part's owner, waited
    for them until the reduce-scatter deadline (half the round deadline: 150 s by default), recording
    no round meanwhile (issue 31's chaos run)."""
    run_name = f"again-{uuid.uuid4().hex[:12]}"
    rounds = dataclasses.replace(ROUNDS, min_peers=2, join_window=timedelta(seconds=1))
    with ExitStack() as stack:
        nodes: list[SwarmNode] = []
        for _ in range(2):
            peers = tuple(nodes[0].multiaddrs()) if nodes else ()
            node = SwarmNode(dataclasses.replace(node_config(run_name, peers), rounds=rounds))
            stack.callback(node.close)
            stack.callback(node.leave)
            nodes.append(node)
        param_hash = param_hash_of(torch.zeros(4))

        def run(node: SwarmNode) -> RoundResult:
            return node.run_round(
                torch.ones(10_007), round=0, param_hash=param_hash, num_tokens=10, tokens_per_s=1.0,
                error_feedback=None,
            )  # fmt: skip

        # Round 1, then round 1 again 5 times (from the state before it): the refusal was a race between
        # the leader's first push and the member's rewind, lost about every other time.
        for attempt in range(6):
            for node in nodes:
                node.publish(round=0, param_hash=param_hash, tokens_per_s=1.0, snapshot=None)
            wait_for_lineages(nodes, {node.peer_id: Lineage(0, param_hash) for node in nodes})
            started = time.monotonic()
            with ThreadPoolExecutor(max_workers=2) as pool:
                results = list(pool.map(run, nodes, timeout=90))
            for result in results:
                assert isinstance(result, GroupAveraged) and result.round == 1, (attempt, result)
                assert not result.allreduce.fell_back and not result.allreduce.failures, (attempt, result)
                contributors = [set(part) for part in result.allreduce.contributors]
                assert contributors == [{n.peer_id for n in nodes}] * 2, (attempt, contributors)
            assert time.monotonic() - started < 10, attempt  # not the reduce-scatter deadline (10 s here)
