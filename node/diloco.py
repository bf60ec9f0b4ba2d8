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

The outer state (``node.outer_state``) is one flat fp32 vector in the canonical parameter order
(``named_parameters`` order), in this process or sharded over the node's local ranks, so the
pseudo-gradient is one contiguous vector for the all-reduce and ``param_hash`` is a SHA-256 over it:
identical global params on two nodes ⇔ identical hash.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from node.outer_state import (
    SGD_SETTINGS,
    FlatOuterState,
    LocalParams,
    OuterState,
    outer_sgd_settings,
    sgd_momentum_and_settings,
    sgd_state_dict,
)
from node.swarm_seam import Adopt, AdoptedState, Averaged, FellBack, RoundDecision


@dataclass(frozen=True)
class AveragingOutcome:
    """What the swarm's averaging returned for one round."""

    averaged: torch.Tensor  # (N,) fp32: the weighted mean pseudo-gradient
    num_peers: int  # peers whose contribution is in the mean (1 = only this node)
    bytes_sent: int = 0
    bytes_recv: int = 0
    fell_back: bool = False  # the swarm round failed and this node used its own vector
    failures: tuple[str, ...] = ()  # human-readable reasons, one per failed peer or phase
    adopted_state: AdoptedState | None = None
    """The swarm's global state to load instead of stepping (this node was off the swarm's lineage
    or missed the round), loaded by the trainer on its own thread."""
    members: tuple[str, ...] = ()  # the round's group (peer ids), for resharding the data
    failures_by_kind: dict[str, int] = field(default_factory=dict)  # node/metrics.py FAILURE_KINDS
    codec_error: float | None = None  # ‖error-feedback residual‖ / ‖Δ‖; None if nothing was encoded
    bytes_recv_state_sync: int = 0  # the swarm's state fetched since the previous round
    bytes_by_phase: dict[str, int] = field(default_factory=dict)
    """bytes_sent / bytes_recv split by all-reduce phase: {"sent_reduce_scatter", "sent_all_gather",
    "recv_reduce_scatter", "recv_all_gather"} (empty if nothing went over the wire)."""
    seconds_forming: float | None = None  # agreeing on the round's group (None: no swarm round)
    seconds_allreduce: float | None = None  # the group's all-reduce (None: it did not run)
    streams: int | None = None  # all-reduce streams the round ran on (None: it did not run)

    @property
    def decision(self) -> RoundDecision:
        """What the round decided, for the loop's one ``match`` (``node/swarm_seam.py``)."""
        if self.adopted_state is not None:
            return Adopt(self.adopted_state)
        if self.fell_back:
            return FellBack(self.averaged, "; ".join(self.failures[:3]) or "fell back")
        return Averaged(self.averaged)


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
    """One applied round: its outcome as the averager returned it (its statistics go to the round
    record from there, not copied field by field) and what DiLoCo measured around it."""

    round_index: int
    outcome: AveragingOutcome
    seconds_comm: float
    pseudo_gradient_norm: float
    param_hash: str
    seconds_waited: float = 0.0  # how long the training thread was blocked on the swarm for this round

    @property
    def decision(self) -> RoundDecision:
        return self.outcome.decision

    @property
    def adopted(self) -> bool:
        return self.outcome.adopted_state is not None

    @property
    def fell_back(self) -> bool:
        return self.outcome.fell_back

    @property
    def num_peers(self) -> int:
        return self.outcome.num_peers


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
        overlap: bool = False,
        local: LocalParams | None = None,
        outer: OuterState | None = None,
    ) -> None:
        self.model = model
        self.overlap = overlap
        # Overlap: round r's averaging runs here while the inner steps of round r + 1 proceed.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="outer-averaging") if overlap else None
        self._pending: Future[OuterStepReport] | None = None
        self._pending_round = 0
        self._anchor: torch.Tensor | None = None  # overlap: the local params the current phase started from
        # Overlap: the background thread applies a round's outer step as soon as its mean arrives;
        # this lock keeps readers of the outer state (hash, checkpoint) from seeing half a step.
        self._lock = threading.RLock()
        self.averager = averager
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
    def outer_step(self, *, round_index: int, weight: float) -> OuterStepReport:
        """Average Δ across the swarm, apply outer Nesterov SGD, copy θ_global into the model."""
        assert not self.overlap, "an overlapping DiLoCo uses phase_delta / finish_pending / submit"
        # Phase 1: the pseudo-gradient of this node's H inner steps.
        delta = self.pseudo_gradient()
        # Phase 2: the swarm's weighted mean (compressed all-reduce in a swarm; identity alone).
        start = time.perf_counter()
        outcome = self.averager.average(delta, round_index=round_index, weight=weight)
        seconds_comm = time.perf_counter() - start
        # Phases 3-4: outer Nesterov step; the model restarts from the new global params.
        report = self._apply(outcome, round_index, seconds_comm=seconds_comm, seconds_waited=seconds_comm)
        if not report.adopted:
            self.load_global_into_model()
        return report

    def _apply(
        self, outcome: AveragingOutcome, round_index: int, *, seconds_comm: float, seconds_waited: float
    ) -> OuterStepReport:
        """Outer Nesterov SGD on θ_global with gradient Δ̄ (nothing if the swarm's state is to be adopted)."""
        norm = 0.0
        if outcome.adopted_state is None:
            averaged = outcome.averaged.to(self.outer_device, torch.float32)
            if averaged.shape != (self.num_elements,):
                raise RuntimeError(
                    f"averager returned shape {tuple(averaged.shape)}, expected ({self.num_elements},)"
                )
            self.outer.step(averaged)
            norm = float(averaged.norm())
        return OuterStepReport(
            round_index=round_index,
            outcome=outcome,
            seconds_comm=seconds_comm,
            pseudo_gradient_norm=norm,
            param_hash=self.param_hash(),
            seconds_waited=seconds_waited,
        )

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
    # with the next round's inner steps. At the end of phase k this node:
    #   1. takes Δ_k = anchor_k − θ_local, its own progress during phase k (phase_delta);
    #   2. waits for round k−1, averaged during phase k on a background thread, which applied
    #      θ_global ← OuterSGD(θ_global, Δ̄_{k−1}) as soon as Δ̄_{k−1} arrived (finish_pending);
    #   3. starts averaging Δ_k in the background and restarts the model from θ_global − Δ_k: the
    #      newest global params plus its own last phase, which is not in θ_global yet (submit).
    # Every node applies the same Δ̄ in the same order, so θ_global stays identical swarm-wide; a
    # node's own progress is counted once, through Δ̄_k when it lands in θ_global. The main thread
    # never touches θ_global during a phase, so the background thread may step it then.

    @property
    def pending_round(self) -> int | None:
        """The round whose averaging is in flight (overlap), else None."""
        return self._pending_round if self._pending is not None else None

    def pending_done(self) -> bool:
        """Whether the round in flight (overlap) has finished, or none is in flight: ending the phase
        now would not block the training thread on the swarm."""
        return self._pending is None or self._pending.done()

    def landed(self) -> OuterStepReport | None:
        """The round in flight once it has landed (applied to θ_global, or sent us to adopt), else
        None; the loop polls this at step boundaries and still takes the round with
        :meth:`finish_pending` at the phase's end."""
        pending = self._pending
        if pending is None or not pending.done() or pending.exception() is not None:
            return None
        return pending.result()

    def pending_adopts(self) -> bool:
        """Whether the round in flight has ended by sending us to adopt the swarm's state (overlap):
        the phase under way trains on params that adoption discards, so the trainer takes it now."""
        report = self.landed()
        return report is not None and report.adopted

    @torch.no_grad()
    def phase_delta(self) -> torch.Tensor:
        """Δ_k: the local progress since the phase started (overlap); θ_global − θ_local before any round."""
        if self._anchor is None:
            return self.outer.delta()
        return self._anchor - self.local.read_params(self.outer_device)

    @torch.no_grad()
    def finish_pending(self) -> OuterStepReport | None:
        """Wait for the round in flight (already applied to θ_global); None if none is in flight."""
        if self._pending is None:
            return None
        start = time.perf_counter()
        report = self._pending.result()  # the averager returns within its own deadlines
        self._pending = None
        return dataclasses.replace(report, seconds_waited=time.perf_counter() - start)

    @torch.no_grad()
    def submit(self, delta: torch.Tensor, *, round_index: int, weight: float) -> None:
        """Start averaging ``delta`` for ``round_index`` in the background; the model continues from
        θ_global − delta (see above)."""
        assert self._executor is not None and self._pending is None
        start = self.outer.params() - delta  # before the averaging thread may step θ_global
        self._load_into_model(start)
        self._anchor = start
        self._pending = self._executor.submit(self._average_and_apply, delta.clone(), round_index, weight)
        self._pending_round = round_index

    @torch.no_grad()
    def _average_and_apply(self, delta: torch.Tensor, round_index: int, weight: float) -> OuterStepReport:
        started = time.perf_counter()
        outcome = self.averager.average(delta, round_index=round_index, weight=weight)
        with self._lock:
            return self._apply(
                outcome, round_index, seconds_comm=time.perf_counter() - started, seconds_waited=0.0
            )

    def close(self) -> None:
        """Stop the background averaging thread (after finish_pending)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    @torch.no_grad()
    def load_global_into_model(self) -> None:
        self.outer.write_to_model()
        self._anchor = None

    @torch.no_grad()
    def _load_into_model(self, flat: torch.Tensor) -> None:
        self.local.write_params(flat)

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
