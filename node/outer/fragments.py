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

Which parameters form a fragment (:func:`fragment_plan`), so each fragment spans the model's depth and
holds about 1/F of its numbers (a fragment round's bytes, and so a node's peak bandwidth and a round's
extra memory, follow the largest fragment):

- a *block* is the parameters whose names share the prefix up to their first integer component
  (``layers.3.``, ``model.layers.3.``, ``transformer.h.3.``): a transformer's repeated layers, numbered
  in order of first appearance; a model with no integer component in any name has one block per
  parameter;
- the first ⌊B/F⌋·F of the B blocks are strided whole: block b joins fragment ``b mod F`` (as in the
  paper), so they fill the F fragments evenly;
- every other parameter (those of the last B mod F blocks, and those in no block: embeddings, final
  norm, head) is placed one at a time, largest first (ties: the earlier in canonical order), in the
  fragment holding the fewest numbers so far (ties: the lowest index): the longest-processing-time
  greedy rule (Graham 1969): with blocks of equal size no fragment exceeds 1/F of the model by more
  than the largest parameter placed this way. On the presets: tiny (6 blocks) over F = 4 gives
  2,705,280 / 2,704,896 / 2,705,664 / 2,705,664 numbers (the largest 0.2500 of the model; the
  rule before, the embeddings with the first block's fragment and the final norm and head with the
  last's, gave 0.336), nano (4 blocks) 246,528 / 246,528 / 213,376 / 213,248 (0.2681, as before
  within 128 numbers: its embeddings and head are one whole parameter each);
- F may be any count from 1 to the number of parameters (a fragment is never empty: with F > B
  every parameter is placed by the greedy rule, and an empty fragment is the lightest); F = 1 is
  the whole model in canonical order.

The state (:class:`FragmentedOuterState`) is an ``OuterState`` whose whole-model view is the
fragments' vectors in canonical order: a checkpoint, a served snapshot and the param_hash read as an
unfragmented node's. This module knows nothing of the swarm: the daemon's ``OuterRound`` drives the
state through the swarm's rounds on a :class:`FragmentSchedule` (``node/outer/round.py``), the
convergence benchmark drives :class:`FragmentedDiLoCo` with a simulated all-reduce.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from node.config import ConfigError, NodeConfig
from node.outer.diloco import DiLoCo, ModuleParams
from node.outer.state import FlatOuterState, outer_sgd_settings, pieces_hash


@dataclass(frozen=True)
class FragmentPlan:
    """Which parameters each fragment holds: indices into the model's trainable parameters (in
    ``model.parameters()`` order, the canonical order), ascending within a fragment."""

    fragments: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]  # every trainable parameter's name, canonical order
    sizes: tuple[int, ...]  # every trainable parameter's number of elements, canonical order

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    def fragment_sizes(self) -> tuple[int, ...]:
        """Each fragment's number of elements (its round's vector length)."""
        return tuple(sum(self.sizes[i] for i in members) for members in self.fragments)

    def digest(self) -> str:
        """A short digest of which parameters each fragment holds: part of a run's identity, so nodes
        that split the model otherwise (another F, or another version's rule) never share a round or a
        state, whose fragment vectors and served pieces would not line up."""
        text = ";".join(",".join(str(i) for i in members) for members in self.fragments)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        """One line per fragment: its numbers and its blocks' names, a block split between fragments
        named by its parameters here."""
        blocks = _blocks(list(self.names))
        lines = []
        for index, members in enumerate(self.fragments):
            held = set(members)
            parts: list[str] = []
            for i in members:
                block = blocks[i]
                whole = block is not None and all(j in held for j, b in enumerate(blocks) if b == block)
                part = block if whole and block is not None else self.names[i]
                if part not in parts:
                    parts.append(part)
            numbers = sum(self.sizes[i] for i in members)
            lines.append(f"fragment {index} ({numbers:,} numbers): {', '.join(parts)}")
        return "\n".join(lines)


def _block_of(name: str) -> str | None:
    """The block a parameter belongs to: its name up to and including the first integer component."""
    parts = name.split(".")
    for position, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: position + 1])
    return None


def _blocks(names: list[str]) -> list[str | None]:
    """Each parameter's block (None: in no block); one block per parameter when no name has one."""
    blocks = [_block_of(name) for name in names]
    if all(block is None for block in blocks):  # no repeated layers: each parameter is a block
        return [str(i) for i in range(len(names))]
    return blocks


