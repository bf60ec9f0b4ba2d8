"""DiLoCo's outer state sharded over a node's local ranks (ZeRO for the outer step).

A node with K local ranks splits θ_global and the outer momentum (the flat fp32 vectors of
``node.outer.state``) into K contiguous ranges, ``[r N / K, (r + 1) N / K)`` for rank r, and each
rank keeps its range on its device (or on the CPU with ``--outer-offload``): 2 N / K fp32 numbers per
rank instead of 2 N on rank 0. Rank 0 (the daemon) still runs the swarm's all-reduce on the whole
pseudo-gradient; the ranks only exchange ranges with it. One outer round (``DiLoCo.outer_step``):

    Phase 1, Δ:      the node's flat local params travel bucket by bucket, each range reduced onto
                     its rank (``RankEngine.param_pieces``); the rank subtracts them from its θ_global
                     range and sends Δ's range to rank 0, which assembles Δ (N,) for the swarm.
    Phase 2, Δ̄:      the swarm's mean (rank 0's averager) — unchanged.
    Phase 3, step:   rank 0 sends each rank its range of Δ̄; each rank steps its range with
                     ``torch.optim.SGD`` (Nesterov), elementwise as the flat vector would be: a shard
                     ends bit-identical to that range of a single process's step.
    Phase 4, model:  each rank broadcasts its θ_global range into every rank's parameters
                     (``RankEngine.write_pieces``).

What needs the whole vector on rank 0 (param_hash, the snapshot a joiner fetches, a checkpoint, an
export) gathers the ranges there on demand (``params``, ``momentum``); the hash is computed once per
change of the state. Every transfer is a collective or a point-to-point send over the node's process
group with the engine's deadline.

Two sides: :class:`OuterShard` is a rank's range, over its ``RankEngine``; :class:`ShardedOuterState` is
rank 0's ``OuterState``, which sends the ``outer_*`` calls of ``node.parallel.commands`` to every rank.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from node.outer.state import SGD_SETTINGS, tensor_hash
from node.parallel.engine import Ranges, RankEngine
from node.parallel.local import LocalWorkers

log = logging.getLogger("dtnode")


def shard_ranges(num_elements: int, world_size: int) -> Ranges:
    """Local rank -> its contiguous range of the flat vector (equal sizes, the first ranks 1 more)."""
    return {
        rank: (rank * num_elements // world_size, (rank + 1) * num_elements // world_size)
        for rank in range(world_size)
    }


class OuterShard:
    """One local rank's range of θ_global and of the outer momentum, and the collectives on them."""

    def __init__(self, engine: RankEngine, settings: dict[str, Any], *, offload: bool) -> None:
        self.engine = engine
        self.rank = dist.get_rank()
        self.ranges = shard_ranges(engine.num_elements, dist.get_world_size())
        self.first, self.last = self.ranges[self.rank]
        self.device = torch.device("cpu") if offload else engine.device
        # A leaf optimized by the outer SGD (its .grad is the rank's range of Δ̄); θ_global starts as
        # the model's params.
        self.params = torch.empty(self.last - self.first, dtype=torch.float32, device=self.device)
        for rank, low, high, values in engine.param_pieces(self.ranges):
            if rank == self.rank:
                assert values is not None
                self._mine(low, high).copy_(values)
        self.params.requires_grad_(True)
        self.optimizer = torch.optim.SGD([self.params], **settings)

    def _mine(self, low: int, high: int) -> Tensor:
        return self.params.detach()[low - self.first : high - self.first]

    def _momentum(self) -> Tensor | None:
        buffer = self.optimizer.state.get(self.params, {}).get("momentum_buffer")
        return buffer if isinstance(buffer, Tensor) else None

    def _send_to_zero(
        self, values: Tensor | None, low: int, high: int, owner: int, out: Tensor | None
    ) -> None:
        """Move numbers [low, high) from ``owner`` (which passes ``values``) into rank 0's ``out``."""
        if owner == 0:
            if self.rank == 0:
                assert values is not None and out is not None
                out[low:high].copy_(values)
            return
        if self.rank == owner:
            assert values is not None
            work = dist.isend(values.detach().to(self.engine.device).contiguous(), dst=0)
        elif self.rank == 0:
            assert out is not None
            buffer = torch.empty(high - low, dtype=torch.float32, device=self.engine.device)
            work = dist.irecv(buffer, src=owner)
        else:
            return
        assert work is not None
        work.wait(self.engine.timeout)
        if self.rank == 0:
            assert out is not None
            out[low:high].copy_(buffer)

    def _receive_from_zero(self, whole: Tensor | None) -> Tensor:
        """This rank's range of rank 0's ``whole`` (N,), sent to each rank in turn."""
        mine = torch.empty(self.last - self.first, dtype=torch.float32, device=self.device)
        for rank, (first, last) in sorted(self.ranges.items()):
            if rank == 0 and self.rank == 0:
                assert whole is not None
                mine.copy_(whole[first:last])
            elif rank != 0 and self.rank == 0:
                assert whole is not None
                work = dist.isend(whole[first:last].to(self.engine.device).contiguous(), dst=rank)
                assert work is not None
                work.wait(self.engine.timeout)
            elif rank == self.rank:
                buffer = torch.empty(last - first, dtype=torch.float32, device=self.engine.device)
                work = dist.irecv(buffer, src=0)
                assert work is not None
                work.wait(self.engine.timeout)
                mine.copy_(buffer)
        return mine

    @torch.no_grad()
    def delta(self) -> Tensor | None:
        """Δ = θ_global − θ_local (N,), assembled on rank 0's host (None elsewhere)."""
        out = torch.empty(self.engine.num_elements, dtype=torch.float32) if self.rank == 0 else None
        for owner, low, high, values in self.engine.param_pieces(self.ranges):
            piece = None
            if owner == self.rank:
                assert values is not None
                piece = self._mine(low, high) - values.to(self.device)
            self._send_to_zero(piece, low, high, owner, out)
        return out

    @torch.no_grad()
    def step(self, averaged: Tensor | None) -> None:
        """One outer SGD step on this range with its part of rank 0's ``averaged`` (N,)."""
        self.params.grad = self._receive_from_zero(averaged)
        self.optimizer.step()
        self.params.grad = None

    def write_to_model(self) -> None:
        """θ_local ← θ_global: every rank's parameters from the ranks' ranges."""
        self.engine.write_pieces(self.ranges, self._mine)

    @torch.no_grad()
    def gather(self, name: str) -> Tensor | None:
        """θ_global ("params") or the momentum ("momentum") on rank 0's host (None elsewhere, or no momentum)."""
        mine = self.params.detach() if name == "params" else self._momentum()
        if mine is None:  # no momentum before the first step: the same on every rank
            return None
        out = torch.empty(self.engine.num_elements, dtype=torch.float32) if self.rank == 0 else None
        for rank, (first, last) in sorted(self.ranges.items()):
            self._send_to_zero(mine if rank == self.rank else None, first, last, rank, out)
        return out

    @torch.no_grad()
    def load(self, payload: tuple[Tensor, Tensor | None] | None, has_momentum: bool) -> None:
        """Replace this range of θ_global and the momentum with rank 0's vectors (``payload`` there)."""
        params, momentum = payload if payload is not None else (None, None)
        self.params.detach().copy_(self._receive_from_zero(params))
        state = self.optimizer.state[self.params]
        if has_momentum:
            state["momentum_buffer"] = self._receive_from_zero(momentum)
        else:
            state.pop("momentum_buffer", None)

    def set_settings(self, settings: dict[str, Any]) -> None:
        self.optimizer.param_groups[0].update(settings)

    def num_bytes(self) -> int:
        """Bytes of outer state this rank holds (θ_global and momentum ranges)."""
        momentum = self._momentum()
        return 4 * self.params.numel() + (0 if momentum is None else 4 * momentum.numel())


