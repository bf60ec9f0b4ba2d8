"""The seam between the training loop and the swarm: what each hands the other, and nothing more.

Like torchft's Manager beside its training loop, the swarm side (``node/swarm.py``) never holds the
trainer. It is given a :class:`GlobalStateAccess` (callables and plain values: the global state it
serves and adopts, the lineage it is on, this node's throughput), and each round hands DiLoCo one
:class:`~node.diloco.AveragingOutcome` whose :attr:`~node.diloco.AveragingOutcome.decision` is one
of the round outcomes below; the loop acts on it in one ``match`` (``Trainer.outer_round``). The
loop sees the swarm only through :class:`SwarmSide`. Background work (an overlapped round) is a
future the loop polls at step boundaries (``DiLoCo.landed``), never a callback into the loop.

Import direction: trainer → swarm_seam ← swarm; swarm_state → swarm_seam. Nothing here imports the
trainer, the swarm or DiLoCo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from protocol.statesync.snapshot import Snapshot
    from protocol.swarm.streams import StreamRunner

Boundary = tuple[int, dict[str, Any]]
"""(inner step, data position) at the end of a round's phase: what a snapshot of that round carries."""

Stepped = tuple[torch.Tensor, torch.Tensor | None]
"""(global params, outer momentum): the outer state after one outer step."""


@dataclass(frozen=True)
class AdoptedState:
    """A verified global state fetched from the swarm (or stepped to with its rounds' means), ready
    for the loop to load (``Trainer.adopt``)."""

    round: int
    param_hash: str
    global_params: torch.Tensor  # (N,) fp32
    outer_momentum: torch.Tensor | None  # (N,) fp32, None before the first outer step
    metadata: dict[str, Any]
    round_mean: Any = None
    """The ``swarm_state.RoundMean`` this state was stepped to with from ours (``caught_up_state``),
    None if it was fetched whole."""

    @property
    def caught_up(self) -> bool:
        return self.round_mean is not None


# --- what one round decided (``AveragingOutcome.decision``) -------------------------------------


@dataclass(frozen=True)
class Averaged:
    """The group's weighted mean Δ̄ arrived: outer step with it."""

    mean: torch.Tensor  # (N,) fp32


@dataclass(frozen=True)
class FellBack:
    """No usable mean (too few peers, a failed all-reduce, no state to adopt): outer step with this
    node's own Δ; the next round's lineage check brings it back to the swarm."""

    own: torch.Tensor  # (N,) fp32
    reason: str


@dataclass(frozen=True)
class Adopt:
    """This node missed the round or is off the swarm's lineage: load the swarm's state instead of
    stepping (fetched whole, or caught up with the rounds' means: ``state.caught_up``)."""

    state: AdoptedState


RoundDecision = Averaged | FellBack | Adopt


# --- what the swarm may read and do to the loop ----------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GlobalStateAccess:
    """The loop's global state as the swarm sees it: values and callables, never the trainer."""

    num_elements: int
    """Numbers in the flat global params."""
    corpus_sha256: str
    """The data identity a fetched state must carry (corpus and tokenizer)."""
    lineage: Callable[[], tuple[int, str]]
    """(rounds applied, param_hash) of the global params now."""
    snapshot: Callable[[int | None, Boundary | None], Snapshot]
    """The global state as served: after ``round`` (default: the rounds applied), at ``boundary``
    (default: the loop's step and data position now)."""
    stepped: Callable[..., Stepped]
    """``stepped(mean, *, start=None)``: the outer state one outer step with ``mean`` gives from ours
    (or from ``start``), on copies (``DiLoCo.stepped``)."""
    adopt: Callable[[AdoptedState], None]
    """Load a state of the swarm's (only while the loop is not training: at start)."""
    tokens_per_s: Callable[[], float]
    stop_requested: Callable[[], bool]
    reshard: Callable[[int, int], None]
    """Train on data shard ``index`` of ``count`` from the next step."""
    open_streams: Callable[[], StreamRunner] | None = None
    """The all-reduce streams 1..S-1 on the local ranks (``--swarm-streams S > 1``), else None."""


class SwarmSide(Protocol):
    """What the training loop calls on the swarm (``node.swarm.SwarmSession``)."""

    num_adoptions: int

    def average(self, vector: torch.Tensor, *, round_index: int, weight: float) -> Any: ...

    def start(self, loop: GlobalStateAccess) -> None: ...

    def after_round(
        self, decision: RoundDecision, members: tuple[str, ...], boundary: Boundary | None = None
    ) -> None: ...

    def publish_landed(self, round: int, boundary: Boundary) -> None: ...

    def phase_should_end(self) -> bool: ...

    def lineage_peer_due(self) -> bool: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...
