"""The one host copy of the global state per version of θ_global, shared by its three readers.

After an outer round the loop owes three readers the new global state θ_global (and its outer
momentum): the snapshot served to joiners (``OuterRound.snapshot``), the checkpoint
(``node/train/checkpoint_state.py``) and the held-out eval (``node/train/round_end.py``). They share **one**
host copy: ``HostCopies.get`` copies θ_global and the momentum to host memory once per version of
θ_global (pinned and asynchronous from a GPU), under DiLoCo's lock so both are of the same round,
with the param_hash DiLoCo already holds for it. Nobody writes to these tensors: a later round makes
a new copy.

With fragments (``--fragments F``) a round steps one fragment, so the copy is per fragment
(``HostFragments``): a version copies the fragments that changed since the last and shares the others'
tensors with it, and the served state is made of these pieces (``node.swarm.state.state_snapshot``,
whose hashes of an unchanged piece are reused too). The whole vectors, which the checkpoint and the
eval read, are put together from the pieces only when one of them asks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
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
class HostFragments:
    """θ_global and the outer momentum of one round in host memory, one vector per fragment
    (``--fragments``): a fragment's copies are made once per version of that fragment, so a round,
    which steps one fragment, copies only it and shares the others' with the versions before."""

    params: tuple[Tensor, ...]  # (N_f,) fp32, CPU, per fragment
    momentum: tuple[Tensor, ...] | None  # (N_f,) fp32, CPU, per fragment; None without outer momentum
    momentum_sha256: str | None  # SHA-256 of the whole momentum vector (canonical order)


class HostGlobalState:
    """θ_global and the outer momentum of one round in host memory, and the param_hash of those
    params: private copies that nobody writes to (read them, never write them). With fragments the
    copies are per fragment (``fragments``), and the whole vectors (``params``, ``momentum``: the
    checkpoint's and the eval's) are put together from them once, when first asked for."""

    def __init__(
        self,
        *,
        param_hash: str,
        params: Tensor | None = None,
        momentum: Tensor | None = None,
        fragments: HostFragments | None = None,
        assemble: Callable[[Sequence[Tensor]], Tensor] | None = None,
    ) -> None:
        if (params is None) == (fragments is None) or (fragments is not None and assemble is None):
            raise ValueError("a host state holds whole vectors, or fragments and how to put them together")
        self.param_hash = param_hash
        self.fragments = fragments
        self._assemble = assemble
        self._whole: tuple[Tensor, Tensor | None] | None = None if params is None else (params, momentum)
        self._lock = threading.Lock()

    def _whole_state(self) -> tuple[Tensor, Tensor | None]:
        with self._lock:  # the eval's reader and the checkpoint's may ask from two threads
            if self._whole is None:
                assert self.fragments is not None and self._assemble is not None
                momentum = self.fragments.momentum
                self._whole = (
                    self._assemble(self.fragments.params),
                    None if momentum is None else self._assemble(momentum),
                )
            return self._whole

    @property
    def params(self) -> Tensor:
        """θ_global, (N,) fp32, CPU."""
        return self._whole_state()[0]

    @property
    def momentum(self) -> Tensor | None:
        """The outer momentum, (N,) fp32, CPU; None before the first outer step."""
        if self.fragments is not None and self.fragments.momentum is None:
            return None
        return self._whole_state()[1]


class HostCopies:
    """The one host copy of the global state per version of θ_global (see the module docstring); with
    fragments, one copy per version of each fragment."""

    def __init__(self, diloco: DiLoCo) -> None:
        self.diloco = diloco
        self._cached: tuple[tuple[int, ...], HostGlobalState] | None = None
        self._fragments: list[tuple[tuple[int, ...], Tensor, Tensor | None] | None] = []
        self.num_copies = 0  # host copies made (tests count them)
        self.num_fragment_copies = 0  # fragments' host copies made

    def get(self) -> HostGlobalState:
        diloco = self.diloco
        with diloco.consistent():  # params and momentum of the same round (overlap steps them)
            outer = diloco.outer
            key = _version_key(outer)
            if key is not None and self._cached is not None and self._cached[0] == key:
                return self._cached[1]
            if isinstance(outer, FragmentedOuterState):
                state = self._fragmented(outer)
            else:
                params, momentum = outer.params(), outer.momentum()
                # Else params() is a copy gathered from the ranks.
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

    def _fragmented(self, outer: FragmentedOuterState) -> HostGlobalState:
        """Host copies of the fragments changed since the last call; the others' are shared."""
        if len(self._fragments) != outer.num_fragments:
            self._fragments = [None] * outer.num_fragments
        for index in range(outer.num_fragments):
            part = outer.fragment(index)
            key = _version_key(part)
            assert key is not None
            cached = self._fragments[index]
            if cached is None or cached[0] != key:
                live = part.momentum()
                self._fragments[index] = (
                    key,
                    host_copy(part.global_params),
                    None if live is None else host_copy(live),
                )
                self.num_fragment_copies += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies have landed
        copies = [entry for entry in self._fragments if entry is not None]
        params = tuple(piece for _, piece, _ in copies)
        momenta = [buffer for _, _, buffer in copies]
        momentum: tuple[Tensor, ...] | None = None
        if any(m is not None for m in momenta):  # a fragment without momentum yet: zero, as it steps
            momentum = tuple(
                m if m is not None else torch.zeros_like(p) for m, p in zip(momenta, params, strict=True)
            )
        fragments = HostFragments(
            params=params,
            momentum=momentum,
            momentum_sha256=None if momentum is None else outer.assembled_hash(momentum),
        )
        return HostGlobalState(
            param_hash=self.diloco.param_hash(), fragments=fragments, assemble=outer.assemble
        )


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
