"""The benchmark's summary of dtnode's rounds, on hand-made worker reports with hand-computed answers."""

from __future__ import annotations

import json

import pytest

from tests.scripts.script_loader import load_script

records = load_script("allreduce_summary")  # what bench_allreduce.py makes of its peers' reports


def report(seconds: float, cpu_seconds: float, peak_rss: int, baseline_rss: int) -> str:
    record = {
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "bytes_sent": 1000,
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
