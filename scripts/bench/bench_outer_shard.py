"""DiLoCo's outer state sharded over a node's local ranks vs held flat on rank 0.

For each layout a node's replica is built over its local workers (``node.train.trainer.build_replica``, the
daemon's own code: this process is rank 0, K - 1 spawned gloo ranks), one inner step is taken, then
``--rounds`` outer rounds run twice on the same replica: with the flat outer state on rank 0
(``node.outer.state.FlatOuterState``, what a node did before) and with the sharded one
(``node.parallel.outer.ShardedOuterState``). Each round: Δ (``delta``), the outer Nesterov step with
Δ̄ = Δ (``step``) and θ_local ← θ_global (``write_to_model``), each timed on rank 0.

Printed per layout (one JSON object each), then a summary object and one line:
    outer_bytes_per_rank: bytes of global params + momentum each rank holds after the rounds (sharded);
    flat_outer_bytes_rank0: the same on rank 0 with the flat state (the other ranks hold none);
    bytes_ratio: max(outer_bytes_per_rank) / flat_outer_bytes_rank0 (target ≈ 1/K);
    seconds_{delta,step,write}[_flat]: medians over the rounds;
    bit_identical: the sharded state's params and momentum equal the flat one's after every round.

    python scripts/bench/bench_outer_shard.py                     # tiny, tp2 and dp2-tp2, 3 rounds
    python scripts/bench/bench_outer_shard.py --model nano --layouts tp2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from node.config import NodeConfig
from node.model.gpt import model_config
from node.model.replica import ParallelReplica
from node.outer.state import FlatOuterState
from node.parallel.outer import ShardedOuterState
from node.train.trainer import build_replica

LAYOUTS: dict[str, dict[str, int]] = {
    "tp2": {"local_workers": 2, "tp": 2},
    "dp2": {"local_workers": 2, "dp": 2},
    "dp2-tp2": {"local_workers": 4, "dp": 2, "tp": 2},
    "tp2-pp2": {"local_workers": 4, "tp": 2, "pp": 2, "microbatches": 2},
}
SETTINGS = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def timed(call: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = call(*args)
    return result, time.perf_counter() - start


def run_layout(name: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-outer-") as run_dir:
        config = NodeConfig.from_flat(
            run_dir=run_dir,
            model=args.model,
            seq_len=args.seq_len,
            batch_size=4,
            threads=1,
            outer_sharding="on",
            **LAYOUTS[name],
        )  # type: ignore[arg-type]
        replica = build_replica(config, model_config(args.model, seq_len=args.seq_len), torch.device("cpu"))
        assert isinstance(replica, ParallelReplica)
        try:
            vocab = replica.model.config.vocab_size
            tokens = torch.randint(
                0, vocab, (4, args.seq_len + 1), generator=torch.Generator().manual_seed(0)
            )
            batch = (tokens[:, :-1], tokens[:, 1:])
            flat = FlatOuterState(replica, device=torch.device("cpu"), **SETTINGS)
            sharded = replica.outer_state(offload=False, **SETTINGS)
            assert isinstance(sharded, ShardedOuterState)
            times: dict[str, list[float]] = {key: [] for key in ("delta", "step", "write")}
            flat_times: dict[str, list[float]] = {key: [] for key in ("delta", "step", "write")}
            identical = True
            for _ in range(args.rounds):
                replica.train_step([batch], lr=1e-3)
                delta, seconds = timed(sharded.delta)
                times["delta"].append(seconds)
                flat_delta, seconds = timed(flat.delta)
                flat_times["delta"].append(seconds)
                times["step"].append(timed(sharded.step, delta)[1])
                flat_times["step"].append(timed(flat.step, flat_delta)[1])
                flat_times["write"].append(timed(flat.write_to_model)[1])
                times["write"].append(timed(sharded.write_to_model)[1])
                identical = identical and torch.equal(sharded.params(), flat.params())
                identical = identical and torch.equal(sharded.momentum(), flat.momentum())  # type: ignore[arg-type]
            per_rank = sharded.num_bytes_per_rank()
            momentum = flat.momentum()
            flat_bytes = 4 * flat.num_elements + (0 if momentum is None else 4 * momentum.numel())
        finally:
            replica.close()
    return {
        "layout": name,
        "model": args.model,
        "local_ranks": LAYOUTS[name]["local_workers"],
        "params": flat.num_elements,
        "rounds": args.rounds,
        "outer_bytes_per_rank": per_rank,
        "flat_outer_bytes_rank0": flat_bytes,
        "bytes_ratio": round(max(per_rank) / flat_bytes, 4),
        **{f"seconds_{key}": round(statistics.median(values), 4) for key, values in times.items()},
        **{f"seconds_{key}_flat": round(statistics.median(values), 4) for key, values in flat_times.items()},
        "bit_identical": identical,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument(
        "--seq-len", type=int, default=64, help="tokens per sequence (one inner step per round)"
    )
    parser.add_argument("--layouts", default="tp2,dp2-tp2", help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=3, help="outer rounds per layout")
    args = parser.parse_args(argv)
    names = [name for name in args.layouts.split(",") if name]
    if unknown := [name for name in names if name not in LAYOUTS]:
        parser.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    records = []
    for name in names:
        records.append(run_layout(name, args))
        print(json.dumps(records[-1]), flush=True)
    met = all(r["bit_identical"] and r["bytes_ratio"] <= 1 / r["local_ranks"] + 0.01 for r in records)
    summary = {"summary": True, "layouts": names, "all_bit_identical": all(r["bit_identical"] for r in records),
               "bytes_ratio_target": "<= 1/K + 0.01", "met": met}  # fmt: skip
    print(json.dumps(summary), flush=True)
    parts = [
        f"{r['layout']} (K={r['local_ranks']}): {max(r['outer_bytes_per_rank']) / 1e6:.1f} MB/rank vs "
        f"{r['flat_outer_bytes_rank0'] / 1e6:.1f} MB on rank 0 ({r['bytes_ratio']:.3f}), outer step "
        f"{r['seconds_delta'] + r['seconds_step'] + r['seconds_write']:.2f} s vs "
        f"{r['seconds_delta_flat'] + r['seconds_step_flat'] + r['seconds_write_flat']:.2f} s flat"
        for r in records
    ]
    print(f"bench_outer_shard {args.model}: " + "; ".join(parts) + f" | {'MET' if met else 'NOT MET'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
