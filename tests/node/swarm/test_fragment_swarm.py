"""Streamed fragments through a real swarm (issue 32): two ``dtnode join`` nodes on loopback with
``--fragments 4``, each fragment's round its own all-reduce of its own vector, overlapped by a step.

Every node must be in every fragment round (two contributions, no fall-back, no adoption), the rounds
must go through the fragments in their order (round r: fragment r mod 4), and after every round both
nodes must hold the same whole global params (param_hash) and the same fragment (fragment_hash)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.node.swarm_cluster import Cluster, tail

NUM_ROUNDS = 8  # two of each fragment: H = 8 steps, a round every 2


@pytest.mark.timeout(400)
def test_two_nodes_with_four_fragments_average_every_fragment_round_and_agree(tmp_path: Path) -> None:
    flags = ["--inner-steps", "8", "--fragments", "4", "--overlap-steps", "1", "--max-rounds", str(NUM_ROUNDS),
             "--start-peers", "2", "--min-peers", "2", "--num-shards", "2"]  # fmt: skip
    with Cluster(tmp_path, forked=True) as cluster:
        first = cluster.start([*flags, "--shard-index", "0"])
        second = cluster.start([*flags, "--shard-index", "1"], peers=cluster.first_multiaddr(first))
        assert cluster.wait_all(360) == [0, 0], f"{tail(first)}\n{tail(second)}"
        rounds = [node.records() for node in (first, second)]
        logs = [node.log() for node in (first, second)]

    for records in rounds:
        assert [(r["round"], r["fragment"]) for r in records] == [
            (r, r % 4) for r in range(1, NUM_ROUNDS + 1)
        ]
        assert [(r["peers"], r["fell_back"], r["adopted"]) for r in records] == [
            (2, False, False)
        ] * NUM_ROUNDS
        assert all(r["bytes_sent"] > 0 for r in records)  # each round's own all-reduce went over the wire
    for key in ("param_hash", "fragment_hash"):
        assert [r[key] for r in rounds[0]] == [r[key] for r in rounds[1]], key
    # A fragment's payload is its own vector: the round line names the fragment.
    assert all(f"| fragment {r % 4} " in log for log in logs for r in range(1, NUM_ROUNDS + 1))
