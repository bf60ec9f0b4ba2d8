"""What the intra-node parallelism tests share: the reference model and batches, and their worker processes.

Every test of a layout (tensor, pipeline, ZeRO, combined) trains the same nano ``GPT`` (``build_model``:
seeded, so every rank and the single-process reference start from the same weights) on the same fixed
batches, once in the test process without any parallelism and once on gloo ranks in processes of their
own. ``spawned_workers`` starts those processes and holds them to a deadline; each worker opens its process
group with ``worker_process_group``, which rendezvouses through a ``FileStore`` in the test's tmp dir
(no port to pick).

The workers are forked from the test process's forkserver (``tests/forking.py``), which imported torch,
torch.distributed, its compiler stack and the node once: a spawned worker spent ~5 CPU-seconds on those
imports before its first step, more than its training. Each is still a process of its own, with its own
process group and gloo sockets.
"""

from __future__ import annotations

import multiprocessing.process
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from node.model.gpt import GPT, model_config
from tests.forking import forkserver
from tests.node.swarm_cluster import NODE_PRELOAD

NUM_STEPS = 10
SEQ_LEN = 32
BATCH_SIZE = 4
SEED = 1234
# After the deadline, a worker that is still running is killed; this bounds the wait for it to go.
KILL_WAIT = timedelta(seconds=10)
# What a worker imports before its first step: the node's own list (one server serves both), the layouts'
# modules and FSDP2 (ZeRO-3).
WORKER_PRELOAD = (
    *NODE_PRELOAD,
    "torch.distributed",
    "torch.distributed.fsdp",
    "torch.distributed.tensor.parallel",
    "node.parallel.pipeline",
    "node.parallel.tensor",
    "node.parallel.zero",
)


def build_model() -> GPT:
    """The nano GPT with the weights of ``SEED``: the same on every rank and in the reference."""
    torch.manual_seed(SEED)
    return GPT(model_config("nano", seq_len=SEQ_LEN))


def fixed_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``NUM_STEPS`` batches of ``BATCH_SIZE`` random sequences: inputs and next-token targets."""
    generator = torch.Generator().manual_seed(SEED + 1)
    config = model_config("nano", seq_len=SEQ_LEN)
    tokens = torch.randint(0, config.vocab_size, (NUM_STEPS, BATCH_SIZE, SEQ_LEN + 1), generator=generator)
    return [(batch[:, :-1], batch[:, 1:]) for batch in tokens]  # each (B, T), (B, T)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` in the Frobenius norm."""
    return float((actual - expected).norm() / expected.norm())


@contextmanager
def worker_process_group(
    rank: int, world_size: int, store_path: str, *, backend: str, timeout: timedelta
) -> Iterator[None]:
    """Inside a worker: the default process group of ``world_size`` ranks, destroyed on the way out.

    One intra-op thread: the ranks share the machine's 2 cores, and more threads only oversubscribe them.
    ``timeout`` bounds every collective, so a rank whose peer died fails instead of hanging.
    """
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _enter_worker(env: dict[str, str], cwd: str, target: Callable[..., None], *args: object) -> None:
    """In the forked worker: the environment and working dir the test process has now (the server's
    are those of its start, perhaps under another test's monkeypatch), then ``target(*args)``."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    target(*args)


@contextmanager
def spawned_workers(
    target: Callable[..., None], args_per_rank: Sequence[tuple[object, ...]], deadline: timedelta
) -> Iterator[None]:
    """Run ``target(*args)`` in one process per entry of ``args_per_rank``, forked from the preloaded
    forkserver (``target`` is pickled by name: a module-level function); all must exit with 0.

    The body of the ``with`` runs while the workers start (a reference computed there overlaps with
    their start-up). After it, the workers get ``deadline`` to finish; any still running then, or after
    the body raised, is killed.
    """
    context = forkserver(WORKER_PRELOAD)
    workers: list[multiprocessing.process.BaseProcess] = [
        context.Process(target=_enter_worker, args=(dict(os.environ), os.getcwd(), target, *args))
        for args in args_per_rank
    ]
    for worker in workers:
        worker.start()
    try:
        yield
        deadline_at = time.monotonic() + deadline.total_seconds()
        for worker in workers:
            worker.join(timeout=max(0.0, deadline_at - time.monotonic()))
        exit_codes = [worker.exitcode for worker in workers]
        assert exit_codes == [0] * len(workers), f"worker exit codes {exit_codes} (None: still running)"
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=KILL_WAIT.total_seconds())
