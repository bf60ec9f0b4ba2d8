"""A node's local workers: the daemon is rank 0, and ``world_size - 1`` spawned processes are the other ranks.

The node stays one peer in the swarm: only rank 0 runs the swarm session (DHT, gRPC, outer step). The other
ranks are servants of one replica: rank 0 broadcasts each call, a name and a payload, and every rank, rank 0
included, runs it on its :class:`Rank` (``node.parallel.commands.LocalRank``: what each call does), whose
collectives tie them together. This module knows the processes and the channel, not the calls.

Process group and deadlines
---------------------------
- Rendezvous through a ``FileStore`` in a private temporary directory (no listening port), gloo bound to
  the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise; NCCL between GPUs when CUDA is
  available (one code path: the backend is chosen by ``distributed_backend``).
- Every collective of a call is bounded by ``timeout``. Commands travel on a separate gloo group whose
  deadline is the daemon's own life: a worker waits for the next call while rank 0 is in an outer round
  (which has its own deadlines), and exits within a second of the daemon's death (it watches its parent).
- A worker that fails exits non-zero; rank 0's next collective then fails and :meth:`LocalWorkers.call`
  reports which rank died and how; :meth:`LocalWorkers.close` stops every worker (killed after a grace).

Starting the ranks
------------------
A spawned rank is a fresh interpreter: it imports torch, the node and ``torch._dynamo`` again, ~2.5
CPU-seconds before its first step. Where a fork is safe the ranks are forked from the daemon instead and
start with all of that loaded (:func:`start_method`): on CPU (CUDA must not be initialized before a fork),
from a daemon with no other thread (a swarm session's gRPC and DHT threads would be copied half-alive), and
with one intra-op thread per rank (GNU OpenMP's pool does not survive a fork: a forked rank that entered a
parallel region could hang). Otherwise they are spawned.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

from node.config import NodeConfig
from node.parallel.layout import LocalLayout
from node.parallel.tensor import device_type, distributed_backend, use_device

log = logging.getLogger("dtnode")

STOP = "stop"
# Commands wait as long as the daemon lives (it may spend an outer round between two calls).
COMMAND_TIMEOUT = timedelta(days=1)
PARENT_POLL_SECONDS = 1.0
STOP_GRACE = timedelta(seconds=10)
DEATH_GRACE = timedelta(seconds=3)  # how long a failed call waits for a dying rank to be reaped


class Rank(Protocol):
    """What every local rank runs: rank 0's calls, one at a time, then ``close``."""

    def run(self, name: str, payload: Any) -> object: ...
    def close(self) -> None: ...


RankFactory = Callable[[dist.ProcessGroup], Rank]
"""Builds a rank's :class:`Rank` once the process group is up, given the group the calls travel on. A
spawned rank receives it pickled: a class or module-level function (or a ``functools.partial`` of one)."""


def _init_process_group(rank: int, world_size: int, store_path: str, timeout: timedelta) -> dist.ProcessGroup:
    """The node's default process group, and the gloo group the commands travel on (returned)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback only
    if device_type() == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ["LOCAL_RANK"] = str(rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        distributed_backend(), store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    assert group is not None
    return group


def start_method(config: NodeConfig) -> Literal["fork", "spawn"]:
    """``fork`` where forking the daemon is safe (see the module docstring), else ``spawn``."""
    safe = device_type() == "cpu" and threading.active_count() == 1 and config.run.threads == 1
    return "fork" if safe else "spawn"


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the daemon is gone (its collectives would otherwise leave us waiting)."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(3)


def worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    config: NodeConfig,
    start_rank: RankFactory,
    timeout_seconds: float,
    parent_pid: int,
) -> None:
    """A local rank (spawned or forked): build its :class:`Rank`, then run rank 0's calls until it says stop."""
    # A Ctrl-C or SIGTERM reaches the whole process group; the daemon handles it (it finishes the step,
    # checkpoints, then stops us), so a rank must not die of it mid-collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    timeout = timedelta(seconds=timeout_seconds)
    use_device(config.run.device)
    commands = _init_process_group(rank, world_size, store_path, timeout)
    try:
        handler = start_rank(commands)
        try:
            while True:  # ends at STOP, or by the parent watch when the daemon dies
                message: list[Any] = [None]
                dist.broadcast_object_list(message, src=0, group=commands)
                name, payload = message[0]
                if name == STOP:
                    break
                handler.run(name, payload)
        finally:
            handler.close()
    finally:
        dist.destroy_process_group()


