"""DiLoCo: the outer step that turns H local inner steps into one swarm-wide update.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language Models")
keeps two copies of the parameters: the *global* params that every peer of the swarm agrees on, and
the model's *local* params that drift during H inner AdamW steps. One outer round:

1. pseudo-gradient  Δ = θ_global − θ_local                (per peer, flat fp32)
2. Δ̄ = weighted mean of Δ over the round's peers          (the :class:`Averager`: the swarm's
                                                             compressed all-reduce, or a swarm of one)
3. outer Nesterov SGD on θ_global with gradient Δ̄         (``torch.optim.SGD(nesterov=True)``;
                                                             lr 0.7, momentum 0.9 as in the paper)
4. θ_local ← θ_global                                     (copied back into the model)

The inner optimizer's state is kept across rounds, as in the paper. This class wraps the training
loop rather than replacing it: the loop stays ``zero_grad / backward / step``; the loop calls
:meth:`DiLoCo.outer_step` every H steps.

The outer state lives in one flat fp32 buffer in the canonical parameter order (``named_parameters``
order), so the pseudo-gradient is one contiguous vector for the all-reduce and ``param_hash`` is a
SHA-256 over it: identical global params on two nodes ⇔ identical hash.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class AveragingOutcome:
    """What the swarm's averaging returned for one round."""

    averaged: torch.Tensor  # (N,) fp32: the weighted mean pseudo-gradient
    num_peers: int  # peers whose contribution is in the mean (1 = only this node)
    bytes_sent: int = 0
    bytes_recv: int = 0
    fell_back: bool = False  # the swarm round failed and this node used its own vector
    failures: tuple[str, ...] = ()  # human-readable reasons, one per failed peer or phase
    adopted: bool = False  # the averager replaced the global state with the swarm's: no outer step


class Averager(Protocol):
    """Averages a flat fp32 pseudo-gradient across the swarm. The daemon supplies the implementation."""

    def average(self, vector: torch.Tensor, *, round_index: int, weight: float) -> AveragingOutcome:
        """Return the weighted mean of ``vector`` over this round's peers (weight = tokens processed)."""
        ...


class SoloAverager:
    """A swarm of one: the mean of one vector is itself."""

    def average(self, vector: torch.Tensor, *, round_index: int, weight: float) -> AveragingOutcome:
        return AveragingOutcome(averaged=vector, num_peers=1)


@dataclass
class OuterStepReport:
    round_index: int
    num_peers: int
    bytes_sent: int
    bytes_recv: int
    seconds_comm: float
    pseudo_gradient_norm: float
    param_hash: str
    fell_back: bool = False
    failures: tuple[str, ...] = field(default_factory=tuple)
    adopted: bool = False  # the global state was replaced by the swarm's instead of stepped


def flatten_params(params: list[nn.Parameter], *, device: torch.device | str) -> torch.Tensor:
    """Concatenate parameters into one fp32 vector on ``device`` (canonical order = list order)."""
    return torch.cat([p.detach().reshape(-1).to(device=device, dtype=torch.float32) for p in params])


def tensor_hash(flat: torch.Tensor) -> str:
    """SHA-256 of an fp32 vector's little-endian bytes."""
    data = flat.detach().to("cpu", torch.float32).contiguous()
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()


