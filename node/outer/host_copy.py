"""The one host copy of the global state per version of θ_global, shared by its three readers.

After an outer round the loop owes three readers the new global state θ_global (and its outer
momentum): the snapshot served to joiners (``OuterRound.snapshot``), the checkpoint
(``node/train/checkpoint_state.py``) and the held-out eval (``node/train/round_end.py``). They share **one**
host copy: ``HostCopies.get`` copies θ_global and the momentum to host memory once per version of
θ_global (pinned and asynchronous from a GPU), under DiLoCo's lock so both are of the same round,
with the param_hash DiLoCo already holds for it. Nobody writes to these tensors: a later round makes
a new copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from node.outer.fragments import FragmentedOuterState
from node.outer.state import FlatOuterState, OuterState, sgd_state_dict
from node.train.checkpoint_writer import host_copy

if TYPE_CHECKING:
    from node.outer.diloco import DiLoCo


@dataclass(frozen=True)
class HostGlobalState:
    """θ_global and the outer momentum of one round in host memory, and the param_hash of those
    params: private copies that nobody writes to (read them, never write them)."""

    params: Tensor  # (N,) fp32, CPU
    momentum: Tensor | None  # (N,) fp32, CPU; None before the first outer step
    param_hash: str


class HostCopies:
    """The one host copy of the global state per version of θ_global (see the module docstring)."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco
        self._cached: tuple[tuple[int, ...], HostGlobalState] | None = None
        self.num_copies = 0  # host copies made (tests count them)

    def get(self) -> HostGlobalState:
        diloco = self.diloco
        with diloco.consistent():  # params and momentum of the same round (overlap steps them)
            outer = diloco.outer
            key = _version_key(outer)
            if key is not None and self._cached is not None and self._cached[0] == key:
                return self._cached[1]
            params, momentum = outer.params(), outer.momentum()
            # Else params() is a copy gathered from the ranks, or put together from the fragments.
            flat = isinstance(outer, FlatOuterState)
            tensors = [params] if momentum is None else [params, momentum]
            copies = [host_copy(t) if flat or t.device.type != "cpu" else t.detach() for t in tensors]
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
            state = HostGlobalState(
                params=copies[0],
                momentum=copies[1] if momentum is not None else None,
                param_hash=diloco.param_hash(),  # once per version (FlatOuterState caches it)
            )
            self.num_copies += 1
            self._cached = (key, state) if key is not None else None
            return state


def _version_key(outer: OuterState) -> tuple[int, ...] | None:
    """What changes whenever θ_global or the outer momentum does, for the states read in this process
    (one flat vector, or its fragments); None for a state gathered from local ranks (copied each time)."""
    if isinstance(outer, FragmentedOuterState):
        return outer.version()
    if isinstance(outer, FlatOuterState):
        momentum = outer.momentum()
        return (outer.global_params._version, id(momentum), -1 if momentum is None else momentum._version)
    return None


def outer_checkpoint_state(diloco: DiLoCo, host: HostGlobalState) -> dict[str, Any]:
    """``DiLoCo.state_dict()`` made of ``host``'s tensors instead of fresh copies of the live ones."""
    return {
        "global_params": host.params,
        "outer_optimizer": sgd_state_dict(diloco.outer.settings(), host.momentum),
    }


def model_state_as_views(
    model_state: dict[str, Tensor], params: Sequence[nn.Parameter], flat: Tensor
) -> dict[str, Tensor]:
    """``model_state`` (a module's ``state_dict``) with each of ``params`` (the module's trainable
    parameters in canonical order, which ``flat`` holds) replaced by its view of ``flat``: for a
    model that holds exactly those values, so its checkpoint needs no copy of its own."""
    views: dict[int, Tensor] = {}
    offset = 0
    for param in params:
        views[param.data_ptr()] = flat[offset : offset + param.numel()].view(param.shape)
        offset += param.numel()
    assert offset == flat.numel(), "the flat params do not fit the model"
    return {name: views.get(tensor.data_ptr(), tensor) for name, tensor in model_state.items()}
