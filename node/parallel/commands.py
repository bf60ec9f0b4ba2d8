"""What rank 0 asks every local rank to do: the calls, and what a rank keeps between them.

A node with local workers runs one :class:`LocalRank` on each of its ranks (``node.parallel.local``
starts the processes and broadcasts each call; rank 0 is the daemon). A call is a name of
:data:`COMMANDS` and a payload; every rank runs it at once, since its work is collectives over the
node's ranks, and rank 0's result is the call's. Between calls a rank keeps:

- its part of the model replica (``node.parallel.engine.RankEngine``): the inner step, the held-out
  loss, the node's flat parameter vector, the inner AdamW state;
- its range of DiLoCo's outer state, once opened (``node.parallel.outer.OuterShard``);
- its all-reduce stream servers, once opened (``node.parallel.streams.RankStreams``);
- the gloo group the calls travel on, which the streams and the outer state's byte count also use.

Rank 0's side of the calls: ``node.model.replica.ParallelReplica`` (the model), ``ShardedOuterState`` (the
``outer_*`` calls) and ``LocalStreams`` (the ``*_streams`` calls).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from node.config import NodeConfig
from node.model.gpt import ModelConfig
from node.parallel.engine import RankEngine
from node.parallel.layout import LocalLayout
from node.parallel.local import LocalWorkers
from node.parallel.outer import OuterShard, bytes_per_rank
from node.parallel.streams import RankStreams, open_streams, run_streams
from protocol.allreduce.allreduce import AllReduceResult
from protocol.swarm.streams import StreamJob


class LocalRank:
    """One local rank of the node: its engine, and its outer state range and streams once opened."""

    def __init__(
        self,
        model_config: ModelConfig,
        config: NodeConfig,
        layout: LocalLayout,
        commands: dist.ProcessGroup,
        *,
        timeout: timedelta,
    ) -> None:
        self.config = config
        self.engine = RankEngine(model_config, config, layout, timeout=timeout)
        self.commands = commands  # the node's gloo group the calls travel on
        self.outer: OuterShard | None = None  # this rank's range of DiLoCo's outer state, once opened
        self.streams: RankStreams | None = None  # this rank's all-reduce streams, once opened

    def run(self, name: str, payload: Any) -> object:
        return COMMANDS[name](self, payload)

    # --- DiLoCo's outer state (node/parallel/outer.py) ---
    def open_outer(self, settings: dict[str, Any], offload: bool) -> int:
        self.outer = OuterShard(self.engine, settings, offload=offload)
        return self.engine.num_elements

    def outer_shard(self) -> OuterShard:
        if self.outer is None:
            raise RuntimeError("the outer state was not opened on this rank")
        return self.outer

    # --- the swarm all-reduce streams served by this rank (node/parallel/streams.py) ---
    def open_streams(self) -> dict[int, str] | None:
        if self.streams is None:
            self.streams = RankStreams(self.config, rank=dist.get_rank(), world_size=dist.get_world_size())
        return open_streams(self.streams, self.commands)

    def run_streams(
        self, jobs: Sequence[StreamJob], shards: Sequence[Tensor] | None
    ) -> list[AllReduceResult] | None:
        return run_streams(self.streams, self.commands, jobs, shards)

    def reset_streams(self) -> None:
        if self.streams is not None:
            self.streams.reset_error_feedback()

    def close(self) -> None:
        """Close what outlives a call: the stream servers."""
        if self.streams is not None:
            self.streams.close()
            self.streams = None


Dispatch = Callable[[LocalRank, Any], object]

# What rank 0 can ask every rank to do, and how a rank does it; the payload travels with the call.
COMMANDS: dict[str, Dispatch] = {
    # the model replica
    "train_step": lambda rank, payload: rank.engine.train_step(payload[0], payload[1]),
    "eval_loss": lambda rank, payload: rank.engine.eval_loss(payload),
    "read_params": lambda rank, payload: rank.engine.read_params(),
    "write_params": lambda rank, payload: rank.engine.write_params(payload),
    "optimizer_state": lambda rank, payload: rank.engine.gather_optimizer_state(),
    "load_optimizer_state": lambda rank, payload: rank.engine.scatter_optimizer_state(payload),
    # the all-reduce streams
    "open_streams": lambda rank, payload: rank.open_streams(),
    "run_streams": lambda rank, payload: rank.run_streams(*payload),
    "reset_streams": lambda rank, payload: rank.reset_streams(),
    # this rank's range of DiLoCo's outer state
    "outer_open": lambda rank, payload: rank.open_outer(*payload),
    "outer_delta": lambda rank, payload: rank.outer_shard().delta(),
    "outer_step": lambda rank, payload: rank.outer_shard().step(payload),
    "outer_write": lambda rank, payload: rank.outer_shard().write_to_model(),
    "outer_gather": lambda rank, payload: rank.outer_shard().gather(payload),
    "outer_load": lambda rank, payload: rank.outer_shard().load(*payload),
    "outer_settings": lambda rank, payload: rank.outer_shard().set_settings(payload),
    "outer_bytes": lambda rank, payload: bytes_per_rank(rank.outer, rank.commands),
}


def start_local_workers(
    model_config: ModelConfig, config: NodeConfig, layout: LocalLayout, *, timeout: timedelta
) -> LocalWorkers:
    """The node's local workers, every rank (this process is rank 0) running a :class:`LocalRank`."""
    start_rank = functools.partial(LocalRank, model_config, config, layout, timeout=timeout)
    return LocalWorkers(config, layout, start_rank, timeout=timeout)