class DiLoCo:
    """Outer state and outer step of DiLoCo around a model whose loop runs the inner steps.

    ``offload`` keeps the global params and the momentum on CPU (saves 2 x fp32 params of device
    memory at the price of a device<->host copy per round).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        averager: Averager,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        offload: bool = False,
    ) -> None:
        self.model = model
        self.averager = averager
        self.params = [p for p in model.parameters() if p.requires_grad]
        model_device = self.params[0].device
        self.outer_device = torch.device("cpu") if offload else model_device
        # The global params: leaf fp32 tensor optimized by the outer SGD; its .grad is Δ̄.
        self.global_params = flatten_params(self.params, device=self.outer_device)
        self.outer_optimizer = torch.optim.SGD(
            [self.global_params], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov
        )

    @property
    def num_elements(self) -> int:
        return self.global_params.numel()

    def param_hash(self) -> str:
        return tensor_hash(self.global_params)

    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_global − θ_local, flat fp32 on the outer device."""
        return self.global_params - flatten_params(self.params, device=self.outer_device)

    @torch.no_grad()
    def outer_step(self, *, round_index: int, weight: float) -> OuterStepReport:
        """Average Δ across the swarm, apply outer Nesterov SGD, copy θ_global into the model."""
        # Phase 1: the pseudo-gradient of this node's H inner steps.
        delta = self.pseudo_gradient()
        # Phase 2: the swarm's weighted mean (compressed all-reduce in a swarm; identity alone).
        start = time.perf_counter()
        outcome = self.averager.average(delta, round_index=round_index, weight=weight)
        seconds_comm = time.perf_counter() - start
        if outcome.adopted:  # the averager loaded the swarm's global state (and the model) already
            return OuterStepReport(
                round_index=round_index,
                num_peers=outcome.num_peers,
                bytes_sent=outcome.bytes_sent,
                bytes_recv=outcome.bytes_recv,
                seconds_comm=seconds_comm,
                pseudo_gradient_norm=0.0,
                param_hash=self.param_hash(),
                failures=outcome.failures,
                adopted=True,
            )
        averaged = outcome.averaged.to(self.outer_device, torch.float32)
        if averaged.shape != self.global_params.shape:
            raise RuntimeError(
                f"averager returned shape {tuple(averaged.shape)}, expected {tuple(self.global_params.shape)}"
            )
        # Phase 3: outer Nesterov step on the global params.
        self.global_params.grad = averaged
        self.outer_optimizer.step()
        self.global_params.grad = None
        # Phase 4: the model restarts the next H inner steps from the new global params.
        self.load_global_into_model()
        return OuterStepReport(
            round_index=round_index,
            num_peers=outcome.num_peers,
            bytes_sent=outcome.bytes_sent,
            bytes_recv=outcome.bytes_recv,
            seconds_comm=seconds_comm,
            pseudo_gradient_norm=float(averaged.norm()),
            param_hash=self.param_hash(),
            fell_back=outcome.fell_back,
            failures=outcome.failures,
        )

    @torch.no_grad()
    def load_global_into_model(self) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(self.global_params[offset : offset + n].view_as(p))
            offset += n
        assert offset == self.global_params.numel()

    def momentum_buffer(self) -> torch.Tensor | None:
        """The outer Nesterov momentum (flat fp32), None before the first outer step."""
        state = self.outer_optimizer.state.get(self.global_params, {})
        buffer = state.get("momentum_buffer")
        return buffer if isinstance(buffer, torch.Tensor) else None

    @torch.no_grad()
    def load_global_state(self, global_params: torch.Tensor, momentum: torch.Tensor | None) -> None:
        """Replace the global params and the outer momentum (e.g. with the swarm's), and the model's params."""
        if global_params.shape != self.global_params.shape:
            raise ValueError(f"got {global_params.numel()} global params, the model has {self.num_elements}")
        self.global_params.copy_(global_params)
        state = self.outer_optimizer.state[self.global_params]
        if momentum is None:
            state.pop("momentum_buffer", None)
        else:
            if momentum.shape != self.global_params.shape:
                raise ValueError("the outer momentum does not match the global params")
            state["momentum_buffer"] = momentum.to(self.outer_device, torch.float32).clone()
        self.load_global_into_model()

    # --- checkpoint state ---
    def state_dict(self) -> dict[str, object]:
        return {"global_params": self.global_params, "outer_optimizer": self.outer_optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, object]) -> None:
        global_params = state["global_params"]
        assert isinstance(global_params, torch.Tensor)
        if global_params.shape != self.global_params.shape:
            raise ValueError(
                f"checkpoint holds {global_params.numel()} global params, the model has {self.global_params.numel()}"
            )
        self.global_params.copy_(global_params)
        outer_state = state["outer_optimizer"]
        assert isinstance(outer_state, dict)
        self.outer_optimizer.load_state_dict(outer_state)
