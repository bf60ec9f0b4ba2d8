"""The layouts as users run them: ``dtnode join --no-swarm --local-workers K ...``, timed from its own records.

Part of ``scripts/bench/bench_intranode.py`` (``--join``). Each layout is one real node process (the daemon is
rank 0 and drives K - 1 spawned workers, ``node/parallel/local.py``) training ``--join-steps`` inner steps of
one outer round. What is read back from its ``metrics.jsonl``:

    tokens_per_second: the median over the step records after ``--warmup-steps`` of the node's own
        ``tokens_per_s`` (its whole batch over the step's wall time, as the daemon sees it: command
        broadcast, every rank's forward/backward, the dp / tp / pipeline communication, AdamW);
    outer_round_seconds: wall time of the round's end on the daemon as its records show it (the time
        between the last step record and the round record: assembling the flat vector from the ranks,
        the outer step, setting it back on every rank, and the held-out eval).
    wall_seconds: the whole process, start-up (spawning and building every rank) included.

Every process runs one intra-op thread (``--threads 1``), so a K-process layout may use K cores while
``single`` uses one; ``single-2threads`` is that one process with both of this machine's cores, the fair
reference for the 2-process layouts. On 2 CPU cores more processes do not make a step faster than one
process using both cores: the numbers are the overhead of each layout's plumbing, not the speed-up the
layout gives on a GPU node.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from scripts.common import REPO_ROOT, print_json

# name -> (local workers, join flags)
JOIN_LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "single": (1, []),
    "single-2threads": (1, ["--threads", "2"]),  # argparse keeps the last --threads: the whole machine
    "tp2": (2, ["--tp", "2"]),
    "tp2-sp": (2, ["--tp", "2", "--sequence-parallel"]),
    "pp2-gpipe": (2, ["--pp", "2", "--pp-schedule", "gpipe"]),
    "pp2-1f1b": (2, ["--pp", "2", "--pp-schedule", "1f1b"]),
    "pp2-interleaved": (2, ["--pp", "2", "--pp-schedule", "interleaved"]),
    "dp2-zero1": (2, ["--dp", "2", "--zero", "1"]),
    "dp2-zero3": (2, ["--dp", "2", "--zero", "3"]),
    "tp2-pp2": (4, ["--tp", "2", "--pp", "2"]),
    "dp2-tp2": (4, ["--dp", "2", "--tp", "2"]),
}


def join_argv(
    layout: str,
    run_dir: Path,
    *,
    model: str,
    seq_len: int,
    batch_size: int,
    num_steps: int,
    num_microbatches: int,
) -> list[str]:
    num_workers, flags = JOIN_LAYOUTS[layout]
    argv = [
        sys.executable, "-m", "node.ops.cli", "join", "--no-swarm", "--run-dir", str(run_dir), "--model", model,
        "--seq-len", str(seq_len), "--batch-size", str(batch_size), "--inner-steps", str(num_steps),
        "--max-rounds", "1", "--eval-batches", "1", "--threads", "1", "--checkpoint-every", "0",
        "--log-every", "1000",
    ]  # fmt: skip
    if num_workers > 1:
        argv += ["--local-workers", str(num_workers)]
    argv += flags
    if "--pp" in flags:
        argv += ["--microbatches", str(num_microbatches)]
    return argv


def measure_join_layout(
    layout: str,
    work_dir: Path,
    *,
    model: str,
    seq_len: int,
    batch_size: int,
    num_steps: int,
    num_warmup_steps: int,
    num_microbatches: int,
    timeout_seconds: float,
) -> dict[str, Any]:
    """Run one layout through ``dtnode join`` and read its records; ``error`` set if it failed."""
    run_dir = work_dir / f"join-{layout}"
    argv = join_argv(
        layout, run_dir, model=model, seq_len=seq_len, batch_size=batch_size, num_steps=num_steps,
        num_microbatches=num_microbatches,
    )  # fmt: skip
    started = time.monotonic()
    try:
        result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        return {"layout": layout, "via": "dtnode join", "error": f"still running after {timeout_seconds:g} s"}
    wall_seconds = time.monotonic() - started
    if result.returncode != 0:
        last_lines = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
        return {"layout": layout, "via": "dtnode join", "error": last_lines[0]}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if record["kind"] == "step"]
    rounds = [record for record in records if record["kind"] == "round"]
    timed = [record["tokens_per_s"] for record in steps[num_warmup_steps:]]
    if not timed:
        return {"layout": layout, "via": "dtnode join", "error": f"no step after {num_warmup_steps} warm-up"}
    return {
        "layout": layout,
        "via": "dtnode join",
        "local_workers": JOIN_LAYOUTS[layout][0],
        "timed_steps": len(timed),
        "tokens_per_second": round(statistics.median(timed)),
        "outer_round_seconds": round(rounds[0]["time"] - steps[-1]["time"], 3) if rounds else None,
        "final_loss": round(steps[-1]["loss"], 4),
        "wall_seconds": round(wall_seconds, 1),
    }


def run_join_layouts(layouts: Sequence[str], **settings: Any) -> list[dict[str, Any]]:
    """Each of ``layouts`` (keys of ``JOIN_LAYOUTS``; ``settings``: ``measure_join_layout``'s); one JSON line each."""
    unknown = [layout for layout in layouts if layout not in JOIN_LAYOUTS]
    if unknown:
        raise ValueError(f"unknown join layouts {unknown}; known: {list(JOIN_LAYOUTS)}")
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-intranode-join-") as work_dir:
        for layout in layouts:
            record = measure_join_layout(layout, Path(work_dir), **settings)
            print_json(record)
            records.append(record)
    return records


def join_summary(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The summary's ``dtnode join`` part: tokens/s and wall seconds per layout, and the failed layouts."""
    ran = [record for record in records if "error" not in record]
    return {
        "join_tokens_per_second": {record["layout"]: record["tokens_per_second"] for record in ran},
        "join_wall_seconds": {record["layout"]: record["wall_seconds"] for record in ran},
        "join_failed": [record["layout"] for record in records if "error" in record],
    }


def join_summary_suffix(summary: Mapping[str, Any]) -> str:
    """The summary line's tail: ``; via dtnode join: single 6712, tp2 FAILED, ...`` (empty without --join)."""
    joined = {
        **summary.get("join_tokens_per_second", {}),
        **dict.fromkeys(summary.get("join_failed", []), "FAILED"),
    }
    return ("; via dtnode join: " + ", ".join(f"{k} {v}" for k, v in joined.items())) if joined else ""


def add_join_arguments(parser: argparse.ArgumentParser) -> None:
    """``--join``, ``--join-steps`` and ``--join-layouts`` of ``bench_intranode.py``."""
    parser.add_argument(
        "--join",
        action="store_true",
        help="also time the layouts through `dtnode join --no-swarm --local-workers K` (one process each)",
    )
    parser.add_argument("--join-steps", type=int, default=20, help="inner steps of each `dtnode join` run")
    parser.add_argument(
        "--join-layouts",
        nargs="+",
        choices=list(JOIN_LAYOUTS),
        default=list(JOIN_LAYOUTS),
        help="layouts of --join (K local workers and flags: JOIN_LAYOUTS in scripts/bench/intranode_join.py)",
    )
