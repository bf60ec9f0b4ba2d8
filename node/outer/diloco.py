"""DiLoCo: the outer step that turns H local inner steps into one swarm-wide update.

DiLoCo (Douillard et al., 2023, "DiLoCo: Distributed Low-Communication Training of Language Models")
keeps two copies of the parameters: the *global* params that every peer of the swarm agrees on, and
the model's *local* params that drift during H inner AdamW steps. One outer round:

1. pseudo-gradient  Δ = θ_global − θ_local                (per peer, flat fp32)
2. Δ̄ = weighted mean of Δ over the round's peers          (the swarm's compressed all-reduce, or a
                                                             swarm of one: ``node/outer/round.py``)
3. outer Nesterov SGD on θ_global with gradient Δ̄         (``torch.optim.SGD(nesterov=True)``;
                                                             lr 0.7, momentum 0.9 as in the paper)
4. θ_local ← θ_global                                     (copied back into the model)

The inner optimizer's state is kept across rounds, as in the paper. This class wraps the training
loop rather than replacing it: the loop stays ``zero_grad / backward / step``; the loop calls
:meth:`DiLoCo.outer_step` every H steps.

The outer state (``node.outer.state``) is one flat fp32 vector in the canonical parameter order
(``named_parameters`` order), in this process or sharded over the node's local ranks, so the
pseudo-gradient is one contiguous vector for the all-reduce and ``param_hash`` is a SHA-256 over it:
identical global params on two nodes ⇔ identical hash.
"""

from __future__ import annotations

import copy
import threading

import torch
from torch import nn

from node.outer.state import (
    SGD_SETTINGS,
    FlatOuterState,
    LocalParams,
    OuterState,
    outer_sgd_settings,
    sgd_momentum_and_settings,
    sgd_state_dict,
)


def flatten_params(params: list[nn.Parameter], *, device: torch.device | str) -> torch.Tensor:
    """Concatenate parameters into one fp32 vector on ``device`` (canonical order = list order)."""
    return torch.cat([p.detach().reshape(-1).to(device=device, dtype=torch.float32) for p in params])


