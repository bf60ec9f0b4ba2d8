"""The node's inner loop against a bare compiled, fused torch loop on the same model and device, and
what a round costs beyond its inner steps.

For every preset in ``--models`` (default ``small,1b``; batch 16 x 512 and 4 x 2048 tokens):

    node:  ``Trainer.inner_step`` of a ``--no-swarm`` node with the node's own settings for the device
           (``--compile auto``, ``--precision auto``, fused AdamW on CUDA; node/model/efficiency.py): the
           batch from the corpus, the LR schedule, clipping, the step record, all included;
    bare:  the model built the same way (``node.model.meta_init.build_model``), ``torch.compile``\\ d,
           ``torch.optim.AdamW(fused=True)`` on CUDA, bf16 autocast where the node uses it, random
           tokens already on the device, ``loss.item()`` per step — what a user writes by hand;
    round: a ``--no-swarm`` node (a swarm of one: the outer step still runs) for ``--rounds`` rounds of
           ``--round-steps`` inner steps with a checkpoint every round and the held-out eval every
           round (``--eval-every 1``: the dearest case); a round's fixed cost is its record's
           ``seconds_wall - seconds_compute`` (node/ops/metrics.py), rounds after the first (which pays
           compilation). ``exit_seconds``: from the last round record to the end of ``run`` (the last
           checkpoint write waited for, the export).

Throughput: ``tokens / seconds`` over steps ``--warmup``..``--steps`` (compilation and allocator
warm-up excluded), each step timed to its ``loss.item()`` (the device is synchronised there).

Output: one JSON object per model (model, params, device, device_name, precision, compile,
batch_size, seq_len, node_tokens_per_s, bare_tokens_per_s, node_vs_bare, startup_seconds,
round_fixed_seconds_mean / _max, exit_seconds, inner_steps_per_round, rounds, met), a summary object
and a one-line summary. ``met`` (CUDA only; null on CPU, a dry run): node_vs_bare >= 0.95 and the
mean fixed cost <= 1 s. Exit code 0 when every model was measured (and met, on CUDA), 1 otherwise.

    python scripts/bench/bench_gpu.py                                  # CUDA: small and 1b
    python scripts/bench/bench_gpu.py --device cpu --models nano       # dry run anywhere (seconds)
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.config import NodeConfig
from node.model.efficiency import resolve_compile, resolve_precision
from node.model.gpt import cross_entropy_loss, model_config
from node.model.meta_init import build_model
from node.ops.metrics import read_metrics
from node.train.trainer import Trainer
from scripts.common import add_output_flags, print_json, write_json

# The shapes the H100 target is stated for: (batch size, sequence length) per preset.
SHAPES = {"small": (16, 512), "1b": (4, 2048)}
DRY_RUN_SHAPE = (4, 64)
TARGET_RATIO, TARGET_FIXED_SECONDS = 0.95, 1.0


def node_config(args: argparse.Namespace, model: str, run_dir: Path, **overrides: Any) -> NodeConfig:
    batch_size, seq_len = SHAPES.get(model, DRY_RUN_SHAPE)
    settings: dict[str, Any] = dict(
        model=model, seq_len=seq_len, batch_size=batch_size, device=args.device, swarm=False,
        run_dir=str(run_dir), log_every=10**6, compile=args.compile, precision=args.precision,
        eval_batches=args.eval_batches,
    )  # fmt: skip
    settings.update(overrides)
    return NodeConfig.from_flat(**settings)


def window_tokens_per_s(step_seconds: Sequence[float], tokens_per_step: int, warmup: int) -> float:
    measured = step_seconds[warmup:]
    return len(measured) * tokens_per_step / sum(measured)


def node_loop(args: argparse.Namespace, model: str, scratch: Path) -> tuple[float, float, int, str, bool]:
    """tokens/s of the node's inner steps; also its start-up seconds, params, precision and compile."""
    start = time.perf_counter()
    config = node_config(args, model, scratch / "node-loop", inner_steps=args.steps + 1)
    trainer = Trainer(config)
    startup = time.perf_counter() - start
    seconds = []
    for _ in range(args.steps):
        step_start = time.perf_counter()
        trainer.inner_step()
        seconds.append(time.perf_counter() - step_start)
    tokens = config.inner.batch_size * config.architecture.seq_len * config.inner.grad_accumulation
    precision = resolve_precision(config.parallel.precision, trainer.device)
    compiled = resolve_compile(config.parallel.compile, trainer.device, local_workers=False)
    num_params = trainer.model.num_params()
    trainer.checkpoints.close()
    trainer.replica.close()
    trainer.metrics.close()
    del trainer
    return window_tokens_per_s(seconds, tokens, args.warmup), startup, num_params, precision, compiled


