"""All-reduce streams (``--swarm-streams``): the vector cut into equal shards, one all-reduce per shard.

Pure parts: shard bounds, the per-stream group, the group and wire rules, a leader leaving out a peer
that opens another number of streams. Live: three SwarmNodes on loopback, each serving streams 1 and 2
on servers of their own, average to the exact token-weighted mean (codec none), and with int8 to what
the same codec gives without streams, within its error.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

from protocol.allreduce.allreduce import AllReduceResult
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.tiers import stage_round_ids
from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.membership.actions import Send
from protocol.membership.lineage import Lineage
from protocol.membership.messages import Accept, Cancel, GroupMember, GroupSpec, Proposal, Reason
from protocol.membership.parts import part_boundaries
from protocol.membership.wire import from_envelope, to_envelope
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.result import GroupAveraged
from protocol.swarm.streams import StreamJob, StreamServer, combine, stream_bounds, stream_group
from tests.protocol.allreduce.support import exact_mean
from tests.protocol.membership.test_rounds import _machine, _proposal, sends
from tests.protocol.swarm.test_swarm_node import NUM_NODES, node_config, param_hash_of, wait_for_lineages

pytestmark = pytest.mark.timeout(60)

STREAMS = 3


def _member(peer_id: str, bandwidth: float, streams: int) -> GroupMember:
    return GroupMember(
        peer_id=peer_id,
        grpc_address=f"10.0.0.{ord(peer_id[0]) - 96}:5000",
        num_tokens=10,
        bandwidth_bytes_per_s=bandwidth,
        stream_addresses=tuple(f"10.0.0.{ord(peer_id[0]) - 96}:{5000 + s}" for s in range(1, streams)),
    )


def _group(members: Sequence[GroupMember], vector_length: int) -> GroupSpec:
    return GroupSpec(
        round=4,
        group_id="a/4/1",
        leader_id=members[0].peer_id,
        param_hash="0" * 64,
        vector_length=vector_length,
        members=tuple(members),
        part_boundaries=part_boundaries([m.bandwidth_bytes_per_s for m in members], vector_length),
    )


def test_stream_bounds_split_the_vector_into_equal_contiguous_shards() -> None:
    assert stream_bounds(10, 1) == (0, 10)
    assert stream_bounds(10, 3) == (0, 4, 7, 10)  # sizes differ by at most one, the larger first
    assert stream_bounds(2, 3) == (0, 1, 2, 2)
    with pytest.raises(ValueError, match="num_streams"):
        stream_bounds(10, 0)


def test_each_stream_runs_the_same_members_on_their_stream_servers_with_parts_of_its_shard() -> None:
    group = _group([_member("a", 1e6, 3), _member("b", 3e6, 3)], vector_length=1001)
    assert group.num_streams == 3
    shard_sizes = [b - a for a, b in zip(stream_bounds(1001, 3), stream_bounds(1001, 3)[1:], strict=False)]
    for stream in range(3):
        spec = stream_group(group, stream)
        assert spec.round_id == stage_round_ids(group.round)[0]  # (a tiered round uses the next id too)
        assert [m.peer_id for m in spec.members] == ["a", "b"]
        port = 5000 + stream
        assert [m.address for m in spec.members] == [f"10.0.0.1:{port}", f"10.0.0.2:{port}"]
        assert spec.part_bounds == part_boundaries([1e6, 3e6], shard_sizes[stream])  # b, 3x faster, owns 3/4
        assert spec.num_elements == shard_sizes[stream]
    with pytest.raises(ValueError, match="stream must be"):
        stream_group(group, 3)


def test_a_group_whose_members_open_different_numbers_of_streams_is_refused() -> None:
    with pytest.raises(ValueError, match="same number of all-reduce streams"):
        _group([_member("a", 1e6, 2), _member("b", 1e6, 1)], vector_length=100)
    with pytest.raises(ValueError, match="stream_addresses"):
        replace(_member("a", 1e6, 1), stream_addresses=("no-port",))
    with pytest.raises(ValueError, match="at most 63"):
        replace(_member("a", 1e6, 1), stream_addresses=tuple(f"h:{p}" for p in range(1, 65)))


def test_stream_addresses_cross_the_wire_and_oversized_lists_are_refused() -> None:
    accept = Accept(
        round=2,
        proposal_id="a/2/1",
        grpc_address="10.0.0.2:5000",
        num_tokens=5,
        bandwidth_bytes_per_s=1e6,
        stream_addresses=("10.0.0.2:5001", "10.0.0.2:5002"),
    )
    envelope = to_envelope(accept, sender_id="b", protocol_version=1)
    assert list(envelope.accept.stream_addresses) == ["10.0.0.2:5001", "10.0.0.2:5002"]
    assert from_envelope(pb.MembershipEnvelope.FromString(envelope.SerializeToString())) == ("b", accept)
    envelope.accept.stream_addresses.extend(f"10.0.0.2:{p}" for p in range(6000, 6070))
    with pytest.raises(ValueError, match="stream_addresses has 72 entries"):
        from_envelope(envelope)


def test_a_leader_cancels_an_accept_that_opens_another_number_of_streams() -> None:
    machine, actions = _machine("a", "ab")  # a leads and invites b at once
    assert [to for to, _ in sends(actions, Proposal)] == ["b"]
    proposal_id = _proposal("a", "ab").proposal_id
    accept = Accept(
        round=1,
        proposal_id=proposal_id,
        grpc_address="10.0.0.2:5000",
        num_tokens=10,
        bandwidth_bytes_per_s=1e6,
        stream_addresses=("10.0.0.2:5001",),  # b opens 2 streams, a (the machine) 1
    )
    assert machine.on_message("b", accept, 0.1) == [
        Send("b", Cancel(round=1, proposal_id=proposal_id, reason=Reason.STREAMS_MISMATCH))
    ]
    assert "b" not in (machine._open.accepts if machine._open else {})
    assert machine.group is None


def _result(values: list[float], *, fell_back: bool = False) -> AllReduceResult:
    return AllReduceResult(
        averaged=torch.tensor(values),
        contributors=[["a", "b"]],
        producers=["a"],
        fell_back=fell_back,
        failures=["lost c"] if fell_back else [],
        bytes_sent=10,
        bytes_recv=20,
        bytes_sent_by_phase={"reduce_scatter": 10},
        bytes_recv_by_phase={"all_gather": 20},
        seconds=1.5,
    )


def test_combine_concatenates_the_streams_and_one_fallback_makes_the_round_fall_back() -> None:
    vector = torch.tensor([9.0, 9.0, 9.0])
    bounds = (0, 2, 3)
    both = combine(vector, bounds, [_result([1.0, 2.0]), _result([3.0])])
    assert torch.equal(both.averaged, torch.tensor([1.0, 2.0, 3.0])) and not both.fell_back
    assert both.contributors == [["a", "b"], ["a", "b"]] and both.bytes_sent == 20
    assert both.bytes_recv_by_phase == {"all_gather": 40}
    fell = combine(vector, bounds, [_result([1.0, 2.0]), _result([3.0], fell_back=True)])
    assert fell.fell_back and torch.equal(fell.averaged, vector) and fell.failures == ["stream 1: lost c"]
    with pytest.raises(ValueError, match="cover"):
        combine(vector, bounds, [_result([1.0])])


# --- live: three nodes, three streams each ---


class _Servers:
    """A StreamRunner over StreamServers of this process (as a node without local workers has)."""

    def __init__(self, count: int) -> None:
        self.servers = [
            StreamServer(listen_host="127.0.0.1", announce_host=None, config=AllReduceConfig(), auth=None)
            for _ in range(count)
        ]
        self.threads = ThreadPoolExecutor(max_workers=count)
        self.resets = 0
        self.jobs_run = 0

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(server.address for server in self.servers)

    def run(self, jobs: Sequence[StreamJob], shards: Sequence[torch.Tensor]) -> list[AllReduceResult]:
        assert [job.stream for job in jobs] == list(range(1, len(self.servers) + 1))
        self.jobs_run += len(jobs)
        futures = [
            self.threads.submit(self.servers[job.stream - 1].allreduce, job, shard)
            for job, shard in zip(jobs, shards, strict=True)
        ]
        return [future.result() for future in futures]

    def reset_error_feedback(self) -> None:
        self.resets += 1

    def close(self) -> None:
        for server in self.servers:
            server.close()
        self.threads.shutdown()


# One xdist worker takes the whole module: its tests share a running swarm (a module fixture).
pytestmark = pytest.mark.xdist_group("protocol.swarm.test_streams")


@pytest.fixture(scope="module")
def streamed_nodes() -> Iterator[list[SwarmNode]]:
    run_name = f"streams-test-{uuid.uuid4().hex[:12]}"
    started: list[SwarmNode] = []
    with ExitStack() as stack:
        for _ in range(NUM_NODES):
            bootstrap = tuple(started[0].multiaddrs()) if started else ()
            node = SwarmNode(replace(node_config(run_name, bootstrap), codec="none"))
            stack.callback(node.close)
            stack.callback(node.leave)
            servers = _Servers(STREAMS - 1)
            stack.callback(servers.close)
            node.attach_streams(servers)
            started.append(node)
        yield started


def _round(
    nodes: list[SwarmNode], vectors: list[torch.Tensor], tokens: list[int], round: int
) -> list[RoundResult]:
    param_hash = param_hash_of(torch.full((4,), float(round)))
    for node in nodes:
        node.publish(round=round, param_hash=param_hash, tokens_per_s=1000.0, snapshot=None)
    wait_for_lineages(nodes, {node.peer_id: Lineage(round, param_hash) for node in nodes})
    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        futures = [
            pool.submit(
                node.run_round,
                vectors[i],
                round=round,
                param_hash=param_hash,
                num_tokens=tokens[i],
                tokens_per_s=1000.0,
                error_feedback=None,
            )
            for i, node in enumerate(nodes)
        ]
        return [future.result(timeout=50) for future in futures]


def test_three_nodes_on_three_streams_average_to_the_exact_token_weighted_mean(
    streamed_nodes: list[SwarmNode],
) -> None:
    num_elements = 30_011  # shards and parts of uneven sizes
    generator = torch.Generator().manual_seed(11)
    vectors = [torch.randn(num_elements, generator=generator) * scale for scale in (1.0, 5.0, 0.1)]
    tokens = [1000, 3000, 17]
    results = _round(streamed_nodes, vectors, tokens, round=0)
    group = results[0].group
    assert group is not None and group.num_streams == STREAMS
    # The reference, stream by stream: the exact token-weighted mean, summed in member order in fp32.
    order = [[n.peer_id for n in streamed_nodes].index(m.peer_id) for m in group.members]
    bounds = stream_bounds(num_elements, STREAMS)
    expected = torch.cat(
        [
            exact_mean(
                [vectors[i][bounds[s] : bounds[s + 1]] for i in order],
                [float(tokens[i]) for i in order],
                stream_group(group, s),
                [list(group.member_ids)] * len(group.members),
            )
            for s in range(STREAMS)
        ]
    )
    for result in results:
        assert isinstance(result, GroupAveraged) and result.group == group, result
        outcome = result.allreduce
        assert outcome is not None and not outcome.fell_back, outcome.failures
        assert len(outcome.contributors) == STREAMS * NUM_NODES  # every part of every stream
        assert all(sorted(part) == sorted(group.member_ids) for part in outcome.contributors)
        assert torch.equal(outcome.averaged, expected)
    weighted = sum(v.double() * t for v, t in zip(vectors, tokens, strict=True)) / sum(tokens)
    torch.testing.assert_close(expected.double(), weighted, rtol=1e-5, atol=1e-6)  # the reference is the mean
    # Every member holds the bit-identical average.
    assert all(torch.equal(r.allreduce.averaged, results[0].allreduce.averaged) for r in results)  # type: ignore[union-attr]
    # Streams 1 and 2 ran on each node's own stream servers.
    assert [node.streams.jobs_run for node in streamed_nodes] == [STREAMS - 1] * NUM_NODES  # type: ignore[union-attr]


def test_streams_keep_serving_the_next_round(streamed_nodes: list[SwarmNode]) -> None:
    vectors = [torch.full((9_000,), float(i + 1)) for i in range(NUM_NODES)]
    results = _round(streamed_nodes, vectors, [1, 1, 2], round=1)  # round ids increase on every server
    for result in results:
        assert isinstance(result, GroupAveraged)
        torch.testing.assert_close(
            result.allreduce.averaged, torch.full((9_000,), 9.0 / 4.0)
        )  # (1 + 2 + 2 x 3) / 4


@pytest.mark.timeout(30)
def test_a_stream_server_advertises_the_announced_host() -> None:
    server = StreamServer(
        listen_host="127.0.0.1", announce_host="10.1.2.3", config=AllReduceConfig(), auth=None
    )
    try:
        host, _, port = server.address.rpartition(":")
        assert host == "10.1.2.3" and int(port) > 0
    finally:
        server.close()


@pytest.mark.timeout(60)
def test_a_member_whose_stream_server_is_gone_falls_back_and_the_others_finish_identical(
    streamed_nodes: list[SwarmNode],
) -> None:
    """Runs last: it closes the third node's server of stream 2 for good."""
    broken = streamed_nodes[2]
    broken.streams.servers[1].close()  # type: ignore[union-attr]  # stream 2 of the third node
    vectors = [torch.full((12_000,), float(i + 1)) for i in range(NUM_NODES)]
    started = time.monotonic()
    results = _round(streamed_nodes, vectors, [1, 1, 1], round=2)
    assert time.monotonic() - started < 20 + 5, "the round must end by its deadline"
    ours = results[2].allreduce
    assert ours is not None and ours.fell_back and torch.equal(ours.averaged, vectors[2])
    assert any("stream 2" in failure for failure in ours.failures), ours.failures
    survivors = [r.allreduce for r in results[:2]]
    assert all(s is not None and not s.fell_back for s in survivors), [s.failures for s in survivors if s]
    assert torch.equal(survivors[0].averaged, survivors[1].averaged)  # type: ignore[union-attr]
    # Streams 0 and 1 average all three (2.0); stream 2 the two survivors ((1 + 2) / 2 = 1.5).
    bounds = stream_bounds(12_000, STREAMS)
    averaged = survivors[0].averaged  # type: ignore[union-attr]
    assert torch.equal(averaged[: bounds[2]], torch.full((bounds[2],), 2.0))
    assert torch.equal(averaged[bounds[2] :], torch.full((12_000 - bounds[2],), 1.5))
    stream_2_parts = survivors[0].contributors[2 * NUM_NODES :]  # type: ignore[union-attr]
    assert all(broken.peer_id not in part for part in stream_2_parts), stream_2_parts
