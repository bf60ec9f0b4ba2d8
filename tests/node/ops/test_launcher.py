"""`dtnode swarm` starts N real `dtnode join` processes, streams their rounds, stops them, reports.

The swarm tests run the launcher through the CLI (its own process, as a user would) and check what it
reports against the nodes' own metrics files: three nodes agree on every round's param_hash and
their eval loss falls; Ctrl-C stops every node cleanly and leaves no process behind. The launcher and
its nodes are forked from a server that imported torch and the node once (tests/node/forked_cli.py):
a fresh interpreter's imports cost about 4 CPU-seconds a process, more than a short node's training.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from node.config import ConfigError
from node.ops.cli import build_parser
from node.ops.launch_config import flags_to_argv, launch_config, node_argv, parse_node_flags
from node.ops.swarm_report import MetricsTail, hash_agreement
from tests.node.forked_cli import run_cli, start_cli
from tests.node.swarm_cluster import REPO_ROOT, SMALL_CORPUS, wait_for
from tests.scripts.script_loader import load_script

# Small and quick (as FAST_FLAGS in swarm_cluster.py), but --threads is left to the launcher. These tests
# check the launcher, not the model: sequences of 32 tokens make a step a third of nano's default 128, and
# the small corpus loads in milliseconds, not the default's ~1 CPU-s a node.
FAST = (
    "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--inner-steps", "10",
    "--log-every", "1000", "--join-window", "5", "--max-wait", "60", "--round-deadline", "60",
    "--heartbeat", "2", "--record-ttl", "16", "--checkpoint-every", "0", "--eval-every", "1",
    "--data", SMALL_CORPUS,
)  # fmt: skip


def swarm_command(root: Path, num_nodes: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "node.ops.cli", "swarm", "--nodes", str(num_nodes), "--run-dir", str(root),
            "--name", "launchertest", *FAST, *flags]  # fmt: skip


def round_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == "round"]


def has_step_record(run_dir: Path) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and '"kind":"step"' in path.read_text()


def processes_left(pids: list[int], marker: str) -> list[str]:
    """Live processes in the process group of one of ``pids`` or with ``marker`` in their command line."""
    left = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited while we looked
        # Fields after "(comm)": state, ppid, pgrp, ...; comm may itself contain spaces or parens.
        state, _, process_group = stat.rpartition(")")[2].split()[:3]
        if state != "Z" and (int(process_group) in pids or marker in cmdline):
            left.append(f"{entry.name}: {cmdline}")
    return left


# --- in-process: flags, per-node settings, the hash verdict ---


def test_flags_round_trip_through_the_join_parser():
    flags = {"model": "nano", "inner_lr": 0.0003, "max_rounds": 4, "outer_nesterov": False, "swarm": True}
    parsed = vars(build_parser().parse_args(["join", *flags_to_argv(flags)]))
    assert {key: parsed[key] for key in flags} == flags


def test_node_argv_fills_only_what_the_user_left_unset():
    config = launch_config(num_nodes=3, node_flags={"model": "nano", "run_dir": "/tmp/sw"})
    config = dataclasses.replace(config, num_cores=8)
    argv = node_argv(config, 2, peers="/ip4/127.0.0.1/tcp/1/p2p/X", host=None)
    parsed = vars(build_parser().parse_args(argv[3:]))
    assert parsed["run_dir"] == "/tmp/sw/node-2"
    assert (parsed["threads"], parsed["shard_index"], parsed["num_shards"]) == (8 // 3, 2, 3)
    assert parsed["listen"] == "127.0.0.1:0" and parsed["peers"] == "/ip4/127.0.0.1/tcp/1/p2p/X"
    assert parsed["model"] == "nano"

    chosen = launch_config(
        num_nodes=3, node_flags={"threads": 2, "num_shards": 1, "peers": "/ip4/1.2.3.4/tcp/5/p2p/Y"}
    )
    parsed = vars(
        build_parser().parse_args(node_argv(chosen, 1, peers="/ip4/127.0.0.1/tcp/1/p2p/X", host=None)[3:])
    )
    assert (parsed["threads"], parsed["num_shards"]) == (2, 1) and "shard_index" not in parsed
    assert parsed["peers"] == "/ip4/1.2.3.4/tcp/5/p2p/Y,/ip4/127.0.0.1/tcp/1/p2p/X"
    first = vars(build_parser().parse_args(node_argv(chosen, 0, peers="", host=None)[3:]))
    assert first["peers"] == "/ip4/1.2.3.4/tcp/5/p2p/Y"


def test_nodes_wait_for_each_other_unless_the_user_chose_start_peers():
    def start_peers(config: Any, index: int) -> int | None:
        return vars(build_parser().parse_args(node_argv(config, index, peers="", host=None)[3:])).get(
            "start_peers"
        )

    config = launch_config(num_nodes=4, node_flags={})
    assert [start_peers(config, i) for i in range(4)] == [4, 4, 4, 4]
    assert start_peers(launch_config(num_nodes=4, node_flags={"start_peers": 1}), 2) == 1


def test_node_flags_reach_only_their_node_and_win():
    overrides = parse_node_flags(["2:--batch-size 16 --inner-lr=1e-3", "2:--threads 1", "0:--no-overlap"])
    assert overrides == {2: {"batch_size": 16, "inner_lr": 1e-3, "threads": 1}, 0: {"overlap": False}}
    config = launch_config(num_nodes=3, node_flags={"batch_size": 8}, node_overrides=overrides)
    parsed = [
        vars(build_parser().parse_args(node_argv(config, i, peers="", host=None)[3:])) for i in range(3)
    ]
    assert [p["batch_size"] for p in parsed] == [8, 8, 16]
    assert parsed[2]["threads"] == 1 and parsed[2]["inner_lr"] == 1e-3 and "inner_lr" not in parsed[1]
    assert parsed[0]["overlap"] is False and "overlap" not in parsed[2]


@pytest.mark.parametrize(
    "specs, message",
    [
        (["2--batch-size 16"], "expected I:FLAGS"),
        (["x:--batch-size 16"], "expected I:FLAGS"),
        (["1:--batch-size sixteen"], "--batch-size"),
        (["1:--batch 16"], "--batch: no such flag; did you mean --batch-size"),  # no prefix matching
        (["1:--model 'nano"], "quotation"),
    ],
)
def test_malformed_node_flags_are_refused(specs, message):
    with pytest.raises(ConfigError, match=message):
        parse_node_flags(specs)


@pytest.mark.parametrize(
    "overrides, stagger, message",
    [
        ({3: {"batch_size": 16}}, 0.0, "names node 3, but the nodes are 0..2"),
        ({1: {"run_dir": "/tmp/x"}}, 0.0, "sets each node's --run-dir"),
        ({1: {"batch_size": 0}}, 0.0, "--node-flags 1: .*batch.size must be >= 1"),
        ({}, -1.0, "--stagger must be >= 0"),
    ],
)
def test_per_node_mistakes_are_refused_before_any_node_starts(overrides, stagger, message):
    with pytest.raises(ConfigError, match=message):
        launch_config(num_nodes=3, node_flags={}, node_overrides=overrides, stagger_seconds=stagger)


def test_each_node_gets_its_own_metrics_port():
    config = launch_config(num_nodes=3, node_flags={"metrics_port": 9400})
    ports = [
        build_parser().parse_args(node_argv(config, i, peers="", host=None)[3:]).metrics_port
        for i in range(3)
    ]
    assert ports == [9400, 9401, 9402]
    unset = launch_config(num_nodes=2, node_flags={})
    assert "metrics_port" not in vars(build_parser().parse_args(node_argv(unset, 1, peers="", host=None)[3:]))
    # On loopback by default (the node's own default); a node on an emulated host (--link-mbit) binds
    # that host's address, which this machine reaches, unless the user chose --metrics-listen.
    assert "metrics_listen" not in vars(
        build_parser().parse_args(node_argv(config, 0, peers="", host=None)[3:])
    )
    linked = launch_config(num_nodes=3, node_flags={"metrics_port": 9400, "bandwidth_mbit": 100.0})
    emulated = build_parser().parse_args(node_argv(linked, 1, peers="", host="10.213.0.2")[3:])
    assert emulated.metrics_listen == "10.213.0.2" and emulated.metrics_port == 9401
    chosen = launch_config(
        num_nodes=2, node_flags={"metrics_port": 9400, "metrics_listen": "0.0.0.0", "bandwidth_mbit": 100.0}
    )
    assert (
        build_parser().parse_args(node_argv(chosen, 1, peers="", host="10.213.0.2")[3:]).metrics_listen
        == "0.0.0.0"
    )


def test_node_argv_on_an_emulated_host_listens_there_at_the_link_rate():
    config = dataclasses.replace(launch_config(num_nodes=2, node_flags={}), link_mbit=20.0)
    parsed = vars(
        build_parser().parse_args(
            node_argv(config, 1, peers="/ip4/10.213.0.1/tcp/1/p2p/X", host="10.213.0.2")[3:]
        )
    )
    assert (parsed["listen"], parsed["dht_listen"]) == ("10.213.0.2:0", "10.213.0.2:0")
    assert parsed["bandwidth_mbit"] == 20.0


def test_metrics_tail_reads_only_new_complete_round_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind":"round","round":1}\n')  # a previous run's: not this launch's
    tail = MetricsTail(path)
    assert tail.read_rounds() == []
    with path.open("a") as handle:
        handle.write('{"kind":"step","round":2,"step":5}\n{"kind":"round","ro')  # a line being written
        handle.flush()
        assert tail.read_rounds() == []
        handle.write('und":2}\n')
    assert tail.read_rounds() == [{"kind": "round", "round": 2}]
    assert tail.read_rounds() == []


@pytest.mark.parametrize(
    "num_nodes, flags, message",
    [
        (0, {}, "--nodes must be >= 1"),
        (2, {"listen": "127.0.0.1:7000"}, "cannot share --listen"),
        (2, {"swarm": False}, "drop --no-swarm"),
        (2, {"model": "huge"}, "model must be one of"),
    ],
)
def test_user_mistakes_are_refused_before_any_node_starts(num_nodes, flags, message):
    with pytest.raises(ConfigError, match=message):
        launch_config(num_nodes=num_nodes, node_flags=flags)


def test_cli_reports_a_mistake_in_one_line(tmp_path):
    completed = subprocess.run(swarm_command(tmp_path, 2, "--listen", "127.0.0.1:7000"),
                               capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)  # fmt: skip
    assert completed.returncode == 2
    assert completed.stderr.strip().count("\n") == 0 and "use port 0" in completed.stderr
    assert not (tmp_path / "node-0").exists()


def test_hash_agreement_names_the_rounds_that_differ():
    node_a = [
        {"round": 1, "param_hash": "aa"},
        {"round": 2, "param_hash": "bb"},
        {"round": 3, "param_hash": "cc"},
    ]
    node_b = [{"round": 1, "param_hash": "aa"}, {"round": 2, "param_hash": "xx"}]
    # The last record of a round wins: node_c adopted round 2's canonical state after a first try.
    node_c = [
        {"round": 1, "param_hash": "aa"},
        {"round": 2, "param_hash": "yy"},
        {"round": 2, "param_hash": "bb"},
    ]
    assert hash_agreement([node_a, node_c]) == {
        "common_rounds": [1, 2],
        "disagreeing_rounds": [],
        "all_agree": True,
    }
    verdict = hash_agreement([node_a, node_b, node_c])
    assert verdict == {"common_rounds": [1, 2], "disagreeing_rounds": [2], "all_agree": False}
    assert hash_agreement([node_a, []])["all_agree"] is False  # nothing in common proves nothing


# --- real swarms through the CLI ---


@pytest.mark.timeout(240)
def test_three_node_swarm_trains_agrees_and_reports(tmp_path):
    root = tmp_path / "swarm"
    # A generous --max-wait: on a loaded machine a joiner may need long to be ready for round 1.
    command = swarm_command(root, 3, "--max-rounds", "3", "--min-peers", "3", "--max-wait", "120")
    completed = run_cli(command[3:], tmp_path, timeout=220)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]

    # The nodes' own metrics, read independently of the launcher.
    records = [round_records(root / f"node-{index}") for index in range(3)]
    for node_records in records:
        assert [r["round"] for r in node_records] == [1, 2, 3]
        assert all(r["peers"] == 3 and not r["fell_back"] and not r["adopted"] for r in node_records)
        assert node_records[-1]["eval_loss"] < node_records[0]["eval_loss"]
    for index in range(3):
        assert len({node_records[index]["param_hash"] for node_records in records}) == 1

    report = json.loads((root / "report.json").read_text())
    assert report["exit_codes"] == [0, 0, 0] and report["stopped_by"] == "finished"
    assert report["param_hash"] == {"common_rounds": [1, 2, 3], "disagreeing_rounds": [], "all_agree": True}
    for index, node in enumerate(report["nodes"]):
        assert node["eval_losses"] == [r["eval_loss"] for r in records[index]]
        assert node["bytes_sent"] == sum(r["bytes_sent"] for r in records[index]) > 0
    assert "every node held the same param_hash" in (root / "report.md").read_text()
    # Every node averaged with the others in rounds 2 and 3 (each node's first round is not counted).
    assert report["participation"] == {"num_pairs": 6, "num_averaged": 6, "participation": 1.0}
    assert report["problems"] == []
    for index, node in enumerate(report["nodes"]):
        assert (node["final_round"], node["final_param_hash"]) == (3, records[index][-1]["param_hash"])
        assert (root / f"node-{index}.pid").read_text() == f"{node['pid']}\n"

    # One streamed line per round per node; the launcher's settings reached the nodes.
    for index in range(3):
        for r in records[index]:
            loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"  # evaluated every few rounds
            expected = f"node-{index} round {r['round']} | eval_loss {loss} | peers 3 |"
            assert expected in completed.stdout
        config_text = (root / f"node-{index}" / "config.toml").read_text()
        assert f"shard_index = {index}\n" in config_text and "num_shards = 3\n" in config_text
        expected_threads = max(1, len(os.sched_getaffinity(0)) // 3)
        assert f"threads = {expected_threads}\n" in config_text
    assert "To join it from another machine" in (root / "node-0.log").read_text()


@pytest.mark.timeout(240)
def test_a_run_that_ends_split_and_alone_exits_1_with_the_reason(tmp_path):
    root = tmp_path / "swarm"
    # Node 1 trains without the swarm: two lineages, and node 0 has nobody to average with.
    command = swarm_command(
        root, 2, "--max-rounds", "2", "--start-peers", "1", "--node-flags", "1:--no-swarm"
    )
    completed = run_cli(command[3:], tmp_path, timeout=220)
    output = completed.stdout + completed.stderr
    assert completed.returncode == 1, output[-3000:]

    records = [round_records(root / f"node-{index}") for index in range(2)]
    assert [len(node_records) for node_records in records] == [2, 2]
    assert records[0][-1]["param_hash"] != records[1][-1]["param_hash"]
    assert all(r["peers"] <= 1 for node_records in records for r in node_records)
    reasons = [line for line in completed.stdout.splitlines() if line.startswith("dtnode swarm: FAILED: ")]
    assert len(reasons) == 1, output[-3000:]
    assert "final param_hash differs" in reasons[0] and "no round averaged two or more nodes" in reasons[0]
    report = json.loads((root / "report.json").read_text())
    assert report["exit_codes"] == [0, 0] and report["participation"]["num_averaged"] == 0
    assert "Verdict: **final param_hash differs" in (root / "report.md").read_text()


@pytest.mark.timeout(240)
def test_ctrl_c_stops_every_node_and_leaves_no_process(tmp_path):
    root = tmp_path / "swarm"
    output = tmp_path / "launcher.out"
    launcher = start_cli(swarm_command(root, 2)[3:], output, output)
    try:
        # A node takes SIGTERM as "stop after this step" once it trains: wait until both do.
        wait_for(
            lambda: all(has_step_record(root / f"node-{i}") for i in range(2)), 150, "two training nodes"
        )
        os.kill(launcher.pid, signal.SIGINT)
        code = launcher.wait(timeout=90)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(10)
    text = output.read_text()
    assert code == 0, text[-4000:]
    assert "stopping 2 node(s)" in text
    report = json.loads((root / "report.json").read_text())
    assert report["stopped_by"] == "signal" and report["exit_codes"] == [0, 0], text[-4000:]
    for index in range(2):
        assert f"node-{index} exited with code 0" in text
        assert "stop requested: checkpointing" in (root / f"node-{index}.log").read_text()
    assert processes_left([node["pid"] for node in report["nodes"]], str(root)) == []


wan_emulator = load_script("wan_emulator")
_no_namespaces = wan_emulator.unavailable_reason()


@pytest.mark.skipif(_no_namespaces is not None, reason=_no_namespaces or "")
@pytest.mark.timeout(180)
def test_link_mbit_runs_each_node_on_an_emulated_host(tmp_path):
    root = tmp_path / "swarm"
    command = swarm_command(root, 2, "--max-rounds", "1", "--min-peers", "2", "--link-mbit", "50")
    completed = run_cli(command[3:], tmp_path, timeout=160)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((root / "report.json").read_text())
    assert report["link_mbit"] == 50 and report["param_hash"]["all_agree"]
    for index in range(2):
        host = f"{wan_emulator.SUBNET_PREFIX}{index + 1}"
        assert f"node-{index} started" in completed.stdout and f"on emulated host {host}" in completed.stdout
        assert f"gRPC {host}:" in (root / f"node-{index}.log").read_text()
        assert round_records(root / f"node-{index}")[0]["peers"] == 2
