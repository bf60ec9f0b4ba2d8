"""Bounded groups in the swarm simulator: a tiered group's cost from the product's ``TierPlan``, and a
simulated swarm whose leaders ask for tiers (``--tier-group-size``) keeping every node to its group
and its column."""

from __future__ import annotations

import pytest

from protocol.allreduce.sparse import is_sparse
from protocol.codecs import get_codec
from protocol.membership.messages import GroupMember, GroupSpec
from protocol.membership.parts import part_boundaries
from scripts.sim.allreduce_cost import part_payload_bytes, round_cost
from scripts.sim.links import LinkProfile, Network
from scripts.sim.settings import SimSettings
from scripts.sim.swarm import simulate

CHUNK = 1 << 18


def _group(num_members: int, tier_group_size: int, vector_length: int) -> tuple[GroupSpec, Network]:
    network = Network(protocol_version=1)
    members = []
    for i in range(num_members):
        peer_id = f"p{i:03d}"
        network.add(peer_id, LinkProfile(latency_s=0.0, up_bytes_per_s=1e7, down_bytes_per_s=1e7))
        members.append(GroupMember(peer_id=peer_id, grpc_address=f"10.0.{i // 200}.{i % 200}:1", num_tokens=1,
                                   bandwidth_bytes_per_s=1e7))  # fmt: skip
    group = GroupSpec(
        round=1, group_id="g", leader_id="p000", param_hash="0" * 64, vector_length=vector_length,
        members=tuple(members), part_boundaries=part_boundaries([1e7] * num_members, vector_length, [False] * num_members),
        tier_group_size=tier_group_size,
    )  # fmt: skip
    return group, network


@pytest.mark.parametrize("codec_name", ["int8", "topk"])
def test_a_tiered_group_of_16_in_fours_costs_its_stages(codec_name: str) -> None:
    codec = get_codec(codec_name)
    vector_length = 16 * 4 * 4096
    group, network = _group(16, 4, vector_length)
    flat_group, _ = _group(16, 0, vector_length)
    tiered, flat = round_cost(group, codec, CHUNK, network), round_cost(flat_group, codec, CHUNK, network)
    assert flat.peers == [15] * 16 and tiered.peers == [6] * 16  # 2(G - 1)
    v = part_payload_bytes(codec, vector_length, CHUNK)  # every part here is whole blocks: exact sums
    quarter = part_payload_bytes(codec, vector_length // 4, CHUNK)
    served = (
        quarter if not is_sparse(codec) else part_payload_bytes(get_codec("int8"), vector_length // 4, CHUNK)
    )
    sparse = is_sparse(codec)
    for t in tiered.traffic:
        # stage A: a flat round of 4 over V; stage B: one of 4 over V/4; stage C: 3 slices pulled
        group_recv = 3 * v // 4 + (4 if sparse else 1) * 3 * v // 4
        column_recv = 3 * quarter // 4 + (4 if sparse else 1) * 3 * quarter // 4
        assert t.received == group_recv + column_recv + 3 * served
        assert t.sent == group_recv + column_recv + 3 * served  # equal parts: what goes out comes in
    if not sparse:
        assert tiered.traffic[0].received / flat.traffic[0].received == pytest.approx(2.625 / 1.875, rel=1e-3)
    assert tiered.seconds > flat.seconds  # three stages one after the other, more bytes


@pytest.mark.timeout(120)
def test_a_simulated_swarm_in_tiers_keeps_every_node_to_its_group_and_column() -> None:
    settings = SimSettings(
        num_nodes=60, num_rounds=2, seed=4, num_params=2_000_000, speed_max=1.0, link_mbit_min=100.0,
        link_mbit_max=100.0, tier_group_size=8,
    )  # fmt: skip
    result = simulate(settings)
    assert result["totals"]["participation"] == 1.0
    assert result["end"]["lineages"] == 1
    for figures in result["rounds"]:
        assert figures["group_sizes"] == [60]
        assert figures["max_peers_per_node"] <= 2 * (8 - 1)  # 8 groups of 7-8: its group and its column
    flat = simulate(SimSettings(**{**settings.__dict__, "tier_group_size": 0}))
    assert [r["max_peers_per_node"] for r in flat["rounds"]] == [59, 59]
