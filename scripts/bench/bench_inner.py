"""Overhead of dtnode's inner steps over a bare torch loop training the same model on the same data.

What is compared
----------------
*dtnode*: the real ``dtnode join`` in a subprocess, with ``--inner-steps`` above ``--max-steps`` so no
outer round (DiLoCo's all-reduce + Nesterov step, an eval and a checkpoint) falls inside the measured
window. Outer rounds are the algorithm, not loop overhead, and the bare loop has nothing to compare
them with; the checkpoint written at exit comes after the measured window. Everything
``Trainer.run`` does per inner step is measured: fetching the batch, setting the LR from the schedule,
``model.train()``, clipping, AdamW, the ``metrics.jsonl`` line, the stop/limit checks.

*bare*: a fresh interpreter (this script with a hidden flag) running the minimal loop

    x, y = batches.next_batch()                 # node.data.batches.ShardedBatches on the same corpus
    loss = cross_entropy_loss(model(x), y); loss.backward()
    clip_grad_norm_; adamw.step(); adamw.zero_grad(set_to_none=True); loss.item()

with the same GPT preset, seed, AdamW settings (weight decay on matrices only, betas, LR), clip norm,
batch shapes and thread count. dtnode runs with ``--lr-schedule constant --warmup-steps 0`` so both
sides use the same LR at every step: the two runs then do the same arithmetic on the same batches,
and their losses must agree bit for bit (``losses_identical``), which proves the comparison is like
for like. dtnode still sets the LR on every step, so that cost is measured.

How it is timed
---------------
Both sides stamp ``time.time()`` right after ``loss.item()`` of every step (dtnode's ``time`` field
of each ``kind: step`` record; the bare loop keeps a list). Throughput is ``(steps - warmup) *
tokens_per_step / active seconds between the stamps of step warmup and step steps``: interpreter
start, corpus loading, model construction and the first ``warmup`` steps (allocator and thread-pool
warm-up) are excluded; every per-step cost after that is included.

The machine may be shared: how much CPU other processes leave a run swings by tens of percent within
seconds, far more than the 3 % to resolve, and run-level alternation (bare, dtnode, bare, ...)
cannot cancel that. So both processes of a repeat are started together and, once both are past
``warmup``, time-sliced by the parent with SIGSTOP/SIGCONT: one side runs one step (or whole steps
for at least ``--slice-seconds``), then it is frozen and the other runs, and so on until both reach
``steps``. The two sides never run at the same time and sample the machine's load in alternation,
step by step. The parent records when each side was frozen; that time is subtracted from its step
stamps ("active" time). Every step after a freeze starts with a cache the other side has used,
equally often on both sides. Each run does one extra step after ``steps`` so that it is frozen
mid-step, never in its exit path (dtnode's final checkpoint), until both are done.

Two estimates are reported:

- ``overhead = 1 - dtnode / bare`` of the window throughputs (tokens / active seconds, median over
  ``--repeats`` paired runs with fresh processes; the side that runs first alternates). It includes
  every cost, but a burst of load that hits a few steps of one side moves it; ``noise`` (max/min - 1
  of the bare repeats) says by how much.
- ``overhead_cpu``: the same ratio from CPU seconds per step (``utime + stime`` of all the child's
  threads from ``/proc/<pid>/stat``, read while it is stopped, at its first and last freeze), the
  median of the repeats' ratios. It counts the work each side does, whoever else shares the cores,
  so on a loaded machine it is the one that resolves 3 %; it misses only time spent blocked
  (dtnode's inner step does no blocking I/O).

``pass``: ``overhead_cpu`` within the target, and ``overhead`` too unless ``noise`` exceeds the
target (then the wall clock cannot resolve 3 % and the CPU time decides).

Defaults (``tiny``, batch 8 x 256 tokens, one thread) give ~1-2 s steps, about what dtnode's default
batch of 16 takes with two threads here; a run takes ~3-4 minutes on an idle 2-core CPU, and
longer in proportion to the load other processes put on it.

    python scripts/bench/bench_inner.py
    python scripts/bench/bench_inner.py --model nano --steps 200 --warmup 20 --threads 2

Prints one JSON object, then a one-line summary. The exit code is 0 unless a run fails; the verdict
is the ``pass`` field.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TARGET_OVERHEAD = 0.03
RUN_DEADLINE = datetime.timedelta(minutes=15)
POLL_INTERVAL = datetime.timedelta(milliseconds=1)
STOP_DEADLINE = datetime.timedelta(seconds=10)
CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")

# Training settings shared by both sides, passed to dtnode as explicit flags so the bare loop's
# numbers do not depend on NodeConfig's defaults staying what they are today.
SEED = 0
DATA_SEED = 0
VAL_FRACTION = 0.01
INNER_LR = 1e-3
WEIGHT_DECAY = 0.1
BETA1 = 0.9
BETA2 = 0.95
GRAD_CLIP = 1.0


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    model: str
    steps: int  # the measured window ends after this step; each run does one more
    warmup: int  # ... and starts after this one
    batch_size: int
    seq_len: int  # 0 = the preset's
    threads: int  # 0 = torch's default
    data: str  # "" = dtnode's default corpus (this Python's stdlib)
    slice_duration: datetime.timedelta  # minimum time one side runs alone in phase 2 (0 = one step)


def process_stat(pid: int) -> list[str]:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, ...; utime and stime are [11] and [12])."""
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # the command name in (...) may contain spaces


