"""The node's extra all-reduce streams (``--swarm-streams S``): stream ``s >= 1`` lives on local rank
``s mod K`` of the node's K ranks (stream 0 is the daemon's node server), so a node whose ranks each
serve a stream encodes, sends and decodes its shards in K processes at once.

- ``RankStreams``: the stream servers of one rank (``protocol.swarm.streams.StreamServer``), run
  concurrently on threads (each server has its own event loop); with rank 0 of 1, the ``StreamRunner``
  of a node without local workers (every stream in the daemon).
- ``LocalStreams``: the ``StreamRunner`` of a node with local workers: the daemon sends each rank its
  shards over the node's gloo command group, every rank runs its streams, and the averages come back
  (``open_streams`` and ``run_streams`` on every rank: the ``*_streams`` calls of ``node.parallel.commands``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from node.config import NodeConfig
from node.parallel.local import LocalWorkers
from protocol.allreduce.allreduce import AllReduceResult
from protocol.swarm.streams import RESULT_MARGIN, StreamJob, StreamServer, fell_back

log = logging.getLogger("dtnode")


def rank_of_stream(stream: int, world_size: int) -> int:
    """The local rank that serves stream ``stream`` (>= 1) of a node with ``world_size`` ranks."""
    return stream % world_size


class RankStreams:
    """The all-reduce stream servers of local rank ``rank``: streams ``s >= 1`` with ``s mod K == rank``."""

    def __init__(self, config: NodeConfig, *, rank: int, world_size: int) -> None:
        # The daemon's listen host, announce host, limits and swarm key. Imported here: it loads the gRPC
        # swarm stack (~1.5 CPU-s), which a rank that serves no stream never needs.
        from node.swarm.setup import swarm_config

        swarm = swarm_config(config)
        self.streams = [s for s in range(1, config.rounds.streams) if rank_of_stream(s, world_size) == rank]
        self.servers: dict[int, StreamServer] = {}
        try:
            for stream in self.streams:
                self.servers[stream] = StreamServer(
                    listen_host=swarm.listen_host,
                    announce_host=swarm.announce_host,
                    config=swarm.allreduce,
                    auth=swarm.auth,
                )
        except BaseException:
            self.close()
            raise
        self._threads = ThreadPoolExecutor(max_workers=max(len(self.streams), 1), thread_name_prefix="stream")

    @property
    def by_stream(self) -> dict[int, str]:
        """Where each of this rank's streams listens."""
        return {stream: server.address for stream, server in self.servers.items()}

    @property
    def addresses(self) -> tuple[str, ...]:
        """This rank's stream addresses in stream order; all of them on a node of one rank (the
        ``StreamRunner`` of a node without local workers: every stream in the daemon's process)."""
        return tuple(address for _, address in sorted(self.by_stream.items()))

    def run(self, jobs: Sequence[StreamJob], shards: Sequence[torch.Tensor]) -> list[AllReduceResult]:
        """Run every job (all ours) on its shard at once; results in job order. A stream that fails
        outright (its loop wedged past the deadline) falls back to its own shard and says why."""
        futures = [
            self._threads.submit(self.servers[job.stream].allreduce, job, shard)
            for job, shard in zip(jobs, shards, strict=True)
        ]
        results = []
        for job, shard, future in zip(jobs, shards, futures, strict=True):
            try:
                results.append(future.result())  # each returns within its deadline + margin
            except Exception as error:
                log.warning("all-reduce stream %d failed: %s", job.stream, error)
                results.append(fell_back(shard, f"stream {job.stream} failed: {error}"))
        return results

    def reset_error_feedback(self) -> None:
        for server in self.servers.values():
            server.reset_error_feedback()

    def close(self) -> None:
        for server in self.servers.values():
            try:
                server.close()
            except Exception as error:  # closing the rest matters more
                log.warning("an all-reduce stream did not close cleanly: %s", error)
        self.servers.clear()
        if hasattr(self, "_threads"):
            self._threads.shutdown(wait=False)


