"""How much of a node's time goes to training rather than waiting for the swarm, with and without overlap.

For every link cap in ``--links`` and every mode in ``--modes`` one swarm of
``--nodes`` nodes runs ``--max-rounds`` outer rounds, each node on its own host of the WAN emulator
(``scripts/tools/wan_emulator.py``: a network namespace whose uplink a tc tbf caps at the link rate). The
swarm is started, stopped and reported on by ``dtnode swarm`` (``node/ops/launcher.py``), run as a child
process with its run dir in a scratch directory; this script only reads what the nodes wrote.

    sync:    each round's all-reduce runs between two inner phases; the training thread waits for it.
    overlap: ``--overlap`` (Streaming DiLoCo, Douillard et al., 2025, arXiv:2501.18512): round r's
             all-reduce runs on a background thread during round r+1's inner steps, and the thread
             only waits for what is left of it at the end of that phase.

Every node writes one record per outer round to ``metrics.jsonl`` (``node/train/trainer.py``,
``_round_record``; the contract in ``node/ops/metrics.py``) with ``seconds_compute`` (the inner steps
since its previous round record: the round's own phase in sync mode, the next one with overlap),
``seconds_wall`` (the wall time since that record) and ``seconds_blocked`` (how long the training
thread waited for the round in it), and

    utilization = seconds_compute / seconds_wall            (wall time: everything that is
                                                             not an inner step counts against it)
    blocked_share = seconds_blocked / seconds_wall          (the part of that spent on the swarm)

Older recorded runs defined utilization as seconds_compute / (seconds_compute +
seconds_blocked), which left eval, checkpoints, hashing and the outer step out (BENCHMARKS.md).

Steady state. The samples are every node's rounds after its first ``--warmup-rounds`` (default 1:
node 0 starts first and waits for the others in round 1, whose steps also warm the allocators), but
for the last round with overlap, applied after the last phase with nothing to hide behind (null).

Fields of the JSON object printed per variant (one line each; then a summary object, then one line):

variant, link_mbit (0: loopback, no emulator), overlap, nodes, model, params, inner_steps,
    batch_size, codec, max_rounds, warmup_rounds: what ran (params: from node 0's log).
num_samples: steady (node, round) samples; utilization_mean / utilization_min over them;
    utilization_per_node: each node's steady values in round order.
seconds_compute_mean, seconds_blocked_mean, seconds_comm_mean, blocked_share_mean: means over the samples
    (seconds_comm: the all-reduce's own wall time, which with overlap runs alongside compute).
seconds_per_round: mean gap between a node's record of round r-1 and of a steady round r (one inner
    phase, the wait, the outer step and the eval).
bytes_sent_per_round: mean over the samples of a node's all-reduce bytes sent in the round.
min_peers: fewest nodes in any steady round (``--min-peers`` is set to ``--nodes``).
param_hash_all_agree: every node held the same params after every round all recorded (report.json).
exit_codes, wall_seconds: of the nodes and of the whole swarm run (start-up and stop included).
met: overlap variants only: utilization_mean >= the target (0.95); null for sync.
load_avg_1min_before / _after; error: why a variant could not be measured (then it counts as failed).

Summary object: ``summary`` (true), ``target_utilization``, ``utilization_mean`` per variant,
``overlap_met`` (every overlap variant met the target), ``num_failed``, ``wall_seconds``.

Defaults (about 11 min in all on 2 cores): tiny (10.8M params, ~16 MB sent per node and round with
int8 at 4 nodes), batch 4, H=10, 5 rounds. The nodes share this machine (the launcher gives each
``--threads`` = cores // nodes), so an inner phase takes ~25 s against ~9 s of all-reduce at 20
Mbit/s. Eval (1 batch, every ``--eval-every`` rounds: the node's default) and the outer step are in
the wall time; checkpoints are off.

    python scripts/bench/bench_utilization.py                     # 4 nodes, tiny, 100 and 20 Mbit/s, both modes
    python scripts/bench/bench_utilization.py --links 20 --modes overlap --max-rounds 4 --model nano

Exit code: 0 if every variant was measured (the verdict is in the output), 1 if one was not, 2 if
the emulator cannot run here (needs root and iproute2), 130 on Ctrl-C or SIGTERM (the swarm is
stopped and its namespaces removed first).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.ops.metrics import read_metrics
from scripts.common import REPO_ROOT, add_output_flags, exit_on_sigterm, print_json, scratch_dir, write_json
from scripts.tools.wan_emulator import cleanup_leftovers, unavailable_reason

TARGET_UTILIZATION = 0.95
MODES = ("sync", "overlap")
LAUNCHER_NAME_PREFIX = "dtswarm"  # node/ops/launcher.py's emulator namespaces
# The launcher gives its nodes 60 s to leave after the first SIGINT; a second one kills them.
STOP_GRACE = datetime.timedelta(seconds=90)
KILL_GRACE = datetime.timedelta(seconds=30)
POLL_SECONDS = 0.2
STOP_STEPS = ((signal.SIGINT, STOP_GRACE), (signal.SIGINT, KILL_GRACE), (signal.SIGKILL, KILL_GRACE))
PARAMS_LINE = re.compile(r"training \S+ \((?P<params>[\d,]+) params\)")


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What every variant runs (the swarm's size, model and schedule)."""

    num_nodes: int
    model: str
    inner_steps: int
    batch_size: int
    codec: str
    max_rounds: int
    warmup_rounds: int
    timeout: datetime.timedelta
    seq_len: int = 0
    """Tokens per sequence; 0: the model preset's own."""


