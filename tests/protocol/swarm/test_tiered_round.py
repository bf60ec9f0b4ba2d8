"""A round of real swarm nodes whose leader asks for a tiered all-reduce (bounded groups).

Five nodes on loopback (DHT, membership, all-reduce servers), ``tier_group_size`` 2: the leader's
Begin carries it, every member runs the tiered round (3 groups of at most 2, 1 slice), and
all of them step to the same bits: the token-weighted mean (fp32 codec, so within fp32 rounding of
torch's exact mean). The wire carries the field both ways; a bad one is refused.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace

import pytest
import torch

from protocol.membership.lineage import Lineage
from protocol.membership.messages import Begin, GroupMember, GroupSpec
from protocol.membership.parts import part_boundaries
from protocol.membership.wire import from_envelope, to_envelope
from protocol.swarm.node import SwarmNode
from protocol.swarm.result import GroupAveraged
from tests.protocol.swarm.test_swarm_node import ROUNDS, node_config, param_hash_of, wait_for_lineages

NUM = 5
TIER = 2


def _group(tier_group_size: int) -> GroupSpec:
    members = tuple(
        GroupMember(
            peer_id=f"p{i}", grpc_address=f"10.0.0.{i}:5000", num_tokens=10, bandwidth_bytes_per_s=1e6
        )
        for i in range(3)
    )
    return GroupSpec(
        round=3, group_id="p0/3/1", leader_id="p0", param_hash="0" * 64, vector_length=100, members=members,
        part_boundaries=part_boundaries([1e6] * 3, 100, [False] * 3), tier_group_size=tier_group_size,
    )  # fmt: skip


def test_the_tier_group_size_crosses_the_wire_and_a_size_of_one_is_refused() -> None:
    group = _group(2)
    assert group.tiered and not _group(0).tiered and not _group(3).tiered
    sender, back = from_envelope(to_envelope(Begin(group=group), sender_id="p0", protocol_version=2))
    assert (
        sender == "p0" and isinstance(back, Begin) and back.group == group and back.group.tier_group_size == 2
    )
    with pytest.raises(ValueError, match="tier_group_size"):
        _group(1)


@pytest.mark.timeout(120)
def test_five_nodes_in_tiers_of_two_step_to_the_same_token_weighted_mean() -> None:
    run_name = f"tiered-test-{uuid.uuid4().hex[:12]}"
    rounds = replace(ROUNDS, min_peers=NUM, tier_group_size=TIER)
    generator = torch.Generator().manual_seed(5)
    num_elements = 10_007
    vectors = [torch.randn(num_elements, generator=generator) for _ in range(NUM)]
    tokens = [100, 300, 50, 70, 11]
    with ExitStack() as stack:
        nodes: list[SwarmNode] = []
        for _ in range(NUM):
            bootstrap = tuple(nodes[0].multiaddrs()) if nodes else ()
            node = SwarmNode(replace(node_config(run_name, bootstrap), rounds=rounds))
            stack.callback(node.close)
            stack.callback(node.leave)
            nodes.append(node)
        param_hash = param_hash_of(torch.zeros(4))
        for node in nodes:
            node.publish(round=0, param_hash=param_hash, tokens_per_s=1000.0, snapshot=None)
        wait_for_lineages(nodes, {node.peer_id: Lineage(0, param_hash) for node in nodes})
        with ThreadPoolExecutor(max_workers=NUM) as pool:
            futures = [
                pool.submit(
                    node.run_round,
                    vectors[i],
                    round=0,
                    param_hash=param_hash,
                    num_tokens=tokens[i],
                    tokens_per_s=1000.0,
                    error_feedback=None,
                )  # fmt: skip
                for i, node in enumerate(nodes)
            ]
            results = [future.result(timeout=90) for future in futures]
    for result in results:
        assert isinstance(result, GroupAveraged), result
        assert result.group.tier_group_size == TIER and result.group.tiered
        assert not result.allreduce.fell_back, result.allreduce.failures
        assert set(result.allreduce.bytes_recv_by_phase) == {"group", "column", "gather"}
    first = results[0]
    assert isinstance(first, GroupAveraged)
    for result in results[1:]:
        assert isinstance(result, GroupAveraged)
        assert torch.equal(result.allreduce.averaged, first.allreduce.averaged)
    total = sum(v.double() * t for v, t in zip(vectors, tokens, strict=True))
    assert isinstance(total, torch.Tensor)
    exact = (total / sum(tokens)).float()
    torch.testing.assert_close(first.allreduce.averaged, exact, rtol=1e-5, atol=1e-6)
