"""Pipeline parallelism: cut a ``GPT`` into consecutive stages, one per rank, and train it with micro-batches.

Partitioning
------------
Stage ``s`` holds a contiguous range of transformer blocks ``layers[start:end]``; stage 0 also holds the
token embedding and the last stage the final RMSNorm and output head (GPipe, Huang et al. 2019). The
ranges are chosen by :func:`split_stages` to minimise the parameter count of the heaviest stage (every
stage has at least one block), because with equal-width blocks parameters are a good proxy for both
memory and compute per token. The stage modules are built by :func:`build_stage`: a copy of the full
model with the other stages' blocks deleted and the end pieces set to ``None``, as ``GPT`` supports
(surviving blocks keep their names, so a stage's ``state_dict`` keys are the full model's keys).

One training step (:class:`PipelineRunner`)
-------------------------------------------
The batch (B, T) is split along B into ``num_microbatches`` equal micro-batches, and the stages exchange
activations (forward) and their gradients (backward) with point-to-point sends between neighbour ranks,
through ``torch.distributed.pipelining``:

- GPipe (Huang et al. 2019): all micro-batch forwards, then all backwards; simple, but every stage keeps
  the activations of all ``num_microbatches`` micro-batches alive.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): after a warm-up of forwards each stage alternates one
  forward and one backward, so at most ``num_stages`` micro-batches are in flight per stage. Needs
  ``num_microbatches >= num_stages``.

Both have the same bubble ``(num_stages - 1) / (num_microbatches + num_stages - 1)`` of the step. The loss
of each micro-batch is ``cross_entropy_loss`` (a mean over its positions); the gradients are summed over
micro-batches and divided by ``num_microbatches``, so with equal micro-batches the step's gradient is the
gradient of the mean loss over the whole batch, exactly as without pipelining. The optimizer is left to
the caller (``zero_grad / forward_backward / step``), each rank stepping the parameters of its own stage.

Backend: gloo on CPU, nccl when CUDA is available (:func:`pipeline_backend`, :func:`pipeline_device`);
the rest is one code path. Every send/receive is bounded by the process group's timeout.

``torch.distributed.pipelining`` is imported by :class:`PipelineRunner` when it is built: the import costs
about a CPU second, which a node without pipeline stages (and each of its local ranks) should not pay.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from node.model.gpt import GPT, ModelConfig, cross_entropy_loss
from node.parallel.tensor import device_type

ScheduleName = Literal["gpipe", "1f1b", "interleaved"]
SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b", "interleaved")


def pipeline_backend() -> str:
    """The process-group backend for pipeline sends: nccl when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def pipeline_device() -> torch.device:
    """This rank's device: ``cuda:$LOCAL_RANK`` when the ranks run on CUDA (``device_type``), else the CPU."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _layer_num_params(config: ModelConfig) -> int:
    """Parameters of one TransformerBlock (all blocks have the same shapes)."""
    dim, kv_dim = config.dim, config.resolved_num_kv_heads * config.head_dim
    attention = 2 * dim * dim + 2 * dim * kv_dim  # wq, wo + wk, wv
    feed_forward = 3 * dim * config.resolved_mlp_hidden_dim  # w1, w2, w3
    return attention + feed_forward + 2 * dim  # + attention_norm, ffn_norm


def split_stages(model: GPT, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous layer ranges ``[(start, end), ...]``, one per stage, balanced by parameter count.

    Balancing rule: the cost of stage ``s`` is the number of parameters it holds, i.e. its blocks plus
    the token embedding for stage 0 and the final norm + output head for the last stage. Among all splits
    of the ``num_layers`` blocks into ``num_stages`` non-empty contiguous ranges we return the one that
    minimises the largest stage cost (the pipeline runs at the pace of its slowest stage); ties go to the
    split found first, which gives earlier stages fewer blocks. Exact dynamic programme over split points,
    O(num_stages * num_layers**2) on integers, so it is deterministic and identical on every rank.

    Raises ValueError for ``num_stages < 1``, more stages than layers, or tied embeddings across stages
    (embedding and output head share one matrix and would have to live on two ranks).
    """
    config = model.config
    num_layers = len(model.layers)
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} non-empty pipeline stages")
    if config.tie_embeddings and num_stages > 1:
        raise ValueError(
            "tie_embeddings shares the embedding with the output head; it cannot be split into pipeline stages"
        )
    layer_cost = _layer_num_params(config)
    first_extra = config.vocab_size * config.dim  # tok_embeddings
    last_extra = config.dim + config.vocab_size * config.dim  # norm + output

    def stage_cost(stage: int, start: int, end: int) -> int:
        cost = (end - start) * layer_cost
        if stage == 0:
            cost += first_extra
        if stage == num_stages - 1:
            cost += last_extra
        return cost

    # best[s][e] = (smallest max-cost of putting layers [0, e) on stages 0..s-1, split point before e).
    infinity = float("inf")
    best: list[list[float]] = [[infinity] * (num_layers + 1) for _ in range(num_stages + 1)]
    split_before: list[list[int]] = [[0] * (num_layers + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for stage_count in range(1, num_stages + 1):
        for end in range(stage_count, num_layers + 1):
            for start in range(stage_count - 1, end):
                if best[stage_count - 1][start] == infinity:
                    continue
                cost = max(best[stage_count - 1][start], stage_cost(stage_count - 1, start, end))
                if cost < best[stage_count][end]:
                    best[stage_count][end] = cost
                    split_before[stage_count][end] = start
    ranges: list[tuple[int, int]] = []
    end = num_layers
    for stage_count in range(num_stages, 0, -1):
        start = split_before[stage_count][end]
        ranges.append((start, end))
        end = start
    assert end == 0, "the split must start at layer 0"
    return ranges[::-1]


def build_stage(model: GPT, stage_index: int, num_stages: int) -> GPT:
    """A copy of ``model`` holding only stage ``stage_index`` of ``split_stages(model, num_stages)``.

    The other stages' blocks are deleted from ``layers`` (survivors keep their keys ``"i"``), and
    ``tok_embeddings`` / ``norm`` + ``output`` are set to ``None`` unless this is the first / last stage.
    The copy is deep (``model`` is left untouched); its parameters start equal to the full model's.
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    start, end = split_stages(model, num_stages)[stage_index]
    stage = copy.deepcopy(model)
    for key in list(stage.layers.keys()):
        if not start <= int(key) < end:
            del stage.layers[key]
    if stage_index != 0:
        stage.tok_embeddings = None
    if stage_index != num_stages - 1:
        stage.norm = None
        stage.output = None
    return stage


class PipelineRunner:
    """Runs forward + backward of a rank's pipeline stage(s) over micro-batches; the caller owns the optimizer.

    Every rank of ``group`` (the world when ``None``) builds one runner with its ``stage_model`` (from
    :func:`build_stage`), where the group rank is the stage index, and then, each step, calls
    ``zero_grad``, :meth:`forward_backward` with the same batch, and its optimizer's ``step``.

    Interleaved 1F1B (Narayanan et al. 2021, section 2.2): each rank holds ``v`` stages ("virtual stages")
    ``rank, rank + p, ..., rank + (v - 1) p`` of ``v * p``; pass them as lists (``stage_model`` and
    ``stage_index``). A micro-batch then crosses every rank ``v`` times, and the bubble shrinks to
    ``(p - 1) / (v * m + p - 1)`` at the price of ``v`` times the point-to-point messages.
    """

    def __init__(
        self,
        stage_model: GPT | Sequence[GPT],
        *,
        stage_index: int | Sequence[int],
        num_stages: int,
        num_microbatches: int,
        schedule: ScheduleName = "1f1b",
        device: torch.device | None = None,
        group: dist.ProcessGroup | None = None,
        scale_grads: bool = True,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
        if num_microbatches < 1:
            raise ValueError(f"num_microbatches must be at least 1, got {num_microbatches}")
        stage_models = [stage_model] if isinstance(stage_model, GPT) else list(stage_model)
        stage_indices = [stage_index] if isinstance(stage_index, int) else list(stage_index)
        if len(stage_models) != len(stage_indices):
            raise ValueError(f"{len(stage_models)} stage modules for {len(stage_indices)} stage indices")
        group_size = dist.get_world_size(group)
        if group_size * len(stage_models) != num_stages:
            raise ValueError(
                f"the process group has {group_size} ranks of {len(stage_models)} stage(s) each, "
                f"but there are {num_stages} stages"
            )
        interleaved = schedule == "interleaved"
        if interleaved != (len(stage_models) > 1):
            raise ValueError("the interleaved schedule takes several stages per rank, the others one")
        if schedule == "1f1b" and num_microbatches < num_stages:
            raise ValueError(
                f"1F1B needs num_microbatches >= num_stages, got {num_microbatches} < {num_stages}"
            )
        if interleaved and num_microbatches % group_size != 0:
            raise ValueError(
                f"interleaved 1F1B needs num_microbatches divisible by the {group_size} ranks, got {num_microbatches}"
            )
        self.stage_indices = stage_indices
        self.stage_index = stage_indices[0]
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.device = pipeline_device() if device is None else device
        self.group = group
        self.stage_models = [model.to(self.device) for model in stage_models]
        self.stage_model = self.stage_models[0]
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        # Shapes of the activations sent between stages are inferred on the first step (a metadata
        # exchange), so the runner needs no knowledge of batch size or sequence length up front.
        stages = [
            PipelineStage(model, index, num_stages, self.device, group=group)
            for model, index in zip(self.stage_models, stage_indices, strict=True)
        ]
        # scale_grads=True divides the summed micro-batch gradients by num_microbatches: the gradient of
        # the mean of the micro-batch mean losses, i.e. of the batch mean when micro-batches are equal.
        # With scale_grads=False the gradients are the sum over micro-batches, for a caller that accumulates
        # several batches and divides once at the end (the schedule would rescale the earlier batches too).
        schedule_class = {
            "gpipe": ScheduleGPipe,
            "1f1b": Schedule1F1B,
            "interleaved": ScheduleInterleaved1F1B,
        }[schedule]
        self._schedule = schedule_class(
            stages if interleaved else stages[0],  # type: ignore[arg-type]  # multi- vs single-stage schedules
            num_microbatches,
            loss_fn=cross_entropy_loss,
            scale_grads=scale_grads,
        )

    @property
    def is_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def is_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    def forward_backward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """Forward and backward of this stage over the micro-batches of ``tokens`` / ``targets`` (B, T).

        Pass the same batch on every rank (the first stage reads ``tokens``, the last ``targets``).
        Gradients accumulate into ``stage_model``'s ``.grad``. Returns the batch's mean loss (the mean of
        the micro-batch losses), broadcast from the last stage so every rank gets the same scalar.
        """
        batch_size = tokens.shape[0]
        if batch_size % self.num_microbatches != 0:
            raise ValueError(
                f"batch size {batch_size} is not divisible by num_microbatches {self.num_microbatches}"
            )
        microbatch_losses: list[Tensor] = []
        if self.is_first and self.is_last:
            self._schedule.step(
                tokens.to(self.device), target=targets.to(self.device), losses=microbatch_losses
            )
        elif self.is_first:
            self._schedule.step(tokens.to(self.device))
        elif self.is_last:
            self._schedule.step(target=targets.to(self.device), losses=microbatch_losses)
        else:
            self._schedule.step()
        if self.is_last:
            assert len(microbatch_losses) == self.num_microbatches, "one loss per micro-batch"
            loss = torch.stack([loss.detach().float() for loss in microbatch_losses]).mean()  # scalar
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        last_rank = (self.num_stages - 1) % dist.get_world_size(self.group)  # the rank of the last stage
        dist.broadcast(loss, group=self.group, group_src=last_rank)
        return loss
