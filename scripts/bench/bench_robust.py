"""Robust aggregation under attack: DiLoCo with one malicious worker among N, mean vs clipped vs trimmed.

N simulated DiLoCo workers (the machinery of ``bench_convergence.py``: the node's GPT, AdamW, shards
and ``DiLoCo`` outer step, outer rounds through ``SimulatedAllReduce``, i.e. the real ``PartReducer``
with the real aggregation rules, no sockets) train the nano model for ``--steps`` inner steps,
``--inner-steps`` H per outer round. Worker 0 trains honestly but sends, instead of its
pseudo-gradient Δ, one of:

    scaled        Δ x ``--attack-scale`` (default 100)
    sign_flipped  -Δ (a sign-flipped pseudo-gradient)
    noise         Gaussian noise whose norm is ``--attack-scale`` x ||Δ||

Every worker (the attacker included) then applies the same aggregated Δ with its own outer step, so
the global params stay identical (checked each round). Scenarios: ``clean`` (no attacker) and every
ATTACK, each with every aggregation rule (``mean``, ``clipped`` with ``--clip-factor``, ``trimmed``
with ``--trim``). Target: with the defence, the final eval loss within 5 % of the clean
mean run; ``mean`` under attack shows the damage.

    nice -n 19 python scripts/bench/bench_robust.py                    # 8 workers, 12 runs, ~30-60 CPU min
    nice -n 19 python scripts/bench/bench_robust.py --steps 50 --inner-steps 25 --scenarios clean:mean,scaled:clipped

Prints one JSON object per run as it finishes, then a one-line summary; ``--out`` writes them all.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.outer.diloco import DiLoCo
from protocol.allreduce.robust import AGGREGATIONS, AggregationRule
from protocol.codecs import get_codec
from scripts.bench.convergence_variants import (
    BenchSettings,
    build_worker,
    evaluate,
    inner_step,
    load_data,
    schedule_of,
)
from scripts.bench.simulated_allreduce import SimulatedAllReduce
from scripts.common import add_output_flags, print_json, write_json

ATTACKS = ("scaled", "sign_flipped", "noise")
TARGET_GAP = 0.05
ATTACKER = 0


@dataclass(frozen=True)
class Scenario:
    attack: str  # "clean" or one of ATTACKS
    aggregation: str

    @property
    def name(self) -> str:
        return f"{self.attack}:{self.aggregation}"


def attacked(delta: torch.Tensor, attack: str, scale: float, generator: torch.Generator) -> torch.Tensor:
    """What the malicious worker sends instead of its pseudo-gradient `delta` (E,)."""
    if attack == "scaled":
        return delta * scale
    if attack == "sign_flipped":
        return -delta
    assert attack == "noise", attack
    noise = torch.randn(delta.shape, generator=generator)
    return noise * (scale * delta.norm() / noise.norm())


def run(settings: BenchSettings, scenario: Scenario, args: argparse.Namespace) -> dict[str, Any]:
    start = time.perf_counter()
    corpus, eval_set = load_data(settings)
    workers = [build_worker(settings, corpus, i) for i in range(settings.num_workers)]
    outer = [
        DiLoCo(w.model, outer_lr=settings.outer_lr, outer_momentum=settings.outer_momentum, nesterov=True)
        for w in workers
    ]
    rule = AggregationRule(
        kind=scenario.aggregation,  # type: ignore[arg-type]
        clip_factor=args.clip_factor,
        trim_per_side=args.trim,
    )
    allreduce = SimulatedAllReduce(
        num_members=settings.num_workers, num_elements=outer[0].num_elements, codec=get_codec(args.codec),
        error_feedback=args.codec != "none", chunk_num_elements=settings.chunk_num_elements, rule=rule,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1234)
    schedule = schedule_of(settings)
    history = [evaluate(workers[0].model, eval_set)]
    num_attacker_adjusted = 0
    for step in range(settings.steps):
        for worker in workers:
            inner_step(worker, settings, schedule.lr(step))
        if (step + 1) % args.inner_steps:
            continue
        round_index = (step + 1) // args.inner_steps
        weight = float(args.inner_steps * settings.batch_size * settings.seq_len)
        deltas = [o.pseudo_gradient() for o in outer]
        sent = list(deltas)
        if scenario.attack != "clean":
            sent[ATTACKER] = attacked(deltas[ATTACKER], scenario.attack, args.attack_scale, generator)
        before = len(allreduce.adjustments)
        averaged = allreduce.reduce(sent, [weight] * settings.num_workers)
        num_attacker_adjusted += sum(f"member {ATTACKER} " in note for note in allreduce.adjustments[before:])
        for o in outer:  # each worker steps with its own copy of the group's mean, as each node does
            o.outer_step(averaged.clone())
        hashes = {o.param_hash() for o in outer}
        assert len(hashes) == 1, "the workers' global params diverged"
        history.append(evaluate(workers[0].model, eval_set))
        print(f"{scenario.name} round {round_index} eval_loss {history[-1]:.4f}", file=sys.stderr, flush=True)
    return {
        "scenario": scenario.name,
        "attack": scenario.attack,
        "aggregation": scenario.aggregation,
        "eval_loss": history[-1],
        "eval_history": history,
        "rounds": settings.steps // args.inner_steps,
        "attacker_parts_adjusted": num_attacker_adjusted,
        "parts_adjusted": len(allreduce.adjustments),
        "wall_seconds": time.perf_counter() - start,
    }


def summary(records: list[dict[str, Any]]) -> str:
    """Gap of every run to the clean mean run; verdict on the defended runs under attack."""
    losses = {r["scenario"]: r["eval_loss"] for r in records}
    clean = losses.get("clean:mean")
    if clean is None:
        return "no clean:mean run: no reference; " + ", ".join(f"{k} {v:.4f}" for k, v in losses.items())
    gaps = {name: loss / clean - 1 for name, loss in losses.items()}
    for record in records:
        record["gap_vs_clean"] = gaps[record["scenario"]]
    defended = [n for n in gaps if not n.startswith("clean") and not n.endswith(":mean")]
    ok = bool(defended) and all(abs(gaps[n]) <= TARGET_GAP for n in defended)
    parts = ", ".join(f"{n} {losses[n]:.4f} ({gaps[n]:+.1%})" for n in losses)
    verdict = "PASS" if ok else ("FAIL" if defended else "n/a")
    return f"robust aggregation [{verdict}: defended runs within {TARGET_GAP:.0%} of clean:mean {clean:.4f}]: {parts}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, default=8, help="simulated workers N (one of them malicious)")
    parser.add_argument("--steps", type=int, default=200, help="inner steps per worker")
    parser.add_argument("--inner-steps", type=int, default=25, help="H: inner steps per outer round")
    parser.add_argument("--warmup-steps", type=int, default=20, help="linear LR warmup steps")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per worker per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--preset", default="nano", help="model preset")
    parser.add_argument("--codec", default="none", help="wire codec of the simulated all-reduce")
    parser.add_argument("--clip-factor", type=float, default=2.0, help="clipped: k x the median norm")
    parser.add_argument("--trim", type=int, default=1, help="trimmed: values dropped per side")
    parser.add_argument("--attack-scale", type=float, default=100.0, help="scaled / noise: x ||Δ||")
    parser.add_argument(
        "--scenarios",
        default="",
        help="comma-separated ATTACK:AGGREGATION (ATTACK in clean," + ",".join(ATTACKS) + "); empty = all",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    add_output_flags(parser)  # --json-out: every record (with its eval history) and the summary
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steps % args.inner_steps:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --inner-steps ({args.inner_steps})")
    if args.scenarios:
        scenarios = [Scenario(*text.split(":", 1)) for text in args.scenarios.split(",")]
    else:
        scenarios = [Scenario(attack, agg) for attack in ("clean", *ATTACKS) for agg in AGGREGATIONS]
    for scenario in scenarios:
        if scenario.attack not in ("clean", *ATTACKS) or scenario.aggregation not in AGGREGATIONS:
            raise SystemExit(f"unknown scenario {scenario.name}")
    settings = BenchSettings(
        preset=args.preset, seq_len=args.seq_len, batch_size=args.batch_size, num_workers=args.workers,
        steps=args.steps, warmup_steps=args.warmup_steps, threads=args.threads,
    )  # fmt: skip
    records = []
    for scenario in scenarios:
        record = run(settings, scenario, args)
        records.append(record)
        print_json({k: v for k, v in record.items() if k != "eval_history"})
    line = summary(records)
    print(line, flush=True)
    write_json(args.json_out, {"records": records, "summary": line})
    return 0


if __name__ == "__main__":
    sys.exit(main())
