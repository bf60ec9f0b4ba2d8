"""Every live node trains in every round: a late node whose catch-up outlasts the swarm's round, and
a slower node with rounds due by time (``--round-seconds``). Real ``dtnode join`` processes on
loopback (``swarm_cluster.py``).

What fails without the design: a node that adopts the swarm's state while the swarm's rounds are
shorter than its catch-up is always one round behind (the leader forms without it, it catches up,
the leader forms without it again); with a fixed H per node, a slower node makes the others idle at
every round (or is left out).
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.node.swarm_cluster import Cluster, Node, tail, wait_for
from tests.scripts.script_loader import load_script

wan_emulator = load_script("wan_emulator")
_reason = wan_emulator.unavailable_reason()


def _steps_per_round(records: list[dict]) -> list[int]:
    steps = [record["step"] for record in records]
    return [later - earlier for earlier, later in zip([0, *steps[:-1]], steps, strict=True)]


@pytest.mark.timeout(300)
@pytest.mark.skipif(_reason is not None, reason=_reason or "")
def test_a_late_node_whose_catch_up_outlasts_a_round_contributes_from_its_second_round_on(
    tmp_path: Path,
) -> None:
    # 20 Mbit/s uplinks: the swarm's state (params + momentum, 7.4 MB) takes ~3 s to fetch and a
    # round's int8 mean ~0.4 s, while the first node's rounds of two inner steps alone last a
    # fraction of a second (~0.15 s; under a loaded CPU still well under a second). Without the
    # leader waiting for the announced catch-up, the late node arrives a round late at every round,
    # forever. (The leader trains on while it waits: a slower link only makes it burn more CPU.)
    with (
        wan_emulator.WanEmulator(2, 20.0, name_prefix="dtlate") as wan,
        Cluster(tmp_path, forked=True) as cluster,
    ):
        nodes: list[Node] = []
        for index in range(2):
            address = wan.address(index)
            flags = ["--inner-steps", "2", "--max-rounds", "100000", "--bandwidth-mbit", "20",
                     "--listen", f"{address}:0", "--dht-listen", f"{address}:0"]  # fmt: skip
            peers = (
                None if index == 0 else cluster.first_multiaddr(nodes[0], prefix=f"/ip4/{wan.address(0)}/")
            )
            nodes.append(cluster.start(flags, peers=peers, netns=wan.namespace(index)))
            if index == 0:
                wait_for(lambda: len(nodes[0].records()) >= 5, 120, "the first node's rounds alone", nodes[0])
        source, late = nodes
        wait_for(lambda: len(late.records()) >= 4, 200, "the late node's first four rounds", late)
        for node in (source, late):
            node.signal(signal.SIGTERM)
        assert cluster.wait_all(60) == [0, 0]
        late_rounds = late.records()[:4]
        for record in late_rounds[1:]:  # from its second round on: averaged with the first node
            assert record["peers"] == 2 and not record["adopted"] and not record["fell_back"], (
                f"round {record['round']}: {record}\n{tail(late)}"
            )
        source_hashes = source.hashes()
        for record in late_rounds[1:]:
            assert source_hashes[record["round"]] == record["param_hash"]


@pytest.mark.timeout(240)
def test_a_slower_node_is_in_every_round_and_the_faster_one_trains_on_meanwhile(tmp_path: Path) -> None:
    # Both nodes train through every inner phase (that is the design), so the phase is kept short: 1 s
    # is ~60 steps of the fast node and ~15 of the slow one (more than one each even on a loaded CPU).
    timed = ["--round-seconds", "1.0", "--start-peers", "2", "--max-rounds", "4"]
    with Cluster(tmp_path, forked=True) as cluster:
        fast = cluster.start(timed)
        slow = cluster.start(
            [*timed, "--batch-size", "16"], peers=cluster.first_multiaddr(fast)
        )  # 4x the batch
        assert cluster.wait_all(200) == [0, 0], f"{tail(fast)}\n{tail(slow)}"
        fast_rounds, slow_rounds = fast.records(), slow.records()
        assert [r["round"] for r in fast_rounds] == [1, 2, 3, 4]
        assert [r["round"] for r in slow_rounds] == [1, 2, 3, 4]
        for record in (*fast_rounds, *slow_rounds):
            assert record["peers"] == 2 and not record["fell_back"] and not record["adopted"], record
        assert [r["param_hash"] for r in fast_rounds] == [r["param_hash"] for r in slow_rounds]
        # Rounds due by time, not by steps: the fast node did more inner steps in the same rounds
        # (with a fixed H both would do H, the fast one then idling at every round).
        assert sum(_steps_per_round(fast_rounds)) > sum(_steps_per_round(slow_rounds))
