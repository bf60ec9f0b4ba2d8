"""scripts/bench/bench_participation.py: its figures from hand-written records against hand computations,
its runs' commands through the real parser, the freeze of case c on a real process group, then one
short run (--cases d --quick: three nano nodes) whose printed figures match the nodes' own files.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from node.ops.cli import build_parser
from tests.node.forked_cli import run_cli
from tests.node.swarm_cluster import SMALL_CORPUS
from tests.scripts.script_loader import SCRIPTS_DIR, load_script, script_path

bench = load_script("bench_participation")

REPO_ROOT = SCRIPTS_DIR.parent


def steps(
    times: list[float], step: int, rate: float, first_tokens: int | None = None
) -> list[dict[str, Any]]:
    """Step records ending at ``times``, ``step`` tokens each at ``rate`` tokens/s."""
    first = step if first_tokens is None else first_tokens
    return [
        {"kind": "step", "time": t, "tokens": first + i * step, "tokens_per_s": rate}
        for i, t in enumerate(times)
    ]


def test_step_tokens_is_the_usual_increment_even_across_an_adopted_counter():
    records = steps([1, 2, 3], 1024, 1.0) + steps([4, 5, 6], 1024, 1.0, first_tokens=50_000)
    assert bench.step_tokens(records) == 1024
    assert bench.step_tokens(steps([1], 512, 1.0)) == 512


def test_throughput_against_a_hand_computation():
    node_a = steps([10, 11, 12], 100, 100.0)  # 1 s per step: stepping from 9 to 12, 300 tokens
    node_b = steps([15, 17], 100, 50.0)  # 2 s per step: stepping from 13 to 17, 200 tokens
    assert bench.throughput([node_a, node_b]) == {
        "tokens": 500,
        "swarm_tokens_per_s": 500 / (17 - 9),
        "node_window_tokens_per_s": 300 / 3 + 200 / 4,
    }
    assert bench.throughput([[], []])["swarm_tokens_per_s"] is None
    assert bench.step_rates([node_a, node_b, []]) == [100.0, 50.0, None]


def test_window_rate_counts_the_steps_that_ended_inside_the_window():
    records = steps([float(t) for t in range(1, 11)], 10, 1.0)
    assert bench.window_rate(records, 2.5, 7.5) == 5 * 10 / 5  # steps ending at 3, 4, 5, 6, 7


def test_participation_figures_leave_out_the_frozen_nodes_rounds_until_it_is_back():
    def rounds(*spec: tuple[int, int]) -> list[dict[str, Any]]:
        return [
            {"round": r, "peers": p, "param_hash": "z", "fell_back": False, "adopted": False} for r, p in spec
        ]

    healthy = rounds((1, 3), (2, 3), (3, 2), (4, 2), (5, 3), (6, 3))  # 5 pairs, all averaged
    frozen = rounds((1, 3), (2, 3), (3, 1), (5, 3), (6, 3))  # 3 alone, 4 skipped
    figures = bench.participation_figures([healthy, healthy, frozen], frozen_node=2, skip_through=4)
    assert figures["participation"] == (5 + 5 + 2) / (5 + 5 + 2)
    assert figures["participation_all"] == (5 + 5 + 3) / (5 + 5 + 5)
    assert figures["rounds_per_node"] == [6, 6, 5] and figures["one_final_param_hash"]
    split = bench.participation_figures([healthy, rounds((1, 1))], frozen_node=None, skip_through=0)
    assert "participation_all" not in split and split["participation"] == 5 / 5
    assert (
        bench.participation_figures([healthy, []], frozen_node=None, skip_through=0)["one_final_param_hash"]
        is False
    )


def test_round_period_is_the_median_gap():
    assert bench.round_period([[{"time": 0}, {"time": 2}, {"time": 3}], [{"time": 5}, {"time": 9}]]) == 2
    assert bench.round_period([[{"time": 0}], []]) is None


def test_targets_at_their_thresholds():
    targets = ("participation", "tokens_ratio", "one_final_param_hash")
    met = {"participation": 0.95, "tokens_ratio": 0.9, "one_final_param_hash": True}
    assert bench.judge(met, targets) == dict.fromkeys(targets, True)
    missed = {"participation": 0.9499, "tokens_ratio": None, "one_final_param_hash": False}
    assert bench.judge(missed, targets) == dict.fromkeys(targets, False)
    assert bench.judge(missed, ("one_final_param_hash",)) == {"one_final_param_hash": False}


def test_runs_of_every_case_are_valid_swarm_commands(tmp_path):
    runs = bench.case_runs(list(bench.CASES), quick=False, link_mbit=20.0, stagger_seconds=10.0)
    assert [run.name for run in runs] == ["a2", "a4", "b", "c", "d-readme", "d-ten"]
    quick = bench.case_runs(list(bench.CASES), quick=True, link_mbit=20.0, stagger_seconds=10.0)
    assert [run.name for run in quick] == ["a2", "b", "c", "d-quick"]
    for run in runs + quick:
        argv = bench.swarm_argv(run, tmp_path, ["--round-seconds", "8"])
        parsed = vars(build_parser().parse_args(argv[3:]))
        assert parsed["num_nodes"] == run.num_nodes and parsed["round_seconds"] == 8.0
        assert parsed["link_mbit"] == (20.0 if run.case == "a" else None)
        assert parsed["stagger"] == {"a": 5.0 if run in quick else 10.0}.get(run.case, 0.0)
        assert parsed["per_node_flags"] == (["2:--batch-size 8"] if run.case == "b" else [])
    d_ten = runs[-1]
    parsed = vars(build_parser().parse_args(bench.swarm_argv(d_ten, tmp_path, [])[3:]))
    assert (parsed["model"], parsed["inner_steps"], parsed["batch_size"], parsed["max_rounds"]) == (
        "nano",
        5,
        8,
        5,
    )


def process_state(pid: int) -> str:
    return (Path("/proc") / str(pid) / "stat").read_text().rpartition(")")[2].split()[0]


def wait_for_state(pid: int, state: str) -> str:
    """The process's state once it is ``state`` (signals are delivered asynchronously), or after 5 s."""
    deadline = time.monotonic() + 5
    while process_state(pid) != state and time.monotonic() < deadline:
        time.sleep(0.01)
    return process_state(pid)