@dataclass
class Child:
    """One side's process, the file it appends a line to per step, and when it was frozen."""

    kind: str
    process: subprocess.Popen[bytes]
    step_marks: Path
    frozen: list[tuple[float, float]] = field(default_factory=list)  # (from, to) in time.time()
    frozen_since: float | None = None
    cpu_samples: list[tuple[int, float]] = field(default_factory=list)  # (steps done, CPU s) when frozen
    _last_size: int = -1
    _steps_done: int = 0

    def steps_done(self) -> int:
        size = self.step_marks.stat().st_size if self.step_marks.exists() else -1
        if size != self._last_size:  # read the file only when it grew
            self._last_size = size
            self._steps_done = self.step_marks.read_bytes().count(b"\n")
        return self._steps_done

    def freeze(self) -> None:
        """SIGSTOP the child; once it has stopped, record its step count and CPU time."""
        assert self.frozen_since is None
        self.frozen_since = time.time()
        self.process.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + STOP_DEADLINE.total_seconds()
        while (stat := process_stat(self.process.pid))[0] != "T":  # "T": stopped by a signal
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.kind} did not stop within {STOP_DEADLINE} (state {stat[0]})")
            time.sleep(POLL_INTERVAL.total_seconds() / 10)
        self.cpu_samples.append((self.steps_done(), (int(stat[11]) + int(stat[12])) / CLOCK_TICKS_PER_S))

    def thaw(self) -> None:
        assert self.frozen_since is not None
        self.process.send_signal(signal.SIGCONT)
        self.frozen.append((self.frozen_since, time.time()))
        self.frozen_since = None

    def check_alive(self, log_path: Path) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.kind} exited early with code {self.process.returncode}:\n{log_path.read_text()}"
            )


@dataclass(frozen=True, kw_only=True)
class RunTiming:
    """One side of one repeat: per-step wall stamps (after ``loss.item()``), losses, frozen spans."""

    kind: str  # "bare" or "dtnode"
    times: list[float]  # times[i] = time.time() after step i + 1
    losses: list[float]
    tokens_per_step: int
    frozen: list[tuple[float, float]]
    cpu_steps: int  # steps between the first and the last freeze, when CPU time was read
    cpu_seconds: float  # CPU seconds (utime + stime, all threads) the child used over them

    def active_seconds(self, start: float, end: float) -> float:
        """Wall seconds in [start, end] minus the time this side was frozen then."""
        frozen = sum(max(0.0, min(end, to) - max(start, since)) for since, to in self.frozen)
        return end - start - frozen

    def tokens_per_s(self, warmup: int, steps: int) -> float:
        """Tokens per active second over steps ``warmup + 1 .. steps``: total tokens / total time."""
        seconds = self.active_seconds(self.times[warmup - 1], self.times[steps - 1])
        return (steps - warmup) * self.tokens_per_step / seconds

    def tokens_per_cpu_s(self) -> float:
        return self.cpu_steps * self.tokens_per_step / self.cpu_seconds


def dtnode_command() -> list[str]:
    """The installed ``dtnode`` console script next to this interpreter, else ``python -m node.ops.cli``."""
    script = Path(sys.executable).parent / "dtnode"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "node.ops.cli"]


