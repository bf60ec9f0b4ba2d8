"""Peak bandwidth of streamed fragments: the busiest second on a node's link, F fragments against one.

For each F in ``--fragments`` (default ``1,4``) ``dtnode swarm`` runs ``--nodes`` nodes in the WAN
emulator (``--link-mbit``: each host's uplink capped by a tbf) for the same inner steps (``--steps``,
a multiple of H): F = 1 as whole-model rounds overlapped with the next phase (``--overlap``), F > 1
as ``--fragments F --overlap-steps τ`` (τ = ⌊H/F⌋ by default), so ``--max-rounds`` is steps/H·F.
While the swarm runs, a thread of this process enters the emulator's switch namespace and reads
``/proc/thread-self/net/dev`` every ``--sample-ms``: the bytes switch port ``p<i>`` *received* are
what host i put on its uplink (after its cap). Per run and node:

    peak_bytes_per_s   the busiest 1-second window: max over samples i of (b_j − b_i)/(t_j − t_i),
                       j the first sample at least 1 s after i
    link_busy_share    bytes sent / (link rate × sampled wall time)
    utilization        the launcher's (inner compute / wall, node.ops.metrics.run_utilization)

and the launcher's participation and param_hash agreement. Targets: the fragmented run's peak (max
over nodes) at most ``--max-peak-ratio`` (0.35) of the F = 1 run's, every run's utilization at least
``--min-utilization`` (0.97), every node in every round, one final param_hash.

    sudo python scripts/bench/bench_fragment_bandwidth.py --model tiny --inner-steps 8 --steps 16

Prints one JSON object per run, a summary object and a one-line summary; exit code 0 if every
target is met, 1 if not (or a swarm failed). Needs root (the WAN emulator).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.common import REPO_ROOT, add_output_flags, print_json, scratch_dir, write_json
from scripts.tools.wan_emulator import enter_network_namespace

NETNS_DIR = Path("/var/run/netns")


def read_port_bytes(num_hosts: int) -> list[int] | None:
    """Bytes each switch port ``p<i>`` received so far (this thread's network namespace); None once
    a port is gone (the emulator is being taken down)."""
    received: dict[str, int] = {}
    for line in Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]:
        name, counters = line.split(":", 1)
        received[name.strip()] = int(counters.split()[0])  # the first column: receive bytes
    ports = [f"p{i}" for i in range(num_hosts)]
    return [received[p] for p in ports] if all(p in received for p in ports) else None


class LinkSampler:
    """Samples the switch's port counters of the emulator the launcher ``owner_pid`` builds."""

    def __init__(self, owner_pid: int, num_hosts: int, interval_s: float) -> None:
        self.owner_pid, self.num_hosts, self.interval_s = owner_pid, num_hosts, interval_s
        self.samples: list[tuple[float, list[int]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _switch_namespace(self) -> str | None:
        prefix = f"dtswarm-{self.owner_pid}-"
        if not NETNS_DIR.is_dir():
            return None
        names = [n for n in os.listdir(NETNS_DIR) if n.startswith(prefix) and n.endswith("-sw")]
        return names[0] if names else None

    def _run(self) -> None:
        name = None
        while name is None and not self._stop.wait(0.05):
            name = self._switch_namespace()
        if name is None:
            self.error = "the emulator's switch namespace never appeared"
            return
        enter_network_namespace(name)  # this thread only (setns is per thread)
        while not self._stop.is_set():
            try:
                counters = read_port_bytes(self.num_hosts)
            except (OSError, ValueError) as error:  # the namespace went away at the run's end
                self.error = self.error or str(error)
                return
            if counters is None:
                if self.samples:
                    return  # the run ended
                self._stop.wait(0.05)  # not every port is built yet
                continue
            self.samples.append((time.monotonic(), counters))
            self._stop.wait(self.interval_s)


def peak_window(samples: list[tuple[float, list[int]]], host: int, window_s: float = 1.0) -> float:
    """The busiest ``window_s`` of host ``host``'s uplink, bytes per second (0 with too few samples)."""
    best, j = 0.0, 0
    for i, (t_i, b_i) in enumerate(samples):
        j = max(j, i + 1)
        while j < len(samples) and samples[j][0] - t_i < window_s:
            j += 1
        if j == len(samples):
            break
        t_j, b_j = samples[j]
        best = max(best, (b_j[host] - b_i[host]) / (t_j - t_i))
    return best


def swarm_argv(args: argparse.Namespace, fragments: int, run_dir: Path) -> list[str]:
    rounds = args.steps // args.inner_steps * fragments
    argv = [
        sys.executable, "-m", "node.ops.cli", "swarm", "--nodes", str(args.nodes), "--run-dir", str(run_dir),
        "--link-mbit", str(args.link_mbit), "--model", args.model, "--inner-steps", str(args.inner_steps),
        "--max-rounds", str(rounds), "--min-peers", str(args.nodes), "--batch-size", str(args.batch_size),
        "--codec", args.codec, "--log-every", "100000",
    ]  # fmt: skip
    if fragments == 1:
        argv.append("--overlap")
    else:
        tau = args.overlap_steps if args.overlap_steps is not None else args.inner_steps // fragments
        argv += ["--fragments", str(fragments), "--overlap-steps", str(tau)]
    return argv + args.node_args.split()


def run_one(args: argparse.Namespace, fragments: int, scratch: Path) -> dict[str, Any]:
    run_dir = scratch / f"fragments-{fragments}"
    argv = swarm_argv(args, fragments, run_dir)
    started = time.monotonic()
    with open(scratch / f"fragments-{fragments}.out", "w") as out:
        swarm = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        sampler = LinkSampler(swarm.pid, args.nodes, args.sample_ms / 1000)
        try:
            code = swarm.wait(timeout=args.timeout)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            swarm.terminate()  # the launcher stops its nodes and deletes its namespaces on SIGTERM
            code = swarm.wait(timeout=120)
        finally:
            sampler.stop()
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else {}
    samples = sampler.samples
    span = samples[-1][0] - samples[0][0] if len(samples) > 1 else 0.0
    link_bytes_per_s = args.link_mbit * 1e6 / 8
    nodes = []
    for host in range(args.nodes):
        sent = samples[-1][1][host] - samples[0][1][host] if samples else 0
        nodes.append({
            "node": host,
            "peak_bytes_per_s": round(peak_window(samples, host)),
            "bytes_on_link": sent,
            "link_busy_share": round(sent / (link_bytes_per_s * span), 4) if span else None,
        })  # fmt: skip
    summaries = report.get("nodes", [])
    utilizations = [n.get("utilization") for n in summaries]
    agreement = report.get("param_hash", {})
    final_hashes = {n.get("final_param_hash") for n in summaries}
    return {
        "fragments": fragments,
        "argv": argv[2:],
        "swarm_exit_code": code,
        "wall_seconds": round(time.monotonic() - started, 1),
        "sampled_seconds": round(span, 1),
        "num_samples": len(samples),
        "sampler_error": sampler.error,
        "peak_bytes_per_s": max((n["peak_bytes_per_s"] for n in nodes), default=0),
        "link_bytes_per_s": link_bytes_per_s,
        "nodes": nodes,
        "utilization": utilizations,
        "min_utilization": min((u for u in utilizations if u is not None), default=None),
        "participation": report.get("participation", {}).get("participation"),
        "rounds": [n.get("num_rounds") for n in summaries],
        "final_param_hashes": sorted(h for h in final_hashes if h),
        "disagreeing_rounds": agreement.get("disagreeing_rounds"),
        "problems": report.get("problems"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fragments", default="1,4", help="comma list of F; the first is the reference (1)")
    parser.add_argument("--nodes", type=int, default=4, help="nodes, one emulated host each")
    parser.add_argument("--link-mbit", type=float, default=20.0, help="each host's uplink cap")
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--inner-steps", type=int, default=8, help="H")
    parser.add_argument("--steps", type=int, default=16, help="inner steps of each run (a multiple of H)")
    parser.add_argument("--overlap-steps", type=int, default=None, help="τ for F > 1 (default ⌊H/F⌋)")
    parser.add_argument("--batch-size", type=int, default=4, help="per node")
    parser.add_argument("--codec", default="int8", help="the payload codec")
    parser.add_argument("--node-args", default="", help="more flags for every node")
    parser.add_argument("--sample-ms", type=float, default=100.0, help="counter sampling period")
    parser.add_argument(
        "--max-peak-ratio", type=float, default=0.35, help="target: peak(F) / peak(1) at most"
    )
    parser.add_argument("--min-utilization", type=float, default=0.97, help="target: every node's at least")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each swarm may run")
    add_output_flags(parser, keep_logs=True)
    args = parser.parse_args(argv)
    if args.steps % args.inner_steps:
        parser.error("--steps must be a multiple of --inner-steps")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs = []
    with scratch_dir(
        args.keep_logs, "bench_fragment_bandwidth", prefix="bench_fragment_bandwidth-"
    ) as scratch:
        for fragments in (int(f) for f in args.fragments.split(",")):
            runs.append(run_one(args, fragments, scratch))
            print_json(runs[-1])
    reference = runs[0]
    checks = []
    for run in runs:
        ratio = (
            run["peak_bytes_per_s"] / reference["peak_bytes_per_s"] if reference["peak_bytes_per_s"] else None
        )
        run["peak_ratio"] = round(ratio, 3) if ratio is not None else None
        checks.append(
            run["swarm_exit_code"] == 0
            and run["participation"] == 1.0
            and len(run["final_param_hashes"]) == 1
            and not run["disagreeing_rounds"]
            and run["min_utilization"] is not None
            and run["min_utilization"] >= args.min_utilization
            and (run is reference or (ratio is not None and ratio <= args.max_peak_ratio))
        )
    met = all(checks)
    summary = {"summary": True, "met": met, "max_peak_ratio": args.max_peak_ratio,
               "min_utilization": args.min_utilization, "uptime": os.getloadavg()}  # fmt: skip
    print_json(summary)
    write_json(args.json_out, {"runs": runs, "summary": summary})
    parts = [
        f"F={r['fragments']}: peak {r['peak_bytes_per_s'] / 1e6:.2f} MB/s (x{r['peak_ratio']}), "
        f"utilization min {r['min_utilization']}, participation {r['participation']}, "
        f"{len(r['final_param_hashes'])} final param_hash"
        for r in runs
    ]
    print(f"bench_fragment_bandwidth: {args.nodes} x {args.model} at {args.link_mbit:g} Mbit/s, H={args.inner_steps}: "
          f"{'; '.join(parts)}; {'PASS' if met else 'FAIL'}")  # fmt: skip
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
