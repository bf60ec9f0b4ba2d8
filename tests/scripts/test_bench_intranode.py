"""scripts/bench/bench_intranode.py: bubble formulas and verdict on hand-made records, then one tiny real run."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.scripts.script_loader import load_script, script_path

bench = load_script("bench_intranode")

SETTINGS = bench.Settings(
    model="nano",
    seq_len=16,
    batch_size=4,
    num_steps=2,
    num_warmup_steps=1,
    num_microbatches=2,
    bubble_microbatches=(2, 4),
    reference_threads=1,
    timeout=bench.timedelta(seconds=60),
)


def test_theory_bubble_is_p_minus_one_over_m_plus_p_minus_one() -> None:
    assert bench.theory_bubble(2, 2) == pytest.approx(1 / 3)
    assert bench.theory_bubble(2, 8) == pytest.approx(1 / 9)
    assert bench.theory_bubble(4, 4) == pytest.approx(3 / 7)
    assert bench.theory_bubble(1, 4) == 0.0


def test_measured_bubble_uses_the_slowest_stage() -> None:
    # m = 4 micro-batches, slowest stage 0.2 s each: 0.8 s busy in a 1.2 s step -> 1/3 idle.
    assert bench.measured_bubble(1.2, [0.1, 0.2], 4) == pytest.approx(1 / 3)
    assert bench.measured_bubble(0.8, [0.2, 0.2], 4) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        bench.measured_bubble(0.0, [0.1], 2)


def test_settings_reject_a_microbatch_count_that_does_not_divide_the_batch() -> None:
    with pytest.raises(ValueError):
        bench.Settings(**{**vars(SETTINGS), "bubble_microbatches": (3,)})


def _ranks(step_seconds: list[float], state_bytes: list[int]) -> list[dict[str, Any]]:
    return [
        {"step_seconds": seconds, "optimizer_state_bytes": size}
        for seconds, size in zip(step_seconds, state_bytes, strict=True)
    ]


def test_layout_record_takes_the_slowest_rank_and_the_ratio_to_the_reference() -> None:
    record = bench.layout_record("dp2-zero1", SETTINGS, _ranks([0.1, 0.2], [600, 400]), 1000)
    assert record["step_seconds_median"] == 0.2
    assert record["tokens_per_second"] == 4 * 16 / 0.2
    assert record["optimizer_state_ratio_per_rank"] == [0.6, 0.4]


def test_verdict_fails_when_zero_does_not_shard_or_a_layout_fails() -> None:
    single = bench.layout_record("single", SETTINGS, _ranks([1.0], [1000]), 1000)
    zero = bench.layout_record("dp2-zero1", SETTINGS, _ranks([0.5, 0.5], [510, 490]), 1000)
    fsdp_unsharded = bench.layout_record("dp2-fsdp", SETTINGS, _ranks([0.5, 0.5], [1000, 1000]), 1000)
    assert bench.summary_object([single, zero], 0.6)["ok"]
    summary = bench.summary_object([single, zero, fsdp_unsharded], 0.6)
    assert not summary["ok"]
    assert summary["max_state_ratio"]["dp2-fsdp"] == 1.0
    failed = bench.summary_object([single, zero, {"layout": "tp2", "error": "boom"}], 0.6)
    assert not failed["ok"] and failed["failed"] == ["tp2"]
    assert bench.summary_line(failed).startswith("FAIL:") and "tp2 FAILED" in bench.summary_line(failed)


@pytest.mark.timeout(240)
def test_tiny_run_shards_the_optimizer_state_and_measures_the_bubble() -> None:
    argv = [
        sys.executable, str(script_path("bench_intranode")), "--layouts", "pp2-1f1b", "dp2-zero1",
        "--seq-len", "16", "--batch-size", "4", "--steps", "2", "--warmup-steps", "1", "--microbatches", "2",
        "--bubble-microbatches", "2", "--reference-threads", "1", "--timeout", "150",
    ]  # fmt: skip
    # ~30 s alone; bounds for a machine whose cores parallel tests share.
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=200, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.strip().splitlines()
    records = [json.loads(line) for line in lines[:-1]]
    assert [record.get("layout") for record in records[:-1]] == ["single", "pp2-1f1b", "dp2-zero1"]
    single, pipeline, zero = records[:3]
    # ZeRO-1 and the pipeline each hold about half the AdamW moments (whole parameters per rank/stage).
    for record in (pipeline, zero):
        ratios = record["optimizer_state_ratio_per_rank"]
        assert sum(ratios) == pytest.approx(1.0, abs=1e-3)
        assert max(ratios) < 0.6
    assert single["optimizer_state_bytes_per_rank"][0] > 0
    (bubble,) = pipeline["bubble"]
    assert bubble["theory_bubble"] == pytest.approx(1 / 3, abs=1e-4)
    assert bubble["measured_bubble"] < 1.0 and bubble["step_seconds"] > 0
    assert records[-1]["ok"] is True
    assert lines[-1].startswith("OK:")


@pytest.mark.timeout(120)
def test_a_layout_timed_through_dtnode_join(tmp_path) -> None:
    """One real `dtnode join --local-workers 2 --tp 2` run, read back from its own records."""
    join = load_script("intranode_join")
    record = join.measure_join_layout(
        "tp2", tmp_path, model="nano", seq_len=16, batch_size=4, num_steps=4, num_warmup_steps=1,
        num_microbatches=2, timeout_seconds=100,
    )  # fmt: skip
    assert "error" not in record, record
    assert record["local_workers"] == 2 and record["tokens_per_second"] > 0
    assert record["outer_round_seconds"] is not None and record["outer_round_seconds"] >= 0


def test_join_summary_reports_tokens_wall_time_and_failed_layouts() -> None:
    join = load_script("intranode_join")
    records = [
        {"layout": "single", "tokens_per_second": 6712, "wall_seconds": 7.7},
        {"layout": "tp2", "error": "RuntimeError: boom"},
        {"layout": "dp2-zero1", "tokens_per_second": 5597, "wall_seconds": 11.2},
    ]
    summary = join.join_summary(records)
    assert summary["join_tokens_per_second"] == {"single": 6712, "dp2-zero1": 5597}
    assert summary["join_wall_seconds"] == {"single": 7.7, "dp2-zero1": 11.2}
    assert summary["join_failed"] == ["tp2"]
    assert join.join_summary_suffix(summary) == "; via dtnode join: single 6712, dp2-zero1 5597, tp2 FAILED"
    assert join.join_summary_suffix({}) == ""
    with pytest.raises(ValueError):
        join.run_join_layouts(["tp3"], model="nano")


def test_join_argv_passes_the_layout_flags_and_microbatches_only_to_pipelines(tmp_path) -> None:
    join = load_script("intranode_join")
    common = {"model": "nano", "seq_len": 16, "batch_size": 4, "num_steps": 3, "num_microbatches": 2}
    single = join.join_argv("single", tmp_path, **common)
    assert "--local-workers" not in single and "--no-swarm" in single
    two_threads = join.join_argv("single-2threads", tmp_path, **common)
    threads = [two_threads[index + 1] for index, arg in enumerate(two_threads) if arg == "--threads"]
    assert "--local-workers" not in two_threads and threads[-1] == "2"  # argparse keeps the last value
    pipeline = join.join_argv("pp2-1f1b", tmp_path, **common)
    assert pipeline[pipeline.index("--local-workers") + 1] == "2"
    assert pipeline[pipeline.index("--pp-schedule") + 1] == "1f1b"
    assert pipeline[pipeline.index("--microbatches") + 1] == "2"
    mixed = join.join_argv("dp2-tp2", tmp_path, **common)
    assert mixed[mixed.index("--local-workers") + 1] == "4" and "--microbatches" not in mixed