@pytest.mark.timeout(60)
def test_freezer_stops_the_node_group_for_one_and_a_half_periods(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        assert wait_for_state(sleeper.pid, "S") == "S"
        (tmp_path / "node-1.pid").write_text(f"{sleeper.pid}\n")
        now = time.time()
        for index in range(2):
            node_dir = tmp_path / f"node-{index}"
            node_dir.mkdir()
            lines = [{"kind": "round", "round": r, "time": now - 1.0 + 0.4 * r} for r in (1, 2)]
            (node_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        freezer = bench.Freezer(tmp_path, 1, 2)
        frozen_at = time.monotonic()
        freezer.poll()
        assert wait_for_state(sleeper.pid, "T") == "T"  # stopped
        assert freezer.figures == {
            "frozen_node": 1, "round_period_s": 0.4, "frozen_s": 0.6, "frozen_at_round": 2
        }  # fmt: skip
        while "resumed_round" not in freezer.figures:
            freezer.poll()
            time.sleep(0.05)
        assert 0.6 <= time.monotonic() - frozen_at < 5
        assert wait_for_state(sleeper.pid, "S") == "S" and freezer.figures["resumed_round"] == 2
        freezer.poll()  # once resumed, never again
        assert process_state(sleeper.pid) == "S"
    finally:
        os.killpg(sleeper.pid, signal.SIGKILL)
        sleeper.wait()


@pytest.mark.timeout(300)
def test_quick_d_run_reports_the_nodes_own_figures(tmp_path):
    # Forked from a preloaded server, as its launcher and nodes are (tests/node/forked_cli.py): a fresh
    # interpreter's imports cost about 4 CPU-seconds each, as much as a node's rounds here. Sequences of
    # 32 tokens (a third of 128's step) and the small corpus (swarm_cluster.py: ~1 CPU-s less a node).
    node_args = f"--node-args=--seq-len 32 --data {shlex.quote(SMALL_CORPUS)}"
    completed = run_cli(
        ["--cases", "d", "--quick", node_args, "--keep-logs", str(tmp_path)],
        tmp_path, timeout=280, script=script_path("bench_participation"),
    )  # fmt: skip
    lines = completed.stdout.strip().splitlines()
    assert len(lines) == 3, completed.stdout[-3000:] + completed.stderr[-3000:]
    record, summary = json.loads(lines[0]), json.loads(lines[1])
    # The nodes' own files, read here independently of the script.
    metrics = [
        [json.loads(line) for line in (tmp_path / "d-quick" / "swarm" / f"node-{i}" / "metrics.jsonl").open()]
        for i in range(3)
    ]
    rounds = [[r for r in node if r["kind"] == "round"] for node in metrics]
    assert record["rounds_per_node"] == [len({r["round"] for r in node}) for node in rounds]
    assert record["final_param_hashes"] == [node[-1]["param_hash"][:10] for node in rounds]
    assert record["tokens"] == sum(max(s["tokens"] for s in node if s["kind"] == "step") for node in metrics)
    averaged = sum(
        r["peers"] >= 2 and not r["adopted"] and not r["fell_back"] for node in rounds for r in node[1:]
    )
    assert record["participation"] == round(averaged / sum(len(node) - 1 for node in rounds), 4)
    assert summary["met"] == {"d-quick": record["met"]}
    assert completed.returncode == (0 if record["met"] else 1)
    assert lines[2].startswith("bench_participation: d-quick participation ")
