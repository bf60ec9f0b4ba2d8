"""The inner AdamW, whole or sharded with ZeRO over a node's data-parallel ranks (ZeRO-3: the weights too).

``build_inner_optimizer`` is the replica's AdamW: weight decay on matrices only (norm gains are not
decayed), the fused kernel on CUDA. A single-process replica (``node.model.replica.SingleReplica``) and a local
rank without ZeRO-1 (``node.parallel.engine.RankEngine``) step it as is; the stages below shard it.

Algorithm (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models")
---------------------------------------------------------------------------------------------------------
Plain data parallelism keeps a full copy of the parameters, gradients and AdamW moments on every rank;
the moments alone are twice the parameters. ZeRO partitions them over the ``dp`` ranks instead:

    stage 1 (``build_zero_optimizer``): each rank owns the AdamW state (exp_avg, exp_avg_sq) of about
        ``1 / dp`` of the parameters and updates only those. One inner step:
            Phase 1: all-reduce the gradients and divide by ``dp`` (``average_gradients``), so every rank
                     holds the gradient of the mean loss over the whole batch;
            Phase 2: each rank runs AdamW on the parameters it owns;
            Phase 3: each owner broadcasts its updated parameters (inside ``ZeroRedundancyOptimizer.step``).
        Built on ``torch.distributed.optim.ZeroRedundancyOptimizer``, which assigns whole parameters to
        ranks greedily (largest first, to the least loaded rank), so a rank's share is ``1 / dp`` up to one
        parameter's size. Gradients are still all-reduced in full, so this is stage 1, not stage 2: with
        a reduce-scatter each rank would keep only its owned gradients, which saves gradient memory but
        needs the flat-bucket bookkeeping that stage 3 below does properly.
    stage 3 (``apply_fully_shard``): FSDP2 (``torch.distributed.fsdp.fully_shard``) on every
        ``TransformerBlock`` and then on the root. Every parameter becomes a ``DTensor`` sharded on dim 0
        over the ``dp`` mesh, so weights, gradients and AdamW state are all ``1 / dp`` per rank. A block's
        weights are all-gathered just before its forward (and again before its backward), and its gradients
        are reduce-scattered (averaged) after its backward; no ``average_gradients`` call is needed. Works
        on CPU with gloo in torch 2.13.

Both keep the same weight-decay split as ``build_inner_optimizer`` (matrices decayed, norm gains not):
stage 1 passes the same two parameter groups to ``ZeroRedundancyOptimizer``, which partitions each group
separately; stage 3 simply uses ``build_inner_optimizer`` on the sharded model (a sharded
``DTensor`` keeps its logical ``dim()``).

``optimizer_state_bytes`` sums the bytes of the optimizer-state tensors this rank holds (local shards
for ``DTensor`` state), the number the memory benchmark compares with the unsharded optimizer.

FSDP2, ``ZeroRedundancyOptimizer`` and ``DTensor`` are imported by the functions that use them: together
about a CPU second of imports, which a node or rank whose layout uses neither stage does not pay.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from node.config import NodeConfig
from node.model.gpt import GPT

if TYPE_CHECKING:
    from torch.distributed.optim import ZeroRedundancyOptimizer

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def build_inner_optimizer(model: nn.Module, config: NodeConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains are not decayed); the fused kernel on CUDA
    (one launch per step for all parameters), torch's default (foreach) elsewhere."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    inner = config.inner
    groups = [
        {"params": decay, "weight_decay": inner.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = all(p.device.type == "cuda" for p in decay + no_decay)
    fused = True if on_cuda and decay + no_decay else None  # None: torch's default
    return torch.optim.AdamW(groups, lr=inner.lr, betas=(inner.beta1, inner.beta2), fused=fused)


def build_zero_optimizer(
    model: nn.Module, config: NodeConfig, process_group: dist.ProcessGroup | None = None
) -> ZeroRedundancyOptimizer:
    """ZeRO-1: ``build_inner_optimizer``'s AdamW with its state sharded over ``process_group``'s ranks.

    ``process_group`` is the node's data-parallel group (``None``: the default group). Call
    ``average_gradients`` after ``backward`` and before ``step``; ``step`` updates this rank's share and
    broadcasts every share, so all ranks end the step with the same full parameters.
    """
    from torch.distributed.optim import ZeroRedundancyOptimizer

    params = [param for param in model.parameters() if param.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    inner = config.inner
    groups = [
        {"params": [param for param in params if param.dim() >= 2], "weight_decay": inner.weight_decay},
        {"params": [param for param in params if param.dim() < 2], "weight_decay": 0.0},
    ]
    return ZeroRedundancyOptimizer(
        [group for group in groups if group["params"]],
        optimizer_class=torch.optim.AdamW,
        process_group=process_group,
        lr=inner.lr,
        betas=(inner.beta1, inner.beta2),
    )


@torch.no_grad()
def average_gradients(
    model: nn.Module,
    process_group: dist.ProcessGroup | None = None,
    timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
) -> None:
    """Replace every gradient by its mean over ``process_group``'s ranks (one flat all-reduce).

    Each rank computed the gradient of the mean loss over its own equal-sized slice of the batch, so the
    mean over ranks is the gradient of the mean loss over the whole batch. The gradients are packed into
    one flat buffer: one collective instead of one per parameter. Gloo has no AVG reduction, hence
    SUM and a division. Raises ``RuntimeError`` if the all-reduce does not finish within ``timeout``.
    """
    # A tensor-parallel model (``apply_tensor_parallel`` on the tp axis of a 2-D mesh) has ``DTensor``
    # gradients; averaging over dp acts on each rank's local shard, which is what the dp peers with the same
    # tp coordinate hold too. ``to_local`` shares storage, so the copy below writes the DTensor gradient.
    from torch.distributed.tensor import DTensor

    grads = [
        grad.to_local() if isinstance(grad, DTensor) else grad
        for grad in (param.grad for param in model.parameters())
        if grad is not None
    ]
    if not grads:
        raise ValueError("no gradients to average: call backward first")
    flat = torch.cat([grad.flatten() for grad in grads])  # (N,)
    work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=process_group, async_op=True)
    assert work is not None  # async_op=True always returns a handle
    work.wait(timeout)
    flat.div_(dist.get_world_size(process_group))
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
    assert offset == flat.numel()


def apply_fully_shard(model: GPT, mesh: DeviceMesh) -> GPT:
    """ZeRO-3: FSDP2 ``fully_shard`` on each ``TransformerBlock``, then on the root; returns ``model``.

    Blocks are wrapped first so each block's weights are gathered and freed as a unit (peak memory is one
    block's full weights, not the model's); the root wrap then owns the leftovers (embedding, final norm,
    output head). ``mesh`` is the 1-D data-parallel mesh. Build the optimizer after this call.
    """
    from torch.distributed.fsdp import fully_shard

    if mesh.ndim != 1:
        raise ValueError(f"apply_fully_shard takes a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer this rank steps: a ``ZeroRedundancyOptimizer``'s over this rank's share, else ``optimizer``.

    Looked up without importing ``torch.distributed.optim`` (it imports FSDP: ~0.4 CPU-s a process, paid
    at every checkpoint's state gather): an instance of its class exists only once the module is loaded.
    """
    zero_module = sys.modules.get("torch.distributed.optim")
    if zero_module is not None and isinstance(optimizer, zero_module.ZeroRedundancyOptimizer):
        local: torch.optim.Optimizer = optimizer.optim
        return local
    return optimizer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer-state tensors held by this rank (for a ``DTensor``, its local shard).

    For a ``ZeroRedundancyOptimizer`` that is the state of the local optimizer over this rank's share
    (its own ``state`` attribute is only filled by ``consolidate_state_dict``). Zero before the first step.
    """
    from torch.distributed.tensor import DTensor

    total = 0
    for param_state in local_optimizer(optimizer).state.values():
        for value in param_state.values():
            if isinstance(value, DTensor):
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total
