"""The node's model replica as the training loop sees it: one process, or the node's local workers.

:class:`SingleReplica` is a plain ``GPT`` with AdamW in the daemon's process. :class:`ParallelReplica` is
the same replica split over ``dp x tp x pp`` local ranks (``node.parallel``): the daemon is rank 0 and
drives the others. Both offer the same calls, so the loop, DiLoCo and the swarm do not care which it is:

    train_step(batches, lr) -> loss     one inner AdamW step over the node's batch (grad accumulation: a list)
    eval_loss(batches) -> loss          mean held-out loss
    read_params() / write_params(flat)  the node's flat fp32 parameter vector, the full model's order
    outer_state(...)                    where DiLoCo's outer state lives (None: flat, in this process)
    model_state() / load_model_state()  named full parameters, for checkpoints

``build_replica`` picks one from the config: ``--local-workers K`` (or one per GPU) with the layout of
``--dp/--tp/--pp``, or the planner's (``node.parallel.plan``) when none is set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from node.config import ConfigError, NodeConfig
from node.model.efficiency import resolve_compile, resolve_precision
from node.model.gpt import GPT, ModelConfig, cross_entropy_loss
from node.model.meta_init import build_model
from node.outer.diloco import ModuleParams
from node.outer.state import OuterState
from node.parallel.commands import start_local_workers
from node.parallel.engine import autocast_forward, checkpoint_blocks, parameter_offsets
from node.parallel.layout import LocalLayout, resolve_layout
from node.parallel.outer import ShardedOuterState
from node.parallel.streams import LocalStreams, RankStreams
from node.parallel.tensor import device_type, use_device
from node.parallel.zero import build_inner_optimizer
from protocol.swarm.streams import StreamRunner

log = logging.getLogger("dtnode")

Batch = tuple[Tensor, Tensor]  # tokens (B, T), targets (B, T)


class Replica(Protocol):
    model: GPT  # the plain model (parameters on the meta device for a ParallelReplica: names and shapes)

    def train_step(self, batches: Sequence[Batch], lr: float) -> float: ...
    def eval_loss(self, batches: Sequence[Batch]) -> float: ...
    def read_params(self, device: torch.device | str) -> Tensor: ...
    def write_params(self, flat: Tensor) -> None: ...
    def model_state(self) -> dict[str, Tensor]: ...
    def load_model_state(self, state: dict[str, Tensor]) -> None: ...
    def optimizer_state(self) -> dict[str, Any] | None: ...
    def load_optimizer_state(self, state: dict[str, Any]) -> None: ...
    def open_streams(self) -> StreamRunner: ...
    def outer_state(self, *, offload: bool, **settings: Any) -> OuterState | None: ...
    def close(self) -> None: ...


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [param for param in model.parameters() if param.requires_grad]


class SingleReplica:
    """The whole replica in this process, on ``device``: built there from the meta device
    (``node.model.meta_init``), with ``compile`` its forward runs through ``torch.compile`` (``node.model.efficiency``)."""

    def __init__(
        self, model_config: ModelConfig, config: NodeConfig, device: torch.device, *, compile: bool = False
    ) -> None:
        self.config = config
        self._streams: RankStreams | None = None
        self.device = device
        self.model = build_model(model_config, device)  # = GPT(model_config).to(device), bit for bit
        self.model.train()
        if config.parallel.activation_checkpointing:
            checkpoint_blocks(self.model)
        autocast_forward(self.model, resolve_precision(config.parallel.precision, device))
        # The compiled module shares the model's parameters: names, state dicts and DiLoCo's flat
        # view stay the plain model's; only the calls below go through the compiled graph.
        self.forward: Callable[[Tensor], Tensor] = torch.compile(self.model) if compile else self.model
        self.optimizer = build_inner_optimizer(self.model, config)
        self._params = ModuleParams(_trainable(self.model))  # DiLoCo's flat view of this model

    def train_step(self, batches: Sequence[Batch], lr: float) -> float:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for tokens, targets in batches:
            x, y = tokens.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            loss = cross_entropy_loss(self.forward(x), y)
            # The gradient of the mean loss over all accumulated batches (equal sizes).
            (loss / len(batches) if len(batches) > 1 else loss).backward()
            losses.append(loss.detach())
        if self.config.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.inner.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().item()  # syncs the device: the step is done when this returns

    @torch.no_grad()
    def eval_loss(self, batches: Sequence[Batch]) -> float:
        self.model.eval()
        total = 0.0
        for x, y in batches:
            total += cross_entropy_loss(self.forward(x.to(self.device)), y.to(self.device)).item()
        self.model.train()  # set once here, not every inner step (it walks every module)
        return total / len(batches)

    def read_params(self, device: torch.device | str) -> Tensor:
        return self._params.read_params(device)

    def write_params(self, flat: Tensor) -> None:
        self._params.write_params(flat)

    def model_state(self) -> dict[str, Tensor]:
        return self.model.state_dict()

    def load_model_state(self, state: dict[str, Tensor]) -> None:
        self.model.load_state_dict(state)

    def optimizer_state(self) -> dict[str, Any] | None:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if "ranks" in state:  # saved by local workers, each with its own share
            log.warning(
                "the checkpoint's inner AdamW state is of local workers (%s): it starts afresh",
                state["layout"],
            )
            return
        self.optimizer.load_state_dict(state)

    def outer_state(self, *, offload: bool, **settings: Any) -> OuterState | None:
        """None: DiLoCo keeps its flat outer state in this process (``node.outer.state.FlatOuterState``)."""
        return None

    def open_streams(self) -> StreamRunner:
        """The extra all-reduce streams (``--swarm-streams``), all in this process; closed with us."""
        if self._streams is None:
            self._streams = RankStreams(self.config, rank=0, world_size=1)
        return self._streams

    def close(self) -> None:
        if self._streams is not None:  # the only thing that outlives this object: stream servers
            self._streams.close()
            self._streams = None


class ParallelReplica:
    """The replica over the node's local workers (``node.parallel.local``, running the calls of
    ``node.parallel.commands``); this process is rank 0."""

    def __init__(
        self, model_config: ModelConfig, config: NodeConfig, layout: LocalLayout, *, timeout: timedelta
    ) -> None:
        with torch.device("meta"):
            self.model = GPT(model_config)  # names and shapes for export and checkpoints; no memory
        self.offsets = parameter_offsets(model_config)
        self.workers = start_local_workers(model_config, config, layout, timeout=timeout)
        self.shard_outer = config.outer.sharding == "on" or (
            config.outer.sharding == "auto" and device_type() == "cuda"
        )
        self._streams: StreamRunner | None = None

    def train_step(self, batches: Sequence[Batch], lr: float) -> float:
        return float(self.workers.call("train_step", (list(batches), lr)))

    def eval_loss(self, batches: Sequence[Batch]) -> float:
        return float(self.workers.call("eval_loss", list(batches)))

    def read_params(self, device: torch.device | str) -> Tensor:
        flat = self.workers.call("read_params")
        assert isinstance(flat, Tensor)
        return flat.to(device)

    def write_params(self, flat: Tensor) -> None:
        self.workers.call("write_params", None, rank0_payload=flat)

    def model_state(self) -> dict[str, Tensor]:
        flat = self.read_params("cpu")
        return {
            name: flat[offset : offset + shape.numel()].view(shape).clone()
            for name, (offset, shape) in self.offsets.items()
        }

    def load_model_state(self, state: dict[str, Tensor]) -> None:
        missing = set(self.offsets) - set(state)
        if missing:
            raise ValueError(f"the model state lacks {sorted(missing)[:3]}")
        flat = torch.cat([state[name].reshape(-1).float() for name in self.offsets])
        self.write_params(flat)

    def optimizer_state(self) -> dict[str, Any] | None:
        """Every rank's share of the inner AdamW state, gathered here, with the layout that made them."""
        return {"layout": self._layout_key(), "ranks": self.workers.call("optimizer_state")}

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        if state.get("layout") != self._layout_key():
            log.warning(
                "the checkpoint's inner AdamW state is of another layout (%s, this node %s): it starts afresh",
                state.get("layout", "a single process"), self._layout_key(),
            )  # fmt: skip
            return
        self.workers.call("load_optimizer_state", None, rank0_payload=state["ranks"])

    def _layout_key(self) -> list[int]:
        layout = self.workers.layout
        return [layout.dp, layout.tp, layout.pp, layout.zero]

    def outer_state(self, *, offload: bool, **settings: Any) -> OuterState | None:
        """DiLoCo's outer state sharded over the local ranks (``node.parallel.outer``), unless
        ``--outer-sharding`` says otherwise (then None: flat on rank 0's host)."""
        if not self.shard_outer:
            return None
        return ShardedOuterState(self.workers, offload=offload, **settings)

    def open_streams(self) -> StreamRunner:
        """The extra all-reduce streams (``--swarm-streams``): stream s on local rank s mod K."""
        if self._streams is None:
            self._streams = LocalStreams(self.workers)
        return self._streams

    def close(self) -> None:
        self.workers.close()  # every rank closes its streams on the way out


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available")
    return torch.device(name)


def build_replica(config: NodeConfig, model_config: ModelConfig, device: torch.device) -> Replica:
    """The node's replica: in this process, or over its local workers (``--local-workers``, ``--dp/--tp/--pp``)."""
    use_device(config.run.device)  # the ranks' device kind (and bf16 autocast's) follows --device
    layout = resolve_layout(config, model_config)
    if layout is not None and config.outer.overlap and config.rounds.streams > 1:
        # The streams travel on the local ranks' command group, which the inner steps hold meanwhile.
        raise ConfigError(
            "--overlap: does not run with --swarm-streams > 1 on a node with local workers "
            "(the streams of a node with local workers run between inner steps, not alongside them)"
        )
    compile_model = resolve_compile(config.parallel.compile, device, local_workers=layout is not None)
    if layout is None:
        return SingleReplica(model_config, config, device, compile=compile_model)
    timeout = timedelta(seconds=config.parallel.local_timeout)
    return ParallelReplica(model_config, config, layout, timeout=timeout)