class LocalWorkerError(RuntimeError):
    """A local rank died or a collective among the node's ranks failed or timed out."""


class LocalWorkers:
    """Rank 0's side: starts the other ranks, builds its own :class:`Rank`, and sends every call to all."""

    def __init__(
        self, config: NodeConfig, layout: LocalLayout, start_rank: RankFactory, *, timeout: timedelta
    ) -> None:
        self.layout = layout
        self._calling = threading.Lock()
        world_size = layout.world_size
        self._store_dir = tempfile.mkdtemp(prefix="dtnode-local-")  # mode 0700: only this user
        store_path = os.path.join(self._store_dir, "store")
        use_device(config.run.device)  # rank 0 (this process) on the same device kind as the others
        context: multiprocessing.context.ForkContext | multiprocessing.context.SpawnContext = (
            multiprocessing.get_context("fork")
            if start_method(config) == "fork"
            else multiprocessing.get_context("spawn")
        )
        self.processes: list[multiprocessing.process.BaseProcess] = [
            context.Process(
                target=worker_main,
                args=(
                    rank,
                    world_size,
                    store_path,
                    config,
                    start_rank,
                    timeout.total_seconds(),
                    os.getpid(),
                ),
                name=f"dtnode-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        for process in self.processes:
            process.start()
        try:
            self._commands = _init_process_group(0, world_size, store_path, timeout)
            self.rank = start_rank(self._commands)
        except BaseException:
            self._stop_processes()
            raise
        self._closed = False
        log.info(
            "%d local workers: dp=%d x tp=%d x pp=%d, %s backend, ranks started by %s",
            world_size, layout.dp, layout.tp, layout.pp, distributed_backend(), context.get_start_method(),
        )  # fmt: skip

    def call(self, name: str, payload: Any = None, *, rank0_payload: Any = None) -> Any:
        """Run call ``name`` on every rank's :class:`Rank`; returns rank 0's result.

        The other ranks get ``payload`` with the command; rank 0 runs with ``rank0_payload`` when given
        (data a collective of the command distributes, e.g. the flat vector ``write_params`` broadcasts).
        """
        with self._calling:  # one call at a time: with --overlap the outer step comes from its own thread
            self._check_workers()
            try:
                dist.broadcast_object_list([(name, payload)], src=0, group=self._commands)
                return self.rank.run(name, payload if rank0_payload is None else rank0_payload)
            except (RuntimeError, dist.DistError) as error:
                # A rank that was killed resets its connections before it is reaped: give it a moment to
                # show up as dead, so the error names it rather than the socket.
                self._await_exit(DEATH_GRACE)
                self._check_workers()
                raise LocalWorkerError(f"local call {name!r} failed: {error}") from error

    def _await_exit(self, grace: timedelta) -> None:
        """Return once some rank has exited, or after ``grace``."""
        deadline = time.monotonic() + grace.total_seconds()
        while time.monotonic() < deadline and all(process.is_alive() for process in self.processes):
            time.sleep(0.05)

    def _check_workers(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                raise LocalWorkerError(f"local worker rank {rank} exited with code {process.exitcode}")

    def close(self) -> None:
        """Tell every rank to stop, wait for them (bounded), and free the process group."""
        if self._closed:
            return
        self._closed = True
        self.rank.close()
        try:
            if all(process.is_alive() for process in self.processes):
                dist.broadcast_object_list([(STOP, None)], src=0, group=self._commands)
        except (RuntimeError, dist.DistError) as error:
            log.warning("local workers did not take the stop: %s", error)
        finally:
            self._stop_processes()
            dist.destroy_process_group()

    def _stop_processes(self) -> None:
        deadline = time.monotonic() + STOP_GRACE.total_seconds()
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=STOP_GRACE.total_seconds())
        shutil.rmtree(self._store_dir, ignore_errors=True)
