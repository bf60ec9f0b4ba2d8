"""Simulate a dtnode swarm of N nodes with the product's own membership code (issue 33, item 1).

    python scripts/tools/swarm_sim.py --nodes 100 --rounds 5 --seed 1 --json sim.json
    python scripts/tools/swarm_sim.py --nodes 1000 --rounds 3 --crash-rate 0.01 --join-rate 0.02 \\
        --leave-rate 0.02 --partition-at 400 --json sim.json --plot sim.png

Each simulated node drives ``protocol.membership.rounds.RoundFormation`` with the daemon's own
settings (``node.swarm.setup.swarm_config``), the lineage rule, the peer records and their TTL, the
parts and the participation and catch-up rules, on an injected clock, over a simulated DHT and
simulated links, with compute speeds spread 1x-4x and faults at rates; the all-reduce is modelled
from its byte formulas (``scripts/sim/``, whose modules document each model). It prints one line per
round and a summary line, writes the JSON (deterministic for a seed) and, if matplotlib is there,
the plots. Exit status 0 once the run reached its last round, 1 if it did not.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.common import pyplot  # noqa: E402
from scripts.sim.report import summary_line  # noqa: E402
from scripts.sim.settings import FaultRates, SimSettings  # noqa: E402
from scripts.sim.swarm import Swarm  # noqa: E402


def parse_settings(argv: list[str] | None) -> tuple[SimSettings, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    sim, faults = SimSettings(), FaultRates()  # the defaults live in the settings, not here
    add("--nodes", type=int, default=sim.num_nodes, help="nodes at the start")
    add("--rounds", type=int, default=sim.num_rounds, help="stop once a group of this round averaged")
    add("--seed", type=int, default=sim.seed, help="every random draw comes from this")
    add("--params", type=int, default=sim.num_params, help="numbers in the pseudo-gradient (fp32)")
    add("--codec", default=sim.codec, help="wire codec, as --codec of dtnode")
    add("--phase-seconds", type=float, default=sim.phase_seconds, help="an inner phase (H steps) at speed 1x")
    add("--speed-max", type=float, default=sim.speed_max, help="compute speeds are uniform in [1, this]")
    add("--round-seconds", type=float, default=sim.round_seconds,
        help="--round-seconds of dtnode: every phase lasts this long (0: H steps, --phase-seconds at 1x)")  # fmt: skip
    add("--link-mbit", type=float, nargs=2, default=(sim.link_mbit_min, sim.link_mbit_max), metavar=("MIN", "MAX"),
        help="uplink = downlink, log-uniform in [MIN, MAX] Mbit/s")  # fmt: skip
    add("--latency-ms", type=float, nargs=2, default=(sim.latency_ms_min, sim.latency_ms_max), metavar=("MIN", "MAX"),
        help="one-way latency to the core, uniform in [MIN, MAX] ms")  # fmt: skip
    add("--dht-delay", type=float, nargs=2, default=(sim.dht_delay_min, sim.dht_delay_max), metavar=("MIN", "MAX"),
        help="seconds before a stored record is visible, uniform")  # fmt: skip
    add("--dht-loss", type=float, default=sim.dht_loss, help="probability that a DHT store is lost")
    add("--join-window", type=float, default=sim.join_window, help="--join-window of the daemon")
    add("--tier-group-size", type=int, default=sim.tier_group_size,
        help="--tier-group-size of the daemon: groups of more nodes average tiered (0: flat rounds)")  # fmt: skip
    add("--max-wait", type=float, default=sim.max_wait, help="--max-wait of the daemon")
    add(
        "--crash-rate",
        type=float,
        default=faults.crash,
        help="fraction of live nodes crashing per nominal round",
    )
    add(
        "--restart-after",
        type=float,
        default=faults.restart_after,
        help="seconds until a crashed node restarts (0: never)",
    )
    add(
        "--freeze-rate",
        type=float,
        default=faults.freeze,
        help="fraction of live nodes freezing per nominal round",
    )
    add("--freeze-seconds", type=float, default=faults.freeze_seconds, help="how long a freeze lasts")
    add(
        "--leave-rate",
        type=float,
        default=faults.leave,
        help="fraction of live nodes leaving per nominal round",
    )
    add(
        "--join-rate",
        type=float,
        default=faults.join,
        help="new nodes per nominal round, fraction of --nodes",
    )
    add(
        "--partition-at",
        type=float,
        default=faults.partition_at,
        help="simulated second of a partition (0: none)",
    )
    add(
        "--partition-seconds",
        type=float,
        default=faults.partition_seconds,
        help="how long the partition lasts",
    )
    add(
        "--partition-fraction",
        type=float,
        default=faults.partition_fraction,
        help="share of nodes on the smaller side",
    )
    add(
        "--max-seconds",
        type=float,
        default=sim.max_seconds,
        help="stop after this many simulated seconds (0: auto)",
    )
    add("--json", type=Path, default=None, help="write the run's figures here")
    add("--plot", type=Path, default=None, help="write per-round plots here (PNG; needs matplotlib)")
    args = parser.parse_args(argv)
    settings = SimSettings(
        num_nodes=args.nodes,
        num_rounds=args.rounds,
        seed=args.seed,
        num_params=args.params,
        codec=args.codec,
        phase_seconds=args.phase_seconds,
        speed_max=args.speed_max,
        round_seconds=args.round_seconds,
        link_mbit_min=args.link_mbit[0],
        link_mbit_max=args.link_mbit[1],
        latency_ms_min=args.latency_ms[0],
        latency_ms_max=args.latency_ms[1],
        dht_delay_min=args.dht_delay[0],
        dht_delay_max=args.dht_delay[1],
        dht_loss=args.dht_loss,
        join_window=args.join_window,
        max_wait=args.max_wait,
        max_seconds=args.max_seconds,
        tier_group_size=args.tier_group_size,
        faults=FaultRates(
            crash=args.crash_rate,
            restart_after=args.restart_after,
            freeze=args.freeze_rate,
            freeze_seconds=args.freeze_seconds,
            leave=args.leave_rate,
            join=args.join_rate,
            partition_at=args.partition_at,
            partition_seconds=args.partition_seconds,
            partition_fraction=args.partition_fraction,
        ),
    )
    return settings, args


def round_line(figures: dict[str, Any]) -> str:
    leader = figures["leader"]
    return (
        f"round {figures['round']}: groups {figures['group_sizes']} (split {figures['split_groups']}, "
        f"other lineages {figures['other_lineage_groups']}), "
        f"formation median/max {figures['formation_seconds_median']}/{figures['formation_seconds_max']} s, "
        f"participation {figures['live_averaged']}/{figures['live_nodes']}, "
        f"bytes/node {figures['bytes_sent_mean']}, all-reduce {figures['allreduce_seconds']} s, "
        f"utilization {figures['compute_utilization']}, messages expired {figures['messages_expired']}, "
        f"leader ({leader.get('uplink_mbit')} Mbit/s) in {leader.get('messages_in')} msgs "
        f"out {leader.get('bytes_out')} B, Begin fan-out {leader.get('begin_fanout_seconds')} s"
    )


def plot(result: dict[str, Any], path: Path) -> bool:
    """Per-round plots; False (and nothing written) if matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    rounds = result["rounds"]
    x = [r["round"] for r in rounds]
    panels = [
        ("formation max (s)", [r["formation_seconds_max"] or 0 for r in rounds]),
        ("largest group", [max(r["group_sizes"], default=0) for r in rounds]),
        ("participation of live nodes", [r["participation"] or 0 for r in rounds]),
        ("compute utilization", [r["compute_utilization"] or 0 for r in rounds]),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3))
    for axis, (title, values) in zip(axes, panels, strict=True):
        axis.plot(x, values, marker="o")
        axis.set_title(title)
        axis.set_xlabel("round")
    settings = result["settings"]
    figure.suptitle(f"swarm_sim: {settings['num_nodes']} nodes, seed {settings['seed']}")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    settings, args = parse_settings(argv)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"swarm_sim: {line} ({time.perf_counter() - started:.0f}s wall)", file=sys.stderr, flush=True)

    swarm = Swarm(settings, progress=progress)
    result = swarm.run()
    wall = time.perf_counter() - started
    for figures in result["rounds"]:
        print(round_line(figures))
        print("  " + swarm.recorder.host_line(figures["round"]))
    for band in result["by_speed"]:
        low, high = band["speeds"]
        print(
            f"speeds {low}x-{high}x: {band['nodes']} nodes, forming rounds {band['formation_share']} of their "
            f"wall time, compute utilization {band['compute_utilization']}"
        )
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    print(
        summary_line(result) + f", wall {wall:.1f}s, CPU {cpu.ru_utime + cpu.ru_stime:.1f}s "
        f"(the process's, imports included), peak RSS {cpu.ru_maxrss / 1024:.0f} MiB, "
        f"views built {swarm.world.dht.num_views_built}, events {result['end']['events']}"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    if args.plot is not None and not plot(result, args.plot):
        print("swarm_sim: matplotlib is not installed: no plots", file=sys.stderr)
    reached = any(r["round"] == settings.num_rounds and r["groups"] for r in result["rounds"])
    return 0 if reached else 1


if __name__ == "__main__":
    sys.exit(main())
