"""Compute utilization of a swarm of 1B / 10B / 100B models against link bandwidth, from the swarm
simulator (issue 33, "What it must show", second item), beside Streaming DiLoCo's published 95%.

    python scripts/bench/bench_sim_utilization.py --json-out sim_util.json --plot sim_util.png

**What runs.** For every model size P, link rate and (codec, F) the swarm simulator (``scripts/sim``,
the product's own membership code) runs ``--nodes`` nodes of equal speed on equal links (uplink =
downlink = the rate, one-way latency ``--latency-ms`` to the core), no faults, ``--rounds`` rounds of
a vector of P/F numbers with an inner phase of H/F steps: with F > 1 each swarm round carries one
fragment (ARCHITECTURE.md, "Streamed fragments"), taken as P/F numbers (the daemon's fragments are
blocks strided over F, balanced parameter by parameter to about P/F each). The all-reduce is the simulator's byte
formulas for the codec over the product's ``GroupSpec``. From the steady rounds (2 onwards) it
takes, per node and round, ``C`` = wall − compute (formation, the all-reduce, the waits for records),
its all-reduce seconds, formation seconds and bytes sent.

**What is derived.** The simulator's nodes run synchronous rounds; it has no model of ``--overlap``
or of τ. Those schedules are the daemon's rule applied to the simulated ``C``
(``scripts/sim/schedule.py``): the training thread waits ``max(0, C − hidden)``, hidden = 0
(synchronous), the next phase (``--overlap``) or τ = H/F steps (fragments, the largest τ the daemon
allows). With equal speeds and no faults this is exact in the model's steady state (every node ends
its phase at the same time with or without overlap, and the simulation counts CPU as free), so a
second implementation of overlap inside the simulator would add nothing here.

Settings (``curves``): int8 and top-k (``--codec topk``, its default density 62/4096 ≈ 1.5%, the
relay of ARCHITECTURE.md "Sparse contributions"), each synchronous, with ``--overlap``, and with
``--fragments F --overlap-steps H/F``.

**Inner step time** (an assumption, stated and printed): ``6 · P · tokens_per_step / (GPUs × peak ×
MFU)``, the 6·P FLOPs per token of a dense transformer's forward and backward (Kaplan et al. 2020),
per node: ``--tokens-per-step`` 2^20 (a 1M-token batch per node per inner step), H100 SXM bf16 dense
peak 989 TFLOP/s (NVIDIA's H100 datasheet), MFU 0.40 (Llama 3, Dubey et al. 2024, arXiv 2407.21783:
38–43% BF16 MFU on H100), and ``--gpus`` per node by memory: mixed-precision AdamW holds 16 bytes a
parameter (ZeRO, Rajbhandari et al. 2020), so 8 GPUs of 80 GB hold 1B and 10B (16 and 160 GB) and a
100B model (1.6 TB) needs 64. H = 100 inner steps (DiLoCo's and Streaming DiLoCo's H,
Douillard et al. 2023, 2025). Utilization depends on these only through the phase's seconds: half the
tokens per step (or twice the GPUs) needs twice the bandwidth for the same figure.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, the compute-utilization simulation): 95%
for 1B, 10B and 100B models at 1–5 Gbit/s between workers; marked on the plot, not recomputed here.

Prints one JSON object per point, a summary object (per model and setting: the lowest rate of the
grid at ≥ 95%, and the rate where the curve crosses 95%: the round's seconds fitted as a + b / rate
between the two grid points around it) and a
one-line summary. Exit status 1 if a simulated run did not form one group of all its nodes in every
measured round (then its figures would not be the schedule's), else 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.common import add_output_flags, print_json, pyplot, write_json  # noqa: E402
from scripts.sim.schedule import utilization  # noqa: E402
from scripts.sim.settings import SimSettings  # noqa: E402
from scripts.sim.swarm import Swarm  # noqa: E402

FLOPS_PER_PARAM_TOKEN = 6
"""Training FLOPs per parameter and token of a dense transformer (forward 2, backward 4)."""
H100_BF16_DENSE_FLOPS = 989e12
"""NVIDIA H100 SXM, bf16 dense tensor-core peak (the datasheet's 1,979 TFLOP/s is with sparsity)."""
TARGET = 0.95
"""Streaming DiLoCo's published utilization at 1–5 Gbit/s."""
PUBLISHED_GBIT = (1.0, 5.0)


@dataclass(frozen=True)
class Setting:
    """One curve: a codec, F fragments, and how much of a round training hides."""

    name: str
    codec: str
    fragments: int
    overlap: bool
    """With F = 1: ``--overlap`` (the next phase hides the round); with F > 1: τ = H/F steps."""


def curves(num_fragments: int) -> tuple[Setting, ...]:
    """The six settings, fragments at ``num_fragments``."""
    return tuple(
        Setting(name, codec, fragments, overlap)
        for codec in ("int8", "topk")
        for name, fragments, overlap in (
            (codec, 1, False),
            (f"{codec} --overlap", 1, True),
            (f"{codec} F={num_fragments} τ=H/F", num_fragments, True),
        )
    )


def step_seconds(
    num_params: float, tokens_per_step: int, num_gpus: int, peak_flops: float, mfu: float
) -> float:
    """One inner step of a node: 6 · P · tokens over the node's achieved FLOP/s."""
    return FLOPS_PER_PARAM_TOKEN * num_params * tokens_per_step / (num_gpus * peak_flops * mfu)


@dataclass(frozen=True)
class SimulatedRound:
    """What the simulator says of a steady synchronous round (rounds 2 onwards, mean over nodes)."""

    round_seconds: float
    """C: a node's wall − compute in a round (formation, all-reduce, waits)."""
    allreduce_seconds: float
    formation_seconds: float
    bytes_sent: float
    utilization: float
    """The simulator's own compute utilization of those rounds (synchronous)."""
    one_group: bool
    """Every measured round formed one group of all the nodes."""
    simulated_seconds: float


def simulate_round(
    *,
    num_nodes: int,
    num_params: int,
    codec: str,
    phase_seconds: float,
    link_mbit: float,
    latency_ms: float,
    num_rounds: int,
    seed: int,
) -> SimulatedRound:
    """Run the simulator (equal speeds and links, no faults) and read its steady rounds."""
    link_bytes_per_s = link_mbit * 1e6 / 8
    # Long enough for the slowest codec's relay: (N + 1) payloads of at most 1.1 bytes a number
    # each way per round, plus the phase and the formation's waits.
    round_bound = phase_seconds + 2 * (num_nodes + 1) * 1.1 * num_params / link_bytes_per_s + 600
    settings = SimSettings(
        num_nodes=num_nodes,
        num_rounds=num_rounds,
        seed=seed,
        num_params=num_params,
        codec=codec,
        phase_seconds=phase_seconds,
        speed_min=1.0,
        speed_max=1.0,
        link_mbit_min=link_mbit,
        link_mbit_max=link_mbit,
        latency_ms_min=latency_ms,
        latency_ms_max=latency_ms,
        max_seconds=(num_rounds + 1) * round_bound,
    )
    swarm = Swarm(settings)
    result = swarm.run()
    steady = [r for r in result["rounds"] if r["round"] >= 2]
    ends = [end for r in steady for end in swarm.recorder.round_ends.get(r["round"], [])]
    if not steady or not ends:
        raise RuntimeError(f"the simulation reached no steady round: {settings}")
    return SimulatedRound(
        round_seconds=statistics.fmean(wall - compute for _, _, compute, wall in ends),
        allreduce_seconds=statistics.fmean(r["allreduce_seconds"] for r in steady),
        formation_seconds=statistics.fmean(r["formation_seconds_max"] or 0.0 for r in steady),
        bytes_sent=statistics.fmean(r["bytes_sent_mean"] or 0 for r in steady),
        utilization=sum(c for _, _, c, _ in ends) / sum(w for _, _, _, w in ends),
        one_group=all(r["group_sizes"] == [num_nodes] and r["live_averaged"] == num_nodes for r in steady),
        simulated_seconds=result["end"]["simulated_seconds"],
    )


@dataclass(frozen=True)
class Model:
    name: str
    num_params: int
    num_gpus: int


def crossing_gbit(
    curve: list[tuple[float, float]], *, phase_seconds: float, hidden_seconds: float, target: float = TARGET
) -> float | None:
    """The link rate at which utilization reaches ``target``, from ``curve``'s (Gbit/s, C) points: C,
    a round's seconds, is a + b / rate in the simulator's model (the all-reduce's bytes over the link,
    plus formation and round trips that do not depend on it), fitted on the two grid points around
    the crossing; the lowest rate if it is already there; None if the grid never reaches it."""
    wanted = hidden_seconds + phase_seconds * (1 / target - 1)  # the largest C that still reaches target
    ordered = sorted(curve)
    for index, (gbit, seconds) in enumerate(ordered):
        if seconds <= wanted:
            if index == 0:
                return gbit
            low_gbit, low_seconds = ordered[index - 1]
            b = (low_seconds - seconds) / (1 / low_gbit - 1 / gbit)
            a = seconds - b / gbit
            return b / (wanted - a) if wanted > a else gbit
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every point of the grid; the summary; whether every run formed one group per round."""
    models = [
        Model(f"{size:g}B", round(size * 1e9), gpus) for size, gpus in zip(args.sizes, args.gpus, strict=True)
    ]
    settings = curves(args.fragments)
    cache: dict[tuple[int, str, int, float], SimulatedRound] = {}
    points: list[dict[str, Any]] = []
    for model in models:
        step = step_seconds(model.num_params, args.tokens_per_step, model.num_gpus, args.peak_flops, args.mfu)
        for gbit in args.links:
            for setting in settings:
                steps_per_round = args.inner_steps // setting.fragments
                phase = steps_per_round * step
                key = (model.num_params, setting.codec, setting.fragments, gbit)
                if key not in cache:
                    cache[key] = simulate_round(
                        num_nodes=args.nodes,
                        num_params=model.num_params // setting.fragments,
                        codec=setting.codec,
                        phase_seconds=phase,
                        link_mbit=gbit * 1000,
                        latency_ms=args.latency_ms,
                        num_rounds=args.rounds,
                        seed=args.seed,
                    )
                simulated = cache[key]
                # --overlap hides a round behind the next phase; τ = H/F steps is one fragment's phase.
                hidden = phase if setting.overlap else 0.0
                point = {
                    "model": model.name,
                    "num_params": model.num_params,
                    "gbit": gbit,
                    "setting": setting.name,
                    "codec": setting.codec,
                    "fragments": setting.fragments,
                    "overlap": setting.overlap,
                    "step_seconds": round(step, 4),
                    "phase_seconds": round(phase, 3),
                    "round_seconds": round(simulated.round_seconds, 3),
                    "allreduce_seconds": round(simulated.allreduce_seconds, 3),
                    "formation_seconds": round(simulated.formation_seconds, 3),
                    "bytes_sent_per_round": round(simulated.bytes_sent),
                    "bytes_sent_per_step": round(simulated.bytes_sent / steps_per_round),
                    "utilization": round(utilization(phase, simulated.round_seconds, hidden), 4),
                    "simulated_utilization": round(simulated.utilization, 4),
                    "one_group": simulated.one_group,
                }
                points.append(point)
                print_json(point)
    summary = []
    for model in models:
        for setting in settings:
            own = [p for p in points if p["model"] == model.name and p["setting"] == setting.name]
            reached = sorted(p["gbit"] for p in own if p["utilization"] >= TARGET)
            phase = own[0]["phase_seconds"]
            crossing = crossing_gbit(
                [(p["gbit"], p["round_seconds"]) for p in own],
                phase_seconds=phase,
                hidden_seconds=phase if setting.overlap else 0.0,
            )
            summary.append(
                {
                    "model": model.name,
                    "setting": setting.name,
                    "lowest_grid_gbit_at_95": reached[0] if reached else None,
                    "gbit_at_95": round(crossing, 4) if crossing is not None else None,
                }
            )
    return {
        "assumptions": {
            "nodes": args.nodes,
            "inner_steps": args.inner_steps,
            "tokens_per_step": args.tokens_per_step,
            "peak_flops": args.peak_flops,
            "mfu": args.mfu,
            "latency_ms": args.latency_ms,
            "rounds": args.rounds,
            "seed": args.seed,
            "models": [vars(m) for m in models],
            "fragments": args.fragments,
            "published": {"utilization": TARGET, "gbit": list(PUBLISHED_GBIT)},
        },
        "points": points,
        "summary": summary,
        "all_one_group": all(p["one_group"] for p in points),
    }


def summary_line(result: dict[str, Any]) -> str:
    by_model: dict[str, list[str]] = {}
    for entry in result["summary"]:
        at = entry["gbit_at_95"]
        by_model.setdefault(entry["model"], []).append(
            f"{entry['setting']} {'never' if at is None else f'{at:.3g}'}"
        )
    parts = "; ".join(f"{model}: {', '.join(values)}" for model, values in by_model.items())
    assumptions = result["assumptions"]
    return (
        f"bench_sim_utilization: N={assumptions['nodes']}, H={assumptions['inner_steps']}, Gbit/s at 95% "
        f"utilization: {parts} (Streaming DiLoCo: 1-5); one group every round: {result['all_one_group']}"
    )


def plot(result: dict[str, Any], path: Path) -> bool:
    """Utilization against link rate, a panel per model size; False if matplotlib is not there."""
    plt = pyplot()
    if plt is None:
        return False
    models = [m["name"] for m in result["assumptions"]["models"]]
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), sharey=True, squeeze=False)
    styles = {"int8": "tab:blue", "topk": "tab:orange"}
    for axis, model in zip(axes[0], models, strict=True):
        for setting in curves(result["assumptions"]["fragments"]):
            curve = sorted(
                (p["gbit"], p["utilization"])
                for p in result["points"]
                if p["model"] == model and p["setting"] == setting.name
            )
            line = ":" if not setting.overlap else ("-" if setting.fragments == 1 else "--")
            axis.plot(
                [g for g, _ in curve],
                [u for _, u in curve],
                line,
                marker="o" if setting.fragments == 1 else "s",
                markersize=3 if setting.fragments == 1 else 5,
                fillstyle="full" if setting.fragments == 1 else "none",
                color=styles[setting.codec],
                label=setting.name,
            )
        low, high = PUBLISHED_GBIT
        axis.axhline(TARGET, color="grey", linewidth=0.6)
        axis.plot([low, high], [TARGET, TARGET], color="black", linewidth=5, alpha=0.6,
                  label="Streaming DiLoCo (published): 95% at 1–5 Gbit/s")  # fmt: skip
        axis.set_xscale("log")
        axis.set_ylim(0, 1.02)
        axis.set_xlabel("link (Gbit/s, each node's up = down)")
        step = next(p["step_seconds"] for p in result["points"] if p["model"] == model)
        axis.set_title(f"{model} (inner step {step:.1f} s, H={result['assumptions']['inner_steps']})")
        axis.grid(True, which="both", linewidth=0.3)
    axes[0][0].set_ylabel("compute utilization (compute / wall)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    figure.suptitle(
        f"dtnode swarm simulator: {result['assumptions']['nodes']} nodes, equal speeds, no faults"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def floats(text: str) -> list[float]:
    return [float(value) for value in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--sizes", type=floats, default=[1.0, 10.0, 100.0], help="model sizes, billions of parameters")
    add(
        "--gpus",
        type=ints,
        default=[8, 8, 64],
        help="GPUs per node, one per size (memory: 16 bytes a parameter)",
    )
    add("--links", type=floats, default=[0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0],
        help="link rates, Gbit/s (uplink = downlink)")  # fmt: skip
    add("--nodes", type=int, default=8, help="nodes in the swarm")
    add("--inner-steps", type=int, default=100, help="H")
    add("--fragments", type=int, default=4, help="F of the fragment settings (H divisible by F)")
    add("--tokens-per-step", type=int, default=1 << 20, help="tokens a node trains per inner step")
    add("--peak-flops", type=float, default=H100_BF16_DENSE_FLOPS, help="peak FLOP/s of one GPU")
    add("--mfu", type=float, default=0.40, help="model FLOP utilization")
    add("--latency-ms", type=float, default=25.0, help="one-way latency of each node to the core")
    add("--rounds", type=int, default=3, help="simulated rounds per point (rounds 2.. are measured)")
    add("--seed", type=int, default=0, help="the simulator's seed")
    add("--plot", type=Path, default=None, help="write the plot here (PNG; needs matplotlib)")
    add_output_flags(parser)
    args = parser.parse_args(argv)
    if len(args.sizes) != len(args.gpus):
        parser.error("--sizes and --gpus need one value each per model")
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (round 1 includes the start)")
    if args.inner_steps % args.fragments:
        parser.error("--inner-steps must be divisible by --fragments")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    print_json({"summary": result["summary"], "all_one_group": result["all_one_group"]})
    print(summary_line(result))
    write_json(args.json_out, result)
    if args.plot is not None and not plot(result, args.plot):
        print("bench_sim_utilization: matplotlib is not installed: no plot", file=sys.stderr)
    return 0 if result["all_one_group"] else 1


if __name__ == "__main__":
    sys.exit(main())
