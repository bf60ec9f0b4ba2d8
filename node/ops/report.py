"""``dtnode report RUN_DIR…``: plots and a markdown summary of runs, from their ``metrics.jsonl``.

A RUN_DIR is one node's run directory (it holds ``metrics.jsonl``) or a ``dtnode swarm`` directory
(``node-<i>/metrics.jsonl``); several may be given to compare runs. Everything is read from the
records of ``node/ops/metrics.py``: step records give the training loss, tokens and throughput, round
records the held-out loss, bytes on the wire, peers and utilization. Four PNGs and ``report.md`` are
written into the output directory (the first RUN_DIR unless told otherwise):

- ``loss.png``: training loss (a running mean, the raw per-step loss is noisy) and held-out loss after
  each round, against wall time and against the tokens the node trained on;
- ``bytes.png``: cumulative MB sent and received by each node against wall time, and MB sent per round;
- ``peers.png``: how many contributions each round's mean held (1 = the node stepped alone);
- ``utilization.png``: the share of each round's wall time spent on inner steps (inner compute / wall
  time since the previous round record: waiting for the swarm, eval and checkpoints count against
  it), per round, and the inner-step throughput over time.

Wall time is counted from the first record of each RUN_DIR, so the nodes of a swarm share one clock.
If a swarm directory holds the launcher's ``report.json``, its summary opens ``report.md``.

Plots are drawn with matplotlib's Agg canvas on ``Figure`` objects, never through pyplot's global
state: no display is needed and nothing leaks between calls.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from node.model.export import MODEL_FILE
from node.ops.metrics import read_metrics, run_utilization
from node.ops.swarm_report import hash_agreement, hash_verdict, report_markdown

PLOT_FILES = ("loss.png", "bytes.png", "peers.png", "utilization.png")
REPORT_FILE = "report.md"
_SMOOTHING_POINTS = 50  # the running mean of the training loss spans ~1/50 of a node's steps


@dataclass
class NodeRun:
    """One node's records, with its time axis already shifted to its RUN_DIR's start."""

    name: str
    run_dir: Path
    steps: list[dict[str, Any]]
    rounds: list[dict[str, Any]]
    start_time: float
    """Unix time of the first record of the RUN_DIR this node belongs to."""

    def seconds(self, records: Sequence[dict[str, Any]]) -> npt.NDArray[np.float64]:
        return _column(records, "time") - self.start_time


def _column(records: Sequence[dict[str, Any]], key: str) -> npt.NDArray[np.float64]:
    """One field of every record as floats; missing or null values (a diverged loss) are NaN."""
    values = [record.get(key) for record in records]
    return np.array([math.nan if value is None else float(value) for value in values], dtype=np.float64)


def node_dirs(run_dir: Path) -> list[Path]:
    """The node run dirs of RUN_DIR: itself, or its ``node-<i>`` subdirs in index order."""
    if (run_dir / "metrics.jsonl").is_file():
        return [run_dir]
    found = [path.parent for path in run_dir.glob("node-*/metrics.jsonl")]
    suffix = [path.name.removeprefix("node-") for path in found]
    if not found or not all(s.isdigit() for s in suffix):
        raise ValueError(f"{run_dir}: no metrics.jsonl here nor in node-<i>/ subdirs")
    return sorted(found, key=lambda path: int(path.name.removeprefix("node-")))


def load_runs(run_dirs: Sequence[Path]) -> list[NodeRun]:
    """Every node of every RUN_DIR; names get the RUN_DIR's name as a prefix when several are given."""
    if not run_dirs:
        raise ValueError("give at least one RUN_DIR")
    runs = []
    for run_dir in run_dirs:
        group = []
        for directory in node_dirs(run_dir):
            records = read_metrics(directory / "metrics.jsonl")
            if directory == run_dir:  # a single node's run dir
                name = run_dir.resolve().name
            else:  # node-<i> of a swarm dir
                name = directory.name if len(run_dirs) == 1 else f"{run_dir.resolve().name}/{directory.name}"
            group.append(
                NodeRun(
                    name=name,
                    run_dir=directory,
                    steps=[r for r in records if r.get("kind") == "step"],
                    rounds=[r for r in records if r.get("kind") == "round"],
                    start_time=0.0,
                )
            )
        times = [
            float(r["time"]) for run in group for r in run.steps + run.rounds if r.get("time") is not None
        ]
        if not times:
            raise ValueError(f"{run_dir}: metrics.jsonl holds no timed step or round record yet")
        for run in group:
            run.start_time = min(times)
        runs.extend(group)
    return runs


