"""What the node's ``auto`` settings for device efficiency resolve to: precision, compile, eval cadence.

- ``--precision auto``: bf16 autocast of the forward pass on a CUDA device that supports bf16, fp32
  elsewhere (on CPU bf16 matmuls are slower than fp32 and the parity tests hold fp32 losses).
- ``--compile auto``: ``torch.compile`` of the model on CUDA (a fused, CUDA-graph-free graph per
  block; the first steps pay the compilation), off on CPU, where inductor's C++ toolchain may be
  missing and eager is what the tests compare against. A node with local workers never compiles:
  its layouts (DTensor tensor parallelism, pipeline stages, FSDP2) are applied per rank by
  ``node.parallel`` and are not wrapped by ``torch.compile`` here.
- ``--eval-background auto``: the held-out eval on its own thread (and CUDA stream) while the next
  phase trains (``node/train/held_out.py``), on with CUDA; off on CPU, where it would share the cores the
  inner steps already use (measured: BENCHMARKS.md, "Held-out eval in the background"), and off
  with local workers, whose replica answers one command at a time.
- ``--eval-every 0`` (auto): the held-out eval runs every N rounds, N the smallest with
  ``eval_batches`` forward passes costing at most ``EVAL_BUDGET`` of the rounds' inner compute
  (a training step costs about ``STEP_COST_IN_FORWARDS`` forward passes: forward + a backward of
  twice its cost). The run's last round is always evaluated (its loss is the run's result); the first
  is not (it would cost a short run far more than the budget).
"""

from __future__ import annotations

import logging
import math

import torch

from node.config import ConfigError, NodeConfig

log = logging.getLogger("dtnode")

EVAL_BUDGET = 0.01  # the share of a round's inner compute that held-out evals may cost on average
STEP_COST_IN_FORWARDS = 3.0  # one training step ≈ forward + backward (≈ 2 forwards) of the same batch


def eval_interval(config: NodeConfig) -> int:
    """Rounds between held-out evals: ``--eval-every``, or with 0 the auto rule of the module docstring
    (with ``--fragments F`` a round comes every H/F inner steps on average: the rule counts those)."""
    if config.eval.every > 0:
        return config.eval.every
    steps_per_round = config.inner.steps / config.outer.fragments
    step_forwards = STEP_COST_IN_FORWARDS * steps_per_round * config.inner.grad_accumulation
    return max(1, math.ceil(config.eval.batches / (step_forwards * EVAL_BUDGET)))


def resolve_precision(precision: str, device: torch.device) -> str:
    """``fp32`` or ``bf16`` for ``--precision`` on ``device`` (``auto``: see the module docstring)."""
    if precision != "auto":
        return precision
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def resolve_compile(setting: str, device: torch.device, *, local_workers: bool) -> bool:
    """Whether to ``torch.compile`` the model (``--compile auto|on|off``, see the module docstring)."""
    if setting == "off":
        return False
    if local_workers:
        if setting == "on":
            raise ConfigError(
                "--compile on needs a node without local workers (the intra-node layouts are not compiled)"
            )
        return False
    return setting == "on" or device.type == "cuda"


def resolve_eval_background(setting: str, device: torch.device, *, local_workers: bool) -> bool:
    """Whether the held-out eval runs on its own thread (``--eval-background``, see the module docstring)."""
    if setting == "off":
        return False
    if local_workers:
        if setting == "on":
            raise ConfigError("--eval-background on needs a node without local workers")
        return False
    return setting == "on" or device.type == "cuda"
