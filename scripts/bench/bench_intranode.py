"""Intra-node parallel layouts on CPU: per-rank optimizer state, pipeline bubble, and step throughput.

Every layout trains the same model on the same global batch (``--batch-size``
sequences of ``--seq-len`` tokens) with the building blocks of ``node/parallel/``:

    single:     one process, no distribution (the reference), ``torch.set_num_threads(--reference-threads)``
    tp2:        Megatron tensor parallelism over 2 ranks (``apply_tensor_parallel``); both ranks see the batch
    pp2-gpipe:  2 pipeline stages (``build_stage`` + ``PipelineRunner``), GPipe, ``--microbatches`` micro-batches
    pp2-1f1b:   the same with 1F1B
    dp2-zero1:  2 data-parallel ranks, each half the batch; ``average_gradients`` + ``build_zero_optimizer``
    dp2-fsdp:   2 data-parallel ranks with ZeRO-3 (``apply_fully_shard``) and the plain inner AdamW

Each distributed layout is 2 processes (forked from one preloaded server) joined by a gloo process group
over a ``FileStore``, one intra-op thread each (2 cores). The optimizer is ``build_inner_optimizer``'s
AdamW (ZeRO-1: its sharded twin); no gradient clipping (a pipeline stage only sees its own gradients, so
a global clip would need an extra all-reduce that no layout here shares).

What is measured
----------------
step time: each rank times ``zero_grad / forward+backward / [average_gradients] / step`` after a barrier,
    for ``--steps`` steps after ``--warmup-steps``; a layout's step time is the slowest rank's median.
    tokens_per_second = batch_size * seq_len / step time.
optimizer state: ``optimizer_state_bytes`` of each rank after the last step (local shards of ``DTensor``
    state), and its ratio to the single-process AdamW's bytes. ZeRO-1/FSDP target 1/dp = 0.5; TP shards
    only the block matrices (embedding, head and norms stay replicated), PP holds one stage's share.
bubble (pp layouts): for each m in ``--bubble-microbatches``, with the layout's schedule,
    T(m) = median wall time of ``PipelineRunner.forward_backward`` over m micro-batches (rank 0's view,
        after a barrier; the ranks finish within one loss broadcast of each other), and
    t(s, m) = median time of stage s alone doing forward + backward of one micro-batch (B/m sequences)
        with no communication (stage 0 on random tokens, later stages on random activations; non-last
        stages back-propagate a random output gradient, the last one the loss).
    busy = m * max_s t(s, m): the ideal step of the slowest stage, and
    measured_bubble = 1 - busy / T(m), compared with theory (p - 1) / (m + p - 1).
    The measured number therefore also counts everything that is not stage compute: gloo send/receive
    latency, the pipelining runtime's Python overhead, the final loss broadcast and stage imbalance.
    Both ranks time their isolated stage at the same moment (so t(s, m) includes the contention of two
    busy cores, as in the pipeline's steady state); during fill and drain one rank runs alone and is
    faster than t(s, m), so at small m the measured bubble can come out *below* the theory. Medians of
    ``--steps`` samples of millisecond-scale work: read differences under ~0.05 as noise.

What the CPU measurement can and cannot show
--------------------------------------------
It can show the memory accounting (optimizer bytes are exact whatever the hardware), that every layout
runs end to end, and the shape of the bubble (it shrinks as m grows). It cannot show GPU speed-ups: there
are 2 cores, so 2 single-threaded ranks compete with nothing but also gain only the second core; gloo over
loopback copies through the kernel (no NVLink, no overlap of compute and communication), so TP's two
all-reduces per block and FSDP's all-gathers are far costlier relative to compute than on a GPU node; and
the nano model's micro-batches are so small that fixed per-message and per-op overheads dominate. The
reference uses ``--reference-threads`` (default 2) so that every layout has the whole machine.

``--join``: every layout also as users run it, ``dtnode join --local-workers K`` (``intranode_join.py``).

Output: one JSON object per layout, then a summary object, then one line. Exit 0 when every layout ran and
ZeRO-1 / FSDP each hold at most ``--max-shard-ratio`` of the unsharded optimizer state per rank, else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.config import NodeConfig
from node.model.gpt import GPT, cross_entropy_loss, model_config
from node.model.replica import build_inner_optimizer
from node.parallel.pipeline import PipelineRunner, ScheduleName, build_stage
from node.parallel.plan import bubble_fraction
from node.parallel.tensor import apply_tensor_parallel, build_tensor_parallel_mesh, device_type
from node.parallel.zero import (
    apply_fully_shard,
    average_gradients,
    build_zero_optimizer,
    optimizer_state_bytes,
)
from scripts.bench.intranode_join import (
    add_join_arguments,
    join_summary,
    join_summary_suffix,
    run_join_layouts,
)
from scripts.common import print_json

LAYOUTS: dict[str, int] = {
    "single": 1,
    "tp2": 2,
    "pp2-gpipe": 2,
    "pp2-1f1b": 2,
    "dp2-zero1": 2,
    "dp2-fsdp": 2,
}  # layout name -> number of processes
SHARDED_LAYOUTS = ("dp2-zero1", "dp2-fsdp")
SEED = 1234


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    model: str
    """Model preset of ``node.model.gpt`` (nano: 0.9M parameters)."""
    seq_len: int
    """Tokens per sequence."""
    batch_size: int
    """Sequences per global step (split over data-parallel ranks and micro-batches)."""
    num_steps: int
    """Timed steps per layout."""
    num_warmup_steps: int
    """Untimed steps first (allocators, pipeline shape inference)."""
    num_microbatches: int
    """Micro-batches per step of the pipeline layouts' throughput run."""
    bubble_microbatches: tuple[int, ...]
    """Micro-batch counts of the bubble measurement."""
    reference_threads: int
    """Intra-op threads of the single-process reference."""
    timeout: timedelta
    """Deadline of one layout's run (and of every collective inside it)."""

    def __post_init__(self) -> None:
        if min(self.seq_len, self.batch_size, self.num_steps, self.num_microbatches) < 1:
            raise ValueError("seq_len, batch_size, steps and microbatches must be positive")
        for num_microbatches in (self.num_microbatches, *self.bubble_microbatches):
            if num_microbatches < 2 or self.batch_size % num_microbatches:
                raise ValueError(f"micro-batch count {num_microbatches} must be >= 2 and divide the batch")
        if self.batch_size % 2:
            raise ValueError("the batch must split over 2 data-parallel ranks")


