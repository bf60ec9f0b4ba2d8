"""scripts/bench/bench_join.py end to end with the nano model: a joiner fetches the state over a capped link
and contributes to a round; Ctrl-C leaves no process or namespace behind.

The figures are checked against independent references: the fetched state is the fp32 global params
plus the fp32 outer momentum (8 bytes per parameter, plus a small JSON metadata), the link cap makes
the fetch at least about as slow as state_bytes / link rate, and the joiner's params after its first
round are the swarm's.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.node.forked_cli import run_cli
from tests.scripts.processes import processes_mentioning
from tests.scripts.script_loader import SCRIPTS_DIR, load_script, script_path

wan_emulator = load_script("wan_emulator")
_reason = wan_emulator.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

REPO_ROOT = SCRIPTS_DIR.parent
NANO_PARAMS = 919_680  # the nano preset on the embedded corpus (tests/node/ops/test_swarm_cli.py)
MAX_METADATA_BYTES = 4096
LINK_MBIT = 100.0
BENCH = [sys.executable, str(script_path("bench_join")), "--model", "nano", "--inner-steps", "10"]


def emulator_namespaces(owner_pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"dtwan-{owner_pid}-")]


@pytest.mark.timeout(240)
def test_joiner_fetches_the_state_and_contributes_a_round(tmp_path: Path) -> None:
    json_out = tmp_path / "trials.json"
    # Forked from a preloaded server, as its nodes are (tests/node/forked_cli.py): a fresh interpreter's
    # imports cost about 4 CPU-seconds each, as much as a node's rounds here. On a timeout, Ctrl-C makes
    # the benchmark stop its nodes and namespaces.
    argv = [*BENCH[2:], "--link-mbit", str(LINK_MBIT), "--timeout", "150", "--json-out", str(json_out)]
    bench = run_cli(argv, tmp_path, timeout=220, script=Path(BENCH[1]))
    stdout, stderr = bench.stdout, bench.stderr
    assert bench.returncode == 0, stderr[-4000:]
    lines = stdout.strip().splitlines()
    assert len(lines) == 2, stdout  # one trial's JSON, then the summary
    record = json.loads(lines[0])
    assert json.loads(json_out.read_text()) == [record]
    assert lines[1].startswith("bench_join: nano (919,680 params")

    assert record["model"] == "nano" and record["nodes"] == 2 and record["link_mbit"] == LINK_MBIT
    assert record["cap_downlink"] is True and record["bound_link"] == "joiner_downlink"
    assert record["params"] == NANO_PARAMS
    # Global params and outer momentum, fp32 each, plus the JSON metadata.
    assert 8 * NANO_PARAMS < record["state_bytes"] < 8 * NANO_PARAMS + MAX_METADATA_BYTES
    bound = record["state_bytes"] * 8 / (LINK_MBIT * 1e6)
    assert record["bound_seconds"] == pytest.approx(bound, abs=1e-3)
    assert record["target_seconds"] == pytest.approx(1.5 * bound + 10, abs=1e-3)
    # The joiner's capped downlink: no fetch beats the link (a tbf burst of a few tens of kB aside).
    assert record["fetch_seconds"] >= 0.9 * bound
    assert record["met"] == (record["seconds_to_first_round"] <= record["target_seconds"])

    # The joiner contributed to a round with the swarm and ended it on the swarm's params.
    assert record["first_round_peers"] == 3
    assert record["param_hash_matches_swarm"] is True
    assert record["num_adoptions"] >= 1 and not record["join_fetch_failed"]
    timeline = record["timeline"]
    # The fetch runs while the trainer is being built (node/swarm/join.py): both come after the DHT and
    # before the load; the rest is one sequence.
    events = ["swarm_up", "join_decided", "fetched", "adopted", "last_inner_step", "first_round"]
    times = [timeline[event] for event in events]
    assert all(t is not None and t > 0 for t in times), timeline
    assert times == sorted(times), timeline
    assert timeline["swarm_up"] <= timeline["trainer_ready"] <= timeline["adopted"], timeline
    assert record["startup_seconds"] == timeline["join_decided"]
    assert record["seconds_to_state"] == timeline["adopted"]
    assert record["seconds_to_first_round"] == pytest.approx(timeline["first_round"], abs=1e-3)
    assert record["inner_phase_seconds"] > 0 and record["round_seconds"] > 0
    # A catch-up with a round's mean is one of the adoptions, after the first, before the phase ends.
    assert record["num_caught_up"] <= record["num_adoptions"]
    if record["num_caught_up"]:
        assert timeline["adopted"] <= timeline["caught_up"] <= timeline["last_inner_step"], timeline
        assert 0 < record["caught_up_megabytes"] * 1e6 < record["state_bytes"]
    else:
        assert timeline["caught_up"] is None and record["caught_up_megabytes"] == 0
    assert emulator_namespaces(bench.pid) == []


@pytest.mark.timeout(120)
def test_ctrl_c_stops_every_node_and_namespace(tmp_path: Path) -> None:
    bench = subprocess.Popen(
        [*BENCH, "--keep-logs", str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    node_log = tmp_path / "trial-0" / "node-0.log"
    try:
        deadline = time.monotonic() + 60
        while b"started a new swarm" not in (node_log.read_bytes() if node_log.exists() else b""):
            assert time.monotonic() < deadline, "node 0 did not start within 60 s"
            assert bench.poll() is None, bench.communicate()[1][-4000:]
            time.sleep(0.2)
        assert processes_mentioning(str(tmp_path))  # the swarm's first node is running
        assert emulator_namespaces(bench.pid)

        bench.send_signal(signal.SIGINT)
        assert bench.wait(timeout=60) == 130
    finally:
        if bench.poll() is None:  # a failed assertion above: do not leave the benchmark running
            bench.send_signal(signal.SIGINT)
            bench.wait(timeout=60)
    assert emulator_namespaces(bench.pid) == []
    assert processes_mentioning(str(tmp_path)) == []
