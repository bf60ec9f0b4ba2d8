"""Bounded resources: does a node's memory grow over many outer rounds?

``dtnode swarm`` runs ``--nodes`` nodes on this machine (loopback) for ``--rounds``
outer rounds of ``--inner-steps`` inner steps each (nano by default: rounds of a second or two, so
the per-round machinery — round formation, the all-reduce and its buffers, snapshots served to
joiners, checkpoints, metrics — runs many times in a few minutes). Every round record carries the
node's resident memory when it was written (``rss_bytes``, ``node/ops/metrics.py``). Per node:

    baseline_bytes  median RSS over rounds [warmup, 2·warmup) (allocators and caches warmed up);
    final_bytes     median RSS over the last ``warmup`` rounds;
    growth_bytes    final − baseline; growth_fraction = growth / baseline;
    slope_bytes_per_round  least-squares slope of RSS over the rounds after the warm-up.

Target: no node grows by more than ``--max-growth`` (default 5 %) of its baseline between the
warm-up and the end of the run.

    python scripts/bench/bench_resources.py                      # 2 nodes, nano, 100 rounds of H=2
    python scripts/bench/bench_resources.py --nodes 3 --rounds 200

Prints one JSON object per node, a summary object and a one-line summary. Exit code 0 if the
target is met, 1 if not (or the swarm failed), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.ops.metrics import read_metrics
from scripts.common import REPO_ROOT, add_output_flags, print_json, write_json


def growth(rss: Sequence[int], warmup: int) -> dict[str, Any]:
    """Baseline, final, growth and slope of one node's RSS series (one value per round, in order)."""
    if len(rss) < 3 * warmup:
        raise ValueError(f"need at least {3 * warmup} rounds of RSS, got {len(rss)}")
    baseline = statistics.median(rss[warmup : 2 * warmup])
    final = statistics.median(rss[-warmup:])
    steady = rss[warmup:]
    slope = statistics.linear_regression(range(len(steady)), steady).slope
    return {
        "rounds": len(rss),
        "baseline_bytes": int(baseline),
        "final_bytes": int(final),
        "peak_bytes": max(rss),
        "growth_bytes": int(final - baseline),
        "growth_fraction": round((final - baseline) / baseline, 4),
        "slope_bytes_per_round": round(slope, 1),
    }


def swarm_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        sys.executable, "-m", "node.ops.cli", "swarm", "--nodes", str(args.nodes), "--run-dir", str(run_dir),
        "--model", args.model, "--inner-steps", str(args.inner_steps), "--max-rounds", str(args.rounds),
        "--min-peers", str(args.nodes), "--batch-size", "4", "--eval-batches", "1", "--log-every", "100000",
    ]  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=2, help="nodes on this machine")
    parser.add_argument("--rounds", type=int, default=100, help="outer rounds")
    parser.add_argument("--inner-steps", type=int, default=2, help="H")
    parser.add_argument("--model", default="nano", help="model preset")
    parser.add_argument("--warmup", type=int, default=10, help="rounds before the baseline")
    parser.add_argument("--max-growth", type=float, default=0.05, help="target: growth / baseline at most")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds the swarm may run")
    add_output_flags(parser)
    args = parser.parse_args(argv)
    if args.nodes < 2 or args.rounds < 3 * args.warmup or args.warmup < 1:
        parser.error("--nodes must be >= 2 and --rounds >= 3 x --warmup >= 3")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_resources-") as scratch:
        run_dir = Path(scratch) / "swarm"
        swarm = subprocess.Popen(swarm_argv(args, run_dir), cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
        try:
            code = swarm.wait(timeout=args.timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            swarm.terminate()  # the launcher stops its nodes on SIGTERM
            swarm.wait(timeout=120)
            return 130 if swarm.returncode == 130 else 1
        records = []
        for index in range(args.nodes):
            rounds = read_metrics(run_dir / f"node-{index}" / "metrics.jsonl", kind="round")
            rss = [r["rss_bytes"] for r in rounds if r.get("rss_bytes")]
            try:
                records.append({"node": index, **growth(rss, args.warmup)})
            except ValueError as error:
                records.append({"node": index, "rounds": len(rss), "error": str(error)})
    for record in records:
        print_json(record)
    worst = max((r.get("growth_fraction", float("inf")) for r in records), default=float("inf"))
    met = code == 0 and worst <= args.max_growth
    summary = {
        "summary": True,
        "nodes": args.nodes,
        "rounds": args.rounds,
        "inner_steps": args.inner_steps,
        "model": args.model,
        "swarm_exit_code": code,
        "worst_growth_fraction": worst,
        "max_growth": args.max_growth,
        "met": met,
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    print_json(summary)
    write_json(args.json_out, {"nodes": records, "summary": summary})
    per_node = ", ".join(
        f"node {r['node']} {r['baseline_bytes'] / 2**20:.0f} -> {r['final_bytes'] / 2**20:.0f} MiB "
        f"({100 * r['growth_fraction']:+.1f}%)"
        if "error" not in r
        else f"node {r['node']}: {r['error']}"
        for r in records
    )
    print(
        f"bench_resources: {args.nodes} nodes x {args.rounds} rounds ({args.model}, H={args.inner_steps}): "
        f"{per_node}; target <= {100 * args.max_growth:.0f}%: {'PASS' if met else 'FAIL'}"
    )
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