def bare_loop(args: argparse.Namespace, model: str, precision: str, compiled: bool) -> float:
    """tokens/s of a hand-written compiled, fused loop on the same model and device."""
    batch_size, seq_len = SHAPES.get(model, DRY_RUN_SHAPE)
    device = torch.device(args.device)
    torch.manual_seed(0)
    net = build_model(model_config(model, seq_len=seq_len), device)
    forward = torch.compile(net) if compiled else net
    optimizer = torch.optim.AdamW(
        net.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda" or None
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
    vocab = net.config.vocab_size
    seconds = []
    for _ in range(args.steps):
        tokens = torch.randint(0, vocab, (batch_size, seq_len + 1), device=device)  # (B, T + 1)
        step_start = time.perf_counter()
        with autocast:
            logits = forward(tokens[:, :-1])  # (B, T, V)
        loss = cross_entropy_loss(logits.float(), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        seconds.append(time.perf_counter() - step_start)
    del net, forward, optimizer
    return window_tokens_per_s(seconds, batch_size * seq_len, args.warmup)


def round_costs(args: argparse.Namespace, model: str, scratch: Path) -> dict[str, Any]:
    """A solo node's rounds with eval and checkpoint every round: fixed cost per round, exit time."""
    run_dir = scratch / "rounds"
    config = node_config(
        args, model, run_dir, inner_steps=args.round_steps, max_rounds=args.rounds, checkpoint_every=1,
        eval_every=1, warmup_steps=1,
    )  # fmt: skip
    trainer = Trainer(config)
    trainer.run()
    end = time.time()
    rounds = read_metrics(run_dir / "metrics.jsonl", kind="round")
    fixed = [r["seconds_wall"] - r["seconds_compute"] for r in rounds[1:]]
    del trainer
    return {
        "round_fixed_seconds": [round(value, 3) for value in fixed],
        "round_fixed_seconds_mean": round(statistics.fmean(fixed), 3) if fixed else None,
        "round_fixed_seconds_max": round(max(fixed), 3) if fixed else None,
        "exit_seconds": round(end - rounds[-1]["time"], 3) if rounds else None,
        "inner_steps_per_round": args.round_steps,
        "rounds": len(rounds),
    }


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args: argparse.Namespace, model: str) -> dict[str, Any]:
    batch_size, seq_len = SHAPES.get(model, DRY_RUN_SHAPE)
    record: dict[str, Any] = {
        "model": model,
        "device": args.device,
        "batch_size": batch_size,
        "seq_len": seq_len,
    }
    if args.device == "cuda":
        record["device_name"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="bench_gpu-") as scratch:
        node_tps, startup, num_params, precision, compiled = node_loop(args, model, Path(scratch))
        free_device()
        bare_tps = bare_loop(args, model, precision, compiled)
        free_device()
        costs = round_costs(args, model, Path(scratch))
        free_device()
    record.update(
        params=num_params, precision=precision, compile=compiled, startup_seconds=round(startup, 2),
        node_tokens_per_s=round(node_tps), bare_tokens_per_s=round(bare_tps),
        node_vs_bare=round(node_tps / bare_tps, 4), **costs,
    )  # fmt: skip
    record["met"] = (
        record["node_vs_bare"] >= TARGET_RATIO
        and costs["round_fixed_seconds_mean"] is not None
        and costs["round_fixed_seconds_mean"] <= TARGET_FIXED_SECONDS
        if args.device == "cuda"
        else None  # a CPU run is a dry run: the targets are for GPUs
    )
    return record


def summary_line(records: Sequence[dict[str, Any]]) -> str:
    parts = [
        f"{r['model']} node {r['node_tokens_per_s']:,} tok/s = {r['node_vs_bare']:.1%} of bare "
        f"{r['bare_tokens_per_s']:,}, round fixed cost {r['round_fixed_seconds_mean']} s"
        for r in records
    ]
    verdicts = {r["met"] for r in records}
    verdict = "DRY RUN (cpu)" if verdicts == {None} else ("PASS" if verdicts == {True} else "FAIL")
    device = records[0].get("device_name", records[0]["device"]) if records else "?"
    return f"bench_gpu ({device}): " + "; ".join(parts) + f": {verdict}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="device of every run")
    parser.add_argument("--models", default="small,1b", help="comma-separated presets (default small,1b)")
    parser.add_argument("--steps", type=int, default=30, help="inner steps timed per loop (default 30)")
    parser.add_argument("--warmup", type=int, default=10, help="... of which the first are not counted")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the fixed-cost run (default 3)")
    parser.add_argument("--round-steps", type=int, default=10, help="inner steps per round there (10)")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out batches per eval (8)")
    parser.add_argument("--compile", default="auto", help="the node's --compile (the bare loop follows it)")
    parser.add_argument("--precision", default="auto", help="the node's --precision (the bare loop too)")
    add_output_flags(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here (--device cpu --models nano is the dry run)", file=sys.stderr)
        return 2
    if args.warmup >= args.steps:
        print("bench_gpu: --warmup must be below --steps", file=sys.stderr)
        return 2
    records = []
    for model in args.models.split(","):
        record = measure(args, model)
        records.append(record)
        print_json(record)
    summary = {"summary": True, "met": all(r["met"] is not False for r in records), "models": len(records)}
    print_json(summary)
    print(summary_line(records))
    write_json(args.json_out, records)
    return 0 if summary["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
