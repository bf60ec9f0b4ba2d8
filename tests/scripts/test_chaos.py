"""scripts/tools/chaos.py: its checks catch what they claim to (on hand-made records), and a short run of
real faults in the WAN emulator — a restart, a kill, a pause, a partition, a slow link — ends with
every node recovered, rejoined and in agreement.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.scripts.script_loader import SCRIPTS_DIR, load_script, script_path

wan_emulator = load_script("wan_emulator")
chaos = load_script("chaos")
_reason = wan_emulator.unavailable_reason()

REPO_ROOT = SCRIPTS_DIR.parent


def round_record(round: int, param_hash: str, members: list[str], **fields: Any) -> dict[str, Any]:
    record = {
        "kind": "round", "round": round, "param_hash": param_hash, "members": members, "peers": len(members),
        "adopted": False, "fell_back": False, "eval_loss": 3.0 - 0.1 * round, "seconds_comm": 1.0, "time": 100.0 + round,
    }  # fmt: skip
    record.update(fields)
    return record


class FakeSwarm:
    """What chaos.check reads: nodes with a run dir holding metrics.jsonl."""

    def __init__(self, root: Path, per_node: list[list[dict[str, Any]]]) -> None:
        self.nodes = []
        for index, records in enumerate(per_node):
            node = chaos.ChaosNode(index, root / f"node-{index}", root / f"node-{index}.log")
            node.run_dir.mkdir(parents=True)
            lines = [json.dumps({"kind": "step", "loss": 3.0, "step": 1, "time": 1.0})]
            lines += [json.dumps(r) for r in records]
            (node.run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
            node.starts.append(0.0)
            self.nodes.append(node)


ARGS = argparse.Namespace(round_deadline=60.0)
RECOVERED = {"recovered": True, "recovery_seconds": 3.0, "silent_nodes": []}


def test_check_tells_a_split_group_from_two_partition_sides(tmp_path: Path) -> None:
    both, side_a, side_b = ["a", "b", "c"], ["a", "b"], ["c"]
    agree = [[round_record(r, f"h{r}", both) for r in range(1, 7)] for _ in range(3)]
    swarm = FakeSwarm(tmp_path / "agree", agree)
    result = chaos.check(swarm, [RECOVERED], ARGS)
    assert (result["divergences"], result["hangs"], result["non_finite"]) == (0, 0, 0)
    assert result["loss_fell"] and result["rounds"] == 6

    # A partition: round 7 of {a, b} and round 7 of {c} differ legitimately; a fell-back record too.
    sides = [
        [round_record(7, "x", side_a)],
        [round_record(7, "x", side_a)],
        [round_record(7, "y", side_b), round_record(8, "z", both, fell_back=True)],
    ]
    result = chaos.check(FakeSwarm(tmp_path / "sides", sides), [RECOVERED], ARGS)
    assert result["divergences"] == 0

    # One group, two results: the one thing that must never happen.
    split = [[round_record(7, "x", both)], [round_record(7, "x", both)], [round_record(7, "q", both)]]
    result = chaos.check(FakeSwarm(tmp_path / "split", split), [RECOVERED], ARGS)
    assert result["divergences"] == 1
    assert result["divergence_details"] == [{"round": 7, "members": 3, "hashes": ["q", "x"]}]


def test_check_counts_hangs_non_finite_losses_and_a_rising_loss(tmp_path: Path) -> None:
    rising = [round_record(r, f"h{r}", ["a", "b"], eval_loss=1.0 + r) for r in range(1, 7)]
    rising[2]["eval_loss"] = None  # written as null: NaN or Inf
    rising[3]["seconds_comm"] = 75.0  # an all-reduce past the 60 s deadline (+ 10 s)
    swarm = FakeSwarm(tmp_path / "run", [rising, rising])
    stuck = {"recovered": False, "recovery_seconds": None, "silent_nodes": [1]}
    result = chaos.check(swarm, [RECOVERED, stuck], ARGS)
    assert result["non_finite"] == 2  # once per node
    assert result["hangs"] == 1 + 2  # the silent trial, and the slow round on each node
    assert result["not_recovered"] == 1
    assert not result["loss_fell"]


def test_a_restarted_node_counts_as_rejoined_only_once_it_matches(tmp_path: Path) -> None:
    members = ["a", "b"]
    others = [round_record(r, f"h{r}", members) for r in range(1, 6)]
    restarted = [round_record(r, f"h{r}", members, time=500.0 + r) for r in (4, 5)]
    swarm = FakeSwarm(tmp_path / "ok", [others, restarted])
    swarm.nodes[1].starts.append(400.0)
    assert chaos.check(swarm, [RECOVERED], ARGS)["rejoined"] == 1

    wrong = [round_record(r, f"other{r}", members, time=500.0 + r) for r in (4, 5)]
    swarm = FakeSwarm(tmp_path / "wrong", [others, wrong])
    swarm.nodes[1].starts.append(400.0)
    result = chaos.check(swarm, [RECOVERED], ARGS)
    assert (result["restarted_nodes"], result["rejoined"]) == (1, 0)


def test_record_gaps_measures_each_live_nodes_longest_silence_and_the_round_period(tmp_path: Path) -> None:
    """--cycle's check: per node but the victim, the longest time without a round record, the cycle's
    start and end counted; the period is the median gap between two records."""
    members = ["a", "b", "c"]
    steady = [round_record(r, f"h{r}", members, time=100.0 + 10 * r) for r in range(1, 10)]  # 110 .. 190
    stalled = [record for record in steady if not 130 < record["time"] < 175]  # silent 130 -> 180
    victim = [round_record(1, "h1", members, time=111.0)]  # silent from 111 on: not checked
    swarm = FakeSwarm(tmp_path / "gaps", [victim, steady, stalled])
    longest, period = chaos.record_gaps(swarm, since=105.0, until=200.0, skip=0)
    assert longest == {1: 10.0, 2: 50.0}
    assert period == 10.0  # the median of 8 gaps of 10 s (node 1) and 10, 10, 50, 10 s (node 2)
    assert chaos.stall_bound(period) == 2 * 10.0 + 15.0 + 30.0


@pytest.mark.skipif(_reason is not None, reason=_reason or "")
@pytest.mark.timeout(420)
def test_a_short_chaos_run_recovers_from_every_kind_of_fault(tmp_path: Path) -> None:
    """Four nodes, one fault of each kind (taken in turn; victims, moments and spans seeded), in one
    swarm: its start-up is paid once. The nodes train all the time, so the run's CPU is its length:
    46-58 CPU-s measured at a load of 15-32 on 2 cores (114 when each node start was a fresh
    interpreter and the first nodes trained alone while the others started)."""
    json_out = tmp_path / "chaos.json"
    results = []
    run_pids: list[int] = []
    for kinds in ("restart,kill,stop,partition,slow_link",):
        num_trials = len(kinds.split(","))
        argv = [sys.executable, str(script_path("chaos")), "--nodes", "4", "--trials", str(num_trials)]
        argv += [
            "--kinds",
            kinds,
            "--in-turn",
            "--inner-steps",
            "10",
            "--seq-len",
            "32",  # a third of the CPU of nano's 128 a step; the faults and checks do not depend on it
            "--fault-seconds",
            "3",
            "6",
            "--max-delay",
            "2",
        ]
        argv += ["--recovery-timeout", "120", "--seed", "1", "--json-out", str(json_out)]
        with subprocess.Popen(
            argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ) as run:
            try:
                stdout, stderr = run.communicate(timeout=320)
            finally:
                if run.poll() is None:  # timed out: stop it (and, through its Ctrl-C path, its nodes)
                    run.send_signal(signal.SIGINT)
                    run.communicate(timeout=60)
        assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
        results.append(json.loads(json_out.read_text()))
        run_pids.append(run.pid)
    for result in results:
        summary = result["summary"]
        assert summary["passed"] and summary["trials"] == sum(summary["faults"].values())
        assert all(count == 1 for count in summary["faults"].values())
        assert (summary["hangs"], summary["divergences"], summary["non_finite"]) == (0, 0, 0)
        assert summary["rejoined"] == summary["restarted_nodes"]
        assert all(trial["recovered"] for trial in result["trials"])
    # Nothing left behind: no namespace of these runs' emulators (named after the chaos process's pid;
    # another chaos run on the machine, e.g. a parallel test session, has its own), no node process.
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [pid for pid in run_pids if f"dtchaos-{pid}-" in listing], listing