def dtnode_argv(settings: BenchSettings, run_dir: Path) -> list[str]:
    num_steps = settings.steps + 1
    flags: dict[str, object] = {
        "model": settings.model, "max-steps": num_steps, "inner-steps": num_steps + 1,
        "log-every": num_steps + 1, "batch-size": settings.batch_size, "seq-len": settings.seq_len,
        "threads": settings.threads, "run-dir": run_dir, "device": "cpu", "seed": SEED,
        "data-seed": DATA_SEED, "val-fraction": VAL_FRACTION, "inner-lr": INNER_LR,
        "weight-decay": WEIGHT_DECAY, "beta1": BETA1, "beta2": BETA2, "grad-clip": GRAD_CLIP,
        "lr-schedule": "constant", "warmup-steps": 0, "eval-batches": 1, "checkpoint-every": 0,
    }  # fmt: skip
    if settings.data:
        flags["data"] = settings.data
    argv = dtnode_command() + ["join"]
    for name, value in flags.items():
        argv += [f"--{name}", str(value)]
    return argv


def bare_argv(settings: BenchSettings, out: Path) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--bare-worker", str(out)]
    argv += ["--model", settings.model, "--steps", str(settings.steps), "--warmup", str(settings.warmup)]
    argv += ["--batch-size", str(settings.batch_size), "--seq-len", str(settings.seq_len)]
    return argv + ["--threads", str(settings.threads), "--data", settings.data]