# --- through the local workers ---


def _stripped(result: AllReduceResult) -> AllReduceResult:
    """The result without its vector (sent separately as a tensor), for the pickled reply."""
    return dataclasses.replace(result, averaged=torch.empty(0))


def open_streams(streams: RankStreams | None, commands: dist.ProcessGroup) -> dict[int, str] | None:
    """Collective: every rank's stream addresses, merged on rank 0 (None elsewhere)."""
    mine = {} if streams is None else streams.by_stream
    gathered: list[Any] = [None] * dist.get_world_size(commands) if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0, group=commands)
    if dist.get_rank() != 0:
        return None
    return {stream: address for addresses in gathered for stream, address in addresses.items()}


def run_streams(
    streams: RankStreams | None,
    commands: dist.ProcessGroup,
    jobs: Sequence[StreamJob],
    shards: Sequence[torch.Tensor] | None,
) -> list[AllReduceResult] | None:
    """Collective: rank 0 (which passes ``shards``) sends each rank the shards of its streams, every
    rank runs them, and rank 0 gets every job's result back in job order (None elsewhere)."""
    rank, world_size = dist.get_rank(), dist.get_world_size(commands)
    wait = max(job.deadline for job in jobs) + RESULT_MARGIN + timedelta(seconds=5)
    owners = [rank_of_stream(job.stream, world_size) for job in jobs]
    if rank == 0:
        assert shards is not None
        sends = [
            dist.isend(shard, dst=owner, group=commands)  # slices of one vector: contiguous already
            for shard, owner in zip(shards, owners, strict=True)
            if owner != 0
        ]
        for work in sends:
            if work is not None:
                work.wait(wait)
        results: dict[int, AllReduceResult] = {}
        ours = [i for i, owner in enumerate(owners) if owner == 0]  # streams >= K stay here
        if ours and streams is not None:
            ran = streams.run([jobs[i] for i in ours], [shards[i] for i in ours])
            results.update(zip(ours, ran, strict=True))
        replies: list[Any] = [None] * world_size
        dist.gather_object(None, replies, dst=0, group=commands)
        for worker_rank in range(1, world_size):
            theirs = [i for i, owner in enumerate(owners) if owner == worker_rank]
            for i, result in zip(theirs, replies[worker_rank] or [], strict=True):
                averaged = torch.empty(shards[i].numel(), dtype=torch.float32)
                dist.recv(averaged, src=worker_rank, group=commands)  # in the order the rank sends them
                results[i] = dataclasses.replace(result, averaged=averaged)
        return [results[i] for i in range(len(jobs))]
    mine = [i for i, owner in enumerate(owners) if owner == rank]
    my_shards = []
    for i in mine:
        length = jobs[i].group.num_elements
        shard = torch.empty(length, dtype=torch.float32)
        dist.recv(shard, src=0, group=commands)
        my_shards.append(shard)
    ran = streams.run([jobs[i] for i in mine], my_shards) if mine and streams is not None else []
    dist.gather_object([_stripped(result) for result in ran], None, dst=0, group=commands)
    for result in ran:
        dist.send(result.averaged.contiguous(), dst=0, group=commands)
    return None


class LocalStreams:
    """The ``StreamRunner`` of a node with local workers (``stream s`` on rank ``s mod K``)."""

    def __init__(self, workers: LocalWorkers) -> None:
        self._workers = workers
        addresses = workers.call("open_streams")
        self._addresses = tuple(address for _, address in sorted(addresses.items()))

    @property
    def addresses(self) -> tuple[str, ...]:
        return self._addresses

    def run(self, jobs: Sequence[StreamJob], shards: Sequence[torch.Tensor]) -> list[AllReduceResult]:
        results = self._workers.call(
            "run_streams", (list(jobs), None), rank0_payload=(list(jobs), list(shards))
        )
        assert isinstance(results, list)
        return results

    def reset_error_feedback(self) -> None:
        self._workers.call("reset_streams")
