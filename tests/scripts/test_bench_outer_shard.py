"""scripts/bench/bench_outer_shard.py: one small real run (nano, tp=2, 2 rounds) prints records that hold."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.scripts.script_loader import script_path


@pytest.mark.timeout(180)
def test_a_small_run_shows_each_rank_holding_half_and_the_same_state() -> None:
    argv = [sys.executable, str(script_path("bench_outer_shard")), "--model", "nano", "--seq-len", "16",
            "--layouts", "tp2", "--rounds", "2"]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, timeout=170)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    record, summary = json.loads(lines[0]), json.loads(lines[1])
    assert record["layout"] == "tp2" and record["local_ranks"] == 2 and record["bit_identical"]
    params = record["params"]
    assert record["flat_outer_bytes_rank0"] == 8 * params  # global params + momentum, fp32
    assert sorted(record["outer_bytes_per_rank"]) == [4 * params, 4 * params]  # half of both each
    assert record["bytes_ratio"] == 0.5
    assert summary["met"] and summary["all_bit_identical"]
    assert lines[2].startswith("bench_outer_shard nano: tp2 (K=2)") and lines[2].endswith("MET")
