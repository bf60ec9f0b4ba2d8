"""Where DiLoCo's outer state lives: the global params θ_global and the outer Nesterov momentum.

:class:`OuterState` is what ``node.outer.diloco.DiLoCo`` asks of it; two implementations:

- :class:`FlatOuterState`: both as one flat fp32 vector each in this process (on the model's device, or
  on the CPU with ``offload``), stepped by ``torch.optim.SGD``. A single-process node's.
- ``node.parallel.outer.ShardedOuterState``: a node with local workers, where each local rank holds
  its contiguous 1/K of both and steps it (``torch.optim.SGD`` too, so a shard steps bit for bit as
  that range of the flat vector would).

Either way the vectors are in the canonical parameter order (``named_parameters``), and a checkpoint
holds them in the same format (``DiLoCo.state_dict``: the momentum and settings as
``torch.optim.SGD.state_dict()`` of one flat parameter), so a node may resume with another layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import Tensor

SGD_SETTINGS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")


def outer_sgd_settings(lr: float, momentum: float, nesterov: bool) -> dict[str, Any]:
    """The outer ``torch.optim.SGD``'s settings; momentum 0 is plain SGD whatever ``nesterov`` says
    (torch refuses Nesterov without momentum)."""
    return {"lr": lr, "momentum": momentum, "nesterov": nesterov and momentum > 0}


def tensor_hash(flat: Tensor) -> str:
    """SHA-256 of an fp32 vector's little-endian bytes."""
    return pieces_hash([flat])


def pieces_hash(pieces: Iterable[Tensor]) -> str:
    """``tensor_hash`` of the pieces put end to end, without putting them together: SHA-256 fed each
    piece's fp32 bytes in place (a CPU fp32 piece is not copied; another is copied one piece at a time),
    so hashing a whole model in fragments holds no second copy of it."""
    digest = hashlib.sha256()
    for piece in pieces:
        data = piece.detach().to("cpu", torch.float32).contiguous()
        digest.update(data.view(torch.uint8).numpy().data)
    return digest.hexdigest()


class LocalParams(Protocol):
    """The node's local params as one flat fp32 vector in the model's parameter order."""

    def read_params(self, device: torch.device | str) -> Tensor: ...
    def write_params(self, flat: Tensor) -> None: ...


class OuterState(Protocol):
    """θ_global and the outer momentum of a node, and the outer step on them."""

    device: torch.device  # where the vectors this state takes and returns live (Δ, Δ̄, copies)
    num_elements: int

    def params(self) -> Tensor:
        """θ_global (N,) fp32; the live vector (flat: never write to it) or a gathered copy (sharded)."""
        ...

    def momentum(self) -> Tensor | None:
        """The outer momentum (N,) fp32, None before the first outer step."""
        ...

    def settings(self) -> dict[str, Any]:
        """The outer SGD's settings (``SGD_SETTINGS``)."""
        ...

    def delta(self) -> Tensor:
        """Δ = θ_global − θ_local (N,), the pseudo-gradient of the inner steps since the last load."""
        ...

    def step(self, averaged: Tensor) -> None:
        """One outer SGD step with gradient ``averaged`` (N,)."""
        ...

    def write_to_model(self) -> None:
        """θ_local ← θ_global."""
        ...

    def load(self, params: Tensor, momentum: Tensor | None) -> None:
        """Replace θ_global and the momentum (the model's params are not touched)."""
        ...

    def set_settings(self, settings: dict[str, Any]) -> None:
        """Replace the outer SGD's settings (``SGD_SETTINGS``; a checkpoint's)."""
        ...

    def hash(self) -> str:
        """``tensor_hash`` of θ_global."""
        ...


class FlatOuterState:
    """The outer state in this process: a flat fp32 leaf tensor optimized by ``torch.optim.SGD``."""

    def __init__(self, local: LocalParams, *, device: torch.device, **settings: Any) -> None:
        self.local = local
        self.device = device
        self.global_params = local.read_params(device)  # its .grad is Δ̄ during a step
        self.num_elements = self.global_params.numel()
        self.optimizer = torch.optim.SGD([self.global_params], **settings)
        # The swarm asks for the hash several times a round (lineage, the round's previous state, the
        # report): hashed once per version of the tensor (every in-place write bumps ``_version``).
        self._hash: tuple[int, str] | None = None

    def params(self) -> Tensor:
        return self.global_params

    def momentum(self) -> Tensor | None:
        buffer = self.optimizer.state.get(self.global_params, {}).get("momentum_buffer")
        return buffer if isinstance(buffer, Tensor) else None

    def settings(self) -> dict[str, Any]:
        group = self.optimizer.param_groups[0]
        return {key: group[key] for key in SGD_SETTINGS}

    def delta(self) -> Tensor:
        return self.global_params - self.local.read_params(self.device)

    @torch.no_grad()
    def step(self, averaged: Tensor) -> None:
        self.global_params.grad = averaged
        self.optimizer.step()
        self.global_params.grad = None

    def write_to_model(self) -> None:
        self.local.write_params(self.global_params)

    @torch.no_grad()
    def load(self, params: Tensor, momentum: Tensor | None) -> None:
        self.global_params.copy_(params)
        state = self.optimizer.state[self.global_params]
        if momentum is None:
            state.pop("momentum_buffer", None)
        else:
            state["momentum_buffer"] = momentum.to(self.device, torch.float32).clone()

    def set_settings(self, settings: dict[str, Any]) -> None:
        self.optimizer.param_groups[0].update(settings)

    def hash(self) -> str:
        version = self.global_params._version
        if self._hash is None or self._hash[0] != version:
            self._hash = (version, tensor_hash(self.global_params))
        return self._hash[1]


def sgd_state_dict(settings: dict[str, Any], momentum: Tensor | None) -> dict[str, Any]:
    """What ``torch.optim.SGD(settings).state_dict()`` of one flat parameter with this momentum holds."""
    state = torch.optim.SGD([torch.empty(0, requires_grad=True)], **settings).state_dict()
    if momentum is not None:
        state["state"] = {0: {"momentum_buffer": momentum}}
    return state


def sgd_momentum_and_settings(state: dict[str, Any]) -> tuple[Tensor | None, dict[str, Any]]:
    """The momentum (None if not there yet) and settings in a ``torch.optim.SGD`` state dict of one parameter."""
    groups = state.get("param_groups")
    if not isinstance(groups, list) or len(groups) != 1:
        raise ValueError("the outer optimizer state is not that of one flat parameter")
    momentum = state.get("state", {}).get(0, {}).get("momentum_buffer")
    return momentum, {key: groups[0][key] for key in SGD_SETTINGS}
