"""Which local layout a node runs: its number of local workers and their ``dp x tp x pp`` mesh.

A :class:`LocalLayout` says how the node's local ranks share its replica (the mesh, the ZeRO stage, the
pipeline schedule, precision, recompute, the bucket the flat vector moves in); every rank builds its part
of the replica from it (``node.parallel.engine.RankEngine``).

Resolution (``resolve_layout``), in order:
    1. workers: ``--local-workers K``, else one per CUDA device, else one (a CPU node runs in one process);
    2. one worker and no layout flag: no local parallelism at all (``None``: the replica stays in the
       daemon's process, ``node.model.replica.SingleReplica``);
    3. ``--dp/--tp/--pp`` all unset (0): the planner's choice (``node.parallel.plan.plan_layout``) for K
       devices of this machine's memory (the GPU's, or the host's divided by K);
    4. some set: the unset axes are 1, and ``dp * tp * pp`` must equal K.
The layout is then checked against the model and batch (``plan.invalid_reason``: tp divides the heads and
the MLP width, pp at most the layers, dp divides the batch, micro-batches divide the replica's batch) so a
mistake is a one-line ``ConfigError`` before any process starts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from node.config import ConfigError, NodeConfig
from node.model.efficiency import resolve_precision
from node.model.gpt import ModelConfig
from node.parallel.plan import Layout, invalid_reason, plan_layout
from node.parallel.tensor import device_type

log = logging.getLogger("dtnode")


@dataclass(frozen=True)
class LocalLayout:
    """How a node's local ranks share its replica; ``dp * tp * pp`` is the number of local workers."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 1  # 1: AdamW state sharded over dp; 3: FSDP2 (weights, grads and state sharded)
    pp_schedule: str = "1f1b"  # gpipe or 1f1b
    num_microbatches: int = 1  # per dp replica and inner step, when pp > 1
    virtual_stages: int = 1  # pipeline stages per rank (> 1 with the interleaved schedule)
    sequence_parallel: bool = False  # with tp > 1: norms and residuals on T / tp positions per rank
    bucket_elements: int = 16 * 2**20  # the flat vector moves between ranks in pieces of this many numbers
    precision: str = "fp32"  # fp32 or bf16 (autocast of the forward pass)
    activation_checkpointing: bool = False
    grad_accumulation: int = 1  # batches per inner step

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp


def num_local_workers(config: NodeConfig) -> int:
    """``--local-workers``, else one per CUDA device (unless ``--device cpu``), else 1."""
    if config.parallel.local_workers:
        return config.parallel.local_workers
    return torch.cuda.device_count() if config.run.device != "cpu" and torch.cuda.is_available() else 1


def device_memory_bytes(num_workers: int, device: str = "auto") -> int:
    """Memory of one local device: the first GPU's, or on CPU the host's RAM shared by the workers."""
    if device != "cpu" and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // num_workers


def resolve_layout(config: NodeConfig, model_config: ModelConfig) -> LocalLayout | None:
    """The node's local layout (see the module docstring), or None for a single process."""
    num_workers = num_local_workers(config)
    explicit = (config.parallel.dp, config.parallel.tp, config.parallel.pp)
    if num_workers == 1 and not any(explicit):
        return None
    num_microbatches = config.parallel.microbatches
    if not any(explicit):
        try:
            plan = plan_layout(
                model_config,
                num_devices=num_workers,
                device_memory_bytes=device_memory_bytes(num_workers, config.run.device),
                seq_len=model_config.seq_len,
                batch_size=config.inner.batch_size,
            )
        except ValueError as error:
            raise ConfigError(f"no local layout for {num_workers} workers: {error}") from None
        dp, tp, pp = plan.layout.dp, plan.layout.tp, plan.layout.pp
        num_microbatches = num_microbatches or plan.num_microbatches
    else:
        dp, tp, pp = (size or 1 for size in explicit)
        if dp * tp * pp != num_workers:
            raise ConfigError(
                f"--local-workers: dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp} must equal the number of local workers "
                f"({num_workers}; set --local-workers, or the layout flags to match)"
            )
    reason = invalid_reason(model_config, Layout(dp=dp, tp=tp, pp=pp), config.inner.batch_size)
    if reason is not None:
        preset = config.architecture.preset
        # The flag of the axis at fault (the planner's layout: the worker count it was planned for).
        axis = reason.split("=")[0] if reason[:3] in ("dp=", "tp=", "pp=") else "pp"
        flag = f"--{axis}" if any(explicit) else "--local-workers"
        raise ConfigError(f"{flag}: local layout dp={dp} x tp={tp} x pp={pp} cannot run {preset}: {reason}")
    num_microbatches = num_microbatches or (pp if pp > 1 else 1)
    replica_batch = config.inner.batch_size // dp
    if pp > 1 and replica_batch % num_microbatches != 0:
        raise ConfigError(
            f"--microbatches {num_microbatches} must divide the per-replica batch {replica_batch} "
            f"(batch_size {config.inner.batch_size} / dp {dp})"
        )
    if pp > 1 and config.parallel.pp_schedule == "1f1b" and num_microbatches < pp:
        raise ConfigError(f"1F1B needs --microbatches >= pp ({pp}), got {num_microbatches}")
    if config.parallel.sequence_parallel and (tp == 1 or pp > 1):
        raise ConfigError("--sequence-parallel needs --tp > 1 and no pipeline stages (--pp 1)")
    if config.parallel.sequence_parallel and model_config.seq_len % tp != 0:
        raise ConfigError(
            f"--sequence-parallel needs seq_len ({model_config.seq_len}) divisible by tp ({tp})"
        )
    interleaved = pp > 1 and config.parallel.pp_schedule == "interleaved"
    virtual_stages = config.parallel.pp_virtual_stages if interleaved else 1
    if interleaved and pp * virtual_stages > model_config.num_layers:
        raise ConfigError(
            f"interleaved: pp x --pp-virtual-stages = {pp * virtual_stages} stages exceed the "
            f"{model_config.num_layers} layers of {config.architecture.preset}"
        )
    if interleaved and num_microbatches % pp != 0:
        raise ConfigError(
            f"interleaved 1F1B needs --microbatches divisible by pp ({pp}), got {num_microbatches}"
        )
    if config.parallel.zero == 3 and pp > 1:
        raise ConfigError("--zero 3 (FSDP2) does not run with pipeline stages: set --pp 1, or use --zero 1")
    if config.parallel.zero == 1 and dp > 1 and tp > 1:
        log.warning("ZeRO-1 needs tp=1: the AdamW state is replicated over dp (--zero 3 shards it)")
    return LocalLayout(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=config.parallel.zero,
        pp_schedule=config.parallel.pp_schedule,
        num_microbatches=num_microbatches if pp > 1 else 1,
        virtual_stages=virtual_stages,
        sequence_parallel=config.parallel.sequence_parallel,
        bucket_elements=max(1, int(config.parallel.local_bucket_mb * 2**20) // 4),  # fp32 numbers
        precision=resolve_precision(config.parallel.precision, torch.device(device_type())),
        activation_checkpointing=config.parallel.activation_checkpointing,
        grad_accumulation=config.inner.grad_accumulation,
    )