def theory_bubble(num_stages: int, num_microbatches: int) -> float:
    """``(p - 1) / (m + p - 1)``: the idle fraction of a balanced pipeline with free communication."""
    return bubble_fraction(num_stages, num_microbatches)


def measured_bubble(
    step_seconds: float, stage_microbatch_seconds: Sequence[float], num_microbatches: int
) -> float:
    """``1 - m * max_s t(s) / T``: the share of the pipelined step the slowest stage was not computing."""
    if step_seconds <= 0 or not stage_microbatch_seconds:
        raise ValueError("need a positive step time and at least one stage time")
    return 1.0 - num_microbatches * max(stage_microbatch_seconds) / step_seconds


def _batches(settings: Settings, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(SEED + 1)
    num_batches = settings.num_warmup_steps + settings.num_steps
    shape = (num_batches, settings.batch_size, settings.seq_len + 1)
    tokens = torch.randint(0, vocab_size, shape, generator=generator)
    return [(batch[:, :-1], batch[:, 1:]) for batch in tokens]  # each (B, T), (B, T)


def _build_model(settings: Settings) -> GPT:
    torch.manual_seed(SEED)
    return GPT(model_config(settings.model, seq_len=settings.seq_len))


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _time_steps(settings: Settings, world_size: int, run_step: Any) -> float:
    """Median seconds of ``run_step(tokens, targets)`` over the timed steps (after the warm-up)."""
    durations = []
    for index, (tokens, targets) in enumerate(_batches(settings, 260)):
        _barrier(world_size)
        started = time.perf_counter()
        run_step(tokens, targets)
        if index >= settings.num_warmup_steps:
            durations.append(time.perf_counter() - started)
    return statistics.median(durations)


def _isolated_stage_seconds(stage: GPT, settings: Settings, microbatch_size: int, is_last: bool) -> float:
    """Median forward + backward of one micro-batch through ``stage`` alone (no communication)."""
    generator = torch.Generator().manual_seed(SEED + 2)
    durations = []
    for index in range(settings.num_warmup_steps + settings.num_steps):
        shape = (microbatch_size, settings.seq_len)
        if stage.tok_embeddings is not None:
            inputs = torch.randint(0, stage.config.vocab_size, shape, generator=generator)  # (b, T)
        else:
            inputs = torch.randn(
                (*shape, stage.config.dim), generator=generator, requires_grad=True
            )  # (b, T, C)
        targets = torch.randint(0, stage.config.vocab_size, shape, generator=generator)  # (b, T)
        started = time.perf_counter()
        output = stage(inputs)
        if is_last:
            cross_entropy_loss(output, targets).backward()
        else:
            output.backward(torch.randn_like(output))
        if index >= settings.num_warmup_steps:
            durations.append(time.perf_counter() - started)
    stage.zero_grad()
    return statistics.median(durations)


def _pipeline_bubbles(
    model: GPT, settings: Settings, rank: int, schedule: ScheduleName
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for num_microbatches in settings.bubble_microbatches:
        stage = build_stage(model, rank, 2)
        runner = PipelineRunner(
            stage, stage_index=rank, num_stages=2, num_microbatches=num_microbatches, schedule=schedule
        )

        def forward_backward(
            tokens: torch.Tensor, targets: torch.Tensor, runner: PipelineRunner = runner
        ) -> None:
            runner.stage_model.zero_grad()
            runner.forward_backward(tokens, targets)

        step_seconds = _time_steps(settings, 2, forward_backward)
        microbatch_size = settings.batch_size // num_microbatches
        own = _isolated_stage_seconds(stage, settings, microbatch_size, is_last=rank == 1)
        stage_seconds: list[float | None] = [None, None]
        dist.all_gather_object(stage_seconds, own)
        assert all(value is not None for value in stage_seconds)
        times = [float(value) for value in stage_seconds if value is not None]
        rows.append({
            "microbatches": num_microbatches,
            "step_seconds": step_seconds,
            "stage_microbatch_seconds": times,
            "measured_bubble": measured_bubble(step_seconds, times, num_microbatches),
            "theory_bubble": theory_bubble(2, num_microbatches),
        })  # fmt: skip
    return rows


def _run_layout(layout: str, settings: Settings, rank: int, world_size: int) -> dict[str, Any]:
    """Build ``layout`` on this rank, time it, and return this rank's figures."""
    config = NodeConfig()
    model = _build_model(settings)
    result: dict[str, Any] = {}
    optimizer: torch.optim.Optimizer
    if layout in ("single", "tp2"):
        if layout == "tp2":
            apply_tensor_parallel(model, build_tensor_parallel_mesh(world_size))
        optimizer = build_inner_optimizer(model, config)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            optimizer.zero_grad()
            cross_entropy_loss(model(tokens), targets).backward()
            optimizer.step()

    elif layout.startswith("pp2-"):
        schedule: ScheduleName = "gpipe" if layout == "pp2-gpipe" else "1f1b"
        result["bubble"] = _pipeline_bubbles(model, settings, rank, schedule)
        runner = PipelineRunner(
            build_stage(model, rank, 2),
            stage_index=rank,
            num_stages=2,
            num_microbatches=settings.num_microbatches,
            schedule=schedule,
        )
        optimizer = build_inner_optimizer(runner.stage_model, config)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            optimizer.zero_grad()
            runner.forward_backward(tokens, targets)
            optimizer.step()

    else:
        per_rank = settings.batch_size // world_size
        if layout == "dp2-fsdp":
            apply_fully_shard(model, init_device_mesh(device_type(), (world_size,), mesh_dim_names=("dp",)))
            optimizer = build_inner_optimizer(model, config)
        else:
            optimizer = build_zero_optimizer(model, config)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> None:
            shard = slice(rank * per_rank, (rank + 1) * per_rank)
            optimizer.zero_grad()
            cross_entropy_loss(model(tokens[shard]), targets[shard]).backward()  # (B / dp, T)
            if layout == "dp2-zero1":
                average_gradients(model, timeout=settings.timeout)  # FSDP reduce-scatters in backward
            optimizer.step()

    result["step_seconds"] = _time_steps(settings, world_size, step)
    result["optimizer_state_bytes"] = optimizer_state_bytes(optimizer)
    return result


def _worker(
    layout: str, settings: Settings, rank: int, world_size: int, store_path: str, out_dir: str
) -> None:
    torch.set_num_threads(settings.reference_threads if world_size == 1 else 1)
    if world_size > 1:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=settings.timeout
        )  # gloo: CPU only, as the module docstring says
    try:
        result = _run_layout(layout, settings, rank, world_size)
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def run_layout(layout: str, settings: Settings) -> list[dict[str, Any]]:
    """Spawn ``layout``'s processes, wait for them (bounded), and return each rank's figures."""
    world_size = LAYOUTS[layout]
    # Forked from a server that imported this script (torch, the node's stack) once, not ~2.5 CPU-s of
    # imports per spawned rank; the server only imports, so each rank starts as clean as a spawned one.
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch._dynamo"])
    with tempfile.TemporaryDirectory(prefix="bench_intranode-") as scratch:
        workers = [
            context.Process(
                target=_worker,
                args=(layout, settings, rank, world_size, str(Path(scratch) / "store"), scratch),
            )
            for rank in range(world_size)
        ]
        for worker in workers:
            worker.start()
        try:
            deadline = time.monotonic() + settings.timeout.total_seconds()
            for worker in workers:
                worker.join(timeout=max(0.0, deadline - time.monotonic()))
            exit_codes = [worker.exitcode for worker in workers]
            if exit_codes != [0] * world_size:
                raise RuntimeError(f"{layout}: worker exit codes {exit_codes} (None: timed out)")
            return [
                json.loads((Path(scratch) / f"rank{rank}.json").read_text()) for rank in range(world_size)
            ]
        finally:
            for worker in workers:
                if worker.is_alive():
                    worker.kill()
                    worker.join(timeout=10)


def layout_record(
    layout: str, settings: Settings, ranks: Sequence[Mapping[str, Any]], reference_state_bytes: int | None
) -> dict[str, Any]:
    """The printed object of one layout from its ranks' figures (pure: no processes)."""
    step_seconds = max(rank["step_seconds"] for rank in ranks)
    state_bytes = [int(rank["optimizer_state_bytes"]) for rank in ranks]
    record: dict[str, Any] = {
        "layout": layout,
        "processes": len(ranks),
        "model": settings.model,
        "seq_len": settings.seq_len,
        "batch_size": settings.batch_size,
        "steps": settings.num_steps,
        "step_seconds_median": round(step_seconds, 5),
        "tokens_per_second": round(settings.batch_size * settings.seq_len / step_seconds, 1),
        "optimizer_state_bytes_per_rank": state_bytes,
        "optimizer_state_ratio_per_rank": (
            [round(value / reference_state_bytes, 4) for value in state_bytes]
            if reference_state_bytes
            else None
        ),
        "error": None,
    }
    if "bubble" in ranks[0]:
        record["microbatches"] = settings.num_microbatches
        record["bubble"] = [
            {key: round(value, 5) if isinstance(value, float) else value for key, value in row.items()}
            | {"stage_microbatch_seconds": [round(value, 5) for value in row["stage_microbatch_seconds"]]}
            for row in ranks[0]["bubble"]
        ]
    return record


def summary_object(records: Sequence[Mapping[str, Any]], max_shard_ratio: float) -> dict[str, Any]:
    """Throughput and state ratio per layout, and the verdict: every layout ran, ZeRO shards the state."""
    failed = [record["layout"] for record in records if record["error"] is not None]
    shard_ratios = {
        record["layout"]: max(record["optimizer_state_ratio_per_rank"])
        for record in records
        if record["layout"] in SHARDED_LAYOUTS
        and record["error"] is None
        and record["optimizer_state_ratio_per_rank"]
    }
    sharded_present = [layout for layout in SHARDED_LAYOUTS if layout in {r["layout"] for r in records}]
    shard_ok = all(shard_ratios.get(layout, 1.0) <= max_shard_ratio for layout in sharded_present)
    return {
        "summary": True,
        "layouts": [record["layout"] for record in records],
        "failed": failed,
        "tokens_per_second": {r["layout"]: r.get("tokens_per_second") for r in records if r["error"] is None},
        "max_state_ratio": {
            r["layout"]: max(r["optimizer_state_ratio_per_rank"])
            for r in records
            if r["error"] is None and r["optimizer_state_ratio_per_rank"]
        },
        "max_shard_ratio": max_shard_ratio,
        "ok": not failed and shard_ok,
    }


def summary_line(summary: Mapping[str, Any]) -> str:
    parts = [
        f"{layout} {summary['tokens_per_second'].get(layout, 'FAILED')} tok/s"
        + (f" state x{summary['max_state_ratio'][layout]}" if layout in summary["max_state_ratio"] else "")
        for layout in summary["layouts"]
    ]
    return ("OK" if summary["ok"] else "FAIL") + ": " + "; ".join(parts) + join_summary_suffix(summary)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS), help="layouts to run"
    )
    parser.add_argument("--model", default="nano", help="model preset (nano: 0.9M params, tiny: 10.8M)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per global step")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup-steps", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches of the pipeline layouts")
    parser.add_argument(
        "--bubble-microbatches",
        type=int,
        nargs="*",
        default=[2, 4, 8],
        help="m values of the bubble measurement",
    )
    parser.add_argument(
        "--reference-threads", type=int, default=2, help="intra-op threads of the single layout"
    )
    parser.add_argument("--max-shard-ratio", type=float, default=0.6, help="ZeRO/FSDP per-rank state bound")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one layout may take")
    add_join_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        settings = Settings(
            model=args.model,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            num_steps=args.steps,
            num_warmup_steps=args.warmup_steps,
            num_microbatches=args.microbatches,
            bubble_microbatches=tuple(args.bubble_microbatches),
            reference_threads=args.reference_threads,
            timeout=timedelta(seconds=args.timeout),
        )
    except ValueError as error:
        print(f"bench_intranode: {error}", file=sys.stderr)
        return 2
    layouts = args.layouts if "single" in args.layouts else ["single", *args.layouts]  # the ratio's reference
    records: list[dict[str, Any]] = []
    reference_state_bytes: int | None = None
    started = time.monotonic()
    load_average_start = os.getloadavg()[0]  # the 1-minute figure: how contended the 2 cores were
    for layout in layouts:
        try:
            ranks = run_layout(layout, settings)
        except RuntimeError as error:
            records.append({"layout": layout, "error": str(error)})
        else:
            if layout == "single":
                reference_state_bytes = int(ranks[0]["optimizer_state_bytes"])
            records.append(layout_record(layout, settings, ranks, reference_state_bytes))
        print_json(records[-1])
    summary = summary_object(records, args.max_shard_ratio)
    if args.join:
        joined = run_join_layouts(
            args.join_layouts, model=args.model, seq_len=args.seq_len, batch_size=args.batch_size,
            num_steps=args.join_steps, num_warmup_steps=args.warmup_steps,
            num_microbatches=args.microbatches, timeout_seconds=args.timeout,
        )  # fmt: skip
        summary |= join_summary(joined)
        summary["ok"] = summary["ok"] and not summary["join_failed"]
    summary["wall_seconds"] = round(time.monotonic() - started, 1)
    summary["load_average_1min"] = [round(load_average_start, 2), round(os.getloadavg()[0], 2)]
    print_json(summary)
    print(summary_line(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
