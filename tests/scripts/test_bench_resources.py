"""scripts/bench/bench_resources.py's growth measure against hand-computed series."""

from __future__ import annotations

import pytest

from tests.scripts.script_loader import load_script

bench_resources = load_script("bench_resources")
MIB = 2**20


def test_a_flat_series_after_warm_up_has_no_growth() -> None:
    rss = [50 * MIB + 3 * MIB * i for i in range(10)] + [100 * MIB] * 30  # warm-up, then flat
    result = bench_resources.growth(rss, warmup=10)
    assert (result["baseline_bytes"], result["final_bytes"], result["growth_bytes"]) == (
        100 * MIB,
        100 * MIB,
        0,
    )
    assert result["slope_bytes_per_round"] == 0 and result["peak_bytes"] == 100 * MIB


def test_a_leak_of_one_mib_per_round_is_measured() -> None:
    rss = [100 * MIB + MIB * i for i in range(40)]
    result = bench_resources.growth(rss, warmup=10)
    # Medians of rounds 10..19 and 30..39: 114.5 and 134.5 MiB.
    assert result["growth_bytes"] == 20 * MIB
    assert result["growth_fraction"] == round(20 / 114.5, 4)
    assert result["slope_bytes_per_round"] == MIB


def test_too_few_rounds_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 30 rounds"):
        bench_resources.growth([MIB] * 29, warmup=10)