def running_mean(values: npt.NDArray[np.float64], window: int) -> npt.NDArray[np.float64]:
    """Mean of the last ``window`` values at each position (fewer at the start); NaNs are skipped."""
    valid = np.isfinite(values)
    cumulative = np.concatenate([[0.0], np.cumsum(np.where(valid, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(valid)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    num_valid = counts[ends] - counts[starts]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(num_valid > 0, (cumulative[ends] - cumulative[starts]) / num_valid, math.nan)


# --- plots ---


def _figure(num_panels: int) -> tuple[Figure, list[Axes]]:
    figure = Figure(figsize=(6 * num_panels, 4.2), layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas renders PNGs with no display
    axes = [figure.add_subplot(1, num_panels, i + 1) for i in range(num_panels)]
    for ax in axes:
        ax.grid(alpha=0.3)
    return figure, axes


def _color(index: int) -> str:
    return f"C{index % 10}"


def _from_zero(ax: Axes, series: Sequence[npt.NDArray[np.float64]], *, counts: bool = False) -> None:
    """A y axis for a quantity that is never negative: from 0, and up to 1 when every value is 0 (a
    flat series would otherwise get matplotlib's ±4 % band around it, e.g. -0.04..0.04 MB). Counts
    get whole-number ticks and room above the largest (a flat count of 1 spans 0..2, not 0.95..1.05)."""
    finite = [value for values in series for value in values if math.isfinite(value)]
    largest = max(finite, default=0.0)
    top = largest + 1 if counts else (1.05 * largest if largest > 0 else 1.0)
    ax.set_ylim(0, top)
    if counts:
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(figure: Figure, axes: list[Axes], path: Path, title: str) -> Figure:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        elif not ax.has_data():
            ax.text(0.5, 0.5, "no records yet", ha="center", va="center", transform=ax.transAxes)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)
    return figure


def plot_loss(runs: Sequence[NodeRun], path: Path) -> Figure:
    figure, (by_time, by_tokens) = _figure(2)
    for index, run in enumerate(runs):
        color = _color(index)
        window = max(1, len(run.steps) // _SMOOTHING_POINTS)
        train_loss = running_mean(_column(run.steps, "loss"), window)
        eval_loss = _column(run.rounds, "eval_loss")
        for ax, steps_x, rounds_x in (
            (by_time, run.seconds(run.steps), run.seconds(run.rounds)),
            (by_tokens, _column(run.steps, "tokens"), _column(run.rounds, "tokens")),
        ):
            ax.plot(steps_x, train_loss, color=color, alpha=0.6, linewidth=1, label=f"{run.name} train")
            ax.plot(rounds_x, eval_loss, "o-", color=color, markersize=4, label=f"{run.name} held-out")
    by_time.set(xlabel="wall time (s)", ylabel="loss (nats/token)")
    by_tokens.set(xlabel="tokens trained on by the node", ylabel="loss (nats/token)")
    return _finish(
        figure, [by_time, by_tokens], path, "Loss (train: running mean; held-out: after each round)"
    )


def plot_bytes(runs: Sequence[NodeRun], path: Path) -> Figure:
    figure, (cumulative, per_round) = _figure(2)
    totals, per_round_sent = [], []
    for index, run in enumerate(runs):
        color = _color(index)
        seconds = run.seconds(run.rounds)
        sent = _column(run.rounds, "bytes_sent") / 1e6
        received = _column(run.rounds, "bytes_recv") / 1e6
        cumulative.plot(
            seconds, np.nancumsum(sent), "o-", color=color, markersize=3, label=f"{run.name} sent"
        )
        cumulative.plot(
            seconds, np.nancumsum(received), "s--", color=color, markersize=3, label=f"{run.name} received"
        )
        per_round.plot(_column(run.rounds, "round"), sent, "o-", color=color, markersize=4, label=run.name)
        totals += [np.nancumsum(sent), np.nancumsum(received)]
        per_round_sent.append(sent)
    _from_zero(cumulative, totals)
    _from_zero(per_round, per_round_sent)
    cumulative.set(xlabel="wall time (s)", ylabel="MB (cumulative)")
    per_round.set(xlabel="outer round", ylabel="MB sent in the round")
    per_round.xaxis.set_major_locator(MaxNLocator(integer=True))
    return _finish(figure, [cumulative, per_round], path, "Bytes on the wire (pseudo-gradient all-reduce)")


def plot_peers(runs: Sequence[NodeRun], path: Path) -> Figure:
    figure, (ax,) = _figure(1)
    for index, run in enumerate(runs):
        ax.step(
            run.seconds(run.rounds), _column(run.rounds, "peers"), "o-", where="post",
            color=_color(index), markersize=4, label=run.name,
        )  # fmt: skip
    ax.set(xlabel="wall time (s)", ylabel="contributions in the round's mean")
    _from_zero(ax, [_column(run.rounds, "peers") for run in runs], counts=True)
    return _finish(figure, [ax], path, "Peers per outer round")


def round_utilization(record: dict[str, Any]) -> float:
    """The record's ``utilization`` (compute / wall seconds, node/ops/metrics.py; older records hold
    compute / (compute + blocked) there); records without one: compute / (compute + blocked, else
    comm) seconds."""
    value = record.get("utilization")
    if value is not None or "utilization" in record:
        return math.nan if value is None else float(value)
    compute = float(record.get("seconds_compute") or 0.0)
    waited = record.get("seconds_blocked", record.get("seconds_comm"))
    if compute <= 0 or waited is None:
        return math.nan
    return compute / (compute + float(waited))


def plot_utilization(runs: Sequence[NodeRun], path: Path) -> Figure:
    figure, (utilization, throughput) = _figure(2)
    for index, run in enumerate(runs):
        color = _color(index)
        values = np.array([round_utilization(record) for record in run.rounds], dtype=np.float64)
        utilization.plot(
            _column(run.rounds, "round"), values, "o-", color=color, markersize=4, label=run.name
        )
        window = max(1, len(run.steps) // _SMOOTHING_POINTS)
        tokens_per_s = running_mean(_column(run.steps, "tokens_per_s"), window)
        throughput.plot(run.seconds(run.steps), tokens_per_s, color=color, linewidth=1, label=run.name)
    utilization.set(xlabel="outer round", ylabel="inner compute / wall time", ylim=(0, 1.05))
    utilization.xaxis.set_major_locator(MaxNLocator(integer=True))
    throughput.set(xlabel="wall time (s)", ylabel="inner-step tokens/s (running mean)")
    return _finish(figure, [utilization, throughput], path, "Utilization of the training thread")


# --- summary ---


def node_summary(run: NodeRun) -> dict[str, Any]:
    """The numbers of one node's row in ``report.md``."""
    steps, rounds = run.steps, run.rounds
    train_loss = _column(steps[-10:], "loss")
    eval_loss = _column(rounds, "eval_loss")
    utilization = run_utilization(rounds)[2]  # Σ compute / Σ wall, the compute-free last round too
    if utilization is None and not any(r.get("seconds_wall") is not None for r in rounds):
        per_round = np.array([round_utilization(r) for r in rounds], dtype=np.float64)  # older records
        utilization = float(np.nanmean(per_round)) if np.isfinite(per_round).any() else None
    times = np.concatenate([run.seconds(steps), run.seconds(rounds)])
    return {
        "name": run.name,
        "num_steps": int(steps[-1]["step"]) if steps else 0,
        "num_rounds": int(rounds[-1]["round"]) if rounds else 0,
        "tokens": int(steps[-1]["tokens"]) if steps else 0,
        "train_loss": float(np.nanmean(train_loss)) if np.isfinite(train_loss).any() else math.nan,
        "final_eval_loss": float(eval_loss[-1]) if len(eval_loss) else math.nan,
        "best_eval_loss": float(np.nanmin(eval_loss)) if np.isfinite(eval_loss).any() else math.nan,
        "mb_sent": sum(float(r.get("bytes_sent") or 0) for r in rounds) / 1e6,
        "mb_received": sum(float(r.get("bytes_recv") or 0) for r in rounds) / 1e6,
        **_wire_summary(rounds),
        "utilization": math.nan if utilization is None else utilization,
        "tokens_per_s": float(np.nanmean(_column(steps, "tokens_per_s"))) if steps else math.nan,
        "wall_seconds": float(np.nanmax(times)) if len(times) else 0.0,
        "param_hash": str(rounds[-1].get("param_hash", ""))[:12] if rounds else "",
        "exported": (run.run_dir / MODEL_FILE).is_file(),
    }


def _wire_summary(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Over the rounds whose all-reduce ran (``density`` set): MB moved (sent + received) per round, the
    payload's density (the last round's: every round of a run has its codec's), and the all-reduce's
    share of the run's wall time (Σ ``seconds_allreduce`` / Σ ``seconds_wall`` over every timed round)."""
    reduced = [r for r in rounds if r.get("density") is not None]
    moved = sum(float(r.get("bytes_sent") or 0) + float(r.get("bytes_recv") or 0) for r in reduced)
    wall = sum(float(r["seconds_wall"]) for r in rounds if r.get("seconds_wall") is not None)
    allreduce = sum(
        float(r.get("seconds_allreduce") or 0) for r in rounds if r.get("seconds_wall") is not None
    )
    return {
        "mb_moved_per_round": moved / 1e6 / len(reduced) if reduced else math.nan,
        "density": float(reduced[-1]["density"]) if reduced else math.nan,
        "allreduce_share": allreduce / wall if reduced and wall > 0 else math.nan,
    }


def fragment_summary(rounds: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per fragment (``--fragments``; empty without): its rounds (records naming it) and the MB they
    sent and received."""
    fragments: dict[int, dict[str, float]] = {}
    for record in rounds:
        if record.get("fragment") is None:
            continue
        row = fragments.setdefault(int(record["fragment"]), {"rounds": 0, "mb_sent": 0.0, "mb_received": 0.0})
        row["rounds"] += 1
        row["mb_sent"] += float(record.get("bytes_sent") or 0) / 1e6
        row["mb_received"] += float(record.get("bytes_recv") or 0) / 1e6
    return dict(sorted(fragments.items()))


def link_busy_share(rounds: Sequence[dict[str, Any]], link_mbit: float | None) -> float:
    """The share of the run's wall time the node's uplink was busy sending its rounds' bytes:
    Σ ``bytes_sent`` / (link rate × wall time), the wall time ``run_utilization``'s (first inner step
    to the last record). NaN where the link rate is not known or no wall time was recorded."""
    wall = run_utilization(rounds)[1]
    if link_mbit is None or wall <= 0:
        return math.nan
    sent = sum(float(r.get("bytes_sent") or 0) for r in rounds)
    return sent / (link_mbit * 1e6 / 8 * wall)


def _number(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.3g}%"


def render_report(
    runs: Sequence[NodeRun],
    run_dirs: Sequence[Path],
    *,
    swarm_summary: str | None,
    link_mbit: float | None = None,
) -> str:
    """``report.md``: the launcher's swarm summary if any, one row per node, the link's busy share
    (``link_mbit``: each node's uplink rate, the WAN emulator's cap; None: not known), the rounds and
    bytes per fragment (``--fragments``), hash agreement, the plots."""
    lines = ["# dtnode report", "", "Runs: " + ", ".join(f"`{d}`" for d in run_dirs) + ".", ""]
    if swarm_summary:
        # The launcher's summary, its title turned into a section of this report.
        lines += [swarm_summary.replace("# dtnode swarm report", "## Swarm", 1).rstrip(), ""]
    lines += [
        "## Nodes",
        "",
        "| node | steps | rounds | tokens | train loss (last 10 steps) | held-out loss: final | best | "
        "MB sent | MB received | MB moved per round | density | all-reduce share | utilization | tokens/s | "
        "wall time (s) | param_hash | model exported |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| --- | --- |",
    ]
    for run in runs:
        row = node_summary(run)
        lines.append(
            f"| {row['name']} | {row['num_steps']} | {row['num_rounds']} | {row['tokens']:,} | "
            f"{_number(row['train_loss'], 4)} | {_number(row['final_eval_loss'], 4)} | "
            f"{_number(row['best_eval_loss'], 4)} | {row['mb_sent']:.2f} | {row['mb_received']:.2f} | "
            f"{_number(row['mb_moved_per_round'], 3)} | {_percent(row['density'])} | "
            f"{_percent(row['allreduce_share'])} | {_number(row['utilization'], 3)} | {_number(row['tokens_per_s'], 0)} | "
            f"{row['wall_seconds']:.1f} | {row['param_hash'] or '-'} | {'yes' if row['exported'] else 'no'} |"
        )
    lines += [
        "",
        "utilization: the run's inner compute over its wall time from the first inner step to the last "
        "round record (per round in utilization.png). MB moved per round: sent + received by the rounds "
        "whose all-reduce ran; density: the share of the pseudo-gradient's numbers its codec sends "
        "(100% dense, k / block for top-k); all-reduce share: the all-reduce's seconds over the run's wall "
        "time (with --overlap they run beside the inner steps).",
        "",
    ]
    lines += ["## Link", ""]
    if link_mbit is None:
        lines += ["The link's busy share is not reported: the link rate is not known (it is where the "
                  "swarm ran in the WAN emulator, `dtnode swarm --link-mbit`).", ""]  # fmt: skip
    else:
        lines += [
            f"Each node's uplink: {link_mbit:g} Mbit/s. Busy share: the bytes the node's rounds sent over "
            "(link rate × the run's wall time, first inner step to last record).",
            "",
            "| node | MB sent | wall time (s) | link busy share |",
            "| --- | ---: | ---: | ---: |",
        ]
        for run in runs:
            sent = sum(float(r.get("bytes_sent") or 0) for r in run.rounds) / 1e6
            wall = run_utilization(run.rounds)[1]
            lines.append(
                f"| {run.name} | {sent:.2f} | {wall:.1f} | {_percent(link_busy_share(run.rounds, link_mbit))} |"
            )
        lines.append("")
    fragment_rows = [(run.name, f, row) for run in runs for f, row in fragment_summary(run.rounds).items()]
    if fragment_rows:
        lines += [
            "## Fragments",
            "",
            "Streamed fragments (`--fragments`): each round synchronises one fragment; per node and fragment, "
            "its rounds and their bytes.",
            "",
            "| node | fragment | rounds | MB sent | MB received |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {name} | {f} | {row['rounds']:.0f} | {row['mb_sent']:.2f} | {row['mb_received']:.2f} |"
            for name, f, row in fragment_rows
        ]
        lines.append("")
    for run_dir in run_dirs:
        group = [run for run in runs if run.run_dir.parent == run_dir]
        if len(group) > 1:
            verdict = hash_verdict(hash_agreement([run.rounds for run in group]))
            lines += [f"`{run_dir}`: {verdict}.", ""]
    lines += ["## Plots", ""]
    for file_name in PLOT_FILES:
        lines += [f"![{file_name.removesuffix('.png')}]({file_name})", ""]
    return "\n".join(lines)


def write_report(run_dirs: Sequence[Path], *, out: Path | None = None) -> Path:
    """Write the four PNGs and ``report.md`` into ``out`` (default: the first RUN_DIR); return report.md."""
    runs = load_runs(run_dirs)
    out = run_dirs[0] if out is None else out
    out.mkdir(parents=True, exist_ok=True)
    plot_loss(runs, out / "loss.png")
    plot_bytes(runs, out / "bytes.png")
    plot_peers(runs, out / "peers.png")
    plot_utilization(runs, out / "utilization.png")
    launcher_json = run_dirs[0] / "report.json"
    launcher = json.loads(launcher_json.read_text()) if launcher_json.is_file() else None
    swarm_summary = report_markdown(launcher) if launcher is not None else None
    link_mbit = launcher.get("link_mbit") if launcher is not None else None
    path = out / REPORT_FILE
    path.write_text(render_report(runs, run_dirs, swarm_summary=swarm_summary, link_mbit=link_mbit))
    return path
