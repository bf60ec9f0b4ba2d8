"""scripts/bench/bench_gpu.py: its dry run on CPU, its figures from what it timed, its verdict line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.scripts.script_loader import load_script

bench = load_script("bench_gpu")


def test_throughput_counts_only_the_steps_after_warmup() -> None:
    # 2 warm-up steps of 10 s (compilation), then 3 steps of 0.5 s with 1000 tokens each.
    assert bench.window_tokens_per_s([10.0, 10.0, 0.5, 0.5, 0.5], 1000, 2) == pytest.approx(2000.0)


def test_summary_line_says_dry_run_on_cpu_and_fail_below_target() -> None:
    record = {"model": "nano", "device": "cpu", "node_tokens_per_s": 900, "bare_tokens_per_s": 1000,
              "node_vs_bare": 0.9, "round_fixed_seconds_mean": 0.5, "met": None}  # fmt: skip
    assert bench.summary_line([record]).endswith(": DRY RUN (cpu)")
    gpu = {**record, "device": "cuda", "device_name": "NVIDIA H100", "met": False}
    line = bench.summary_line([gpu])
    assert line.startswith(
        "bench_gpu (NVIDIA H100): nano node 900 tok/s = 90.0% of bare 1,000"
    ) and line.endswith("FAIL")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_device_exits_2() -> None:
    assert bench.main(["--models", "nano"]) == 2


@pytest.mark.timeout(600)
def test_dry_run_on_cpu_measures_both_loops_and_the_rounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.json"
    argv = ["--device", "cpu", "--models", "nano", "--steps", "4", "--warmup", "1", "--rounds", "3",
            "--round-steps", "2", "--eval-batches", "1", "--json-out", str(out)]  # fmt: skip
    # One intra-op thread: a second one only spins on the busy test machine (15.5 -> 3.0 CPU-s here). The
    # dry run's figures are whatever this CPU gives; what is checked holds for any thread count.
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(previous_threads)
    lines = capsys.readouterr().out.strip().splitlines()
    record, summary = json.loads(lines[0]), json.loads(lines[1])
    assert json.loads(out.read_text()) == [record] and summary["met"] is True
    assert record["params"] == 919_680 and record["precision"] == "fp32" and record["compile"] is False
    assert record["node_tokens_per_s"] > 0 and record["bare_tokens_per_s"] > 0
    # The record's tokens/s are rounded to integers (a loaded CPU may run only tens of tokens/s) and
    # the ratio, from the unrounded rates, to 4 digits: the bound of those roundings.
    node, bare = record["node_tokens_per_s"], record["bare_tokens_per_s"]
    rounding = node / bare * (0.5 / node + 0.5 / bare) * 1.01 + 5e-5
    assert record["node_vs_bare"] == pytest.approx(node / bare, abs=rounding)
    # 3 rounds: the fixed cost of rounds 2 and 3, each the record's wall minus compute, not negative.
    assert record["rounds"] == 3 and len(record["round_fixed_seconds"]) == 2
    assert min(record["round_fixed_seconds"]) >= 0 and record["met"] is None
    assert lines[2].startswith("bench_gpu (cpu): nano node ") and lines[2].endswith("DRY RUN (cpu)")
