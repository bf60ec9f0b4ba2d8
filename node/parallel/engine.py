"""One rank of a node's model replica: the layout applied to the plain ``GPT``, its inner step, eval and params.

Every local rank of a node builds one :class:`RankEngine` with the same arguments (its
``node.parallel.layout.LocalLayout``); its methods are collectives (every rank calls them together, in the
same order). Rank 0 is the daemon and sends each rank the next call (``node.parallel.commands``, over the
processes of ``node.parallel.local``).

Build order (as torchtitan applies its parallelisms), every step a function of ``node.parallel``:
    1. the full model from the seed (``GPT.init_weights`` draws each parameter from ``(seed, name)``, so
       every rank starts from the same weights as a single-process node);
    2. pipeline: keep this rank's stage (``build_stage``, balanced by parameter count), or its ``V``
       stages ``pp_index + v * pp`` with the interleaved 1F1B schedule;
    3. tensor parallel: Megatron plans over the ``tp`` axis (``apply_tensor_parallel``);
    4. activation checkpointing of each ``TransformerBlock`` (recomputed in the backward pass);
    5. bf16 autocast of the forward pass (``precision="bf16"``);
    6. ZeRO-3: FSDP2 ``fully_shard`` over the ``dp`` axis; or ZeRO-1: the AdamW state sharded over ``dp``
       (``ZeroRedundancyOptimizer``, with ``tp == 1``); plain AdamW otherwise.

One inner step (:meth:`RankEngine.train_step`), per accumulation micro-step:
    Phase 1: this rank's dp replica takes rows ``[d * B / dp, (d + 1) * B / dp)`` of the node's batch;
    Phase 2: forward + backward — through the pipeline schedule (GPipe / 1F1B micro-batches) when pp > 1,
             with the tensor-parallel all-reduces inside the blocks;
then the gradients are averaged over dp (FSDP2 reduce-scatters them itself), divided by the accumulation
count, clipped by their global norm (reduced over tp shards and pipeline stages), and AdamW steps. The
gradient is that of the mean loss over the node's whole batch, as in a single process.

The node's flat parameter vector (:meth:`read_params` / :meth:`write_params`) is the concatenation of the
full model's parameters in ``GPT.named_parameters`` order, whatever the layout: the one DiLoCo averages
and hashes, so nodes with different layouts meet in one swarm.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from node.config import NodeConfig
from node.model.gpt import GPT, ModelConfig, cross_entropy_loss
from node.parallel.layout import LocalLayout
from node.parallel.mesh import build_mesh
from node.parallel.pipeline import PipelineRunner, build_stage, pipeline_device
from node.parallel.tensor import apply_tensor_parallel, clip_grad_norm, device_type, full_tensor
from node.parallel.zero import (
    apply_fully_shard,
    average_gradients,
    build_inner_optimizer,
    build_zero_optimizer,
    local_optimizer,
    optimizer_state_bytes,
)

Batch = tuple[Tensor, Tensor]  # tokens (B, T), targets (B, T)
Ranges = dict[int, tuple[int, int]]  # local rank -> its range [first, last) of the node's flat vector


def bucket_pieces(start: int, end: int, ranges: Ranges) -> list[tuple[int, int, int]]:
    """(rank, low, high): the parts of bucket [start, end) that fall in each rank's range."""
    cuts = [(rank, max(start, first), min(end, last)) for rank, (first, last) in sorted(ranges.items())]
    return [(rank, low, high) for rank, low, high in cuts if low < high]


def parameter_offsets(model_config: ModelConfig) -> dict[str, tuple[int, torch.Size]]:
    """Name -> (offset, shape) of every trainable parameter in the node's flat vector (the full model's order)."""
    with torch.device("meta"):
        reference = GPT(model_config)
    offsets: dict[str, tuple[int, torch.Size]] = {}
    offset = 0
    for name, param in reference.named_parameters():
        if param.requires_grad:
            offsets[name] = (offset, param.shape)
            offset += param.numel()
    return offsets


