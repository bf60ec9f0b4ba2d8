"""A client-mode SwarmNode (accepts no connections) in rounds with two ordinary nodes, on loopback.

The client advertises an address nothing listens on, so any peer that tried to dial it (to deliver
a Proposal or Begin, hand it a replica, ask it to back up a part, fetch state from it) would fail;
the round must still form with it in the group, and every member must get the same exact mean.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest
import torch

from protocol.discovery.dht_node import DhtConfig
from protocol.membership.lineage import Lineage
from protocol.membership.messages import GroupMember, GroupSpec
from protocol.membership.parts import part_boundaries
from protocol.swarm.config import SwarmConfig
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.result import GroupAveraged
from protocol.swarm.streams import stream_group, to_allreduce_group
from tests.protocol.allreduce.support import exact_mean
from tests.protocol.swarm.test_swarm_node import node_config, param_hash_of, wait_for_lineages

NOWHERE = "127.0.0.1:9"  # the discard port: a dial is refused


def client_config(run_name: str, peers: tuple[str, ...]) -> SwarmConfig:
    config = node_config(run_name, peers)
    dht = DhtConfig(listen="127.0.0.1:0", initial_peers=peers, client_mode=True)
    return dataclasses.replace(config, dht=dht, client_mode=True)


@pytest.mark.timeout(120)
def test_a_client_node_is_in_every_round_and_nobody_dials_it() -> None:
    run_name = f"client-test-{uuid.uuid4().hex[:12]}"
    with ExitStack() as stack:
        nodes: list[SwarmNode] = []
        for index in range(3):
            peers = tuple(nodes[0].multiaddrs()) if nodes else ()
            # The client has the smallest peer id or not, by chance; it must never lead either way.
            config = client_config(run_name, peers) if index == 2 else node_config(run_name, peers)
            node = SwarmNode(config)
            stack.callback(node.close)
            stack.callback(node.leave)
            nodes.append(node)
        client = nodes[2]
        client.grpc_address = NOWHERE  # anyone who dials it fails (its record and Accepts say so)

        generator = torch.Generator().manual_seed(3)
        num_elements = 20_011
        param_hash = param_hash_of(torch.zeros(4))
        for round_index in range(2):
            for node in nodes:
                node.publish(round=round_index, param_hash=param_hash, tokens_per_s=1000.0, snapshot=None)
            wait_for_lineages(nodes, {node.peer_id: Lineage(round_index, param_hash) for node in nodes})
            seen = {record.peer_id: record.client for record in nodes[0].view()}
            assert seen == {nodes[0].peer_id: False, nodes[1].peer_id: False, client.peer_id: True}
            vectors = [torch.randn(num_elements, generator=generator) for _ in nodes]
            num_tokens = [100, 200, 300]

            def run(index: int) -> RoundResult:
                return nodes[index].run_round(
                    vectors[index], round=round_index, param_hash=param_hash,  # noqa: B023
                    num_tokens=num_tokens[index], tokens_per_s=1000.0, error_feedback=None,  # noqa: B023
                )  # fmt: skip

            started = time.monotonic()
            with ThreadPoolExecutor(max_workers=3) as pool:
                results = list(pool.map(run, range(3), timeout=100))
            for result in results:
                assert isinstance(result, GroupAveraged), result
                assert result.group == results[0].group
                assert result.allreduce is not None and not result.allreduce.fell_back, result.allreduce
                assert result.allreduce.failures == [], result.allreduce.failures
            group = results[0].group
            assert group is not None
            assert group.leader_id != client.peer_id
            entry = group.members[group.index_of(client.peer_id)]
            assert entry.client and entry.grpc_address == NOWHERE
            assert group.part(client.peer_id)[0] == group.part(client.peer_id)[1]  # owns nothing
            averaged = results[0].allreduce.averaged  # type: ignore[union-attr]
            contributors = results[0].allreduce.contributors  # type: ignore[union-attr]
            for result in results:
                assert torch.equal(result.allreduce.averaged, averaged)  # type: ignore[union-attr]
            assert all(client.peer_id in part for part in contributors if part)
            index_of = {node.peer_id: i for i, node in enumerate(nodes)}
            reference = exact_mean(
                [vectors[index_of[p]] for p in group.member_ids],
                [float(num_tokens[index_of[p]]) for p in group.member_ids],
                to_allreduce_group(group),
                contributors,
            )
            assert torch.equal(averaged, reference)
            assert time.monotonic() - started < 30  # messages reached the client by its own polls
            param_hash = param_hash_of(averaged)


def test_every_stream_of_a_round_gives_a_client_an_empty_part_and_marks_it() -> None:
    members = tuple(
        GroupMember(
            peer_id=peer_id, grpc_address=f"10.0.0.{i}:7000", num_tokens=10, bandwidth_bytes_per_s=1e6,
            stream_addresses=(f"10.0.0.{i}:7100",), client=peer_id == "a",
        )
        for i, peer_id in enumerate("abc")
    )  # fmt: skip
    group = GroupSpec(
        round=2, group_id="b/2/1", leader_id="b", param_hash="0" * 64, vector_length=1001, members=members,
        part_boundaries=part_boundaries([1e6] * 3, 1001, [True, False, False]),
    )  # fmt: skip
    for stream in (0, 1):
        shard = stream_group(group, stream)
        assert [m.client for m in shard.members] == [True, False, False]
        assert shard.part_num_elements(0) == 0 and shard.chain(1) == (1, 2)
    assert to_allreduce_group(group).members[0].client
