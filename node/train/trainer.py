"""The node's training loop: inner AdamW steps, the outer round at each step boundary, repeated.

One outer round as the loop sees it (``node/outer/round.py`` owns the round; ARCHITECTURE.md the swarm):

    for step in phase:                                   # inner phase, this node alone
        x, y = batches.next_batch()                      # this node's data shard
        loss = CE(model(x), y); loss.backward()
        clip; set LR from the schedule; adamw.step(); adamw.zero_grad()
        round.count_step(tokens, seconds)
        round.at_step_boundary()                         # the phase's end: Δ → swarm → Nesterov → model
    on each round applied (``_round_applied``): the round record with its held-out eval (inline, or
    on a thread during the next phase: node/train/round_end.py), metrics.jsonl, a checkpoint on schedule

Counters are global over the run (a resumed run continues them): ``step`` = inner steps done,
``round`` = outer rounds done.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from node.config import ConfigError, NodeConfig
from node.data.batches import ShardedBatches, eval_batches
from node.data.corpus import Corpus
from node.data.node_corpus import load_node_corpus
from node.data.tokenizer import Tokenizer
from node.model.efficiency import eval_interval
from node.model.export import export_model, tokenizer_info
from node.model.hf import init_state, node_model
from node.model.replica import SingleReplica, build_replica, pick_device
from node.ops.liveness import LIVENESS_FILE, LivenessBounds, LivenessSink
from node.ops.metrics import MetricsSink, MetricsWriter
from node.ops.progress import progress_sink
from node.ops.prometheus import PrometheusExporter
from node.outer.diloco import DiLoCo
from node.outer.fragments import FragmentedOuterState, fragment_schedule, model_fragment_plan
from node.outer.round import OuterRound, RoundApplied, RoundProgress, RoundSettings
from node.outer.seam import Averager, SoloAverager, SwarmSide
from node.outer.state import outer_sgd_settings
from node.train.checkpoint import latest_checkpoint
from node.train.checkpoint_state import checkpoint_state, restore_state
from node.train.checkpoint_writer import CheckpointWriter
from node.train.held_out import background_eval
from node.train.round_end import RoundEnd
from node.train.schedule import LRSchedule
from protocol.allreduce.config import AllReduceConfig

log = logging.getLogger("dtnode")


class Trainer:
    """Trains one node; ``averager`` is the swarm (a :class:`SoloAverager` for a swarm of one)."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        averager: Averager | None = None,
        swarm: SwarmSide | None = None,
        corpus: tuple[Tokenizer, Corpus] | None = None,
    ) -> None:
        """``corpus``: the tokenizer and corpus already loaded (``dtnode join`` loads them before any
        socket opens: node/ops/preflight.py); None: loaded here."""
        self.config = config
        self.swarm = swarm
        self.run_dir = config.resolved_run_dir
        self.device = pick_device(config.run.device)
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        self._stop = threading.Event()

        # --tokenizer, --data (node/data/node_corpus.py)
        self.tokenizer, self.corpus = load_node_corpus(config) if corpus is None else corpus
        # --model-config / --init-from (an HF Llama config.json: node/model/hf.py), else the preset.
        self.model_config = node_model(config, self.corpus.vocab_size)
        torch.manual_seed(config.run.seed)
        self.replica = build_replica(config, self.model_config, self.device)
        initial_state = init_state(config, self.model_config)
        if initial_state is not None:  # --init-from: before DiLoCo copies the params as the global ones
            self.replica.load_model_state(initial_state)
        self.model = self.replica.model  # plain GPT (on the meta device when the local workers hold it)
        self.schedule = LRSchedule(
            kind=config.inner.lr_schedule,
            peak_lr=config.inner.lr,
            warmup_steps=config.inner.warmup_steps,
            horizon_steps=config.schedule_horizon,
            min_lr_ratio=config.inner.min_lr_ratio,
            decay_fraction=config.inner.wsd_decay_fraction,
        )
        self.batches = ShardedBatches(
            self.corpus.train,
            seq_len=self.model_config.seq_len,
            batch_size=config.inner.batch_size,
            seed=config.corpus.seed,
            shard_index=config.corpus.shard_index,
            num_shards=config.corpus.num_shards,
        )
        self.eval_set = eval_batches(
            self.corpus.val,
            seq_len=self.model_config.seq_len,
            batch_size=config.inner.batch_size,
            num_batches=config.eval.batches,
        )
        outer_settings = outer_sgd_settings(config.outer.lr, config.outer.momentum, config.outer.nesterov)
        # --fragments F > 1: one fragment per round, the outer state in fragments (node/outer/fragments.py)
        fragments = fragment_schedule(config)
        if fragments is None:
            outer = self.replica.outer_state(offload=config.outer.offload, **outer_settings)
        else:
            if not isinstance(self.replica, SingleReplica):
                raise ConfigError("--fragments needs the model in this process: --local-workers 1")
            params = [p for p in self.model.parameters() if p.requires_grad]
            plan = model_fragment_plan(self.model, fragments.num_fragments)
            device = torch.device("cpu") if config.outer.offload else params[0].device
            outer = FragmentedOuterState(params, plan, device=device, **outer_settings)
            log.info("fragments (%d, a round each; H=%d, overlap %d steps, mix %g):\n%s", fragments.num_fragments,
                     fragments.inner_steps, fragments.overlap_steps, config.outer.fragment_mix,
                     outer.plan.describe())  # fmt: skip
        self.diloco = DiLoCo(
            self.model,
            outer_lr=config.outer.lr,
            outer_momentum=config.outer.momentum,
            nesterov=config.outer.nesterov,
            offload=config.outer.offload,
            local=self.replica,
            outer=outer,
        )
        # The outer round: phase clock, the swarm's round, adoption, overlap (node/outer/round.py).
        self.round = OuterRound(
            self.diloco,
            averager=averager or swarm or SoloAverager(),
            swarm=swarm,
            settings=RoundSettings(
                inner_steps=config.inner.steps, round_seconds=config.rounds.seconds, overlap=config.outer.overlap,
                model=config.architecture.preset, corpus_sha256=self.corpus.sha256,
                rank=config.corpus.rank, architecture=self.model_config.architecture(),
                fragments=fragments, fragment_mix=config.outer.fragment_mix,
                pace_sends=config.outer.pace_sends == "auto",
            ),
            data=self.batches,
            stop_requested=self._stop.is_set,
            on_applied=self._round_applied,
            open_streams=self.replica.open_streams if config.rounds.streams > 1 else None,
        )  # fmt: skip
        self.checkpoint_root = self.run_dir / "checkpoints"
        self.resumed_from: Path | None = None
        self._saved_step = -1  # inner step of the newest checkpoint written by this process
        self._restored_swarm_state: dict[str, torch.Tensor] = {}  # from the checkpoint resumed (_restore)
        self.checkpoints = CheckpointWriter(self.checkpoint_root, keep=config.checkpoint.keep)
        self._prepare_run_dir()
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", sinks=self._metrics_sinks())
        # Round records and their held-out evals, read from the round's one host copy of θ_global.
        self.round_end = RoundEnd(
            diloco=self.diloco, replica=self.replica, eval_set=self.eval_set, metrics=self.metrics,
            eval_every=eval_interval(config),  # rounds between held-out evals (the final one always)
            background=background_eval(config, self.replica, self.model_config, self.device, self.eval_set),
            host=self.round.host, overlap=config.outer.overlap,
            keeps_local=fragments is not None,  # the model's other fragments train on after the eval
        )  # fmt: skip

    @property
    def progress(self) -> RoundProgress:
        """The run's counters (the outer round's)."""
        return self.round.progress

    def _metrics_sinks(self) -> list[MetricsSink]:
        """The progress display, the liveness file of a swarm node (``dtnode health`` of a node with
        no port to ask: node/ops/liveness.py), and the Prometheus endpoint (on --metrics-listen:
        loopback unless asked otherwise, as it has no authentication) if --metrics-port."""
        config = self.config
        sinks: list[MetricsSink] = [progress_sink(config)]
        if self.swarm is not None:
            bounds = LivenessBounds(
                inner_steps=config.inner.steps, round_seconds=config.rounds.seconds,
                join_window=timedelta(seconds=config.rounds.join_window),
                stall_timeout=AllReduceConfig.stall_timeout,  # the swarm's (node/swarm/setup.py keeps the default)
                sync_deadline=timedelta(seconds=config.rounds.sync_deadline),
            )  # fmt: skip
            sinks.append(LivenessSink(self.run_dir / LIVENESS_FILE, bounds))
        if config.metrics.port:
            exporter = PrometheusExporter()
            host = config.metrics.listen.strip("[]")  # an IPv6 host may come bracketed
            try:
                exporter.serve(host, config.metrics.port)
            except OSError as error:
                raise ConfigError(f"cannot serve metrics on {host}:{config.metrics.port}: {error}") from None
            log.info("Prometheus metrics at http://%s:%d/metrics", host, config.metrics.port)
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
        """The checkpoint's state tree (node/train/checkpoint_state.py); ``model_is_global``: the model holds θ_global."""
        return self._checkpoint_state(model_is_global)[0]

    def _checkpoint_state(self, model_is_global: bool) -> tuple[dict[str, Any], list[torch.Tensor]]:
        return checkpoint_state(
            replica=self.replica, diloco=self.diloco, batches=self.batches, swarm=self.swarm,
            host=self.round.host.get(), model_is_global=model_is_global,
        )  # fmt: skip

    def save(self, *, model_is_global: bool = False) -> None:
        """Checkpoint the state now: copied to host memory here (the global state: the round's one
        copy, node/train/round_end.py), hashed and written on the writer's thread (node/train/checkpoint_writer.py)
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
            "model": self.config.architecture.preset,
            "tokenizer_sha256": self.corpus.tokenizer_sha256,
            "time": time.time(),
            "model_config": dataclasses.asdict(self.model_config),  # a resume checks its shapes first
        }  # + param_hash, of the snapshot's global params, by the writer
        if outer_round := self.round.state_dict():  # a fragment's mix still due (node/outer/round.py)
            meta["outer_round"] = outer_round
        state, owned = self._checkpoint_state(model_is_global)
        self.checkpoints.submit(f"step-{progress.step:010d}", state, meta, owned=owned)
        self._saved_step = progress.step

    def _restore(self, path: Path) -> None:
        meta, self._restored_swarm_state = restore_state(
            path, replica=self.replica, diloco=self.diloco, batches=self.batches,
            corpus_sha256=self.corpus.sha256, model_name=self.config.architecture.preset,
        )  # fmt: skip
        self.round.restore(
            RoundProgress(
                step=meta["step"],
                round=meta["round"],
                tokens=meta["tokens"],
                round_tokens=meta["round_tokens"],
            ),
            state=meta.get("outer_round"),
        )
        self.resumed_from = path
        self._saved_step = self.progress.step
        log.info(
            "resumed from %s: round %d, step %d, param_hash %s",
            path, meta["round"], meta["step"], meta["param_hash"][:12],
        )  # fmt: skip

    # --- the loop ---
    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def request_stop(self) -> None:
        """Ask the loop to stop after the current inner step (signal-handler safe)."""
        self._stop.set()

    def _done(self) -> bool:
        config, progress = self.config, self.progress
        rounds = progress.round + self.round.in_flight  # applied or in flight
        return (config.run.max_rounds > 0 and rounds >= config.run.max_rounds) or (
            config.run.max_steps > 0 and progress.step >= config.run.max_steps
        )

    def inner_step(self) -> dict[str, Any]:
        """One AdamW step on the next batch of this node's shard; returns its step record."""
        start = time.perf_counter()
        self.round_end.phase_started(start)  # the first round's wall time starts at this process's first step
        batches = [
            self.batches.next_batch() for _ in range(self.config.inner.grad_accumulation)
        ]  # (B, T) pairs
        lr = self.schedule.lr(self.progress.step)
        loss_value = self.replica.train_step(batches, lr)  # returns when the step is done
        seconds = time.perf_counter() - start
        progress = self.progress
        num_tokens = sum(x.numel() for x, _ in batches)
        self.round.count_step(num_tokens, seconds)
        return {
            "kind": "step",
            "round": self.round.phase,
            "step": progress.step,
            "loss": loss_value,
            "lr": lr,
            "tokens": progress.tokens,
            "tokens_per_s": num_tokens / seconds,
            "time": time.time(),
        }

    def evaluate(self) -> float:
        return self.replica.eval_loss(self.eval_set)

    def _round_applied(self, applied: RoundApplied) -> None:
        """A round was applied (``OuterRound.on_applied``, before the next is in flight): write its
        record (now, or after its background eval) and checkpoint on schedule."""
        config, progress = self.config, self.progress
        self.round_end.record(
            applied,
            progress=progress,
            shard=(self.batches.shard_index, self.batches.num_shards),
            final=self._done() or self._stop.is_set(),
        )
        if config.checkpoint.every and progress.round % config.checkpoint.every == 0:
            self.save(model_is_global=applied.model_is_global)

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
            config.architecture.hf_config or config.architecture.init_from or config.architecture.preset, f"{self.model.num_params():,}",
            self.corpus.description, config.inner.steps, self.device, self.run_dir,
        )  # fmt: skip
        try:
            try:
                self.round.start(self._restored_swarm_state)
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
        while not self._done() and not self._stop.is_set():
            record = self.inner_step()
            self.metrics.write(record)  # its sinks log every log_every-th step and export it
            self.checkpoints.poll()  # a background write that finished is logged; one that failed raises
            self.round_end.poll()  # a background eval that landed: its round record is written
            if not math.isfinite(record["loss"]):
                raise FloatingPointError(f"inner loss is {record['loss']} at step {record['step']}")
            self.round.at_step_boundary()  # the phase's end, if due: its round is recorded in _round_applied
        if self._stop.is_set():
            log.info("stop requested: checkpointing at step %d", self.progress.step)
        self.round.finish()  # overlap: the round still in flight, applied and recorded
        self.round_end.finish()  # the last eval waited for, every round record written

    def export(self) -> Path:
        """Write the global params, the swarm's model, as ``RUN_DIR/model.safetensors`` (node/model/export.py)."""
        progress = self.progress
        path = export_model(
            self.run_dir,
            self.model,
            self.diloco.global_params,  # the averaging thread is closed: nothing steps it now
            preset=self.config.architecture.preset,
            tokenizer=tokenizer_info(self.config.corpus.path, self.corpus.vocab_size, self.tokenizer),
            round_index=progress.round,
            step=progress.step,
            tokens=progress.tokens,
        )
        log.info("exported the global params of round %d to %s", progress.round, path)
        return path
