"""Bounded groups through a real swarm (issue 33, item 2): four ``dtnode join`` nodes on loopback with
``--tier-group-size 2``, so every round's all-reduce runs tiered (two groups of two, each column of
the groups over one slice, the other slice pulled); then one node is killed and the three survivors
go on, still tiered (groups of two and one).

Every node must be in every round, and after every round all of them must hold the same global params
(param_hash), before the kill and after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.node.swarm_cluster import Cluster, kill_one_and_run_on


@pytest.mark.timeout(400)
def test_four_nodes_in_tiers_of_two_agree_every_round_and_survive_a_killed_member(tmp_path: Path) -> None:
    flags = ["--inner-steps", "4", "--tier-group-size", "2", "--max-rounds", "100000", "--start-peers", "4"]
    with Cluster(tmp_path, forked=True) as cluster:
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        nodes = [first, *(cluster.start(flags, peers=peers) for _ in range(3))]
        kill_one_and_run_on(nodes, rounds_before=3, rounds_after=4)
        survivors = nodes[:3]
        rounds = [node.records() for node in survivors]
        logs = [node.log() for node in survivors]

    assert all("tiered all-reduce, 2 groups of <= 2, 2 slices" in log for log in logs)  # four members
    assert all("tiered all-reduce, 2 groups of <= 2, 1 slices" in log for log in logs)  # three
    by_round = [{r["round"]: r for r in records} for records in rounds]
    # Rounds 1-2: all four in every round, one param_hash.
    for round_index in (1, 2):
        records = [rounds_of[round_index] for rounds_of in by_round]
        assert [(r["peers"], r["fell_back"]) for r in records] == [(4, False)] * 3, records
        assert len({r["param_hash"] for r in records}) == 1
    # The last three rounds every survivor recorded before its own last one (a SIGTERM may end one
    # node's final round before the others'), well after the kill: the three of them, one param_hash.
    common = sorted(set.intersection(*({r["round"] for r in records[:-1]} for records in rounds)))[-3:]
    assert len(common) == 3 and common[0] > at_kill_round(by_round), common
    for round_index in common:
        records = [rounds_of[round_index] for rounds_of in by_round]
        assert [(r["peers"], r["fell_back"], r["adopted"]) for r in records] == [(3, False, False)] * 3, (
            records
        )
        assert len({r["param_hash"] for r in records}) == 1, records


def at_kill_round(by_round: list[dict[int, dict[str, object]]]) -> int:
    """The last round any survivor averaged with four members (the kill came after it)."""
    return max(r for rounds_of in by_round for r, record in rounds_of.items() if record["peers"] == 4)
