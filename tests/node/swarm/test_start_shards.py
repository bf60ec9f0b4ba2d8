"""Disjoint data from the first inner step for nodes joined by hand (issue 31, item 2).

Two real ``dtnode join`` processes on loopback, the second given ``--peers``, both ``--start-peers 2``
and no shard flags (``dtnode swarm`` passes ``--shard-index i --num-shards N``; a user starting nodes
one by one does not). Both start from the same seeded init, so their first step's losses are equal
exactly when they read the same batch: before the start barrier assigned shards, both read shard
(0, 1) in round 1 and every step loss of round 1 matched.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from tests.node.swarm_cluster import Cluster, tail

INNER_STEPS = 3
START_LINE = re.compile(r"reading data shard (\d+) of (\d+) from the first step")


@pytest.mark.timeout(240)
def test_two_nodes_joined_by_hand_read_disjoint_data_from_the_first_step(tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text(inspect.getsource(inspect) * 2)  # 0.2 MB: quick to load
    flags = ["--data", str(corpus), "--inner-steps", str(INNER_STEPS), "--max-rounds", "1",
             "--start-peers", "2", "--min-peers", "2"]  # fmt: skip
    with Cluster(tmp_path, forked=True) as cluster:
        first = cluster.start(flags)
        second = cluster.start(flags, peers=cluster.first_multiaddr(first))
        assert cluster.wait_all(200) == [0, 0], f"{tail(first)}\n{tail(second)}"
        steps = [[record["loss"] for record in node.records("step")] for node in (first, second)]
        rounds = [node.records() for node in (first, second)]
        said = [START_LINE.findall(node.log()) for node in (first, second)]

    assert [len(losses) for losses in steps] == [INNER_STEPS, INNER_STEPS]
    # Same init, other batches: every step of round 1 differs, the first included.
    for step, (a, b) in enumerate(zip(*steps, strict=True), start=1):
        assert a != b, f"step {step}: both nodes' loss is {a}: they read the same batch"
    # Each says which shard it reads: shards 0 and 1 of 2 from one position read disjoint windows (the
    # data layer's contract, tests/protocol/membership/test_shards.py).
    assert [len(found) for found in said] == [1, 1], said
    assert sorted((int(found[0][0]), int(found[0][1])) for found in said) == [(0, 2), (1, 2)]
    # Both took part in the one round, averaged together, and agree on its result.
    for records in rounds:
        assert [(r["round"], r["peers"], r["fell_back"], r["adopted"]) for r in records] == [
            (1, 2, False, False)
        ]
    assert rounds[0][0]["param_hash"] == rounds[1][0]["param_hash"]
