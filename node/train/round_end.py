"""A round's end besides the outer step: the round record and its held-out eval.

After an outer round (``node/outer/round.py``) the loop writes the round's record:

    Phase 1 (the eval): held-out loss of θ_global, read from the round's one host copy of the global
             state (``node/outer/host_copy.py``): inline on the training thread, or on a background
             thread (``node/train/held_out.py``) while the next phase trains, its model made of views of
             that copy (CPU).
    Phase 2 (the record): the round's wall time is measured here, at the round's end. An inline
             eval runs first and counts in it; a background eval's record is held until the loss is
             in, then written at a step boundary, round records always in round order. The run's
             last eval is waited for (that wait is added to its round's wall time) before the run ends.

``eval_loss`` is the held-out loss of the global params the record's ``param_hash`` names, inline
or in the background (with ``--overlap`` the model holds the next phase's params: the eval loads
θ_global first).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from node.ops.metrics import MetricsWriter, round_record, utilization
from node.outer.host_copy import HostCopies

if TYPE_CHECKING:
    from node.model.replica import Replica
    from node.outer.diloco import DiLoCo
    from node.outer.round import RoundApplied
    from node.train.held_out import Batch, HeldOutEval


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
        host: HostCopies,
        overlap: bool,
        keeps_local: bool = False,
    ) -> None:
        self.diloco = diloco
        self.overlap = overlap
        # --fragments: the model's local params train on past the round (no restart from θ_global),
        # so an inline eval puts them back after evaluating θ_global.
        self.keeps_local = keeps_local
        self.replica = replica
        self.eval_set = eval_set
        self.metrics = metrics
        self.eval_every = eval_every
        self.background = background
        self.host = host  # the round's one host copy of the global state (node/outer/host_copy.py)
        self._since_round: float | None = None  # perf_counter of the last round record (or the first step)
        self._held: deque[dict[str, Any]] = deque()  # records not written yet, in round order
        self._awaiting: dict[str, Any] | None = None  # the held record whose eval is in flight

    def phase_started(self, now: float) -> None:
        """The first inner step of this process started at ``now``: the first round's wall time starts."""
        if self._since_round is None:
            self._since_round = now

    def evaluate_inline(self, *, model_is_global: bool) -> float:
        """The held-out loss of θ_global on the training thread (loaded into the model first unless it
        holds it already: with overlap the model holds the phase's own params, which are replaced next;
        with fragments they are trained on, and are put back after the eval)."""
        if model_is_global:
            return self.replica.eval_loss(self.eval_set)
        local = self.replica.read_params("cpu") if self.keeps_local else None
        with self.diloco.consistent():
            self.replica.write_params(self.diloco.global_params)
        loss = self.replica.eval_loss(self.eval_set)
        if local is not None:
            self.replica.write_params(local)
        return loss

    def record(
        self, applied: RoundApplied, *, progress: Any, shard: tuple[int, int], final: bool
    ) -> dict[str, Any]:
        """The record of the round ``applied`` (``node.ops.metrics.round_record``), written now or, with
        a background eval, once its loss is in. Eval at the run's last round and every ``eval_every``
        rounds (null in the others: not the first round by rule, whose eval would cost a short run more
        than ``--eval-every`` auto's budget)."""
        due = final or progress.round % self.eval_every == 0
        eval_loss = (
            self.evaluate_inline(model_is_global=applied.model_is_global)
            if due and not self.background
            else None
        )
        now = (
            time.perf_counter()
        )  # the record's wall interval: to here (after an inline eval), before the save
        wall = now - (self._since_round if self._since_round is not None else now)
        self._since_round = now
        record = round_record(
            applied,
            progress=progress,
            wall_seconds=wall,
            eval_loss=eval_loss,
            overlap=self.overlap,
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
            if record["allreduce_share"] is not None:
                record["allreduce_share"] = record["seconds_allreduce"] / wall
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