def fragment_plan(names: Sequence[str], sizes: Sequence[int], num_fragments: int) -> FragmentPlan:
    """Split parameters (their names and numbers of elements, canonical order) into ``num_fragments``
    fragments by the module docstring's rule."""
    if len(names) != len(sizes):
        raise ValueError(f"{len(names)} names but {len(sizes)} sizes")
    if num_fragments < 1:
        raise ValueError(f"the number of fragments must be >= 1, got {num_fragments}")
    if num_fragments > len(names):
        raise ValueError(
            f"{num_fragments} fragments but the model has {len(names)} parameters: at most {len(names)}"
        )
    blocks = _blocks(list(names))
    order = list(dict.fromkeys(block for block in blocks if block is not None))  # first appearance
    # Phase 1: the blocks that fill the fragments evenly, strided whole.
    num_strided = len(order) // num_fragments * num_fragments
    fragment_of_block = {block: index % num_fragments for index, block in enumerate(order[:num_strided])}
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    numbers = [0] * num_fragments
    rest = []
    for index, block in enumerate(blocks):
        if block in fragment_of_block:
            fragment = fragment_of_block[block]
            members[fragment].append(index)
            numbers[fragment] += sizes[index]
        else:
            rest.append(index)
    # Phase 2: the rest, largest first, each into the lightest fragment (ties: the lowest index).
    for index in sorted(rest, key=lambda i: (-sizes[i], i)):
        fragment = min(range(num_fragments), key=lambda f: (numbers[f], f))
        members[fragment].append(index)
        numbers[fragment] += sizes[index]
    return FragmentPlan(
        fragments=tuple(tuple(sorted(m)) for m in members), names=tuple(names), sizes=tuple(sizes)
    )


def model_fragment_plan(model: nn.Module, num_fragments: int) -> FragmentPlan:
    """:func:`fragment_plan` of ``model``'s trainable parameters (``model.parameters()`` order)."""
    trainable = [(name, p.numel()) for name, p in model.named_parameters() if p.requires_grad]
    return fragment_plan([name for name, _ in trainable], [size for _, size in trainable], num_fragments)


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


def fragment_of_round(round_index: int, num_fragments: int) -> int:
    """The fragment that round ``round_index`` (1-based, counted over the run) synchronises: a function
    of the round's index alone (:class:`FragmentSchedule`), so a node that missed rounds knows which
    fragment each one stepped."""
    return round_index % num_fragments


@dataclass(frozen=True, kw_only=True)
class FragmentSchedule:
    """When the daemon's fragment rounds come, as one sequence of swarm rounds.

    With H ≥ F the offsets ``o_f`` are distinct, so at most one fragment is due after any step and
    the fragments' rounds form one sequence: round r (1-based, counted over the run) is fragment
    ``r mod F``'s, after inner step ``s_r = ⌊r/F⌋·H + o_{r mod F}`` (fragment 1 first, at ⌊H/F⌋; fragment
    0 at H). A round overlaps the next τ = ``overlap_steps`` inner steps and lands (its mean applied,
    the fragment mixed) after step ``s_r + τ``; τ ≤ ⌊H/F⌋, the shortest gap between two rounds, so a
    round lands before (or as) the next one goes: at most one round is in flight, and every node
    applies the rounds in the same order (ARCHITECTURE.md, "Streamed fragments")."""

    inner_steps: int  # H
    num_fragments: int  # F
    overlap_steps: int = 0  # τ

    def __post_init__(self) -> None:
        if self.num_fragments < 1:
            raise ValueError(f"the number of fragments must be >= 1, got {self.num_fragments}")
        if self.inner_steps < self.num_fragments:
            raise ValueError(
                f"{self.num_fragments} fragments need at least as many inner steps per round (H = {self.inner_steps}): "
                "each fragment's round comes at its own step"
            )
        gap = self.inner_steps // self.num_fragments
        if not 0 <= self.overlap_steps <= gap:
            raise ValueError(
                f"the overlap must be in [0, H/F] = [0, {gap}] steps (a round lands before the next fragment's), "
                f"got {self.overlap_steps}"
            )

    def offset(self, fragment: int) -> int:
        return fragment_offset(fragment, inner_steps=self.inner_steps, num_fragments=self.num_fragments)

    def fragment_of_round(self, round_index: int) -> int:
        """The fragment round ``round_index`` (1-based) synchronises."""
        return fragment_of_round(round_index, self.num_fragments)

    def round_step(self, round_index: int) -> int:
        """``s_r``: the inner step after which round ``round_index`` (1-based) is due."""
        cycles, fragment = divmod(round_index, self.num_fragments)
        return cycles * self.inner_steps + self.offset(fragment)

    def is_due(self, step: int) -> bool:
        return bool(due_fragments(step, inner_steps=self.inner_steps, num_fragments=self.num_fragments))

    def previous_round_step(self, step: int) -> int:
        """The last step ≤ ``step`` after which a round is due (0: none yet)."""
        while step > 0 and not self.is_due(step):
            step -= 1
        return step

    def next_round_step(self, step: int) -> int:
        """The first step > ``step`` after which a round is due."""
        step += 1
        while not self.is_due(step):
            step += 1
        return step