class ShardedOuterState:
    """Rank 0's ``OuterState`` of a node whose outer state is sharded over its local ranks."""

    def __init__(self, workers: LocalWorkers, *, offload: bool, **settings: Any) -> None:
        self._workers = workers
        self._settings = {"dampening": 0.0, "weight_decay": 0.0, **settings}
        assert set(self._settings) == set(SGD_SETTINGS), self._settings
        self.num_elements = int(workers.call("outer_open", (self._settings, offload)))
        self.device = torch.device("cpu")  # Δ and Δ̄ live on rank 0's host, where the averager runs
        self._hash: str | None = None
        world_size = workers.layout.world_size
        log.info(
            "DiLoCo outer state sharded over %d local ranks%s: %.1f MB of global params and as much momentum "
            "each (%.1f MB each unsharded)",
            world_size, " (on CPU)" if offload else "", 4 * self.num_elements / world_size / 1e6,
            4 * self.num_elements / 1e6,
        )  # fmt: skip

    def params(self) -> Tensor:
        gathered = self._workers.call("outer_gather", "params")
        assert isinstance(gathered, Tensor)
        return gathered

    def momentum(self) -> Tensor | None:
        gathered = self._workers.call("outer_gather", "momentum")
        assert gathered is None or isinstance(gathered, Tensor)
        return gathered

    def settings(self) -> dict[str, Any]:
        return dict(self._settings)

    def delta(self) -> Tensor:
        delta = self._workers.call("outer_delta")
        assert isinstance(delta, Tensor)
        return delta

    def step(self, averaged: Tensor) -> None:
        self._hash = None
        self._workers.call("outer_step", None, rank0_payload=averaged.to("cpu", torch.float32))

    def write_to_model(self) -> None:
        self._workers.call("outer_write")

    def load(self, params: Tensor, momentum: Tensor | None) -> None:
        self._hash = None
        payload = (
            params.to("cpu", torch.float32),
            None if momentum is None else momentum.to("cpu", torch.float32),
        )
        self._workers.call(
            "outer_load", (None, momentum is not None), rank0_payload=(payload, momentum is not None)
        )

    def set_settings(self, settings: dict[str, Any]) -> None:
        self._settings = {key: settings[key] for key in SGD_SETTINGS}
        self._workers.call("outer_settings", self._settings)

    def hash(self) -> str:
        if self._hash is None:
            self._hash = tensor_hash(self.params())
        return self._hash

    def num_bytes_per_rank(self) -> list[int]:
        """Bytes of outer state each local rank holds."""
        held = self._workers.call("outer_bytes")
        assert isinstance(held, list)
        return held


def bytes_per_rank(shard: OuterShard | None, commands: dist.ProcessGroup) -> list[int] | None:
    """Collective: bytes of outer state every rank holds (0 where it was not opened), on rank 0 (None
    elsewhere), gathered over the command group."""
    held = 0 if shard is None else shard.num_bytes()
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(held, gathered if dist.get_rank() == 0 else None, dst=0, group=commands)
    return gathered if dist.get_rank() == 0 else None
