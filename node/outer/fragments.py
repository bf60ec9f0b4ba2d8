"""Streamed fragments: the parameters split into F fragments, each with its own outer round.

Streaming DiLoCo (Douillard et al. 2025, arXiv:2501.18512) synchronises the model a fragment at a
time instead of all at once: fragment f's outer round comes every H inner steps, at offset
``o_f = ⌊f·H/F⌋``, so the link carries 1/F of the pseudo-gradient F times per H steps instead of all of
it once (the peak bandwidth drops by F). Each fragment is a DiLoCo of its own: its own θ_global, outer
momentum, pseudo-gradient and error feedback. A fragment's round may overlap the next τ inner steps
(``overlap_steps``); when its mean lands, the fragment's global params take the outer step and the
model's copy of the fragment is *mixed* with them::

    θ_global,f ← OuterSGD(θ_global,f, Δ̄_f)                 (Δ_f = θ_global,f − θ_local,f at the round)
    θ_local,f  ← α·θ_local,f + (1 − α)·θ_global,f          (α = ``mix``; the paper's best: 0.5,
                                                             ours 0: BENCHMARKS.md, issue 32)

With F = 1, τ = 0 and α = 0 this is plain DiLoCo, bit for bit (``tests/node/outer/test_fragments.py``).

Which parameters form a fragment (:func:`fragment_plan`), so each fragment spans the model's depth:

- a *block* is the parameters whose names share the prefix up to their first integer component
  (``layers.3.``, ``model.layers.3.``, ``transformer.h.3.``): a transformer's repeated layers; block b
  (in order of first appearance) joins fragment ``b mod F`` (strided, as in the paper);
- parameters in no block (embeddings, final norm, head) join an adjacent block's fragment: those
  before the first block go with the first block, those after it with the last block, so with F ≥ 2
  the embeddings and the head sit in different fragments;
- a model with no integer component in any name is treated as one block per parameter;
- F may not exceed the number of blocks (a fragment would be empty).

This module knows nothing of the swarm: whoever averages Δ_f (the swarm's all-reduce, or the
convergence benchmark's simulated one) calls :meth:`FragmentedDiLoCo.pseudo_gradient` and
:meth:`FragmentedDiLoCo.land`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from node.outer.diloco import DiLoCo, ModuleParams


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameters each fragment holds: indices into the model's trainable parameters (in
    ``model.parameters()`` order, the canonical order), ascending within a fragment."""

    fragments: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]  # every trainable parameter's name, canonical order

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def describe(self) -> str:
        """One line per fragment: its blocks' names, shortened."""
        lines = []
        for index, members in enumerate(self.fragments):
            blocks = sorted({_block_of(self.names[i]) or self.names[i] for i in members}, key=str)
            lines.append(f"fragment {index}: {', '.join(blocks)}")
        return "\n".join(lines)


def _block_of(name: str) -> str | None:
    """The block a parameter belongs to: its name up to and including the first integer component."""
    parts = name.split(".")
    for position, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: position + 1])
    return None


def fragment_plan(names: list[str], num_fragments: int) -> FragmentPlan:
    """Split parameters (their names, canonical order) into ``num_fragments`` fragments by the module
    docstring's rule."""
    if num_fragments < 1:
        raise ValueError(f"the number of fragments must be >= 1, got {num_fragments}")
    blocks = [_block_of(name) for name in names]
    if all(block is None for block in blocks):  # no repeated layers: each parameter is a block
        blocks = [str(i) for i in range(len(names))]
    order: list[str] = []
    for block in blocks:
        if block is not None and block not in order:
            order.append(block)
    if num_fragments > len(order):
        raise ValueError(
            f"{num_fragments} fragments but the model has {len(order)} blocks: at most {len(order)}"
        )
    fragment_of_block = {block: index % num_fragments for index, block in enumerate(order)}
    first_block = next(i for i, block in enumerate(blocks) if block is not None)
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    for index, block in enumerate(blocks):
        if block is None:  # before the first block: with it; after it: with the last block
            block = order[0] if index < first_block else order[-1]
        members[fragment_of_block[block]].append(index)
    return FragmentPlan(fragments=tuple(tuple(m) for m in members), names=tuple(names))


def fragment_offset(fragment: int, *, inner_steps: int, num_fragments: int) -> int:
    """``o_f``: fragment f's rounds come after inner steps s with s ≡ o_f (mod H)."""
    return fragment * inner_steps // num_fragments


def due_fragments(step: int, *, inner_steps: int, num_fragments: int) -> list[int]:
    """The fragments whose round is due after inner step ``step`` (1-based, counted from the run's start)."""
    return [
        f
        for f in range(num_fragments)
        if step > 0
        and (step - fragment_offset(f, inner_steps=inner_steps, num_fragments=num_fragments)) % inner_steps
        == 0
    ]


class FragmentedDiLoCo:
    """One DiLoCo per fragment over the same model (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        plan: FragmentPlan,
        *,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if len(params) != len(plan.names):
            raise ValueError(f"the plan covers {len(plan.names)} parameters, the model has {len(params)}")
        self.plan = plan
        self.params = params
        self.fragments = [
            DiLoCo(
                model,
                outer_lr=outer_lr,
                outer_momentum=outer_momentum,
                nesterov=nesterov,
                local=ModuleParams([params[i] for i in members]),
            )
            for members in plan.fragments
        ]

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def num_elements(self, fragment: int) -> int:
        return self.fragments[fragment].num_elements

    def pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """Δ_f = θ_global,f − θ_local,f (flat fp32, the fragment's parameters in canonical order)."""
        return self.fragments[fragment].pseudo_gradient()

    @torch.no_grad()
    def land(self, fragment: int, mean: torch.Tensor, *, mix: float) -> float:
        """Fragment ``fragment``'s round landed with mean ``mean``: the outer step on its global params,
        then its local params mixed with them (``mix`` = α, the share of the local params kept).
        Returns ‖Δ̄_f‖."""
        if not 0.0 <= mix < 1.0:
            raise ValueError(f"mix must be in [0, 1), got {mix}")
        diloco = self.fragments[fragment]
        norm = diloco.apply_mean(mean)
        if mix == 0.0:
            diloco.load_global_into_model()  # θ_local ← θ_global exactly (plain DiLoCo)
        else:
            local = diloco.local.read_params(diloco.outer_device)
            diloco.local.write_params(torch.lerp(diloco.global_params, local, mix))
        return norm

    def global_params(self) -> torch.Tensor:
        """θ_global of the whole model, flat fp32 in canonical order (the fragments' put back in place)."""
        sizes = [p.numel() for p in self.params]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        flat = torch.empty(starts[-1], dtype=torch.float32)
        for members, diloco in zip(self.plan.fragments, self.fragments, strict=True):
            fragment = diloco.global_params.to("cpu")
            offset = 0
            for i in members:
                flat[starts[i] : starts[i + 1]] = fragment[offset : offset + sizes[i]]
                offset += sizes[i]
        return flat

    def param_hash(self) -> str:
        """SHA-256 over the fragments' hashes in order: equal on two nodes iff every fragment's global
        params are."""
        digest = hashlib.sha256()
        for diloco in self.fragments:
            digest.update(bytes.fromhex(diloco.param_hash()))
        return digest.hexdigest()