def fragment_schedule(config: NodeConfig) -> FragmentSchedule | None:
    """The daemon's fragment schedule (None: whole-model rounds, ``--fragments 1``); ConfigError, naming
    the flags, for settings fragments cannot run with."""
    outer = config.outer
    if outer.fragments == 1:
        return None
    if config.rounds.seconds:
        raise ConfigError("--fragments runs each fragment's round at its own step: drop --round-seconds")
    if config.rounds.streams > 1:
        raise ConfigError("--fragments sends each fragment on one stream: drop --swarm-streams")
    try:
        return FragmentSchedule(
            inner_steps=config.inner.steps, num_fragments=outer.fragments, overlap_steps=outer.overlap_steps
        )
    except ValueError as error:
        raise ConfigError(f"--fragments {outer.fragments}, --inner-steps {config.inner.steps}, "
                          f"--overlap-steps {outer.overlap_steps}: {error}") from None  # fmt: skip


class FragmentedOuterState:
    """DiLoCo's outer state (``node.outer.state.OuterState``) as F fragments, each its own flat state:
    its θ_global,f, its outer momentum and its SGD step, over its own parameters of the model.

    The whole model's view (``params``, ``momentum``, ``hash``, ``load``) is the fragments' vectors put
    back in the canonical parameter order, so a whole state (a checkpoint, a served snapshot, the
    param_hash) reads exactly as an unfragmented node's: the same SHA-256 over the same flat vector.
    With F > 1 every fragment's momentum starts at zero instead of absent (one SGD step from a zero
    buffer is the step from none), so a whole momentum vector always says every fragment's, and a
    state loaded from it steps on bit for bit."""

    def __init__(
        self, params: list[nn.Parameter], plan: FragmentPlan, *, device: torch.device, **settings: Any
    ) -> None:
        if len(params) != len(plan.names):
            raise ValueError(f"the plan covers {len(plan.names)} parameters, the model has {len(params)}")
        self.plan = plan
        self.device = device
        self.parts = [
            FlatOuterState(ModuleParams([params[i] for i in members]), device=device, **settings)
            for members in plan.fragments
        ]
        # Per parameter in canonical order: (fragment, its start in the fragment, its start in the
        # whole vector, its numbers).
        fragment_of = {i: f for f, members in enumerate(plan.fragments) for i in members}
        starts_in_fragment = [0] * len(self.parts)
        self._layout: list[tuple[int, int, int, int]] = []
        whole = 0
        for index, param in enumerate(params):
            fragment, size = fragment_of[index], param.numel()
            self._layout.append((fragment, starts_in_fragment[fragment], whole, size))
            starts_in_fragment[fragment] += size
            whole += size
        self.num_elements = whole
        if len(self.parts) > 1 and settings.get("momentum", 0) > 0:
            for part in self.parts:
                part.optimizer.state[part.global_params]["momentum_buffer"] = torch.zeros_like(
                    part.global_params
                )
        self._hash: tuple[tuple[int, ...], str] | None = None

    @property
    def num_fragments(self) -> int:
        return len(self.parts)

    def fragment(self, fragment: int) -> FlatOuterState:
        """Fragment ``fragment``'s own outer state (its Δ, its step, its hash)."""
        return self.parts[fragment]

    def fragment_sizes(self) -> tuple[int, ...]:
        return tuple(part.num_elements for part in self.parts)

    @torch.no_grad()
    def stepped(
        self, fragment: int, averaged: Tensor, start: tuple[Tensor, Tensor | None]
    ) -> tuple[Tensor, Tensor | None]:
        """The whole model's global params and outer momentum that fragment ``fragment``'s outer step
        with its round's mean ``averaged`` gives from ``start`` = (params, momentum), on copies (this
        node's own state is untouched): the fragment's vector is taken out of the whole, stepped by the
        same ``torch.optim.SGD`` as the fragment's own (``FlatOuterState.step``: the same vector in the
        same order) and put back, so a member's fragment step is reproduced bit for bit; the other
        fragments' numbers are left as they are. Catching up with served fragment means uses it."""
        part = self.parts[fragment]
        if averaged.shape != (part.num_elements,):
            raise ValueError(
                f"fragment {fragment}'s mean has {averaged.numel()} numbers, it holds {part.num_elements}"
            )
        params, momentum = start
        if params.shape != (self.num_elements,):
            raise ValueError(f"got {params.numel()} numbers, the fragments hold {self.num_elements}")
        params = params.detach().to(self.device, torch.float32).clone()
        if momentum is not None:
            momentum = momentum.detach().to(self.device, torch.float32).clone()
        leaf = self._piece(params, fragment).requires_grad_(True)
        optimizer = torch.optim.SGD([leaf], **part.settings())
        if momentum is not None:
            optimizer.state[leaf]["momentum_buffer"] = self._piece(momentum, fragment)
        leaf.grad = averaged.to(self.device, torch.float32)
        optimizer.step()
        self._put(params, fragment, leaf.detach())
        buffer = optimizer.state[leaf].get("momentum_buffer")
        if buffer is not None:
            if momentum is None:  # (the other fragments' momentum: zero, as a member's starts)
                momentum = torch.zeros_like(params)
            self._put(momentum, fragment, buffer)
        return params, momentum

    def _piece(self, whole: Tensor, fragment: int) -> Tensor:
        """Fragment ``fragment``'s vector (a copy) out of a whole-model vector."""
        return torch.cat([whole[start : start + size] for f, _, start, size in self._layout if f == fragment])

    def _put(self, whole: Tensor, fragment: int, piece: Tensor) -> None:
        """Write fragment ``fragment``'s vector ``piece`` into its places in the whole-model vector."""
        for f, at, start, size in self._layout:
            if f == fragment:
                whole[start : start + size] = piece[at : at + size]

    @torch.no_grad()
    def mix(self, fragment: int, mix: float) -> None:
        """After fragment ``fragment``'s round landed: θ_local,f ← α·θ_local,f + (1 − α)·θ_global,f
        (α = ``mix``; 0: θ_local,f ← θ_global,f exactly)."""
        if not 0.0 <= mix < 1.0:
            raise ValueError(f"mix must be in [0, 1), got {mix}")
        part = self.parts[fragment]
        if mix == 0.0:
            part.write_to_model()
        else:
            local = part.local.read_params(self.device)
            part.local.write_params(torch.lerp(part.global_params, local, mix))

    # --- the whole model's view (OuterState) ---

    def _whole(self, pieces: Sequence[Tensor]) -> Tensor:
        return torch.cat([pieces[f][a : a + n] for f, a, _, n in self._layout])

    def assemble(self, pieces: Sequence[Tensor]) -> Tensor:
        """The whole-model vector (canonical order) of one vector per fragment (a state served in
        fragments, ``node.swarm.state.state_snapshot``); ValueError if they are not the fragments' sizes."""
        sizes = tuple(piece.numel() for piece in pieces)
        if sizes != self.fragment_sizes():
            raise ValueError(f"got pieces of {sizes} numbers, the fragments hold {self.fragment_sizes()}")
        return self._whole(pieces)

    def assembled_hash(self, pieces: Sequence[Tensor]) -> str:
        """``tensor_hash(self.assemble(pieces))`` without putting the whole vector together."""
        return pieces_hash(pieces[f][a : a + n] for f, a, _, n in self._layout)

    def _pieces(self, whole: Tensor) -> list[Tensor]:
        if whole.shape != (self.num_elements,):
            raise ValueError(f"got {whole.numel()} numbers, the fragments hold {self.num_elements}")
        by_fragment: list[list[Tensor]] = [[] for _ in self.parts]
        for fragment, _, start, size in self._layout:
            by_fragment[fragment].append(whole[start : start + size])
        return [torch.cat(pieces) for pieces in by_fragment]

    def params(self) -> Tensor:
        """θ_global of the whole model (a copy put together from the fragments)."""
        return self._whole([part.global_params for part in self.parts])

    def momentum(self) -> Tensor | None:
        momenta = [part.momentum() for part in self.parts]
        if all(m is None for m in momenta):
            return None
        return self._whole(
            [
                m if m is not None else torch.zeros_like(p.global_params)
                for m, p in zip(momenta, self.parts, strict=True)
            ]
        )

    def settings(self) -> dict[str, Any]:
        return self.parts[0].settings()

    def delta(self) -> Tensor:
        return self._whole([part.delta() for part in self.parts])

    def step(self, averaged: Tensor) -> None:
        """Every fragment's outer step at once (a whole-model mean)."""
        for part, piece in zip(self.parts, self._pieces(averaged), strict=True):
            part.step(piece)

    def write_to_model(self) -> None:
        for part in self.parts:
            part.write_to_model()

    def load(self, params: Tensor, momentum: Tensor | None) -> None:
        momenta = self._pieces(momentum) if momentum is not None else [None] * len(self.parts)
        for part, piece, buffer in zip(self.parts, self._pieces(params), momenta, strict=True):
            part.load(piece, buffer)

    def set_settings(self, settings: dict[str, Any]) -> None:
        for part in self.parts:
            part.set_settings(settings)

    def hash(self) -> str:
        """``tensor_hash`` of the whole θ_global (as an unfragmented node's), once per version: fed
        the fragments' slices in canonical order, so no whole copy is put together for it (a round
        in flight holds only its fragment's extra copies)."""
        versions = tuple(part.global_params._version for part in self.parts)
        if self._hash is None or self._hash[0] != versions:
            self._hash = (versions, self.assembled_hash([part.global_params for part in self.parts]))
        return self._hash[1]

    def version(self) -> tuple[int, ...]:
        """Changes whenever any fragment's θ_global or momentum does (``HostCopies`` keys its one host
        copy of the whole state on it)."""
        key: list[int] = []
        for part in self.parts:
            momentum = part.momentum()
            key += [part.global_params._version, id(momentum), -1 if momentum is None else momentum._version]
        return tuple(key)


