"""scripts/bench/bench_utilization.py: its figures from hand-written round records, then two short runs on
loopback (2 nano nodes): the printed figures match the nodes' own metrics, and Ctrl-C (twice) stops
every node.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.node.forked_cli import run_cli, start_cli
from tests.scripts.processes import kill_process_groups, processes_in_groups
from tests.scripts.script_loader import SCRIPTS_DIR, load_script, script_path

bench = load_script("bench_utilization")

REPO_ROOT = SCRIPTS_DIR.parent
SETTINGS = bench.Settings(
    num_nodes=2,
    model="nano",
    inner_steps=5,
    batch_size=4,
    codec="int8",
    max_rounds=4,
    warmup_rounds=1,
    timeout=bench.datetime.timedelta(seconds=60),
)
SMALL_RUN = [
    sys.executable, str(script_path("bench_utilization")), "--links", "0", "--nodes", "2",
    "--model", "nano", "--inner-steps", "5", "--seq-len", "32",
]  # fmt: skip


def round_record(
    round_index: int, compute: float, blocked: float, time_written: float, **extra: Any
) -> dict[str, Any]:
    """A round record as node/train/trainer.py writes it (the fields the benchmark reads)."""
    return {
        "kind": "round",
        "round": round_index,
        "seconds_compute": compute,
        "seconds_blocked": blocked,
        "seconds_comm": blocked + 1.0,
        "utilization": compute / (compute + blocked) if compute > 0 else None,
        "bytes_sent": 1000 * round_index,
        "peers": 2,
        "param_hash": f"h{round_index}",
        "time": time_written,
    } | extra


def test_steady_rounds_skip_the_warmup_and_the_unhidden_last_overlapped_round() -> None:
    # With overlap the last round is applied after the last phase: compute 0, utilization None.
    rounds = [
        round_record(1, 9.0, 5.0, 10.0),
        round_record(2, 9.0, 0.5, 20.0),
        round_record(3, 9.0, 0.1, 30.0),
    ]
    rounds.append(round_record(4, 0.0, 2.0, 32.0))
    assert [r["round"] for r in bench.steady_rounds(rounds, 1)] == [2, 3]
    assert [r["round"] for r in bench.steady_rounds(rounds, 0)] == [1, 2, 3]
    assert bench.steady_rounds(rounds, 3) == []


def test_summarize_against_a_hand_computation() -> None:
    node0 = [
        round_record(1, 8.0, 12.0, 100.0),
        round_record(2, 9.0, 1.0, 111.0),
        round_record(3, 8.0, 2.0, 121.5),
    ]
    # Node 1 lost its record of round 2: no gap ends at round 3 (nothing to measure it from).
    node1 = [round_record(1, 8.0, 30.0, 101.0), round_record(3, 19.0, 1.0, 122.0, peers=1)]
    overlap = bench.Variant(link_mbit=20.0, overlap=True)
    summary = bench.summarize(overlap, SETTINGS, [node0, node1])
    # Samples: node 0 rounds 2, 3 and node 1 round 3; utilizations 0.9, 0.8, 0.95.
    assert summary["num_samples"] == 3
    assert summary["utilization_mean"] == pytest.approx((0.9 + 0.8 + 0.95) / 3, abs=1e-4)
    assert summary["utilization_min"] == pytest.approx(0.8)
    assert summary["utilization_per_node"] == [[0.9, 0.8], [0.95]]
    assert summary["seconds_compute_mean"] == pytest.approx((9 + 8 + 19) / 3, abs=1e-4)
    assert summary["seconds_blocked_mean"] == pytest.approx((1 + 2 + 1) / 3, abs=1e-4)
    assert summary["seconds_comm_mean"] == pytest.approx((2 + 3 + 2) / 3, abs=1e-4)
    assert summary["seconds_per_round"] == pytest.approx((11.0 + 10.5) / 2)  # node 0's 1->2 and 2->3
    assert summary["bytes_sent_per_round"] == round((2000 + 3000 + 3000) / 3)
    assert summary["min_peers"] == 1
    assert summary["met"] is False  # mean 0.883 < 0.95

    sync = bench.summarize(bench.Variant(link_mbit=20.0, overlap=False), SETTINGS, [node0, node1])
    assert sync["met"] is None  # the target applies to overlap only
    fast = [round_record(1, 9.0, 9.0, 0.0), round_record(2, 99.0, 1.0, 100.0)]
    assert bench.summarize(overlap, SETTINGS, [fast])["met"] is True  # 0.99


def test_summary_verdict_and_line() -> None:
    common = {"model": "tiny", "nodes": 4, "inner_steps": 10, "codec": "int8", "warmup_rounds": 1}
    sync = common | {"variant": "20mbit-sync", "overlap": False, "met": None}
    sync |= {"utilization_mean": 0.7, "utilization_min": 0.65, "seconds_per_round": 38.0}
    overlap = common | {"variant": "20mbit-overlap", "overlap": True, "met": True}
    overlap |= {"utilization_mean": 0.97, "utilization_min": 0.951, "seconds_per_round": 28.04}
    assert bench.summary_object([sync, overlap]) == {
        "summary": True,
        "target_utilization": 0.95,
        "utilization_mean": {"20mbit-sync": 0.7, "20mbit-overlap": 0.97},
        "overlap_met": True,
        "num_failed": 0,
    }
    line = bench.summary_line([sync, overlap])
    assert "20mbit-sync 0.700 (min 0.650, 38.0 s/round)" in line
    assert "20mbit-overlap 0.970 (min 0.951, 28.0 s/round)" in line
    assert line.endswith("with overlap: PASS")

    failed = overlap | {"error": "boom", "met": False, "utilization_mean": None}
    assert bench.summary_object([sync, failed])["overlap_met"] is False
    assert bench.summary_object([sync, failed])["num_failed"] == 1
    assert "20mbit-overlap FAILED" in bench.summary_line([sync, failed])
    assert bench.summary_line([sync, failed]).endswith("FAIL")
    assert bench.summary_line([sync]).endswith("no overlap variant")


def test_variants_and_their_command() -> None:
    args = bench.parse_args(["--links", "100,20", "--modes", "sync,overlap"])
    assert args.links == [100.0, 20.0] and args.modes == ["sync", "overlap"]
    for bad in (["--modes", "async"], ["--links", "-1"], ["--max-rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    capped = bench.swarm_argv(SETTINGS, bench.Variant(link_mbit=20.0, overlap=True), Path("/tmp/x"))
    assert capped[capped.index("--link-mbit") + 1] == "20.0" and "--overlap" in capped
    assert capped[capped.index("--min-peers") + 1] == "2"
    loopback = bench.swarm_argv(SETTINGS, bench.Variant(link_mbit=0.0, overlap=False), Path("/tmp/x"))
    assert "--link-mbit" not in loopback and "--no-overlap" in loopback


def test_no_emulator_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "unavailable_reason", lambda: "the WAN emulator needs root")
    assert bench.main(["--links", "20"]) == 2


@pytest.mark.timeout(90)
def test_small_overlapped_run_reports_the_nodes_own_figures(tmp_path: Path) -> None:
    json_out, logs = tmp_path / "out.json", tmp_path / "logs"
    run = [*SMALL_RUN, "--modes", "overlap", "--max-rounds", "3", "--json-out", str(json_out)]
    # Forked from a preloaded server, as its launcher and nodes are (tests/node/forked_cli.py): a fresh
    # interpreter's imports cost about 4 CPU-seconds each, as much as a node's rounds here.
    done = run_cli([*run[2:], "--keep-logs", str(logs)], tmp_path, timeout=80, script=Path(run[1]))
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3, done.stdout  # the variant, the summary object, the summary line
    record, summary = json.loads(lines[0]), json.loads(lines[1])
    assert json.loads(json_out.read_text())[0] == record
    assert summary["utilization_mean"] == {"loopback-overlap": record["utilization_mean"]}
    assert lines[2].startswith("bench_utilization: nano, 2 nodes, H=5, int8")
    assert record["params"] == 919_680 and record["exit_codes"] == [0, 0]
    assert record["param_hash_all_agree"] is True and record["min_peers"] == 2

    # Independently from the nodes' files: 3 rounds with overlap, round 1 is warm-up and round 3 is
    # applied after the last phase (no compute beside it), so round 2 of each node is the sample.
    run_dir = logs / "loopback-overlap" / "swarm"
    expected = []
    for index in range(2):
        lines_of_node = (run_dir / f"node-{index}" / "metrics.jsonl").read_text().splitlines()
        rounds = [r for r in map(json.loads, lines_of_node) if r.get("kind") == "round"]
        assert [r["round"] for r in rounds] == [1, 2, 3] and rounds[2]["seconds_compute"] == 0
        # Utilization over wall time: the inner compute over the gap between the round records.
        wall = rounds[1]["time"] - rounds[0]["time"]
        assert rounds[1]["seconds_wall"] == pytest.approx(wall, abs=0.05)
        expected.append(rounds[1]["seconds_compute"] / rounds[1]["seconds_wall"])
    assert record["num_samples"] == 2
    assert record["utilization_per_node"] == [[pytest.approx(u, abs=1e-4)] for u in expected]
    assert record["utilization_mean"] == pytest.approx(sum(expected) / 2, abs=1e-4)
    assert 0 < record["utilization_min"] <= record["utilization_mean"] <= 1


@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_node(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    # Forked, with its launcher and nodes (tests/node/forked_cli.py), as the small run above.
    argv = [*SMALL_RUN[2:], "--modes", "sync", "--max-rounds", "1000", "--keep-logs", str(logs)]
    stderr_path = tmp_path / "bench.stderr"
    bench_process = start_cli(argv, tmp_path / "bench.stdout", stderr_path, script=Path(SMALL_RUN[1]))
    swarm_dir = logs / "loopback-sync" / "swarm"
    metrics = swarm_dir / "node-1" / "metrics.jsonl"
    node_pids: list[int] = []  # each node leads its process group: its DHT process and p2pd are in it
    try:
        # Bounds for a loaded machine (parallel tests share the cores): a first round in ~10 s alone.
        deadline = time.monotonic() + 120
        while not (metrics.exists() and '"param_hash"' in metrics.read_text()):
            assert bench_process.poll() is None, stderr_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "no round within 120 s"
            time.sleep(0.5)
        node_pids = [int((swarm_dir / f"node-{i}.pid").read_text()) for i in range(2)]
        assert len(processes_in_groups(node_pids)) >= 2  # the nodes run
        # First Ctrl-C: the launcher stops the nodes gracefully (a node in a round may wait for its
        # departed peer up to the launcher's grace); a second one makes it kill them at once.
        os.kill(bench_process.pid, signal.SIGINT)
        launcher_log = logs / "loopback-sync" / "swarm.log"
        deadline = time.monotonic() + 60
        while bench_process.poll() is None and "stopping 2 node(s)" not in launcher_log.read_text():
            assert time.monotonic() < deadline, "the launcher did not start stopping its nodes"
            time.sleep(0.2)
        if bench_process.poll() is None:
            os.kill(bench_process.pid, signal.SIGINT)
        bench_process.wait(timeout=60)
    finally:
        if bench_process.poll() is None:  # the test failed above: leave no launcher or node running
            os.killpg(bench_process.pid, signal.SIGKILL)
            bench_process.wait(timeout=10)
            kill_process_groups(node_pids)
    stderr = stderr_path.read_text()
    assert bench_process.returncode == 130, stderr[-4000:]
    assert "interrupted" in stderr
    assert processes_in_groups(node_pids) == []
