"""A round's end besides the outer step: one host copy of the global state, the round record, its eval.

After DiLoCo's outer step (``Trainer.outer_round``) the loop owes three readers the new global
state θ_global (and its outer momentum): the snapshot served to joiners (``Trainer.snapshot``), the
checkpoint (``node/checkpoint_writer.py``) and the held-out eval. They share **one** host copy:

    Phase 1 (training thread): ``HostCopies.get`` copies θ_global and the momentum to host memory
             once per version of θ_global (pinned and asynchronous from a GPU), under DiLoCo's lock
             so both are of the same round, with the param_hash DiLoCo already holds for it. The
             served ``Snapshot`` takes these tensors without copying them; the checkpoint's state
             tree holds them as its outer state and, when the model holds θ_global (after a
             synchronous outer step or an adoption), as its model parameters too (views), and the
             writer does not copy them again; the background eval's model is made of views of them
             (CPU). Nobody writes to them: a later round makes a new copy.
    Phase 2 (the record): the round's wall time is measured here, at the round's end. An inline
             eval runs first and counts in it; a background eval (``node/held_out.py``) runs while
             the next phase trains and its record is held until the loss is in, then written at a
             step boundary, round records always in round order. The run's last eval is waited for
             (that wait is added to its round's wall time) before the run ends.

``eval_loss`` is the held-out loss of the global params the record's ``param_hash`` names, inline
or in the background (with ``--overlap`` the model holds the next phase's params: the eval loads
θ_global first).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from node.checkpoint_writer import host_copy
from node.metrics import MetricsWriter, round_record, utilization
from node.outer_state import FlatOuterState, sgd_state_dict

if TYPE_CHECKING:
    from node.diloco import DiLoCo, OuterStepReport
    from node.held_out import Batch, HeldOutEval
    from node.replica import Replica


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
            params, momentum = outer.params(), outer.momentum()
            flat = isinstance(outer, FlatOuterState)  # else params() is a copy gathered from the ranks
            key = (params._version, id(momentum), -1 if momentum is None else momentum._version)
            if flat and self._cached is not None and self._cached[0] == key:
                return self._cached[1]
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
            self._cached = (key, state) if flat else None
            return state


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


class RoundEnd:
    """The round records and their evals (see the module docstring); ``background`` evaluates off the
    training thread, else the replica evaluates inline. Call :meth:`poll` at step boundaries."""

    def __init__(
        self,
        *,
        diloco: DiLoCo,
        replica: Replica,
        eval_set: Sequence[Batch],
        metrics: MetricsWriter,
        eval_every: int,
        background: HeldOutEval | None,
    ) -> None:
        self.diloco = diloco
        self.replica = replica
        self.eval_set = eval_set
        self.metrics = metrics
        self.eval_every = eval_every
        self.background = background
        self.host = HostCopies(diloco)
        self._since_round: float | None = None  # perf_counter of the last round record (or the first step)
        self._held: deque[dict[str, Any]] = deque()  # records not written yet, in round order
        self._awaiting: dict[str, Any] | None = None  # the held record whose eval is in flight

    def phase_started(self, now: float) -> None:
        """The first inner step of this process started at ``now``: the first round's wall time starts."""
        if self._since_round is None:
            self._since_round = now

    def evaluate_inline(self, *, model_is_global: bool) -> float:
        """The held-out loss of θ_global on the training thread (loaded into the model first unless it
        holds it already: with overlap the model holds the phase's own params, which are replaced next)."""
        if not model_is_global:
            with self.diloco.consistent():
                self.replica.write_params(self.diloco.global_params)
        return self.replica.eval_loss(self.eval_set)

    def record(
        self,
        report: OuterStepReport,
        *,
        progress: Any,
        compute_seconds: float,
        shard: tuple[int, int],
        final: bool,
        model_is_global: bool,
    ) -> dict[str, Any]:
        """The round record of ``report`` (``node.metrics.round_record``), written now or, with a
        background eval, once its loss is in. Eval at the run's last round and every ``eval_every``
        rounds (null in the others: not the first round by rule, whose eval would cost a short run more
        than ``--eval-every`` auto's budget)."""
        due = final or progress.round % self.eval_every == 0
        eval_loss = (
            self.evaluate_inline(model_is_global=model_is_global) if due and not self.background else None
        )
        now = (
            time.perf_counter()
        )  # the record's wall interval: to here (after an inline eval), before the save
        wall = now - (self._since_round if self._since_round is not None else now)
        self._since_round = now
        record = round_record(
            report,
            progress=progress,
            compute_seconds=compute_seconds,
            wall_seconds=wall,
            eval_loss=eval_loss,
            overlap=self.diloco.overlap,
            shard=shard,
        )
        self._held.append(record)
        if due and self.background is not None:
            self._submit_eval(record)
        self.poll()
        return record

    def _submit_eval(self, record: dict[str, Any]) -> None:
        assert self.background is not None
        self._fill(self.background.wait())  # at most one in flight: the previous one lands first
        if self.background.device.type == "cpu":
            self.background.submit(record["round"], self.host.get().params)  # views of the host copy
        else:
            with self.diloco.consistent():  # a device-to-device copy, ordered before the next step
                self.background.submit(record["round"], self.diloco.global_params)
        self._awaiting = record

    def _fill(self, result: tuple[int, float] | None) -> None:
        if result is not None:
            assert self._awaiting is not None and self._awaiting["round"] == result[0]
            self._awaiting["eval_loss"] = result[1]
            self._awaiting = None

    def poll(self) -> None:
        """Write the held records that are complete (a background eval that landed fills its record)."""
        if self.background is not None:
            self._fill(self.background.poll())
        while self._held and self._held[0] is not self._awaiting:
            self.metrics.write(self._held.popleft())  # its sinks log the round line and export it

    def finish(self) -> None:
        """The run ends: wait for the eval in flight (its wait counts in its round's wall time) and
        write every held record."""
        if self.background is not None and self._awaiting is not None:
            start = time.perf_counter()
            result = self.background.wait()
            record = self._awaiting
            record["seconds_wall"] += time.perf_counter() - start
            wall, compute = record["seconds_wall"], record["seconds_compute"]
            record["utilization"] = utilization(compute, wall)
            if record["blocked_share"] is not None:
                record["blocked_share"] = record["seconds_blocked"] / wall
            self._fill(result)
        self.poll()

    def close(self) -> None:
        """Stop the eval thread and write what is held (after :meth:`finish` nothing is; on the way out
        of a failed run, the records as they are)."""
        try:
            if self.background is not None:
                self._fill(self.background.wait())
                self.background.close()
        finally:
            while self._held:
                self.metrics.write(self._held.popleft())
            self._awaiting = None
