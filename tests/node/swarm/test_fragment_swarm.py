"""Streamed fragments through a real swarm (issue 32): two ``dtnode join`` nodes on loopback with
``--fragments 4``, each fragment's round its own all-reduce of its own vector, overlapped by a step.

Every node must be in every fragment round (two contributions, no fall-back, no adoption), the rounds
must go through the fragments in their order (round r: fragment r mod 4), and after every round both
nodes must hold the same whole global params (param_hash) and the same fragment (fragment_hash)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.node.swarm_cluster import Cluster, kill_one_and_run_on, tail, wait_for

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


@pytest.mark.timeout(400)
def test_a_joiner_fetches_the_whole_state_mid_run_and_is_in_every_fragment_round_after(
    tmp_path: Path,
) -> None:
    flags = ["--inner-steps", "8", "--fragments", "4", "--overlap-steps", "1", "--max-rounds", "100000"]
    with Cluster(tmp_path, forked=True) as cluster:
        source = cluster.start(flags)
        wait_for(lambda: len(source.records()) >= 3, 200, "the first node's rounds alone", source)
        joiner = cluster.start(flags, peers=cluster.first_multiaddr(source))
        wait_for(lambda: len(joiner.records()) >= 6, 300, "the joiner's first six rounds", joiner)
        for node in (source, joiner):
            node.signal(signal.SIGTERM)
        assert cluster.wait_all(60) == [0, 0], f"{tail(source)}\n{tail(joiner)}"
        joined, log = joiner.records(), joiner.log()
        by_round = {record["round"]: record for record in source.records()}

    assert joined[0]["round"] > 3  # it joined mid-run, holding the swarm's state: every fragment's version
    # Fetched whole (far behind: more rounds than means are stepped through), then perhaps stepped on
    # with the fragment means of rounds that ended while it fetched (node/swarm/join.py's prefetch).
    assert "adopting the swarm's state" in log
    for record in joined[1:6]:  # from its second round on: in every fragment round, on the swarm's params
        assert (record["peers"], record["fell_back"], record["adopted"]) == (2, False, False), record
        assert record["fragment"] == record["round"] % 4
        theirs = by_round[record["round"]]
        assert (record["param_hash"], record["fragment_hash"]) == (
            theirs["param_hash"],
            theirs["fragment_hash"],
        )


@pytest.mark.timeout(400)
def test_survivors_of_a_member_killed_mid_run_go_on_through_the_fragment_rounds_together(
    tmp_path: Path,
) -> None:
    # SIGKILL lands wherever the victim is: on loopback a fragment's all-reduce lasts a fraction of a
    # second, so mostly in a phase or the round in flight (a death inside an all-reduce is the
    # protocol's tests' job: a fragment's vector is a vector). What must hold wherever it lands: the
    # survivors form the next fragment rounds without it and average every one of them together.
    flags = ["--inner-steps", "8", "--fragments", "4", "--overlap-steps", "1", "--max-rounds", "100000",
             "--start-peers", "3"]  # fmt: skip
    with Cluster(tmp_path, forked=True) as cluster:
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        nodes = [first, cluster.start(flags, peers=peers), cluster.start(flags, peers=peers)]
        kill_one_and_run_on(nodes, rounds_before=3, rounds_after=6)
        survivors = nodes[:2]
        rounds = [node.records() for node in survivors]

    # The last four rounds both survivors recorded before their own last one (a SIGTERM may end one
    # node's final round before the other's forms): one of each fragment, well after the kill.
    common = sorted(set.intersection(*({r["round"] for r in records[:-1]} for records in rounds)))[-4:]
    last = [[r for r in records if r["round"] in common] for records in rounds]
    assert common == list(range(common[0], common[0] + 4)) and common[0] > 3, common
    for records in last:
        assert [(r["peers"], r["fell_back"], r["adopted"]) for r in records] == [(2, False, False)] * 4, (
            records
        )
        assert [r["fragment"] for r in records] == [r % 4 for r in common]
    for key in ("param_hash", "fragment_hash"):
        assert [r[key] for r in last[0]] == [r[key] for r in last[1]], key
