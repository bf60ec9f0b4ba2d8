"""Does every live node train in every round? Measured on ``dtnode swarm`` runs.

Each run is one ``python -m node.ops.cli swarm …`` (``node/ops/launcher.py``) in a scratch directory, in the
WAN emulator (``scripts/tools/wan_emulator.py``, needs root) where the case needs slow links; this script
only reads what the nodes wrote (``metrics.jsonl``, the launcher's ``report.json``). Cases:

    a  a2, a4: 2 and 4 nodes, tiny, 5 inner steps, --link-mbit (20) uplinks, nodes started
       --stagger (10) s apart: fetching a round's mean takes longer than a round.
    b  3 nodes on loopback, tiny, H=10; node 2 has twice the batch (its inner step takes twice as
       long): ``--node-flags 2:--batch-size 8``.
    c  3 nodes on loopback, tiny, H=10; once every node recorded round 2, node 2's process group is
       SIGSTOPped for 1.5 round periods (the median gap between round records so far), then resumed.
    d  d-readme: the README's run (``--nodes 3 --max-rounds 3 --inner-steps 12``, defaults otherwise);
       d-ten: 10 nano nodes on loopback, --inner-steps 5 --batch-size 8 --max-rounds 5.

``--quick`` (a dry run, minutes): a2 only, nano, 4 rounds, 5 s apart; b and c nano; d one run of 3
nano nodes, --inner-steps 5 --batch-size 8 --max-rounds 3. ``--node-args "…"`` appends flags to
every run's command (e.g. ``--node-args "--round-seconds 8"``): they win over the case's.

Figures per run (one JSON object each, then a summary object, then one line):

participation: averaged (node, round) pairs / all pairs after each node's first round, pooled
    over the nodes (``node/ops/swarm_report.py``, ``node_participation``: a pair is averaged when the
    node's record of that round has peers >= 2 and neither fell_back nor adopted; a round the node
    skipped counts as not averaged). Case c: the frozen node's rounds up to 2 after the highest round
    any node had recorded when it was resumed are left out (``resumed_round``; it must be back within 2
    rounds); ``participation_all`` counts them.
rounds_per_node, first_round_per_node, final_param_hashes; one_final_param_hash: every node's last
    round record holds the same param_hash. problems / launcher_exit_code: ``dtnode swarm``'s verdict.
swarm_tokens_per_s: Σ over nodes of the tokens of their step records / the wall time from the start
    of the first inner step of any node to the end of the last one (a step's tokens: the usual
    increment of the node's cumulative ``tokens``; its start: its record's time less its duration,
    tokens / ``tokens_per_s``). node_window_tokens_per_s: Σ over nodes of each node's tokens over
    its own such window (blind to a staggered start).
solo_tokens_per_s: per node, with ``--solo-seconds S`` > 0 (cases a and b): the same N node
    settings (each node's ``config.toml`` from the swarm run) run together with ``--no-swarm`` and
    no round or step limit, sharing this machine as the swarm's nodes did; from the moment all of
    them stepped, for S seconds, each node's tokens of the steps that ended in that window / S;
    with S = 0, or in cases c and d: the mean of the swarm run's step records' ``tokens_per_s`` per
    node (its compute rate while stepping). solo_source says which.
    tokens_ratio = swarm_tokens_per_s / Σ solo_tokens_per_s.
targets: participation >= 0.95 (a, b, c, d), tokens_ratio >= 0.90 (a, b), one final
    param_hash (all); met: every target of the run and no error.

    python scripts/bench/bench_participation.py --cases d --quick          # a dry run (3 nano nodes)
    python scripts/bench/bench_participation.py                            # a, b, c, d (an hour or more)
    python scripts/bench/bench_participation.py --cases a,b --node-args "--round-seconds 8"

Exit code: 0 if every run met its targets, 1 if one did not or could not be measured, 2 if the
emulator cannot run here (case a needs root and iproute2), 130 on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.ops.metrics import read_metrics
from node.ops.swarm_report import node_participation, swarm_participation
from scripts.bench.bench_utilization import stop_launcher
from scripts.common import REPO_ROOT, add_output_flags, exit_on_sigterm, print_json, scratch_dir, write_json
from scripts.tools.wan_emulator import unavailable_reason

CASES = ("a", "b", "c", "d")
TARGET_PARTICIPATION = 0.95
TARGET_TOKENS_RATIO = 0.90
FREEZE_AFTER_ROUND = 2
FREEZE_PERIODS = 1.5
BACK_WITHIN_ROUNDS = 2
SOLO_STOP_GRACE_SECONDS = 60.0
POLL_SECONDS = 0.5
QUIET = ("--eval-batches", "1", "--checkpoint-every", "0", "--log-every", "1000")


@dataclass(frozen=True, kw_only=True)
class Run:
    """One ``dtnode swarm`` run of a case."""

    name: str
    case: str
    num_nodes: int
    flags: tuple[str, ...]
    """Node flags for every node (the case's; ``--node-args`` comes after them)."""
    node_flags: tuple[str, ...] = ()
    """``--node-flags I:FLAGS`` values."""
    link_mbit: float | None = None
    stagger_seconds: float = 0.0
    freeze_node: int | None = None
    """Case c: the node SIGSTOPped and resumed."""
    targets: tuple[str, ...] = ("participation", "one_final_param_hash")


def case_runs(cases: Sequence[str], *, quick: bool, link_mbit: float, stagger_seconds: float) -> list[Run]:
    model = "nano" if quick else "tiny"
    rounds = ("--max-rounds", "4" if quick else "8")
    all_targets = ("participation", "tokens_ratio", "one_final_param_hash")
    runs = []
    if "a" in cases:
        for num_nodes in (2,) if quick else (2, 4):
            flags = ("--model", model, "--inner-steps", "5", "--batch-size", "4", *rounds, *QUIET)
            runs.append(Run(name=f"a{num_nodes}", case="a", num_nodes=num_nodes, flags=flags,
                            link_mbit=link_mbit, stagger_seconds=stagger_seconds / 2 if quick else stagger_seconds,
                            targets=all_targets))  # fmt: skip
    h10 = ("--model", model, "--inner-steps", "10", "--batch-size", "4", *QUIET)
    if "b" in cases:
        runs.append(Run(name="b", case="b", num_nodes=3, flags=(*h10, *rounds), node_flags=("2:--batch-size 8",),
                        targets=all_targets))  # fmt: skip
    if "c" in cases:
        runs.append(Run(name="c", case="c", num_nodes=3, flags=(*h10, "--max-rounds", "6" if quick else "10"),
                        freeze_node=2))  # fmt: skip
    if "d" in cases:
        short = ("--model", "nano", "--inner-steps", "5", "--batch-size", "8")
        if quick:
            runs.append(
                Run(name="d-quick", case="d", num_nodes=3, flags=(*short, "--max-rounds", "3", *QUIET))
            )
        else:
            readme = ("--max-rounds", "3", "--inner-steps", "12")
            runs.append(Run(name="d-readme", case="d", num_nodes=3, flags=readme))
            runs.append(
                Run(name="d-ten", case="d", num_nodes=10, flags=(*short, "--max-rounds", "5", *QUIET))
            )
    return runs


def swarm_argv(run: Run, run_dir: Path, node_args: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "node.ops.cli", "swarm", "--nodes", str(run.num_nodes), "--run-dir", str(run_dir),
            "--name", "benchpart", *run.flags, *node_args]  # fmt: skip
    if run.link_mbit is not None:
        argv += ["--link-mbit", f"{run.link_mbit:g}"]
    if run.stagger_seconds:
        argv += ["--stagger", f"{run.stagger_seconds:g}"]
    for spec in run.node_flags:
        argv += ["--node-flags", spec]
    return argv


# --- figures from the nodes' records (pure) ---


def step_tokens(steps: Sequence[Mapping[str, Any]]) -> int:
    """Tokens of one inner step of a node: the most common increment of its cumulative ``tokens``
    (an adopted state may move the counter by other amounts); its first record's alone."""
    increments = [int(b["tokens"]) - int(a["tokens"]) for a, b in zip(steps, steps[1:], strict=False)]
    positive = [i for i in increments if i > 0]
    if positive:
        return collections.Counter(positive).most_common(1)[0][0]
    return int(steps[0]["tokens"]) if steps else 0


def step_window(steps: Sequence[Mapping[str, Any]]) -> tuple[int, float, float]:
    """A node's (tokens, start of its first step, end of its last step) from its step records."""
    tokens = step_tokens(steps)
    first = steps[0]
    start = float(first["time"]) - tokens / float(first["tokens_per_s"])
    return tokens * len(steps), start, float(steps[-1]["time"])


def throughput(steps_per_node: Sequence[Sequence[Mapping[str, Any]]]) -> dict[str, Any]:
    """Σ tokens / the swarm's stepping window, and Σ each node's tokens / its own window."""
    windows = [step_window(steps) for steps in steps_per_node if steps]
    if not windows:
        return {"tokens": 0, "swarm_tokens_per_s": None, "node_window_tokens_per_s": None}
    tokens = sum(w[0] for w in windows)
    wall = max(w[2] for w in windows) - min(w[1] for w in windows)
    return {
        "tokens": tokens,
        "swarm_tokens_per_s": tokens / wall if wall > 0 else None,
        "node_window_tokens_per_s": sum(w[0] / (w[2] - w[1]) for w in windows if w[2] > w[1]),
    }


def step_rates(steps_per_node: Sequence[Sequence[Mapping[str, Any]]]) -> list[float | None]:
    """Each node's mean ``tokens_per_s`` over its step records (its rate while computing)."""
    return [
        statistics.fmean(float(s["tokens_per_s"]) for s in steps) if steps else None
        for steps in steps_per_node
    ]


def round_period(rounds_per_node: Sequence[Sequence[Mapping[str, Any]]]) -> float | None:
    """Median gap in seconds between a node's consecutive round records, over every node."""
    gaps = [
        float(b["time"]) - float(a["time"])
        for rounds in rounds_per_node
        for a, b in zip(rounds, rounds[1:], strict=False)
    ]
    return statistics.median(gaps) if gaps else None


def participation_figures(
    rounds_per_node: Sequence[Sequence[Mapping[str, Any]]], *, frozen_node: int | None, skip_through: int
) -> dict[str, Any]:
    per_node = [
        node_participation(rounds, skip_through=skip_through if index == frozen_node else 0)
        for index, rounds in enumerate(rounds_per_node)
    ]
    finals = [node["final_param_hash"] for node in per_node]
    figures = {
        "participation": swarm_participation(per_node)["participation"],
        "participation_per_node": [node["participation"] for node in per_node],
        "rounds_per_node": [len({int(r["round"]) for r in rounds}) for rounds in rounds_per_node],
        "first_round_per_node": [node["first_round"] for node in per_node],
        "final_param_hashes": [None if h is None else h[:10] for h in finals],
        "one_final_param_hash": None not in finals and len(set(finals)) == 1,
    }
    if frozen_node is not None:
        everything = [node_participation(rounds) for rounds in rounds_per_node]
        figures["participation_all"] = swarm_participation(everything)["participation"]
    return figures


def judge(record: Mapping[str, Any], targets: Sequence[str]) -> dict[str, bool]:
    """Each of the run's targets: met or not (a figure that could not be measured is not met)."""
    checks = {
        "participation": lambda: (record.get("participation") or 0) >= TARGET_PARTICIPATION,
        "tokens_ratio": lambda: (record.get("tokens_ratio") or 0) >= TARGET_TOKENS_RATIO,
        "one_final_param_hash": lambda: bool(record.get("one_final_param_hash")),
    }
    return {name: checks[name]() for name in targets}


# --- processes ---


@dataclass
class Freezer:
    """Case c: SIGSTOP node ``index``'s process group once every node recorded round
    ``FREEZE_AFTER_ROUND``, for ``FREEZE_PERIODS`` round periods, then SIGCONT."""

    run_dir: Path
    index: int
    num_nodes: int
    figures: dict[str, Any] = field(default_factory=dict)
    _pid: int | None = None
    _resume_at: float | None = None

    def poll(self) -> None:
        rounds = [read_rounds(self.run_dir / f"node-{i}") for i in range(self.num_nodes)]
        if self._pid is None and "resumed_round" not in self.figures:
            period = round_period(rounds)
            if period is None or not all(r and int(r[-1]["round"]) >= FREEZE_AFTER_ROUND for r in rounds):
                return
            self._pid = int((self.run_dir / f"node-{self.index}.pid").read_text())
            os.killpg(self._pid, signal.SIGSTOP)
            self._resume_at = time.monotonic() + FREEZE_PERIODS * period
            self.figures |= {"frozen_node": self.index, "round_period_s": round(period, 2),
                             "frozen_s": round(FREEZE_PERIODS * period, 2),
                             "frozen_at_round": max(int(r[-1]["round"]) for r in rounds)}  # fmt: skip
        elif self._resume_at is not None and time.monotonic() >= self._resume_at:
            self.release()
            self.figures["resumed_round"] = max((int(r[-1]["round"]) for r in rounds if r), default=0)

    def release(self) -> None:
        """SIGCONT if frozen (also on any way out: a frozen group would outlive the run's stop)."""
        if self._pid is not None:
            try:
                os.killpg(self._pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # the node is gone already: nothing left frozen
            self._pid, self._resume_at = None, None


def read_rounds(node_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(node_dir / "metrics.jsonl", kind="round")


def read_steps(node_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(node_dir / "metrics.jsonl", kind="step")


def run_swarm(
    run: Run, workdir: Path, node_args: Sequence[str], timeout: float
) -> tuple[int | None, Freezer | None]:
    """The swarm run (with case c's freeze); the launcher's exit code (None: it timed out)."""
    run_dir, log_path = workdir / "swarm", workdir / "swarm.log"
    freezer = None if run.freeze_node is None else Freezer(run_dir, run.freeze_node, run.num_nodes)
    print(f"bench_participation: running {run.name} (log {log_path})", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    with log_path.open("wb") as log_file:
        # Its own session: a terminal's Ctrl-C reaches only this script, which stops the launcher.
        launcher = subprocess.Popen(swarm_argv(run, run_dir, node_args), cwd=REPO_ROOT, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            while launcher.poll() is None and time.monotonic() < deadline:
                if freezer is not None:
                    freezer.poll()
                time.sleep(POLL_SECONDS)
        finally:
            if freezer is not None:
                freezer.release()
            timed_out = launcher.poll() is None
            stop_launcher(launcher, log_path)
    return (None if timed_out else launcher.returncode), freezer


def measure_solo(run: Run, workdir: Path, seconds: float, timeout: float) -> list[float | None]:
    """Each node's tokens/s trained alone (``--no-swarm``), all N together as in the swarm run."""
    processes = []
    for index in range(run.num_nodes):
        node_dir = workdir / "solo" / f"node-{index}"
        node_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "node.ops.cli", "join", "--config", str(workdir / "swarm" / f"node-{index}" / "config.toml"),
                "--no-swarm", "--run-dir", str(node_dir), "--max-rounds", "0", "--max-steps", "0",
                "--checkpoint-every", "0", "--metrics-port", "0"]  # fmt: skip
        with (workdir / "solo" / f"node-{index}.log").open("wb") as log_file:
            processes.append(subprocess.Popen(argv, cwd=REPO_ROOT, stdout=log_file, stderr=subprocess.STDOUT,
                                              start_new_session=True))  # fmt: skip
    dirs = [workdir / "solo" / f"node-{i}" for i in range(run.num_nodes)]
    try:
        deadline = time.monotonic() + timeout
        while not all(read_steps(d) for d in dirs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                return [None] * run.num_nodes  # one failed (its log says why) or never stepped
            time.sleep(POLL_SECONDS)
        window_start = time.time()  # the steps' records carry wall-clock times
        while time.time() < window_start + seconds and all(p.poll() is None for p in processes):
            time.sleep(POLL_SECONDS)
        window_end = time.time()
    finally:
        for process in processes:  # SIGTERM: each finishes its step and exits; then SIGKILL
            with_group(process, signal.SIGTERM)
        stop_by = time.monotonic() + SOLO_STOP_GRACE_SECONDS
        for process in processes:
            try:
                process.wait(timeout=max(0.1, stop_by - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass  # killed just below
            with_group(process, signal.SIGKILL)
            process.wait()
    if window_end < window_start + seconds:
        return [None] * run.num_nodes  # a node exited early: no window shared by all
    return [window_rate(read_steps(d), window_start, window_end) for d in dirs]


def with_group(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass  # already gone


def window_rate(steps: Sequence[Mapping[str, Any]], start: float, end: float) -> float:
    """Tokens per second of the steps that ended in ``(start, end]`` (wall-clock seconds)."""
    num_steps = sum(1 for s in steps if start < float(s["time"]) <= end)
    return num_steps * step_tokens(steps) / (end - start)


def measure(run: Run, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One run's record (see the docstring); ``error`` says why a figure could not be measured."""
    record: dict[str, Any] = {"run": run.name, "case": run.case, "nodes": run.num_nodes, "link_mbit": run.link_mbit,
                              "stagger_s": run.stagger_seconds, "flags": " ".join([*run.flags, *args.node_args]),
                              "node_flags": list(run.node_flags), "load_avg_1min_before": round(os.getloadavg()[0], 2)}  # fmt: skip
    started = time.monotonic()
    exit_code, freezer = run_swarm(run, workdir, args.node_args, args.timeout)
    run_dir = workdir / "swarm"
    record["launcher_exit_code"] = exit_code
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    record["problems"] = report.get("problems")
    rounds = [read_rounds(run_dir / f"node-{i}") for i in range(run.num_nodes)]
    steps = [read_steps(run_dir / f"node-{i}") for i in range(run.num_nodes)]
    skip_through = 0
    if freezer is not None:
        record |= freezer.figures
        skip_through = freezer.figures.get("resumed_round", 0) + BACK_WITHIN_ROUNDS
    record |= participation_figures(rounds, frozen_node=run.freeze_node, skip_through=skip_through)
    record |= throughput(steps)
    solo: list[float | None] = step_rates(steps)
    record["solo_source"] = "step records' tokens_per_s (swarm run)"
    if "tokens_ratio" in run.targets and args.solo_seconds > 0 and exit_code is not None:
        solo = measure_solo(run, workdir, args.solo_seconds, args.timeout)
        record["solo_source"] = f"--no-swarm, {run.num_nodes} nodes together, {args.solo_seconds:g} s"
    record["solo_tokens_per_s"] = [None if rate is None else round(rate, 1) for rate in solo]
    solo_sum = sum(rate for rate in solo if rate is not None) if None not in solo else None
    swarm_rate = record["swarm_tokens_per_s"]
    record["tokens_ratio"] = swarm_rate / solo_sum if swarm_rate and solo_sum else None
    for key in ("participation", "participation_all", "tokens_ratio"):
        if record.get(key) is not None:
            record[key] = round(record[key], 4)
    for key in ("swarm_tokens_per_s", "node_window_tokens_per_s"):
        if record.get(key) is not None:
            record[key] = round(record[key], 1)
    if exit_code is None:
        record["error"] = f"the swarm did not finish within {args.timeout:g} s"
    elif not report:
        record["error"] = f"dtnode swarm exited {exit_code} without a report; see {workdir / 'swarm.log'}"
    elif freezer is not None and "resumed_round" not in freezer.figures:
        record["error"] = "node was never frozen and resumed (the run ended before round 2 + 1.5 periods)"
    record["targets"] = judge(record, run.targets)
    record["met"] = "error" not in record and all(record["targets"].values())
    record["wall_seconds"] = round(time.monotonic() - started, 1)
    record["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    return record


def summary_line(records: Sequence[Mapping[str, Any]]) -> str:
    """``bench_participation: a2 participation 97.5% tokens 0.93 hash one PASS; … | all targets: PASS``."""
    parts = []
    for r in records:
        share = "-" if r.get("participation") is None else f"{100 * r['participation']:.1f}%"
        ratio = "" if r.get("tokens_ratio") is None else f" tokens {r['tokens_ratio']:.2f}"
        hashes = "one" if r.get("one_final_param_hash") else "SPLIT"
        verdict = "PASS" if r["met"] else ("ERROR: " + r["error"] if "error" in r else "FAIL")
        parts.append(f"{r['run']} participation {share}{ratio} hash {hashes} {verdict}")
    overall = "PASS" if records and all(r["met"] for r in records) else "FAIL"
    return f"bench_participation: {'; '.join(parts)} | all targets: {overall}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=lambda t: [c.strip() for c in t.split(",")], default=list(CASES),
                        help="comma-separated cases: a, b, c, d")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small, short runs (see the docstring)")
    parser.add_argument("--node-args", type=shlex.split, default=[], help="flags appended for every node")
    parser.add_argument("--link-mbit", type=float, default=20.0, help="case a's uplink cap")
    parser.add_argument("--stagger", type=float, default=10.0, help="case a: seconds between node starts")
    parser.add_argument("--solo-seconds", type=float, default=60.0,
                        help="cases a, b: seconds of the --no-swarm runs (0: step records' rates)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one swarm run may take")
    add_output_flags(parser, keep_logs=True)  # --json-out: every object printed
    args = parser.parse_args(argv)
    if not args.cases or any(case not in CASES for case in args.cases):
        parser.error(f"--cases must list some of {', '.join(CASES)}")
    if not args.link_mbit > 0 or args.stagger < 0 or args.solo_seconds < 0 or not args.timeout > 0:
        parser.error("--link-mbit and --timeout must be > 0, --stagger and --solo-seconds >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "a" in args.cases and (reason := unavailable_reason()) is not None:
        print(f"bench_participation: case a needs the WAN emulator: {reason}", file=sys.stderr)
        return 2
    exit_on_sigterm()  # unwinds run_swarm's `finally`, which stops the swarm
    runs = case_runs(args.cases, quick=args.quick, link_mbit=args.link_mbit, stagger_seconds=args.stagger)
    records: list[dict[str, Any]] = []
    try:
        for run in runs:
            with scratch_dir(args.keep_logs, run.name, prefix="bench_participation-") as workdir:
                records.append(measure(run, workdir, args))
            print_json(records[-1])
    except (KeyboardInterrupt, SystemExit):
        print("bench_participation: interrupted; the swarm was stopped", file=sys.stderr)
        return 130
    finally:
        summary = {"summary": True, "met": {r["run"]: r["met"] for r in records},
                   "all_met": bool(records) and all(r["met"] for r in records)}  # fmt: skip
        write_json(args.json_out, [*records, summary])
    print_json(summary)
    print(summary_line(records), flush=True)
    return 0 if summary["all_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