def bare_loop(settings: BenchSettings, out: Path) -> None:
    """The reference: the minimal torch loop, built the way the Trainer builds its model and data."""
    import torch

    from node.data.batches import ShardedBatches, load_corpus
    from node.model.gpt import GPT, cross_entropy_loss, model_config

    if settings.threads:
        torch.set_num_threads(settings.threads)
    corpus = load_corpus(settings.data or None, val_fraction=VAL_FRACTION)
    overrides: dict[str, Any] = {"vocab_size": corpus.vocab_size}
    if settings.seq_len:
        overrides["seq_len"] = settings.seq_len
    config = model_config(settings.model, **overrides)
    torch.manual_seed(SEED)  # GPT.init_weights draws its seed from torch's global RNG
    model = GPT(config)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    gains = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": WEIGHT_DECAY}, {"params": gains, "weight_decay": 0.0}],
        lr=INNER_LR,
        betas=(BETA1, BETA2),
    )
    batches = ShardedBatches(
        corpus.train, seq_len=config.seq_len, batch_size=settings.batch_size, seed=DATA_SEED
    )
    times: list[float] = []
    losses: list[float] = []
    # One newline per step, unbuffered, for the parent's scheduler (dtnode's is its metrics line).
    marks = os.open(out.with_suffix(".steps"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for _ in range(settings.steps + 1):
        x, y = batches.next_batch()  # (B, T), (B, T)
        loss = cross_entropy_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.time())
        os.write(marks, b"\n")
    os.close(marks)
    tokens_per_step = settings.batch_size * config.seq_len
    out.write_text(json.dumps({"times": times, "losses": losses, "tokens_per_step": tokens_per_step}))


def _die_with_parent() -> None:
    """Runs in the child before exec: if this script dies (even by SIGKILL), so does the child,
    instead of lingering frozen by SIGSTOP."""
    pr_set_pdeathsig = 1  # from <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _wait(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(f"a benchmark run did not finish within {RUN_DEADLINE}")
    time.sleep(POLL_INTERVAL.total_seconds())


def run_pair(settings: BenchSettings, work_dir: Path, *, first: str) -> dict[str, RunTiming]:
    """Run bare and dtnode together, time-sliced after warmup (see the module docstring)."""
    from node.ops.metrics import read_metrics  # here: the orchestrating process never needs torch

    run_dir, bare_out = work_dir / "dtnode-run", work_dir / "bare.json"
    argvs = {"bare": bare_argv(settings, bare_out), "dtnode": dtnode_argv(settings, run_dir)}
    marks = {"bare": bare_out.with_suffix(".steps"), "dtnode": run_dir / "metrics.jsonl"}
    logs = {kind: work_dir / f"{kind}.log" for kind in argvs}
    order = [first, "dtnode" if first == "bare" else "bare"]
    deadline = time.monotonic() + RUN_DEADLINE.total_seconds()
    children: dict[str, Child] = {}
    try:
        for kind in order:
            with open(logs[kind], "wb") as log:
                process = subprocess.Popen(
                    argvs[kind], stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
                )
            children[kind] = Child(kind, process, marks[kind])
        # Phase 1: start-up runs concurrently; each side is frozen as soon as it is past warmup.
        while any(child.frozen_since is None for child in children.values()):
            for kind, child in children.items():
                if child.frozen_since is None:
                    child.check_alive(logs[kind])
                    if child.steps_done() >= settings.warmup:
                        child.freeze()
            _wait(deadline)
        # Phase 2: one side at a time, whole steps for >= slice_duration each, until both pass `steps`.
        while any(child.steps_done() < settings.steps for child in children.values()):
            for kind in order:
                child = children[kind]
                start_steps = child.steps_done()
                if start_steps >= settings.steps:
                    continue
                child.thaw()
                slice_end = time.monotonic() + settings.slice_duration.total_seconds()
                while not (
                    child.steps_done() >= settings.steps
                    or (child.steps_done() > start_steps and time.monotonic() >= slice_end)
                ):
                    child.check_alive(logs[kind])
                    _wait(deadline)
                child.freeze()
        # Phase 3: both finish their extra step and exit.
        for child in children.values():
            child.thaw()
        for kind, child in children.items():
            while child.process.poll() is None:
                _wait(deadline)
            if child.process.returncode != 0:
                raise RuntimeError(
                    f"{kind} failed with code {child.process.returncode}:\n{logs[kind].read_text()}"
                )
    finally:
        for child in children.values():
            if child.process.poll() is None:
                child.process.kill()  # also ends a stopped process
                child.process.wait()

    bare = json.loads(bare_out.read_text())
    records = [r for r in read_metrics(marks["dtnode"]) if r["kind"] == "step"]
    if [r["step"] for r in records] != list(range(1, settings.steps + 2)):
        raise RuntimeError(
            f"dtnode wrote steps {[r['step'] for r in records]}, expected 1..{settings.steps + 1}"
        )
    tokens = [r["tokens"] for r in records]
    if any(after - before != tokens[0] for before, after in zip(tokens, tokens[1:], strict=False)):
        raise RuntimeError("dtnode's steps did not all process the same number of tokens")
    cpu = {kind: cpu_window(child.cpu_samples) for kind, child in children.items()}
    return {
        "bare": RunTiming(kind="bare", frozen=children["bare"].frozen, **cpu["bare"], **bare),
        "dtnode": RunTiming(
            kind="dtnode",
            times=[r["time"] for r in records],
            losses=[r["loss"] for r in records],
            tokens_per_step=tokens[0],
            frozen=children["dtnode"].frozen,
            **cpu["dtnode"],
        ),
    }


def cpu_window(samples: list[tuple[int, float]]) -> dict[str, Any]:
    """CPU time between the first freeze (past warmup) and the last (past ``steps``), both read
    while the child was stopped, so no step is half counted."""
    (first_steps, first_cpu), (last_steps, last_cpu) = samples[0], samples[-1]
    return {"cpu_steps": last_steps - first_steps, "cpu_seconds": last_cpu - first_cpu}


def spread(values: list[float]) -> float:
    return max(values) / min(values) - 1


def benchmark(settings: BenchSettings, num_repeats: int) -> dict[str, Any]:
    warmup, steps = settings.warmup, settings.steps
    firsts = ["bare" if i % 2 == 0 else "dtnode" for i in range(num_repeats)]
    pairs: list[dict[str, RunTiming]] = []
    load_before = os.getloadavg()[0]
    for index, first in enumerate(firsts):
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="bench_inner-") as tmp:
            pairs.append(run_pair(settings, Path(tmp), first=first))
        rates = {kind: timing.tokens_per_s(warmup, steps) for kind, timing in pairs[-1].items()}
        cpu_rates = {kind: timing.tokens_per_cpu_s() for kind, timing in pairs[-1].items()}
        print(
            f"repeat {index + 1}/{num_repeats} ({first} first): bare {rates['bare']:,.0f} tok/s, dtnode "
            f"{rates['dtnode']:,.0f} tok/s, overhead {1 - rates['dtnode'] / rates['bare']:+.2%}, CPU time "
            f"{1 - cpu_rates['dtnode'] / cpu_rates['bare']:+.2%} ({time.monotonic() - start:.0f} s)",
            file=sys.stderr,
        )
    bare = [p["bare"].tokens_per_s(warmup, steps) for p in pairs]
    dtnode = [p["dtnode"].tokens_per_s(warmup, steps) for p in pairs]
    overhead = 1 - statistics.median(dtnode) / statistics.median(bare)
    bare_cpu = [p["bare"].tokens_per_cpu_s() for p in pairs]
    dtnode_cpu = [p["dtnode"].tokens_per_cpu_s() for p in pairs]
    # Each repeat's two sides ran interleaved, so their ratio cancels that repeat's machine state.
    overhead_cpu = statistics.median(1 - d / b for b, d in zip(bare_cpu, dtnode_cpu, strict=True))
    noise = spread(bare)
    passed = overhead_cpu <= TARGET_OVERHEAD and (overhead <= TARGET_OVERHEAD or noise > TARGET_OVERHEAD)
    max_loss_difference = max(
        abs(a - b) for p in pairs for a, b in zip(p["bare"].losses, p["dtnode"].losses, strict=True)
    )
    return {
        "model": settings.model,
        "steps": steps,
        "warmup": warmup,
        "repeats": num_repeats,
        "batch_size": settings.batch_size,
        "tokens_per_step": pairs[0]["bare"].tokens_per_step,
        "threads": settings.threads,
        "bare_tokens_per_s": round(statistics.median(bare), 1),
        "dtnode_tokens_per_s": round(statistics.median(dtnode), 1),
        "overhead": round(overhead, 4),
        "bare_tokens_per_cpu_s": round(statistics.median(bare_cpu), 1),
        "dtnode_tokens_per_cpu_s": round(statistics.median(dtnode_cpu), 1),
        "overhead_cpu": round(overhead_cpu, 4),
        "per_repeat": [
            {
                "first": first,
                "bare": round(b, 1),
                "dtnode": round(d, 1),
                "overhead": round(1 - d / b, 4),
                "bare_cpu": round(bc, 1),
                "dtnode_cpu": round(dc, 1),
                "overhead_cpu": round(1 - dc / bc, 4),
            }
            for first, b, d, bc, dc in zip(firsts, bare, dtnode, bare_cpu, dtnode_cpu, strict=True)
        ],
        "noise": round(noise, 4),
        "losses_identical": max_loss_difference == 0.0,
        "max_loss_difference": max_loss_difference,
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "target": TARGET_OVERHEAD,
        "pass": passed,
        "settings": {**asdict(settings), "slice_duration": settings.slice_duration.total_seconds()},
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="model preset of both runs")
    parser.add_argument("--steps", type=int, default=20, help="the measured window ends after this step")
    parser.add_argument("--warmup", type=int, default=3, help="... and starts after this one")
    parser.add_argument(
        "--repeats", type=int, default=3, help="paired runs; the side that runs first alternates"
    )
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0 = the preset's)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default)")
    parser.add_argument("--data", default="", help="corpus path (empty = dtnode's default corpus)")
    parser.add_argument(
        "--slice-seconds", type=float, default=0.0, help="minimum time one side runs alone (0 = one step)"
    )
    parser.add_argument("--bare-worker", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.warmup < 1 or args.steps < args.warmup + 2:
        raise SystemExit(f"need warmup >= 1 and steps >= warmup + 2, got {args.steps=} {args.warmup=}")
    if args.repeats < 1 or args.batch_size < 1 or args.seq_len < 0 or args.threads < 0:
        raise SystemExit("repeats and batch-size must be >= 1, seq-len and threads >= 0")
    settings = BenchSettings(
        model=args.model, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
        seq_len=args.seq_len, threads=args.threads, data=args.data,
        slice_duration=datetime.timedelta(seconds=args.slice_seconds),
    )  # fmt: skip
    if args.bare_worker is not None:
        bare_loop(settings, args.bare_worker)
        return 0
    report = benchmark(settings, args.repeats)
    print(json.dumps(report, indent=2))
    print(
        f"{'PASS' if report['pass'] else 'FAIL'}: {settings.model}, {settings.steps} steps x {args.repeats} "
        f"repeats: dtnode {report['dtnode_tokens_per_s']:,.0f} vs bare {report['bare_tokens_per_s']:,.0f} "
        f"tok/s, overhead {report['overhead']:+.2%} (noise {report['noise']:.1%}); CPU time per step "
        f"overhead {report['overhead_cpu']:+.2%}; target <= {TARGET_OVERHEAD:.0%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
