"""scripts/bench/bench_sim_utilization.py: one point (1B, 8 nodes, links of 50 Mbit/s, too slow for
a round to hide behind a phase) against a hand computation: the inner step from its FLOPs, the int8
all-reduce's bytes and seconds from the codec's layout and the links, and the utilization of each
schedule from the daemon's rule; then the 95% crossing on a curve whose answer is known."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.scripts.script_loader import load_script

bench = load_script("bench_sim_utilization")

pytestmark = pytest.mark.timeout(120)

NODES, H, F = 8, 100, 4
PARAMS = 1_000_000_000
LINK_BYTES_PER_S = 50e6 / 8
LATENCY_S = 0.025
FORMATION_BOUND_S = 5.0  # join window aside, equal nodes form in a few seconds (DHT delays, refreshes)


def int8_part_bytes(num_numbers: int) -> int:
    """A part in chunks of 2^18 numbers, each 1 byte a number plus a 4-byte scale per 256 started."""
    chunk = 1 << 18
    sizes = [chunk] * (num_numbers // chunk) + ([num_numbers % chunk] if num_numbers % chunk else [])
    return sum(n + 4 * math.ceil(n / 256) for n in sizes)


def hand_allreduce(vector_length: int) -> tuple[int, float]:
    """Bytes a member sends and the seconds of an int8 butterfly of 8 equal members over equal links:
    each phase moves 7 parts' bytes each way at the link rate, then two round trips between the two
    farthest members (2 × 2 × (25 + 25) ms)."""
    part = int8_part_bytes(vector_length // NODES)
    sent = 2 * (NODES - 1) * part
    return sent, sent / LINK_BYTES_PER_S + 2 * 2 * 2 * LATENCY_S


def test_one_slow_point_against_a_hand_computation(tmp_path: Path) -> None:
    out = tmp_path / "points.json"
    argv = ["--sizes", "1", "--gpus", "8", "--links", "0.05", "--rounds", "2", "--json-out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    points = {p["setting"]: p for p in result["points"]}
    assert set(points) == {
        "int8",
        "int8 --overlap",
        f"int8 F={F} τ=H/F",
        "topk",
        "topk --overlap",
        f"topk F={F} τ=H/F",
    }

    step = 6 * PARAMS * 2**20 / (8 * 989e12 * 0.40)  # 1.988 s
    for name, fragments in (("int8", 1), ("int8 --overlap", 1), (f"int8 F={F} τ=H/F", F)):
        point = points[name]
        phase = H // fragments * step
        sent, allreduce = hand_allreduce(PARAMS // fragments)
        assert point["step_seconds"] == pytest.approx(step, abs=1e-4)
        assert point["phase_seconds"] == pytest.approx(phase, abs=1e-3)
        assert point["bytes_sent_per_round"] == sent
        assert point["allreduce_seconds"] == pytest.approx(allreduce, abs=1e-3)
        # C: the all-reduce plus a formation of a few seconds; it does not fit in a phase.
        seconds = point["round_seconds"]
        assert allreduce < seconds < allreduce + FORMATION_BOUND_S
        assert seconds > phase
        hidden = phase if point["overlap"] else 0.0
        assert point["utilization"] == pytest.approx(phase / (phase + seconds - hidden), abs=1e-4)

    whole = hand_allreduce(PARAMS)[1]
    # Synchronous: compute / (compute + the whole round); the simulator's own figure says the same.
    sync = points["int8"]
    assert sync["utilization"] == pytest.approx(sync["simulated_utilization"], abs=1e-4)
    phase = H * step
    assert phase / (phase + whole + FORMATION_BOUND_S) < sync["utilization"] < phase / (phase + whole)
    assert 0.40 < sync["utilization"] < 0.42  # 198.8 / (198.8 + 284.6 + formation)
    # --overlap: the next phase hides 198.8 s of the 284.6 s round: utilization = phase / C.
    overlap = points["int8 --overlap"]
    assert phase / (whole + FORMATION_BOUND_S) < overlap["utilization"] < phase / whole
    assert 0.68 < overlap["utilization"] < 0.70
    # F = 4, τ = 25 steps: a quarter of the bytes behind a quarter of the phase: the same share hidden.
    fragment = points[f"int8 F={F} τ=H/F"]
    phase_f, whole_f = H // F * step, hand_allreduce(PARAMS // F)[1]
    assert phase_f / (whole_f + FORMATION_BOUND_S) < fragment["utilization"] < phase_f / whole_f

    # Top-k's relay: (N - 1)(N + 1)/N of a member's payload k = P · 0.0209 (ARCHITECTURE.md's table).
    topk = points["topk"]
    assert topk["bytes_sent_per_round"] == pytest.approx(
        (NODES - 1) * (NODES + 1) / NODES * PARAMS * 0.02094, rel=0.01
    )
    assert points["topk --overlap"]["utilization"] == 1.0  # 26 s of all-reduce behind a 199 s phase


def test_the_crossing_of_a_curve_of_known_shape() -> None:
    # C = 2 + 10 / rate; a synchronous phase of 100 s reaches 95% where C = 100 / 0.95 - 100.
    curve = [(rate, 2 + 10 / rate) for rate in (0.5, 1.0, 10.0, 100.0)]
    expected = 10 / (100 / 0.95 - 100 - 2)
    assert bench.crossing_gbit(curve, phase_seconds=100.0, hidden_seconds=0.0) == pytest.approx(expected)
    # With the phase hidden, the round may last 100 / 0.95 s: reached below the grid's lowest rate.
    assert bench.crossing_gbit(curve, phase_seconds=100.0, hidden_seconds=100.0) == 0.5
    assert bench.crossing_gbit([(1.0, 50.0), (10.0, 40.0)], phase_seconds=100.0, hidden_seconds=0.0) is None