@dataclass(frozen=True, kw_only=True)
class Variant:
    link_mbit: float
    """Every node's uplink cap; 0 runs the nodes on loopback without the emulator."""
    overlap: bool

    @property
    def name(self) -> str:
        link = "loopback" if self.link_mbit == 0 else f"{self.link_mbit:g}mbit"
        return f"{link}-{'overlap' if self.overlap else 'sync'}"


def swarm_argv(settings: Settings, variant: Variant, run_dir: Path) -> list[str]:
    """``dtnode swarm`` for one variant; the launcher picks threads, shards and addresses."""
    argv = [
        sys.executable, "-m", "node.ops.cli", "swarm", "--nodes", str(settings.num_nodes),
        "--run-dir", str(run_dir), "--name", "benchutil", "--model", settings.model,
        "--inner-steps", str(settings.inner_steps), "--batch-size", str(settings.batch_size),
        "--codec", settings.codec, "--max-rounds", str(settings.max_rounds),
        "--min-peers", str(settings.num_nodes), "--eval-batches", "1", "--checkpoint-every", "0",
        "--log-every", "1000", "--overlap" if variant.overlap else "--no-overlap",
    ]  # fmt: skip
    if variant.link_mbit > 0:
        argv += ["--link-mbit", str(variant.link_mbit)]
    if settings.seq_len > 0:
        argv += ["--seq-len", str(settings.seq_len)]
    return argv


def read_rounds(node_dir: Path) -> list[dict[str, Any]]:
    """A node's round records (``kind`` round with a ``param_hash``), in file order."""
    return [r for r in read_metrics(node_dir / "metrics.jsonl", kind="round") if "param_hash" in r]


def steady_rounds(rounds: Sequence[Mapping[str, Any]], warmup_rounds: int) -> list[Mapping[str, Any]]:
    """The samples of one node: rounds after the warm-up that have a utilization (see the docstring)."""
    return [r for r in rounds if r["round"] > warmup_rounds and r.get("utilization") is not None]


