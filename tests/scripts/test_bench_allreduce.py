"""The benchmark's summary of dtnode's rounds, on hand-made worker reports with hand-computed answers, and
the benchmark itself with the sparse codec on loopback (3 peers, one of them killed mid-round)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from protocol.codecs import get_codec
from tests.scripts.processes import kill_processes_mentioning, processes_mentioning
from tests.scripts.script_loader import load_script, script_path

REPO_ROOT = Path(__file__).resolve().parents[2]

records = load_script("allreduce_summary")  # what bench_allreduce.py makes of its peers' reports


def report(seconds: float, cpu_seconds: float, peak_rss: int, baseline_rss: int) -> str:
    record = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "bytes_sent": 1000,
        "bytes_recv": 1000,
        "max_abs_error": 0.0,
        "sha256": "same",
        "peak_rss_bytes": peak_rss,
        "baseline_rss_bytes": baseline_rss,
        "fell_back": False,
        "failures": [],
    }
    return json.dumps(record)


def test_steady_state_and_first_round_are_reported_apart() -> None:
    # 2 peers, 3 rounds, fp32 of 1000 numbers = 4000 wire bytes, 8 Mbit/s = 1e6 bytes/s.
    setup = records.Setup(num_peers=2, num_elements=1000, codec="none", link_mbit=8.0, num_rounds=3, seed=0)
    peer_0 = [report(5.0, 0.1, 300, 200), report(3.0, 0.5, 400, 200), report(2.0, 0.9, 500, 200)]
    peer_1 = [report(4.0, 0.2, 300, 100), report(2.5, 0.7, 400, 100), report(3.5, 1.1, 450, 100)]
    run = records.PeerRun(stdouts=["\n".join(peer_0), "\n".join(peer_1)], error=None, tx_bytes=None)

    summary = records.summarize_dtnode(setup, run)

    # A round takes as long as its fastest peer; the steady state is the median of rounds 1 and 2.
    assert summary["seconds_per_round"] == [4.0, 2.5, 2.0]
    assert summary["first_round_seconds"] == 4.0
    assert summary["seconds"] == pytest.approx(2.25)
    assert "rounds 1..2" in summary["seconds_statistic"]
    link_bound = 2 * (2 - 1) / 2 * 4000 / 1e6
    assert summary["link_bound_seconds"] == pytest.approx(link_bound)
    assert summary["link_efficiency"] == pytest.approx(link_bound / 2.25, abs=1e-4)
    assert summary["first_round_link_efficiency"] == pytest.approx(link_bound / 4.0, abs=1e-4)
    assert summary["cpu_seconds_per_peer"] == pytest.approx((0.5 + 0.9 + 0.7 + 1.1) / 4)
    # Both peers' CPU work spread over this machine's cores.
    assert summary["cpu_bound_seconds"] == pytest.approx(2 * 0.8 / (os.cpu_count() or 1), abs=1e-4)
    # Raw peak: the largest process; above baseline: each peer against its own baseline.
    assert summary["peak_rss_bytes_per_peer"] == 500
    assert summary["baseline_rss_bytes_per_peer"] == 200
    assert summary["peak_rss_above_baseline_bytes"] == 350
    assert summary["peak_rss_above_baseline_x_vector"] == pytest.approx(350 / 4000, abs=1e-3)

    record = {"peers": 2, "codec": "none", "elements": 1000, "link_mbit": 8.0, **summary}
    record["targets"] = records.evaluate_targets(setup, record)
    line = records.summary_line(record)
    assert "dtnode 2.25 s (first round 4.00 s" in line and "first round 0.00" in line


def test_a_single_round_is_its_own_steady_state() -> None:
    setup = records.Setup(num_peers=2, num_elements=1000, codec="int8", link_mbit=None, num_rounds=1, seed=0)
    run = records.PeerRun(
        stdouts=[report(1.5, 0.3, 300, 200), report(1.0, 0.3, 300, 200)], error=None, tx_bytes=None
    )
    summary = records.summarize_dtnode(setup, run)
    assert summary["seconds"] == summary["first_round_seconds"] == 1.0
    assert summary["link_efficiency"] is None and summary["first_round_link_efficiency"] is None
    assert "rounds 0..0" in summary["seconds_statistic"]


def test_sparse_link_bound_is_the_busiest_uplink_of_design_a() -> None:
    # N = 4 equal parts of 250 000 numbers, chunks of 100 000: two full chunks and one of 50 000 a part.
    setup = records.Setup(
        num_peers=4, num_elements=1_000_000, codec="topk", link_mbit=100.0, num_rounds=3, seed=0,
        chunk_num_elements=100_000,
    )  # fmt: skip
    codec = get_codec("topk")
    part = 2 * codec.encoded_num_bytes(100_000) + codec.encoded_num_bytes(50_000)  # k_j, one member's
    # Each member pushes its payload for the 3 other parts, then serves its part's bundle (4 payloads) to 3.
    busiest = 3 * part + 3 * 4 * part
    assert setup.uplink_bytes_per_member() == [busiest] * 4
    assert setup.link_bound_seconds == pytest.approx(busiest / 12.5e6)
    record = {"link_efficiency": 0.79, "peak_rss_above_baseline_x_vector": 1.0}
    assert records.evaluate_targets(setup, record)["link_efficiency"] == {
        "value": 0.79,
        "min": 0.8,
        "pass": False,
    }
    # A dense codec keeps the butterfly's 2 (N - 1) / N of the encoded vector.
    dense = records.Setup(num_peers=4, num_elements=1000, codec="none", link_mbit=8.0, num_rounds=1, seed=0)
    assert dense.uplink_bytes_per_member() == [2 * 3 / 4 * 4000] * 4


NUM_ELEMENTS, CHUNK = 300_000, 32_768  # parts of 100 000 numbers: three full chunks and a short one


def run_bench(tmp_path: Path, *extra: str) -> dict[str, Any]:
    """bench_allreduce.py with topk on loopback, 3 peers; its one JSON record (every peer stopped)."""
    json_out = tmp_path / "records.json"
    command = [
        sys.executable, str(script_path("bench_allreduce")),
        "--peers", "3", "--elements", str(NUM_ELEMENTS), "--codec", "topk", "--topk-density", "0.03",
        "--rounds", "2", "--chunk-elements", str(CHUNK), "--json-out", str(json_out),
        "--keep-logs", str(tmp_path / "logs"), *extra,
    ]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=REPO_ROOT)
    finally:
        kill_processes_mentioning(str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not processes_mentioning(str(tmp_path))
    (record,) = json.loads(json_out.read_text())
    return record


@pytest.mark.timeout(180)
def test_topk_round_on_loopback_is_the_exact_mean_of_what_was_sent(tmp_path: Path) -> None:
    record = run_bench(tmp_path)

    codec = get_codec("topk", density=0.03)
    assert record["codec"] == "topk" and record["topk_density"] == 123 / 4096  # ceil(0.03 * 4096) of 4096
    assert record["wire_bytes"] == codec.encoded_num_bytes(NUM_ELEMENTS)
    # The reference: each peer's top-k payloads decoded and summed in member order (sparse_mean_error).
    assert record["max_abs_error"] == 0.0 and record["max_abs_error_per_round"] == [0.0, 0.0]
    assert record["bit_identical"] is True and record["fell_back"] is False and record["failures"] == []
    assert len(record["seconds_per_round"]) == 2 and record["link_bound_seconds"] is None
    # hivemind has no sparse codec: no run, and the record says why.
    assert record["hivemind_seconds"] is None and "sparse" in record["hivemind_skipped"]
    # Design (a): 3 parts of 100 000 numbers, chunks of 32 768: up_i = 2 k + (3 - 1) * 3 k = 8 k.
    part = 3 * codec.encoded_num_bytes(CHUNK) + codec.encoded_num_bytes(100_000 - 3 * CHUNK)
    assert record["wire_bytes_ideal_per_peer"] == record["busiest_link_bytes"] == 8 * part
    # What the peers counted on the wire (received: a peer done early may not have served all yet, so its
    # bytes sent undercount; download = upload here): those payloads plus the messages' headers.
    assert 8 * part <= record["wire_bytes_received_per_peer"] <= 1.05 * 8 * part
    assert "killed_member" not in record and "survivors_bit_identical" not in record["targets"]


@pytest.mark.timeout(180)
def test_topk_survivors_agree_bit_for_bit_when_a_member_is_killed_mid_round(tmp_path: Path) -> None:
    # Member 2 (owner of part 2) dies after serving its second average chunk, in the round after the timed ones.
    record = run_bench(tmp_path, "--kill-member", "serve_chunk:1", "--no-hivemind")

    assert record["killed_member"] == 2 and record["kill_fault"] == "serve_chunk:2:1:kill"
    assert record["survivors_bit_identical"] is True and record["killed_round_fell_back"] is False
    assert record["targets"]["survivors_bit_identical"]["pass"] is True
    # The survivors saw it die, and hold the exact mean over the contributors they report.
    assert any("peer-2" in failure for failure in record["killed_round_failures"])
    assert record["killed_round_max_abs_error"] == 0.0 and record["killed_round_contributors_agree"] is True
    # The timed rounds before it are whole.
    assert record["bit_identical"] is True and record["max_abs_error"] == 0.0
