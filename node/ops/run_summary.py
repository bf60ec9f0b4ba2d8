"""The one line ``dtnode join`` logs when its run ends, read back from ``metrics.jsonl``.

The line is built from the round records this process wrote (those stamped at or after its start:
a resumed run appends to the same file), so it states what the records state: the rounds this run
did, the last held-out loss measured (``eval_loss`` is null in rounds without an eval), the wire
bytes of those rounds' all-reduces plus the state this node fetched, the run's utilization (inner
compute over the wall time its round records cover, the last round's included:
``node.ops.metrics.run_utilization``), the wall time, and where the metrics and the exported model are
(``dtnode report RUN_DIR`` draws the plots from them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from node.ops.metrics import read_metrics, run_utilization


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What one process's run did, from its round records."""

    num_rounds: int
    first_round: int | None
    last_round: int | None
    eval_loss: float | None
    """The last held-out loss of this run (None if no round evaluated)."""
    eval_round: int | None
    bytes_sent: int
    bytes_received: int
    """All-reduce bytes received plus the verified bytes of state fetched."""
    compute_seconds: float
    """Inner compute of those rounds, over ``rounds_wall_seconds``: from the first step to the last record."""
    rounds_wall_seconds: float
    utilization: float | None
    wall_seconds: float


def summarize_run(metrics_path: Path, *, started: float, ended: float) -> RunSummary:
    """The summary of the round records written between ``started`` and ``ended`` (epoch seconds)."""
    rounds = [
        record for record in read_metrics(metrics_path, kind="round") if record.get("time", 0) >= started
    ]
    evaluated = [record for record in rounds if _finite(record.get("eval_loss"))]
    compute, rounds_wall, share = run_utilization(rounds)
    return RunSummary(
        num_rounds=len(rounds),
        first_round=rounds[0]["round"] if rounds else None,
        last_round=rounds[-1]["round"] if rounds else None,
        eval_loss=evaluated[-1]["eval_loss"] if evaluated else None,
        eval_round=evaluated[-1]["round"] if evaluated else None,
        bytes_sent=sum(int(record.get("bytes_sent") or 0) for record in rounds),
        bytes_received=sum(
            int(record.get("bytes_recv") or 0) + int(record.get("bytes_recv_state_sync") or 0)
            for record in rounds
        ),
        compute_seconds=compute,
        rounds_wall_seconds=rounds_wall,
        utilization=share,
        wall_seconds=max(0.0, ended - started),
    )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def format_duration(seconds: float) -> str:
    """``0.4 s``, ``42 s``, ``5 min 34 s``, ``2 h 03 min``: under 10 s to a tenth, so that a short run's
    compute and wall time (0.4 s of 1.3 s) are not rounded into "0 s of 1 s"."""
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def summary_line(summary: RunSummary, run_dir: Path) -> str:
    """One line: rounds, final held-out loss, bytes, utilization, wall time, where the results are."""
    if summary.num_rounds == 0:
        rounds = "no round completed"
    elif summary.first_round == summary.last_round:
        rounds = f"round {summary.last_round}"
    else:
        rounds = f"{summary.num_rounds} rounds ({summary.first_round}-{summary.last_round})"
    loss = "no held-out loss measured"
    if summary.eval_loss is not None:
        loss = f"held-out loss {summary.eval_loss:.4f} (round {summary.eval_round})"
    traffic = f"sent {summary.bytes_sent / 1e6:.1f} MB, received {summary.bytes_received / 1e6:.1f} MB"
    busy = ""
    if summary.utilization is not None:
        busy = (
            f", utilization {summary.utilization:.2f} (inner compute {format_duration(summary.compute_seconds)}"
            f" of {format_duration(summary.rounds_wall_seconds)} from the first step to the last round)"
        )
    metrics = run_dir / "metrics.jsonl"
    return (
        f"run ended: {rounds}, {loss}, {traffic}{busy}, {format_duration(summary.wall_seconds)}; "
        f"metrics {metrics} (plots: dtnode report {run_dir})"
    )