def round_gaps(rounds: Sequence[Mapping[str, Any]], steady: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds from a node's record of round r-1 to that of each steady round r."""
    written = {int(r["round"]): float(r["time"]) for r in rounds}
    return [float(r["time"]) - written[r["round"] - 1] for r in steady if r["round"] - 1 in written]


def _mean(values: Sequence[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def summarize(
    variant: Variant, settings: Settings, rounds_per_node: Sequence[Sequence[Mapping[str, Any]]]
) -> dict[str, Any]:
    """The variant's figures from every node's round records (one list per node)."""
    steady_per_node = [steady_rounds(rounds, settings.warmup_rounds) for rounds in rounds_per_node]
    samples = [r for steady in steady_per_node for r in steady]
    utilizations = [float(r["utilization"]) for r in samples]
    gaps = [
        gap
        for rounds, steady in zip(rounds_per_node, steady_per_node, strict=True)
        for gap in round_gaps(rounds, steady)
    ]
    mean_utilization = _mean(utilizations)
    met = None
    if variant.overlap:
        met = mean_utilization is not None and mean_utilization >= TARGET_UTILIZATION
    bytes_sent = [int(r["bytes_sent"]) for r in samples]
    return {
        "num_samples": len(samples),
        "utilization_mean": mean_utilization,
        "utilization_min": round(min(utilizations), 4) if utilizations else None,
        "utilization_per_node": [
            [round(float(r["utilization"]), 4) for r in steady] for steady in steady_per_node
        ],
        "seconds_compute_mean": _mean([float(r["seconds_compute"]) for r in samples]),
        "seconds_blocked_mean": _mean([float(r["seconds_blocked"]) for r in samples]),
        "blocked_share_mean": _mean(
            [float(r["blocked_share"]) for r in samples if r.get("blocked_share") is not None]
        ),
        "seconds_comm_mean": _mean([float(r["seconds_comm"]) for r in samples]),
        "seconds_per_round": _mean(gaps),
        "bytes_sent_per_round": round(statistics.fmean(bytes_sent)) if bytes_sent else None,
        "min_peers": min((int(r["peers"]) for r in samples), default=None),
        "met": met,
    }


def stop_launcher(process: subprocess.Popen[bytes], log_path: Path) -> None:
    """SIGINT (the nodes finish their round and leave), a second SIGINT (it kills them), SIGKILL;
    a Ctrl-C or SIGTERM meanwhile skips to the next step at once, and is raised again at the end."""
    signals: list[int] = []
    handlers = {s: signal.signal(s, lambda n, _: signals.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for signum, grace in STOP_STEPS:
            num_signals, deadline = len(signals), time.monotonic() + grace.total_seconds()
            if process.poll() is None:
                process.send_signal(signum)
            while process.poll() is None and time.monotonic() < deadline and len(signals) == num_signals:
                time.sleep(POLL_SECONDS)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    if process.returncode == -signal.SIGKILL:
        # The launcher could not stop its nodes: kill their groups (pids from its log), remove its namespaces.
        for match in re.finditer(r"started \(pid (\d+)\)", log_path.read_text(errors="replace")):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(match[1]), signal.SIGKILL)
        if unavailable_reason() is None:
            cleanup_leftovers(LAUNCHER_NAME_PREFIX)
    if signals:
        raise KeyboardInterrupt if signals[0] == signal.SIGINT else SystemExit(128 + signals[0])


def run_variant(settings: Settings, variant: Variant, workdir: Path) -> dict[str, Any]:
    """One swarm run; the variant's record (with ``error`` if it could not be measured)."""
    record: dict[str, Any] = {
        "variant": variant.name,
        "link_mbit": variant.link_mbit,
        "overlap": variant.overlap,
        "nodes": settings.num_nodes,
        "model": settings.model,
        "params": None,
        "inner_steps": settings.inner_steps,
        "batch_size": settings.batch_size,
        "seq_len": settings.seq_len or None,  # None: the model preset's
        "codec": settings.codec,
        "max_rounds": settings.max_rounds,
        "warmup_rounds": settings.warmup_rounds,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
    }
    run_dir = workdir / "swarm"
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "swarm.log"
    print(f"bench_utilization: running {variant.name} (log {log_path})", file=sys.stderr, flush=True)
    with log_path.open("wb") as log_file:
        # Its own session: a terminal's Ctrl-C reaches only this script, which stops the launcher.
        launcher = subprocess.Popen(
            swarm_argv(settings, variant, run_dir), cwd=REPO_ROOT, stdout=log_file,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            launcher.wait(timeout=settings.timeout.total_seconds())
        except subprocess.TimeoutExpired:
            record["error"] = (
                f"the swarm did not finish {settings.max_rounds} rounds within {settings.timeout}"
            )
        finally:
            stop_launcher(launcher, log_path)
    rounds_per_node = [read_rounds(run_dir / f"node-{i}") for i in range(settings.num_nodes)]
    record.update(summarize(variant, settings, rounds_per_node))
    report_path = run_dir / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    record["param_hash_all_agree"] = report.get("param_hash", {}).get("all_agree")
    record["exit_codes"] = report.get("exit_codes")
    record["wall_seconds"] = report.get("wall_seconds")
    node0_log = run_dir / "node-0.log"
    if node0_log.exists() and (match := PARAMS_LINE.search(node0_log.read_text(errors="replace"))):
        record["params"] = int(match["params"].replace(",", ""))
    if "error" not in record:
        if launcher.returncode != 0 or not report:
            record["error"] = f"dtnode swarm exited with code {launcher.returncode}; see {log_path}"
        elif record["num_samples"] == 0:
            record["error"] = "no steady-state round: raise --max-rounds above --warmup-rounds + 1"
    record["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    return record


def summary_object(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    overlap = [r for r in records if r["overlap"]]
    return {
        "summary": True,
        "target_utilization": TARGET_UTILIZATION,
        "utilization_mean": {r["variant"]: r.get("utilization_mean") for r in records},
        "overlap_met": all(r.get("met") is True for r in overlap) if overlap else None,
        "num_failed": sum("error" in r for r in records),
    }


def summary_line(records: Sequence[Mapping[str, Any]]) -> str:
    """``bench_utilization: tiny, 4 nodes, H=10, int8: 100mbit-sync 0.812 (min 0.790) ...: PASS``."""
    first = records[0]
    parts = []
    for r in records:
        if "error" in r or r.get("utilization_mean") is None:
            parts.append(f"{r['variant']} FAILED")
        else:
            parts.append(
                f"{r['variant']} {r['utilization_mean']:.3f} (min {r['utilization_min']:.3f}, "
                f"{r['seconds_per_round']:.1f} s/round)"
            )
    verdict = {None: "no overlap variant", True: "PASS", False: "FAIL"}[
        summary_object(records)["overlap_met"]
    ]
    return (
        f"bench_utilization: {first['model']}, {first['nodes']} nodes, H={first['inner_steps']}, "
        f"{first['codec']}, steady rounds > {first['warmup_rounds']}: {'; '.join(parts)} | "
        f"target mean >= {TARGET_UTILIZATION} with overlap: {verdict}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--links", type=lambda t: [float(x) for x in t.split(",")], default=[100.0, 20.0],
        help="comma-separated uplink caps in Mbit/s (0 = loopback, no emulator)",
    )  # fmt: skip
    parser.add_argument(
        "--modes",
        type=lambda t: [x.strip() for x in t.split(",")],
        default=list(MODES),
        help="comma-separated: sync, overlap",
    )
    parser.add_argument("--nodes", type=int, default=4, help="nodes in each swarm (they share this machine)")
    parser.add_argument("--model", default="tiny", help="model preset (tiny: 10.8M params, nano: 0.9M)")
    parser.add_argument("--inner-steps", type=int, default=10, help="H, inner steps per outer round")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per inner step")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0: the model's own)")
    parser.add_argument("--codec", default="int8", help="pseudo-gradient wire codec")
    parser.add_argument("--max-rounds", type=int, default=5, help="outer rounds per swarm run")
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="first rounds of every node left out (see Steady state)"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one swarm run may take")
    add_output_flags(parser, keep_logs=True)  # --json-out: every object printed
    args = parser.parse_args(argv)
    if not args.links or any(link < 0 for link in args.links):
        parser.error("--links must list caps >= 0")
    if not args.modes or any(mode not in MODES for mode in args.modes):
        parser.error(f"--modes must list some of {', '.join(MODES)}")
    if min(args.nodes, args.inner_steps, args.batch_size, args.max_rounds) < 1 or args.warmup_rounds < 0:
        parser.error(
            "--nodes, --inner-steps, --batch-size and --max-rounds must be >= 1, --warmup-rounds >= 0"
        )
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if any(link > 0 for link in args.links) and (reason := unavailable_reason()) is not None:
        print(f"bench_utilization: cannot run the WAN emulator: {reason} (--links 0 runs on loopback)",
              file=sys.stderr)  # fmt: skip
        return 2
    exit_on_sigterm()  # unwinds run_variant's `finally`, which stops the swarm
    settings = Settings(
        num_nodes=args.nodes,
        model=args.model,
        inner_steps=args.inner_steps,
        batch_size=args.batch_size,
        codec=args.codec,
        max_rounds=args.max_rounds,
        warmup_rounds=args.warmup_rounds,
        timeout=datetime.timedelta(seconds=args.timeout),
        seq_len=args.seq_len,
    )
    variants = [
        Variant(link_mbit=link, overlap=mode == "overlap") for link, mode in itertools.product(args.links, args.modes)
    ]  # fmt: skip
    records: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        for variant in variants:
            with scratch_dir(args.keep_logs, variant.name, prefix="bench_utilization-") as workdir:
                records.append(run_variant(settings, variant, workdir))
            print_json(records[-1])
    except (KeyboardInterrupt, SystemExit):
        print("bench_utilization: interrupted; the swarm and its namespaces were stopped", file=sys.stderr)
        return 130
    finally:
        write_json(args.json_out, [*records, summary_object(records)])
    summary = summary_object(records) | {"wall_seconds": round(time.monotonic() - started, 1)}
    print_json(summary)
    print(summary_line(records), flush=True)
    return 1 if summary["num_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