class ModuleParams:
    """``LocalParams`` of parameters in this process."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params

    def read_params(self, device: torch.device | str) -> torch.Tensor:
        return flatten_params(self.params, device=device)

    @torch.no_grad()
    def write_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p))
            offset += n
        assert offset == flat.numel()


class DiLoCo:
    """Outer state and outer step of DiLoCo around a model whose loop runs the inner steps.

    ``offload`` keeps the global params and the momentum on CPU (saves 2 x fp32 params of device
    memory at the price of a device<->host copy per round). ``outer`` (a node with local workers: the
    state sharded over its ranks) replaces the flat state of this process built from ``local``; its own
    settings then apply, not ``outer_lr``, ``outer_momentum``, ``nesterov`` and ``offload``.

    DiLoCo knows nothing of the swarm: the outer round (``node/outer/round.py``) takes Δ from here,
    has it averaged, and hands the mean back to :meth:`apply_mean`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        offload: bool = False,
        local: LocalParams | None = None,
        outer: OuterState | None = None,
    ) -> None:
        self.model = model
        self._anchor: torch.Tensor | None = None  # overlap: the local params the current phase started from
        # Overlap: the round in flight applies its outer step on a background thread as soon as its
        # mean arrives; this lock keeps readers of the outer state (hash, checkpoint) from seeing half a step.
        self._lock = threading.RLock()
        self.params = [p for p in model.parameters() if p.requires_grad]
        # Where the local params live: this model, or a replica spread over the node's local workers.
        self.local: LocalParams = local if local is not None else ModuleParams(self.params)
        settings = outer_sgd_settings(outer_lr, outer_momentum, nesterov)
        model_device = self.params[0].device
        if outer is None:
            device = torch.device("cpu") if offload or model_device.type == "meta" else model_device
            outer = FlatOuterState(self.local, device=device, **settings)
        self.outer: OuterState = outer
        self.outer_device = outer.device

    @property
    def num_elements(self) -> int:
        return self.outer.num_elements

    @property
    def global_params(self) -> torch.Tensor:
        """θ_global (N,) fp32 on the outer device: read-only (sharded: a copy gathered from the ranks)."""
        with self._lock:
            return self.outer.params()

    def consistent(self) -> threading.RLock:
        """Hold while reading several parts of the outer state (params and momentum) that must be of
        the same round: the averaging thread applies an overlapped round under this lock."""
        return self._lock

    def param_hash(self) -> str:
        with self._lock:
            return self.outer.hash()

    def pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_global − θ_local, flat fp32 on the outer device."""
        return self.outer.delta()

    @torch.no_grad()
    def outer_step(self, mean: torch.Tensor) -> float:
        """A whole synchronous outer step with the swarm's mean Δ̄ (phases 3-4 of the module
        docstring): outer Nesterov SGD on θ_global, then the model restarts from θ_global. Returns
        ‖Δ̄‖."""
        norm = self.apply_mean(mean)
        self.load_global_into_model()
        return norm

    @torch.no_grad()
    def apply_mean(self, mean: torch.Tensor) -> float:
        """Outer Nesterov SGD on θ_global with gradient Δ̄ = ``mean`` (the model is left as it is);
        returns ‖Δ̄‖. Safe on the averaging thread while the loop trains (overlap)."""
        averaged = mean.to(self.outer_device, torch.float32)
        if averaged.shape != (self.num_elements,):
            raise RuntimeError(f"the mean has shape {tuple(averaged.shape)}, expected ({self.num_elements},)")
        with self._lock:
            self.outer.step(averaged)
        return float(averaged.norm())

    @torch.no_grad()
    def stepped(
        self, averaged: torch.Tensor, *, start: tuple[torch.Tensor, torch.Tensor | None] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The global params and outer momentum one outer step with mean ``averaged`` would give from
        ours (or from ``start`` = (params, momentum)), computed on copies (this node's own state is
        untouched): the same ``torch.optim.SGD`` with the same settings as ``outer_step``, so a
        member's step is reproduced bit for bit."""
        with self._lock:
            settings = self.outer.settings()
            params, momentum = start if start is not None else (self.outer.params(), self.outer.momentum())
            params = params.detach().to(self.outer_device, torch.float32).clone().requires_grad_(True)
            optimizer = torch.optim.SGD([params], **{key: settings[key] for key in SGD_SETTINGS})
            if momentum is not None:
                optimizer.state[params]["momentum_buffer"] = momentum.to(
                    self.outer_device, torch.float32
                ).clone()
        params.grad = averaged.to(self.outer_device, torch.float32)
        optimizer.step()
        buffer = optimizer.state[params].get("momentum_buffer")
        return params.detach(), None if buffer is None else buffer.detach()

    # --- overlapped rounds: the outer update reaches the model one round late ---
    #
    # Streaming DiLoCo (Douillard et al., 2025, arXiv:2501.18512) overlaps a round's communication
    # with the next round's inner steps (the round in flight is ``node/outer/round.py``'s). At the end
    # of phase k this node:
    #   1. takes Δ_k = anchor_k − θ_local, its own progress during phase k (phase_delta);
    #   2. waits for round k−1, averaged during phase k on a background thread, which applied
    #      θ_global ← OuterSGD(θ_global, Δ̄_{k−1}) as soon as Δ̄_{k−1} arrived;
    #   3. restarts the model from θ_global − Δ_k: the newest global params plus its own last phase,
    #      which is not in θ_global yet (restart_from), and hands Δ_k to the swarm.
    # Every node applies the same Δ̄ in the same order, so θ_global stays identical swarm-wide; a
    # node's own progress is counted once, through Δ̄_k when it lands in θ_global. The main thread
    # never touches θ_global during a phase, so the background thread may step it then.

    @torch.no_grad()
    def phase_delta(self) -> torch.Tensor:
        """Δ_k: the local progress since the phase started (overlap); θ_global − θ_local before any round."""
        if self._anchor is None:
            return self.outer.delta()
        return self._anchor - self.local.read_params(self.outer_device)

    @torch.no_grad()
    def restart_from(self, delta: torch.Tensor) -> None:
        """The next phase trains from θ_global − ``delta`` (see above); call before the round that
        averages ``delta`` may step θ_global."""
        start = self.outer.params() - delta
        self.local.write_params(start)
        self._anchor = start

    @torch.no_grad()
    def load_global_into_model(self) -> None:
        self.outer.write_to_model()
        self._anchor = None

    def momentum_buffer(self) -> torch.Tensor | None:
        """The outer Nesterov momentum (flat fp32), None before the first outer step."""
        with self._lock:
            return self.outer.momentum()

    @torch.no_grad()
    def load_global_state(self, global_params: torch.Tensor, momentum: torch.Tensor | None) -> None:
        """Replace the global params and the outer momentum (e.g. with the swarm's), and the model's params."""
        if global_params.shape != (self.num_elements,):
            raise ValueError(f"got {global_params.numel()} global params, the model has {self.num_elements}")
        if momentum is not None and momentum.shape != global_params.shape:
            raise ValueError("the outer momentum does not match the global params")
        with self._lock:
            self.outer.load(global_params.to(self.outer_device, torch.float32), momentum)
        self.load_global_into_model()

    # --- checkpoint state ---
    def state_dict(self) -> dict[str, object]:
        with self._lock:  # copies: the averaging thread may step the outer state right after
            return {
                "global_params": self.outer.params().detach().clone(),
                "outer_optimizer": copy.deepcopy(
                    sgd_state_dict(self.outer.settings(), self.outer.momentum())
                ),
            }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, object]) -> None:
        global_params = state["global_params"]
        assert isinstance(global_params, torch.Tensor)
        if global_params.shape != (self.num_elements,):
            raise ValueError(
                f"checkpoint holds {global_params.numel()} global params, the model has {self.num_elements}"
            )
        outer_state = state["outer_optimizer"]
        assert isinstance(outer_state, dict)
        momentum, settings = sgd_momentum_and_settings(outer_state)
        if momentum is not None and momentum.shape != global_params.shape:
            raise ValueError("the checkpoint's outer momentum does not match its global params")
        with self._lock:
            self.outer.set_settings(settings)
            self.outer.load(global_params.to(self.outer_device, torch.float32), momentum)