class FragmentedDiLoCo:
    """One DiLoCo per fragment over the same model (see the module docstring): a DiLoCo whose outer
    state is a :class:`FragmentedOuterState`, and the per-fragment steps the convergence benchmark
    drives (the daemon's ``OuterRound`` drives the same state through the swarm)."""

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
        self.plan = plan
        self.outer = FragmentedOuterState(
            params, plan, device=params[0].device, **outer_sgd_settings(outer_lr, outer_momentum, nesterov)
        )
        self.diloco = DiLoCo(model, outer=self.outer)

    @property
    def num_fragments(self) -> int:
        return self.outer.num_fragments

    def num_elements(self, fragment: int) -> int:
        return self.outer.fragment(fragment).num_elements

    def pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """Δ_f = θ_global,f − θ_local,f (flat fp32, the fragment's parameters in canonical order)."""
        return self.outer.fragment(fragment).delta()

    @torch.no_grad()
    def land(self, fragment: int, mean: torch.Tensor, *, mix: float) -> float:
        """Fragment ``fragment``'s round landed with mean ``mean``: the outer step on its global params,
        then its local params mixed with them (``mix`` = α, the share of the local params kept).
        Returns ‖Δ̄_f‖."""
        if not 0.0 <= mix < 1.0:
            raise ValueError(f"mix must be in [0, 1), got {mix}")
        part = self.outer.fragment(fragment)
        averaged = mean.to(self.outer.device, torch.float32)
        if averaged.shape != (part.num_elements,):
            raise RuntimeError(f"the mean has shape {tuple(averaged.shape)}, expected ({part.num_elements},)")
        with self.diloco.consistent():
            part.step(averaged)
        self.outer.mix(fragment, mix)
        return float(averaged.norm())

    def global_params(self) -> torch.Tensor:
        """θ_global of the whole model, flat fp32 in canonical order (the fragments' put back in place)."""
        return self.outer.params().to("cpu")

    def fragment_hash(self, fragment: int) -> str:
        """SHA-256 of fragment ``fragment``'s global params."""
        return self.outer.fragment(fragment).hash()

    def param_hash(self) -> str:
        """SHA-256 of the whole model's global params, as an unfragmented DiLoCo's."""
        return self.diloco.param_hash()
