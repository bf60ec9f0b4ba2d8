"""Nodes started through `dtnode join` form one swarm on loopback: real processes, DHT and gRPC.

What must hold: every member of a round ends it with the same param_hash; a node that
joins mid-run adopts the swarm's state and matches after its first round; a SIGKILLed node does
not stop the others past the round deadline; SIGTERM leaves cleanly with exit 0.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.node.swarm_cluster import FAST_FLAGS, Cluster, tail, wait_for


def assert_one_lineage(nodes_hashes: list[dict[int, str]], rounds: list[int]) -> None:
    for r in rounds:
        hashes = {hashes[r] for hashes in nodes_hashes if r in hashes}
        assert len(hashes) == 1, f"round {r}: param_hash differs across nodes: {hashes}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_three_nodes_share_every_round(tmp_path, mode):
    flags = ["--max-rounds", "3", "--min-peers", "3"] + (["--overlap"] if mode == "overlap" else [])
    with Cluster(tmp_path, forked=True) as cluster:
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        assert (first.run_dir / "node.json").exists()
        for _ in range(2):
            cluster.start(flags, peers=peers)
        assert cluster.wait_all(180) == [0, 0, 0], "\n\n".join(tail(n) for n in cluster.nodes)
        records = [node.records() for node in cluster.nodes]
        for node_records in records:
            assert [r["round"] for r in node_records] == [1, 2, 3]
            bad = [r for r in node_records if r["peers"] != 3 or r["fell_back"] or r["adopted"]]
            assert not bad, f"{bad}\n\n" + "\n\n".join(tail(n) for n in cluster.nodes)
            assert all(r["overlap"] == (mode == "overlap") for r in node_records)
            # int8 all-reduce of the nano model: each node sends about 2 (N-1)/N of 1 byte per number.
            num_params = 919_680
            for r in node_records:
                assert 0.5 * num_params < r["bytes_sent"] < 2.0 * num_params, r["bytes_sent"]
                # seconds_comm = forming the group + its all-reduce (+ a DHT read): the parts fit in it.
                assert r["streams"] == 1 and r["seconds_forming"] >= 0 and r["seconds_allreduce"] > 0, r
                assert r["seconds_forming"] + r["seconds_allreduce"] <= r["seconds_comm"] + 1e-3, r
                assert (
                    r["density"] == 1.0 and r["allreduce_share"] == r["seconds_allreduce"] / r["seconds_wall"]
                )
        assert_one_lineage([node.hashes() for node in cluster.nodes], [1, 2, 3])
        # After each round the members read disjoint shards: one each of three.
        for index in range(3):
            shards = sorted(tuple(node_records[index]["shard"]) for node_records in records)
            assert shards == [(0, 3), (1, 3), (2, 3)], shards
        losses = [r["eval_loss"] for r in records[0]]
        assert losses[-1] < losses[0], losses
        assert "To join it from another machine" in first.log()
        # (That each averaged round's mean is served beside the new state, with overlap too, is
        # checked over sockets in tests/node/swarm/test_catch_up.py; the serving lines are DEBUG now.)


@pytest.mark.timeout(300)
def test_joiner_adopts_the_swarm_state_and_matches(tmp_path):
    with Cluster(tmp_path, forked=True) as cluster:
        flags = ["--min-peers", "2", "--inner-steps", "20"]  # no round limit: stopped by SIGTERM below
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        cluster.start(flags, peers=peers)
        wait_for(lambda: len(first.records()) >= 2, 120, "two rounds before the joiner", first)
        joiner = cluster.start(flags, peers=peers)
        wait_for(lambda: len(joiner.hashes()) >= 2, 180, "two rounds of the joiner", joiner)
        for node in cluster.nodes:
            node.signal(signal.SIGTERM)
        assert cluster.wait_all(60) == [0, 0, 0], "\n\n".join(tail(n) for n in cluster.nodes)
        assert "adopting the swarm's state" in joiner.log()
        joined_rounds = sorted(joiner.hashes())
        assert joined_rounds[0] >= 3, joined_rounds
        first_hashes = first.hashes()
        for r in joined_rounds:
            if r in first_hashes:
                assert joiner.hashes()[r] == first_hashes[r], f"round {r}: the joiner diverged"
        assert any(r["peers"] == 3 for r in joiner.records()), joiner.records()


@pytest.mark.timeout(300)
def test_sigkilled_node_does_not_stop_the_swarm(tmp_path):
    with Cluster(tmp_path, forked=True) as cluster:
        flags = ["--max-rounds", "5", "--min-peers", "2"]
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        second = cluster.start(flags, peers=peers)
        victim = cluster.start(flags, peers=peers)
        wait_for(lambda: len(victim.records()) >= 2, 120, "two rounds with three nodes", victim)
        victim.signal(signal.SIGKILL)
        codes = [first.wait(200), second.wait(200)]
        assert codes == [0, 0], tail(first) + "\n\n" + tail(second)
        for node in (first, second):
            rounds = node.records()
            assert [r["round"] for r in rounds] == [1, 2, 3, 4, 5]
            assert all(r["seconds_comm"] < 60 + 15 for r in rounds)  # round deadline + formation
            assert rounds[-1]["peers"] == 2
        assert_one_lineage([first.hashes(), second.hashes()], [1, 2, 3, 4, 5])


@pytest.mark.timeout(240)
def test_sigterm_leaves_cleanly(tmp_path):
    with Cluster(tmp_path, forked=True) as cluster:
        # No round limit: stopped by SIGTERM below. Both start at the start barrier: their first round is
        # of two, with no rounds of the first alone while the leaver starts.
        flags = ["--min-peers", "1", "--inner-steps", "20"]
        first = cluster.start([*flags, "--start-peers", "2"])
        peers = cluster.first_multiaddr(first)
        leaver = cluster.start([*flags, "--start-peers", "2"], peers=peers)
        wait_for(lambda: any(r["peers"] == 2 for r in leaver.records()), 120, "a round of two", leaver)
        leaver.signal(signal.SIGTERM)
        assert leaver.wait(60) == 0, tail(leaver)
        left_at = time.time()
        assert "checkpoint" in leaver.log()
        # The signal went to the leaver's whole process group, its DHT process and p2p daemon too: they
        # outlive it until the node has stored its 'left' tombstone through them.
        assert "could not store our 'left' tombstone" not in leaver.log(), tail(leaver)

        # The tombstone drops the leaver from the view at once: the rounds whose matchmaking began after
        # it was stored (before the leaver exited) do not wait a join window (5 s) for the leaver to become
        # ready, as they would for a peer whose record lingers. A round written at `time` began its
        # communication by `time - seconds_comm` (1 s of margin for the outer step and the record).
        def after_the_leave() -> list[dict]:
            return [r for r in first.records() if r["time"] - r["seconds_comm"] > left_at + 1]

        wait_for(lambda: len(after_the_leave()) >= 2, 60, "rounds alone", first)
        first.signal(signal.SIGTERM)
        assert first.wait(60) == 0, tail(first)
        alone = after_the_leave()
        assert all(r["peers"] == 1 for r in alone), alone
        assert all(r["seconds_comm"] < 4.0 for r in alone), [r["seconds_comm"] for r in alone]


@pytest.mark.timeout(120)
def test_sigterm_during_start_up_exits_cleanly(tmp_path):
    """A signal while torch imports, the DHT starts or the model is built is kept, not fatal:
    the node stops before its first step and exits 0 (a fresh interpreter: its imports are timed).

    The signal goes once the node has logged its config: its handler is installed by then (a signal
    before it, while the interpreter itself starts, is the default's), and torch, the DHT and the model
    are still ahead of it. A fixed sleep instead lost the race on a busy machine."""
    with Cluster(tmp_path) as cluster:
        node = cluster.start(["--min-peers", "1", "--inner-steps", "20"])
        wait_for(lambda: "config: " in node.log(), 60, "the config line", node)
        node.signal(signal.SIGTERM)
        assert node.wait(60) == 0, tail(node)
        assert "received SIGTERM" in node.log()
        assert not [r for r in node.records() if "param_hash" in r]  # it never finished a round


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_stop_asked_before_or_while_the_swarm_starts_exits_0(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    """A signal to the node's process group also reaches the helpers its start-up spawns (torch's
    shared-memory manager: a CI run once ended `no response from torch_shm_manager` inside the DHT's
    start, exit 1). Asked to stop, the node exits 0 whether start-up failed or had not begun; without
    a stop, the same failure is still raised."""
    from node.ops import cli, preflight
    from node.swarm import setup

    signal_at = {"when": when}  # the last call below runs with no signal at all
    starts = []
    check = preflight.check_before_sockets

    def checked_then_signalled(config: object) -> object:
        corpus = check(config)
        if signal_at["when"] == "before":
            os.kill(os.getpid(), signal.SIGTERM)  # kept by the handler run_join installed first
        return corpus

    def failing_start(config: object, **kwargs: object) -> object:
        starts.append(config)
        if signal_at["when"] == "during":
            os.kill(os.getpid(), signal.SIGTERM)
        raise RuntimeError("no response from torch_shm_manager")

    monkeypatch.setattr(preflight, "check_before_sockets", checked_then_signalled)
    monkeypatch.setattr(setup, "start_swarm", failing_start)
    argv = ["join", "--name", "stoptest", "--run-dir", str(tmp_path / "run"), *FAST_FLAGS]
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        with caplog.at_level("INFO", logger="dtnode"):
            assert cli.main(argv) == 0
        assert "received SIGTERM" in caplog.text
        assert len(starts) == (1 if when == "during" else 0)  # before: no swarm was started at all
        signal_at["when"] = "never"
        with pytest.raises(RuntimeError, match="torch_shm_manager"):
            cli.main(argv)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@pytest.mark.timeout(120)
def test_sigusr1_writes_every_threads_stack_to_the_log_and_the_node_goes_on(tmp_path):
    """``kill -USR1`` on a running ``dtnode join``: its threads' stacks in its log (written by C code,
    so even a main thread stuck in a native call shows where), and the node trains on to a clean exit."""
    with Cluster(tmp_path) as cluster:
        node = cluster.start(["--min-peers", "1", "--inner-steps", "5", "--max-rounds", "40"])
        wait_for(lambda: "round 1 done" in node.log(), 90, "round 1", node)
        node.signal_process(signal.SIGUSR1)
        wait_for(lambda: "Current thread" in node.log() or "Thread 0x" in node.log(), 30, "the stacks", node)
        assert "node/ops/cli.py" in node.log() and node.process.poll() is None
        wait_for(lambda: "round 2 done" in node.log(), 60, "round 2 after the dump", node)
        node.signal(signal.SIGTERM)
        assert node.wait(60) == 0
