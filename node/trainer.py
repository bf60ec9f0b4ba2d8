"""The node's training loop: H inner AdamW steps, then one DiLoCo outer round, repeated.

One outer round as the loop sees it (see ARCHITECTURE.md for the swarm side):

    for step in round:                                   # inner phase, this node alone
        x, y = batches.next_batch()                      # this node's data shard
        loss = CE(model(x), y); loss.backward()
        clip; set LR from the schedule; adamw.step(); adamw.zero_grad()
    diloco.outer_step(weight=tokens)                      # Δ → averager → Nesterov → model
    round end (node/round_end.py): one host copy of θ_global for the served snapshot and the
    checkpoint; held-out eval (inline, or on a thread during the next phase); metrics.jsonl

Counters are global over the run (a resumed run continues them): ``step`` = inner steps done,
``round`` = outer rounds done; the current round is ``step // H + 1``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from node.checkpoint import latest_checkpoint
from node.checkpoint_state import checkpoint_state, restore_state
from node.checkpoint_writer import CheckpointWriter
from node.config import ConfigError, NodeConfig
from node.data import ShardedBatches, eval_batches
from node.diloco import Averager, DiLoCo, OuterStepReport, SoloAverager
from node.efficiency import eval_interval
from node.export import export_model, tokenizer_info
from node.held_out import background_eval
from node.hf import init_state, node_model_config
from node.metrics import MetricsSink, MetricsWriter
from node.model import model_config
from node.outer_state import outer_sgd_settings
from node.phase_clock import PhaseClock
from node.progress import progress_sink
from node.prometheus import PrometheusExporter
from node.records import load_node_corpus
from node.replica import build_replica, pick_device
from node.round_end import RoundEnd
from node.schedule import LRSchedule
from node.swarm_seam import Adopt, AdoptedState, Averaged, Boundary, FellBack, GlobalStateAccess, SwarmSide
from node.swarm_state import state_snapshot

if TYPE_CHECKING:
    from protocol.statesync.snapshot import Snapshot

log = logging.getLogger("dtnode")


@dataclass
class Progress:
    step: int = 0  # inner steps done over the whole run
    round: int = 0  # outer rounds done over the whole run
    tokens: int = 0  # training tokens this node has processed over the whole run
    round_tokens: int = 0  # tokens processed since the last outer step
    round_compute_seconds: float = 0.0


class Trainer:
    """Trains one node; ``averager`` is the swarm (a :class:`SoloAverager` for a swarm of one)."""

    def __init__(
        self, config: NodeConfig, *, averager: Averager | None = None, swarm: SwarmSide | None = None
    ) -> None:
        self.config = config
        self.swarm = swarm
        self.run_dir = config.resolved_run_dir
        self.device = pick_device(config.device)
        if config.threads:
            torch.set_num_threads(config.threads)
        self._stop = threading.Event()

        self.tokenizer, self.corpus = load_node_corpus(config)  # --tokenizer, --data (node/records.py)
        overrides: dict[str, Any] = {"vocab_size": self.corpus.vocab_size}
        if config.seq_len:
            overrides["seq_len"] = config.seq_len
        # --model-config / --init-from (an HF Llama config.json: node/hf.py), else the preset.
        self.model_config = node_model_config(config, self.corpus.vocab_size) or model_config(
            config.model, **overrides
        )
        torch.manual_seed(config.seed)
        self.replica = build_replica(config, self.model_config, self.device)
        initial_state = init_state(config, self.model_config)
        if initial_state is not None:  # --init-from: before DiLoCo copies the params as the global ones
            self.replica.load_model_state(initial_state)
        self.model = self.replica.model  # plain GPT (on the meta device when the local workers hold it)
        self.schedule = LRSchedule(
            kind=config.lr_schedule,
            peak_lr=config.inner_lr,
            warmup_steps=config.warmup_steps,
            horizon_steps=config.schedule_horizon,
            min_lr_ratio=config.min_lr_ratio,
            decay_fraction=config.wsd_decay_fraction,
        )
        self.batches = ShardedBatches(
            self.corpus.train,
            seq_len=self.model_config.seq_len,
            batch_size=config.batch_size,
            seed=config.data_seed,
            shard_index=config.shard_index,
            num_shards=config.num_shards,
        )
        self.eval_set = eval_batches(
            self.corpus.val,
            seq_len=self.model_config.seq_len,
            batch_size=config.batch_size,
            num_batches=config.eval_batches,
        )
        self.diloco = DiLoCo(
            self.model,
            averager=averager or swarm or SoloAverager(),
            outer_lr=config.outer_lr,
            outer_momentum=config.outer_momentum,
            nesterov=config.outer_nesterov,
            offload=config.outer_offload,
            overlap=config.overlap,
            local=self.replica,
            outer=self.replica.outer_state(
                offload=config.outer_offload,
                **outer_sgd_settings(config.outer_lr, config.outer_momentum, config.outer_nesterov),
            ),
        )
        self.progress = Progress()
        # Overlap: (step, data position) at the end of the phase whose round is in flight (node/swarm.py).
        self.submitted_boundary: tuple[int, dict[str, Any]] | None = None
        self.unrecorded_compute = 0.0  # inner compute of phases no round record counted yet (overlap)
        self.checkpoint_root = self.run_dir / "checkpoints"
        self.resumed_from: Path | None = None
        self._saved_step = -1  # inner step of the newest checkpoint written by this process
        self.phase_clock = PhaseClock(config)  # the inner phase under way (_phase_due)
        self._restored_swarm_state: dict[str, torch.Tensor] = {}  # from the checkpoint resumed (_restore)
        self.checkpoints = CheckpointWriter(self.checkpoint_root, keep=config.keep_checkpoints)
        self._prepare_run_dir()
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", sinks=self._metrics_sinks())
        # Round records, their held-out evals and the round's one host copy of θ_global (round_end.py).
        self.round_end = RoundEnd(
            diloco=self.diloco, replica=self.replica, eval_set=self.eval_set, metrics=self.metrics,
            eval_every=eval_interval(config),  # rounds between held-out evals (the final one always)
            background=background_eval(config, self.replica, self.model_config, self.device, self.eval_set),
        )  # fmt: skip

    def _metrics_sinks(self) -> list[MetricsSink]:
        """The progress display, and the Prometheus endpoint on the --listen host if --metrics-port."""
        config = self.config
        sinks: list[MetricsSink] = [progress_sink(config)]
        if config.metrics_port:
            exporter = PrometheusExporter()
            host = config.listen.rpartition(":")[0] or "0.0.0.0"
            try:
                exporter.serve(host, config.metrics_port)
            except OSError as error:
                raise ConfigError(f"cannot serve metrics on {host}:{config.metrics_port}: {error}") from None
            log.info("Prometheus metrics at http://%s:%d/metrics", host, config.metrics_port)
            sinks.append(exporter)
        return sinks

    # --- run directory and checkpoints ---
    def _prepare_run_dir(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(self.config.to_toml())
        corpus_record = self.run_dir / "corpus.txt"
        latest = latest_checkpoint(self.checkpoint_root)
        if latest is not None:
            self._restore(latest)
        tokenizer_sha256 = self.corpus.tokenizer_sha256 or "none (byte tokens)"
        corpus_record.write_text(
            f"sha256 = {self.corpus.sha256}\ndescription = {self.corpus.description}\n"
            f"tokenizer_sha256 = {tokenizer_sha256}\n"
        )

    def state_dict(self, *, model_is_global: bool = False) -> dict[str, Any]:
        """The checkpoint's state tree (node/checkpoint_state.py); ``model_is_global``: the model holds θ_global."""
        return self._checkpoint_state(model_is_global)[0]

    def _checkpoint_state(self, model_is_global: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return checkpoint_state(
            replica=self.replica, diloco=self.diloco, batches=self.batches, swarm=self.swarm,
            host=self.round_end.host.get(), model_is_global=model_is_global,
        )  # fmt: skip

    def save(self, *, model_is_global: bool = False) -> None:
        """Checkpoint the state now: copied to host memory here (the global state: the round's one
        copy, node/round_end.py), hashed and written on the writer's thread (node/checkpoint_writer.py)
        while training goes on; the loop polls it. ``model_is_global``: the model holds θ_global now."""
        progress = self.progress
        if self._saved_step == progress.step:
            return
        meta: dict[str, Any] = {
            "step": progress.step,
            "round": progress.round,
            "tokens": progress.tokens,
            "round_tokens": progress.round_tokens,
            "corpus_sha256": self.corpus.sha256,
            "model": self.config.model,
            "time": time.time(),
        }  # + param_hash, of the snapshot's global params, by the writer
        state, owned = self._checkpoint_state(model_is_global)
        self.checkpoints.submit(f"step-{progress.step:010d}", state, meta, owned=owned)
        self._saved_step = progress.step

    def _restore(self, path: Path) -> None:
        meta, self._restored_swarm_state = restore_state(
            path, replica=self.replica, diloco=self.diloco, batches=self.batches,
            corpus_sha256=self.corpus.sha256, model_name=self.config.model,
        )  # fmt: skip
        self.progress = Progress(
            step=meta["step"], round=meta["round"], tokens=meta["tokens"], round_tokens=meta["round_tokens"]
        )
        self.resumed_from = path
        self._saved_step = self.progress.step
        log.info(
            "resumed from %s: round %d, step %d, param_hash %s",
            path, meta["round"], meta["step"], meta["param_hash"][:12],
        )  # fmt: skip

    def adopt(self, state: AdoptedState) -> None:
        """Continue from the swarm's global state: params, outer momentum, counters, data position.

        The inner steps since the last round are dropped (their Δ belongs to other params); the
        inner optimizer's state is this node's own and is kept, as in DiLoCo.
        """
        self.diloco.load_global_state(state.global_params, state.outer_momentum)
        if self.diloco.param_hash() != state.param_hash:
            raise RuntimeError("the adopted params do not match their param_hash")
        # The swarm's data position; our shard stays the first until the next round assigns ours (a
        # bounded duplicate read, never a gap: protocol/membership/shards.py).
        data = {"shard_index": 0, **state.metadata["data"]}
        self.batches.load_state_dict(data)
        self.progress = Progress(
            step=int(state.metadata["step"]), round=state.round, tokens=self.progress.tokens
        )
        log.info(
            "now at round %d, step %d, param_hash %s", state.round, self.progress.step, state.param_hash[:12]
        )

    def _act_on(self, report: OuterStepReport, boundary: Boundary | None = None) -> OuterStepReport:
        """The one place the loop acts on a round's decision (``node/swarm_seam.py``): count the round
        it stepped through, or load the state it was sent to (the report then names the params this
        node holds now; ``adopt`` checked they hash to it); then the swarm reshards and serves it."""
        match report.decision:
            case Adopt(state=state):
                self.adopt(state)
                report = dataclasses.replace(report, param_hash=state.param_hash)
            case Averaged() | FellBack():
                self.progress.round = report.round_index
        if self.swarm is not None:
            self.swarm.after_round(report.decision, report.outcome.members, boundary)
        return report

    def snapshot(self, round: int | None = None, boundary: Boundary | None = None) -> Snapshot:
        """The global state as served to joiners (``swarm_state.state_snapshot``): after ``round``
        (default the rounds applied), at ``boundary`` (default the step and data position now)."""
        step, data = boundary if boundary is not None else (self.progress.step, self.batches.state_dict())
        host = self.round_end.host.get()  # the round's one host copy, shared with the checkpoint
        return state_snapshot(
            global_params=host.params,
            outer_momentum=host.momentum,
            param_hash=host.param_hash,
            copy=False,
            round=self.progress.round if round is None else round,
            step=step,
            data=data,
            model=self.config.model,
            corpus_sha256=self.corpus.sha256,
        )

    def global_state_access(self) -> GlobalStateAccess:
        """The loop's side of the seam, handed to the swarm (``SwarmSide.start``)."""
        return GlobalStateAccess(
            num_elements=self.diloco.num_elements,
            corpus_sha256=self.corpus.sha256,
            lineage=lambda: (self.progress.round, self.diloco.param_hash()),
            snapshot=self.snapshot,
            stepped=self.diloco.stepped,
            adopt=self.adopt,
            tokens_per_s=self.tokens_per_s,
            stop_requested=self._stop.is_set,
            reshard=self.batches.reshard,
            open_streams=self.replica.open_streams if self.config.swarm_streams > 1 else None,
        )

    def tokens_per_s(self) -> float:
        """This node's inner-phase throughput so far in the round (0 before its first step)."""
        progress = self.progress
        return (
            progress.round_tokens / progress.round_compute_seconds if progress.round_compute_seconds else 0.0
        )

    # --- the loop ---
    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask the loop to stop after the current inner step (signal-handler safe)."""
        self._stop.set()

    def _done(self) -> bool:
        config, progress = self.config, self.progress
        rounds = progress.round + (self.diloco.pending_round is not None)  # applied or in flight
        return (config.max_rounds > 0 and rounds >= config.max_rounds) or (
            config.max_steps > 0 and progress.step >= config.max_steps
        )

    def inner_step(self) -> dict[str, Any]:
        """One AdamW step on the next batch of this node's shard; returns its step record."""
        start = time.perf_counter()
        self.round_end.phase_started(start)  # the first round's wall time starts at this process's first step
        batches = [self.batches.next_batch() for _ in range(self.config.grad_accumulation)]  # (B, T) pairs
        lr = self.schedule.lr(self.progress.step)
        loss_value = self.replica.train_step(batches, lr)  # returns when the step is done
        seconds = time.perf_counter() - start
        progress = self.progress
        num_tokens = sum(x.numel() for x, _ in batches)
        progress.step += 1
        progress.tokens += num_tokens
        progress.round_tokens += num_tokens
        progress.round_compute_seconds += seconds
        return {
            "kind": "step",
            "round": self._phase(),
            "step": progress.step,
            "loss": loss_value,
            "lr": lr,
            "tokens": progress.tokens,
            "tokens_per_s": num_tokens / seconds,
            "time": time.time(),
        }

    def evaluate(self) -> float:
        return self.replica.eval_loss(self.eval_set)

    def outer_round(self) -> dict[str, Any] | None:
        """End of an inner phase: the outer step, or with ``overlap`` the previous round's.

        Writes (and returns) the record of the round applied now, and checkpoints on schedule; None
        for the first overlapped phase, whose round is still in flight (its compute goes to round 1's).
        """
        progress = self.progress
        self.unrecorded_compute += progress.round_compute_seconds  # (overlap: phase 1's is round 1's)
        weight, progress.round_tokens, progress.round_compute_seconds = float(progress.round_tokens), 0, 0.0
        if not self.diloco.overlap:
            report: OuterStepReport | None = self.diloco.outer_step(
                round_index=progress.round + 1, weight=weight
            )
            delta = None
        else:
            delta = self.diloco.phase_delta()  # before finish_pending: the model still holds this phase
            report = self.diloco.finish_pending()
        if report is not None:
            report = self._act_on(report, self.submitted_boundary if self.diloco.overlap else None)
            if report.adopted:
                delta = None  # this phase's progress belongs to other params
        record = None
        if report is not None:
            # Without overlap (or after adopting) the model restarts from θ_global: it holds it now.
            model_is_global = not self.diloco.overlap or report.adopted
            record = self._round_record(report, model_is_global=model_is_global)
            if self.config.checkpoint_every and self.progress.round % self.config.checkpoint_every == 0:
                # Before submit: no round in flight, so the saved state is consistent.
                self.save(model_is_global=model_is_global)
        if delta is not None:
            self.submitted_boundary = (progress.step, self.batches.state_dict())
            self.diloco.submit(delta, round_index=self._phase(), weight=weight)
        # The next phase starts now (self.progress: an adopted state replaced the object `progress` is).
        self.phase_clock.restart(self.progress.step)
        return record

    def _phase_due(self) -> bool:
        """Whether the inner phase is over (``node/phase_clock.py``)."""
        return self.phase_clock.due(
            self.progress,
            pending_done=self.diloco.pending_done,
            peer_due=None if self.swarm is None else self.swarm.lineage_peer_due,
        )

    def _phase(self) -> int:
        """The outer round the current inner phase belongs to (1-based)."""
        return self.progress.round + 1 + (self.diloco.pending_round is not None)

    def _round_record(
        self, report: OuterStepReport, *, model_is_global: bool, final: bool = False
    ) -> dict[str, Any]:
        """The round's record (the compute no record counted yet; written now or after its eval)."""
        compute_seconds, self.unrecorded_compute = self.unrecorded_compute, 0.0
        return self.round_end.record(
            report,
            progress=self.progress,
            compute_seconds=compute_seconds,
            shard=(self.batches.shard_index, self.batches.num_shards),
            final=final or self._done() or self._stop.is_set(),
            model_is_global=model_is_global,
        )

    def _finish_rounds(self) -> None:
        """Overlap: apply the round still in flight, so the run ends on the swarm's latest params."""
        report = self.diloco.finish_pending()
        if report is not None:
            report = self._act_on(report, self.submitted_boundary)
            if not report.adopted:
                self.diloco.load_global_into_model()
            self._round_record(report, model_is_global=True, final=True)
        self.diloco.close()
        self.round_end.finish()  # the last eval waited for, every round record written

    def run(self) -> None:
        """Train until a limit is reached or :meth:`request_stop` is called; checkpoint and export the
        model on the way out."""
        config = self.config
        if self._done():
            log.info(
                "nothing to do: run already at round %d, step %d", self.progress.round, self.progress.step
            )
            self.replica.close()
            return
        log.info(
            "training %s (%s params) on %s; H=%d, device %s, run dir %s",
            config.model_config or config.init_from or config.model, f"{self.model.num_params():,}",
            self.corpus.description, config.inner_steps, self.device, self.run_dir,
        )  # fmt: skip
        try:
            try:
                if self.swarm is not None:
                    self.swarm.start(self.global_state_access())
                    if self._restored_swarm_state and not self.swarm.num_adoptions:
                        self.swarm.load_state_dict(self._restored_swarm_state)
                self._train()
            finally:
                self.round_end.close()  # the eval thread (a failed run's records are written as they are)
                self.metrics.close()
            self.save()
            self.checkpoints.wait()  # on disk before the export (and a failed write fails the run)
            self.export()
        finally:
            self.checkpoints.close()  # a write still in flight (an error above) finishes first
            self.replica.close()  # the local workers, if any (after save: it reads their params)

    def _train(self) -> None:
        config = self.config
        while not self._done() and not self._stop.is_set():
            record = self.inner_step()
            self.metrics.write(record)  # its sinks log every log_every-th step and export it
            self.checkpoints.poll()  # a background write that finished is logged; one that failed raises
            self.round_end.poll()  # a background eval that landed: its round record is written
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"inner loss is {record['loss']} at step {record['step']}")
            if self._phase_due():
                self.outer_round()
            elif self.diloco.pending_adopts():
                # Overlap: the round in flight sent us to adopt the swarm's state; this phase's
                # steps are on params it replaces, so adopt now rather than at the phase's end,
                # a round behind the swarm again (then catch up as any adopter does, below).
                log.info("adopting the swarm's state mid-phase (the round in flight was not ours)")
                self.outer_round()
            elif self.swarm is not None and self.swarm.phase_should_end():
                # Catching up after adopting the swarm's state: join the round the swarm is
                # forming now with the steps done so far (weighted by their tokens), or, if the
                # swarm already moved past our state, let the round's lineage check catch us up;
                # on the swarm's step count and data position (if the round sends us to adopt
                # again, the adopted state sets both).
                done = self.progress.step - self.phase_clock.start_step
                missing = 0 if config.round_seconds else max(config.inner_steps - done, 0)
                log.info("ending the phase %d steps early to join the swarm's round", missing)
                self.batches.skip(missing)
                self.progress.step += missing
                self.outer_round()
            elif self.swarm is not None and (landed := self.diloco.landed()) is not None:
                # Overlap: the round in flight was applied (polled at this step boundary): serve it
                # now, not at the phase's end (the swarm serves each round once).
                assert self.submitted_boundary is not None
                self.swarm.publish_landed(landed.round_index, self.submitted_boundary)
        if self._stop.is_set():
            log.info("stop requested: checkpointing at step %d", self.progress.step)
        self._finish_rounds()

    def export(self) -> Path:
        """Write the global params, the swarm's model, as ``RUN_DIR/model.safetensors`` (node/export.py)."""
        progress = self.progress
        path = export_model(
            self.run_dir,
            self.model,
            self.diloco.global_params,  # the averaging thread is closed: nothing steps it now
            preset=self.config.model,
            tokenizer=tokenizer_info(self.config.data, self.corpus.vocab_size, self.tokenizer),
            round_index=progress.round,
            step=progress.step,
            tokens=progress.tokens,
        )
        log.info("exported the global params of round %d to %s", progress.round, path)
        return path