def checkpoint_blocks(model: GPT) -> None:
    """Activation checkpointing: each block keeps only its input and recomputes the rest in backward.

    The block's ``forward`` is wrapped in place (no wrapper module), so parameter names, and with them the
    node's flat vector and its checkpoints, stay those of the plain model.
    """
    for block in model.layers.values():
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]


def autocast_forward(model: GPT, precision: str) -> None:
    """bf16: run ``model``'s forward under ``torch.autocast`` and hand fp32 activations/logits onwards.

    Weights, gradients and the optimizer stay fp32 (autocast casts per operation); the fp32 output keeps
    the cross-entropy and the activations a pipeline stage sends in full precision.
    """
    if precision == "fp32":
        return
    if precision != "bf16":
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    forward = model.forward
    autocast = torch.autocast(device_type(), dtype=torch.bfloat16)

    def bf16_forward(tokens: Tensor) -> Tensor:
        with autocast:
            output = forward(tokens)
        return output.float()

    model.forward = bf16_forward  # type: ignore[method-assign]


class RankEngine:
    """This rank's part of the node's replica; every method is a collective over the node's ranks."""

    def __init__(
        self, model_config: ModelConfig, config: NodeConfig, layout: LocalLayout, *, timeout: timedelta
    ) -> None:
        if not dist.is_initialized():
            raise ValueError("RankEngine needs the node's process group: call init_process_group first")
        self.model_config = model_config
        self.config = config
        self.layout = layout
        self.timeout = timeout
        self.device = pipeline_device()
        self.mesh = build_mesh(layout.dp, layout.tp, layout.pp)
        self.dp_index = self.mesh["dp"].get_local_rank()
        self.tp_index = self.mesh["tp"].get_local_rank()
        self.pp_index = self.mesh["pp"].get_local_rank()
        self.offsets = parameter_offsets(model_config)
        self.num_elements = sum(shape.numel() for _, shape in self.offsets.values())

        # Pipeline stages of this rank: one, or with the interleaved schedule pp_index + v * pp for v < V.
        self.num_stages = layout.pp * layout.virtual_stages
        self.stage_indices = [self.pp_index + v * layout.pp for v in range(layout.virtual_stages)]
        torch.manual_seed(config.run.seed)  # the same draw as a single-process node's model
        full_model = GPT(model_config)
        stage_models = (
            [build_stage(full_model, index, self.num_stages) for index in self.stage_indices]
            if layout.pp > 1
            else [full_model]
        )
        for stage_model in stage_models:
            stage_model.to(self.device)
            stage_model.train()
            if layout.tp > 1:
                apply_tensor_parallel(
                    stage_model, self.mesh["tp"], sequence_parallel=layout.sequence_parallel
                )
            if layout.activation_checkpointing:
                checkpoint_blocks(stage_model)
            autocast_forward(stage_model, layout.precision)
        self.fully_sharded = layout.zero == 3 and layout.dp > 1
        if self.fully_sharded:  # dp only (no pipeline): one stage
            apply_fully_shard(stage_models[0], self.mesh["dp"])
        self.stage_models = stage_models
        # What the optimizer, the gradient mean and clipping walk: every parameter this rank holds.
        model: nn.Module = stage_models[0] if len(stage_models) == 1 else nn.ModuleList(stage_models)
        self.model = model
        self.dp_group = self.mesh["dp"].get_group()
        self.pp_group = self.mesh["pp"].get_group()
        # ZeroRedundancyOptimizer broadcasts whole parameters, which tensor-parallel DTensors do not
        # support: with tp > 1 ZeRO-1 keeps a replicated AdamW state (--zero 3 shards it with FSDP2).
        if layout.dp > 1 and layout.zero == 1 and layout.tp == 1:
            self.optimizer: torch.optim.Optimizer = build_zero_optimizer(model, config, self.dp_group)
        else:
            self.optimizer = build_inner_optimizer(model, config)  # the single-process node's AdamW groups
        self.runner: PipelineRunner | None = None
        if layout.pp > 1:
            self.runner = PipelineRunner(
                stage_models,
                stage_index=self.stage_indices,
                num_stages=self.num_stages,
                num_microbatches=layout.num_microbatches,
                schedule=layout.pp_schedule,  # type: ignore[arg-type]  # checked by the config
                device=self.device,
                group=self.pp_group,
                scale_grads=False,  # summed over micro-batches; train_step divides once
            )

    # --- one inner step ---
    def _replica_rows(self, tensor: Tensor) -> Tensor:
        """This dp replica's equal share of the node's batch rows (B / dp, ...)."""
        rows = tensor.shape[0] // self.layout.dp
        return tensor[self.dp_index * rows : (self.dp_index + 1) * rows].to(self.device)

    def train_step(self, batches: Sequence[Batch], lr: float) -> float:
        """One AdamW step over ``batches`` (the node's whole batch, ``grad_accumulation`` of them); the mean loss."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        losses = []
        for tokens, targets in batches:
            x, y = self._replica_rows(tokens), self._replica_rows(targets)  # (B/dp, T)
            if self.runner is not None:
                losses.append(self.runner.forward_backward(x, y))
            else:
                loss = cross_entropy_loss(self.stage_models[0](x), y)
                loss.backward()
                losses.append(loss.detach())
        if self.layout.dp > 1 and not self.fully_sharded:
            average_gradients(self.model, self.dp_group, self.timeout)
        # The gradient of the mean loss: divide the sum over accumulated batches (and, in a pipeline, over
        # its micro-batches) once.
        num_terms = len(batches) * (self.layout.num_microbatches if self.runner is not None else 1)
        if num_terms > 1:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.div_(num_terms)
        if self.config.inner.grad_clip > 0:
            clip_grad_norm(
                self.model.parameters(),
                self.config.inner.grad_clip,
                stage_group=self.pp_group if self.layout.pp > 1 else None,
            )
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._node_mean(torch.stack(losses).mean())

    def _node_mean(self, value: Tensor) -> float:
        """The mean over dp replicas of a scalar every rank of a replica holds alike (a world all-reduce)."""
        total = value.detach().float().reshape(1).to(self.device)
        work = dist.all_reduce(total, op=dist.ReduceOp.SUM, async_op=True)
        assert work is not None
        work.wait(self.timeout)
        return float(total) / self.layout.world_size

    # --- evaluation ---
    @torch.no_grad()
    def eval_loss(self, batches: Sequence[Batch]) -> float:
        """Mean loss over ``batches`` (no gradients); the pipeline passes activations stage to stage."""
        self.model.eval()
        try:
            losses = [self._eval_batch(tokens, targets) for tokens, targets in batches]
        finally:
            self.model.train()
        return self._node_mean(torch.stack(losses).mean())

    def _eval_batch(self, tokens: Tensor, targets: Tensor) -> Tensor:
        """One batch's loss; through the pipeline, stage ``j`` (on rank ``j mod pp``) hands its output on."""
        x, y = self._replica_rows(tokens), self._replica_rows(targets)  # (B/dp, T)
        if self.layout.pp == 1:
            return cross_entropy_loss(self.stage_models[0](x), y)
        hidden_shape = (x.shape[0], x.shape[1], self.model_config.dim)  # (B/dp, T, C)
        pp = self.layout.pp
        loss = torch.zeros((), device=self.device)
        for stage_index in self.stage_indices:  # increasing; neighbouring stages are on other ranks (pp > 1)
            if stage_index == 0:
                stage_input = x
            else:
                stage_input = torch.empty(hidden_shape, dtype=torch.float32, device=self.device)
                dist.recv(stage_input, group=self.pp_group, group_src=(stage_index - 1) % pp)
            output = self.stage_models[self.stage_indices.index(stage_index)](stage_input)
            if stage_index == self.num_stages - 1:
                loss = cross_entropy_loss(output, y)
            else:
                dist.send(output.float().contiguous(), group=self.pp_group, group_dst=(stage_index + 1) % pp)
        dist.broadcast(loss, group=self.pp_group, group_src=(self.num_stages - 1) % pp)
        return loss

    # --- the node's flat parameter vector ---
    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the full model's names (a stage keeps the names it had)."""
        return [
            (name, param)
            for stage_model in self.stage_models
            for name, param in stage_model.named_parameters()
            if param.requires_grad
        ]

    def _placed_parameters(self) -> list[tuple[int, int, nn.Parameter]]:
        """(offset, numel, parameter) of this rank's parameters, by offset in the node's flat vector."""
        placed = []
        for name, param in self._named_parameters():
            offset, shape = self.offsets[name]
            placed.append((offset, shape.numel(), param))
        return sorted(placed, key=lambda entry: entry[0])

    def _buckets(self) -> list[tuple[int, int]]:
        size = self.layout.bucket_elements
        return [(start, min(start + size, self.num_elements)) for start in range(0, self.num_elements, size)]

    @torch.no_grad()
    def read_params(self) -> Tensor | None:
        """The node's flat fp32 parameter vector (N,) on rank 0's host (None elsewhere).

        Bucket by bucket of ``bucket_elements`` numbers, so no device holds more than a bucket and one
        parameter beyond its own: each parameter is all-gathered within its tp / dp group when the walk
        reaches it (a collective: the ranks of a stage hold the same list), the ranks at dp = tp = 0 of each
        stage write their parameters' numbers into a zero bucket, and a sum-reduce to rank 0 assembles it
        (each number is written by exactly one rank, so the sum is exact).
        """
        flat = torch.empty(self.num_elements, dtype=torch.float32) if dist.get_rank() == 0 else None
        for _, low, high, values in self.param_pieces({0: (0, self.num_elements)}):
            if flat is not None:
                assert values is not None
                flat[low:high].copy_(values)
        return flat

    def param_pieces(self, ranges: Ranges) -> Iterator[tuple[int, int, int, Tensor | None]]:
        """Collective: the node's flat parameter vector in pieces, each on the rank whose range holds it.

        Yields (rank, low, high, values): numbers [low, high) of the flat vector, values on that rank
        (None on the others), walking the vector bucket by bucket (see read_params); ``ranges`` maps
        each receiving rank to its range [first, last) of the vector.
        """
        writes = self.dp_index == 0 and self.tp_index == 0
        placed = self._placed_parameters()
        current: tuple[int, Tensor] | None = None  # (index in placed, its full flat values)
        next_index = 0
        for start, end in self._buckets():
            bucket = torch.zeros(end - start, dtype=torch.float32, device=self.device)
            index = next_index
            while index < len(placed) and placed[index][0] < end:
                offset, numel, param = placed[index]
                if current is None or current[0] != index:
                    current = (index, full_tensor(param.detach()).reshape(-1))  # a collective for a DTensor
                low, high = max(offset, start), min(offset + numel, end)
                if writes:
                    bucket[low - start : high - start].copy_(current[1][low - offset : high - offset])
                if offset + numel <= end:
                    next_index, current = index + 1, None  # done with it
                index += 1
            for rank, low, high in bucket_pieces(start, end, ranges):
                piece = bucket[low - start : high - start]
                work = dist.reduce(piece, dst=rank, op=dist.ReduceOp.SUM, async_op=True)
                assert work is not None
                work.wait(self.timeout)
                yield rank, low, high, piece if dist.get_rank() == rank else None

    @torch.no_grad()
    def write_params(self, flat: Tensor | None) -> None:
        """Set every rank's parameters from rank 0's flat vector (N,) (broadcast by buckets; others pass None)."""
        if dist.get_rank() == 0:
            assert flat is not None and flat.numel() == self.num_elements, "rank 0 passes the node's vector"
        self.write_pieces(
            {0: (0, self.num_elements)}, lambda low, high: None if flat is None else flat[low:high]
        )

    @torch.no_grad()
    def write_pieces(self, ranges: Ranges, values: Callable[[int, int], Tensor | None]) -> None:
        """Collective: set every rank's parameters from the node's flat vector, held in pieces: numbers
        [low, high) come from the rank whose range (``ranges``) holds them, which passes
        ``values(low, high)`` (the other ranks' are not read); together the ranges cover the vector.

        Bucket by bucket: each piece of a bucket is broadcast from its rank; a parameter is staged in full on
        the device until its last bucket has arrived, then each rank cuts its own shard from it
        (``distribute_tensor`` without communication) or copies it whole.
        """
        placed = self._placed_parameters()
        staged: Tensor | None = None  # the full values of the parameter being assembled
        index = 0
        for start, end in self._buckets():
            bucket = torch.empty(end - start, dtype=torch.float32, device=self.device)
            for rank, low, high in bucket_pieces(start, end, ranges):
                piece = bucket[low - start : high - start]
                if dist.get_rank() == rank:
                    given = values(low, high)
                    assert given is not None and given.numel() == high - low
                    piece.copy_(given.detach())
                work = dist.broadcast(piece, src=rank, async_op=True)
                assert work is not None
                work.wait(self.timeout)
            while index < len(placed) and placed[index][0] < end:
                offset, numel, param = placed[index]
                if staged is None:
                    staged = torch.empty(numel, dtype=torch.float32, device=self.device)
                low, high = max(offset, start), min(offset + numel, end)
                staged[low - offset : high - offset].copy_(bucket[low - start : high - start])
                if offset + numel > end:
                    break  # continues in the next bucket
                self._set_parameter(param, staged.view(param.shape))
                staged, index = None, index + 1

    @staticmethod
    def _set_parameter(param: nn.Parameter, full: Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        if isinstance(param, DTensor):
            # Each rank cuts its own shard from the full tensor it already has: no communication.
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(local.to_local())
        else:
            param.copy_(full)

    # --- the inner optimizer's state, for checkpoints ---
    def _local_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW this rank steps: ZeRO-1's optimizer over this rank's share, else the one optimizer."""
        return local_optimizer(self.optimizer)

    def gather_optimizer_state(self) -> list[dict[str, Any]] | None:
        """Every rank's inner AdamW state (its ZeRO share, its tp / FSDP shards as local tensors) on rank 0."""
        from torch.distributed.tensor import DTensor

        state = self._local_optimizer().state_dict()
        local_state = {
            "state": {
                index: {
                    key: (value.to_local() if isinstance(value, DTensor) else value).detach().cpu()
                    if isinstance(value, Tensor)
                    else value
                    for key, value in param_state.items()
                }
                for index, param_state in state["state"].items()
            },
            "param_groups": state["param_groups"],
        }
        gathered: list[Any] | None = [None] * self.layout.world_size if dist.get_rank() == 0 else None
        dist.gather_object(local_state, gathered, dst=0)
        return gathered

    def scatter_optimizer_state(self, states: list[dict[str, Any]] | None) -> None:
        """Load rank r's share of ``states`` (rank 0's list, as :meth:`gather_optimizer_state` made it)."""
        from torch.distributed.tensor import DTensor

        received: list[Any] = [None]
        dist.scatter_object_list(received, states if dist.get_rank() == 0 else None, src=0)
        state = received[0]
        optimizer = self._local_optimizer()
        params = [param for group in optimizer.param_groups for param in group["params"]]
        for index, param_state in state["state"].items():
            param = params[index]
            for key, value in param_state.items():
                if isinstance(param, DTensor) and isinstance(value, Tensor) and value.dim() > 0:
                    param_state[key] = DTensor.from_local(
                        value.to(self.device), param.device_mesh, param.placements, run_check=False
                    )
        optimizer.load_state_dict(state)

    def optimizer_state_bytes(self) -> int:
        """Bytes of the inner optimizer state this rank holds (its ZeRO share)."""
        return optimizer_state_bytes(self.optimizer)
