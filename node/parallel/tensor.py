"""Megatron-style tensor parallelism for the plain ``GPT`` of ``node.model.gpt``, applied from outside.

Algorithm (Shoeybi et al. 2019, "Megatron-LM", section 3)
--------------------------------------------------------
Each transformer block holds two matrix-multiply pairs; each pair is split across the ``tp`` ranks so
that only one all-reduce is needed per pair in the forward pass and one in the backward pass:

    attention:     wq, wk, wv   column-parallel -> each rank computes its own heads (no communication)
                   wo           row-parallel    -> partial (B, T, C) sums, all-reduced to the full output
    feed-forward:  w1, w3       column-parallel -> each rank holds F / tp hidden units
                   w2           row-parallel    -> partial sums, all-reduced

"Column-parallel" splits the output features of ``nn.Linear`` (rows of its ``(out, in)`` weight), so a
rank with ``1 / tp`` of the ``wq/wk/wv`` rows owns whole heads; ``Attention.forward`` infers its local
head count from the projection width (``view(B, T, -1, head_dim)``), so the module needs no change. The
SwiGLU product ``silu(w1 x) * w3 x`` is elementwise, so sharding w1 and w3 the same way keeps it local.

Communication phases of one block:
    Phase 1 (forward):  all-reduce the (B, T, C) partial output of ``wo``, then of ``w2``.
    Phase 2 (backward): all-reduce the (B, T, C) input gradient entering ``wq/wk/wv`` and ``w1/w3``
                        (each rank only saw its own heads' / hidden units' contribution).

Everything else (token embedding, RMSNorm gains, final norm, output head) stays a plain replicated
tensor: every rank computes the same activations and the same gradients for them, so no communication
is needed and no rank can drift. Sharding the vocabulary too would save memory at the price of a
loss-parallel cross-entropy; for the model sizes a node trains, simplicity wins.

After ``apply_tensor_parallel`` the sharded weights are ``DTensor`` parameters, in the same position of
``model.parameters()`` as before. Optimizers (AdamW) work on them unchanged. ``full_parameters`` gathers
every parameter back to a full fp32 tensor in that canonical order, which is what DiLoCo's outer step and
the swarm's parameter hash need: they must see the same vector whatever the node's ``tp`` is.
``torch.nn.utils.clip_grad_norm_`` rejects the mix of sharded and plain gradients; use ``clip_grad_norm``.

Device and backend: one code path; the device type is ``cuda`` when CUDA is available (backend nccl),
else ``cpu`` (backend gloo). The caller initialises the process group (``init_process_group``) with
``distributed_backend()`` and builds the mesh with ``build_tensor_parallel_mesh``.

``torch.distributed.tensor`` (DTensor and its parallel styles) is imported by the functions that use it,
not with this module: every node imports this module for ``device_type``, and the import costs about half
a CPU second, which a node without local workers should not pay at each start.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from node.model.gpt import GPT

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

TENSOR_PARALLEL_AXIS = "tp"


_chosen_device: str | None = None  # --device cpu|cuda for this process's ranks; None: auto


def use_device(name: str) -> None:
    """Pin this process's local ranks to ``--device``: ``cpu`` (gloo, even on a CUDA machine),
    ``cuda``, or ``auto`` (CUDA when available)."""
    global _chosen_device
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {name!r}")
    _chosen_device = None if name == "auto" else name


def device_type() -> str:
    """The device of the mesh and model: ``--device`` if pinned (``use_device``), else ``"cuda"`` when a
    CUDA device is available, else ``"cpu"``."""
    if _chosen_device is not None:
        return _chosen_device
    return "cuda" if torch.cuda.is_available() else "cpu"


def distributed_backend() -> str:
    """The process-group backend matching ``device_type()``: nccl for CUDA, gloo for CPU."""
    return "nccl" if device_type() == "cuda" else "gloo"


def build_tensor_parallel_mesh(num_ranks: int) -> DeviceMesh:
    """A 1-D mesh named ``"tp"`` over ``num_ranks`` ranks; the default process group must exist."""
    if num_ranks <= 0:
        raise ValueError(f"the tensor-parallel size must be positive, got {num_ranks}")
    return init_device_mesh(device_type(), (num_ranks,), mesh_dim_names=(TENSOR_PARALLEL_AXIS,))


def _block_plan() -> dict[str, ParallelStyle]:
    """Module name (relative to a ``TransformerBlock``) -> sharding style; see the module docstring."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def _sequence_parallel_block_plan() -> dict[str, ParallelStyle]:
    """The Megatron plan with sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
    Recomputation in Large Transformer Models", section 4.2.2): between the two matmul pairs the residual
    stream and the RMSNorms run on ``T / tp`` positions per rank (``Shard(1)``); each pair all-gathers the
    sequence before its column-parallel matmuls and reduce-scatters after its row-parallel one, the same
    bytes as the all-reduce it replaces, with activations of norms and residuals cut by ``tp``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    return {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def _sequence_parallel_ends_plan() -> dict[str, ParallelStyle]:
    """Embedding rows split by vocabulary with its output sharded on the sequence; the final norm on the
    shards; the output head column-parallel from the sharded sequence to replicated logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


def validate_tensor_parallel_size(model: GPT, num_ranks: int) -> None:
    """Raise ``ValueError`` unless heads, kv heads and the MLP hidden width split evenly ``num_ranks`` ways."""
    config = model.config
    sizes = {
        "num_heads": config.num_heads,
        "num_kv_heads": config.resolved_num_kv_heads,
        "mlp_hidden_dim": config.resolved_mlp_hidden_dim,
    }
    for name, size in sizes.items():
        if size % num_ranks != 0:
            raise ValueError(
                f"tensor parallelism over {num_ranks} ranks needs {name} ({size}) divisible by {num_ranks}; "
                f"choose a tp size that divides num_heads={sizes['num_heads']}, "
                f"num_kv_heads={sizes['num_kv_heads']} and mlp_hidden_dim={sizes['mlp_hidden_dim']}"
            )


def apply_tensor_parallel(model: GPT, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> GPT:
    """Shard every ``TransformerBlock`` of ``model`` in place over the 1-D ``mesh``; returns ``model``.

    Every rank must call this with the same, identically initialised model (same seed): each rank keeps
    its own slice of the full weights, and the replicated parts must agree. Activations entering and
    leaving each block are plain replicated tensors (``use_local_output``), so ``GPT.forward`` and the
    loss are untouched.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D device mesh, got {mesh.ndim} dimensions")
    validate_tensor_parallel_size(model, mesh.size())
    if mesh.size() == 1:
        return model  # nothing to split; keep plain tensors so single-rank runs are untouched
    if sequence_parallel:
        if model.tok_embeddings is None or model.output is None or model.config.tie_embeddings:
            raise ValueError(
                "sequence parallelism needs the whole model (no pipeline stages, untied embeddings)"
            )
        if model.config.seq_len % mesh.size() != 0:
            raise ValueError(f"sequence parallelism needs seq_len divisible by tp={mesh.size()}")
        parallelize_module(model, mesh, _sequence_parallel_ends_plan())
    plan = _sequence_parallel_block_plan() if sequence_parallel else _block_plan()
    for block in model.layers.values():
        parallelize_module(block, mesh, plan)
    return model


@torch.no_grad()
def full_parameters(model: nn.Module) -> list[Tensor]:
    """Every parameter of ``model`` as a full (unsharded) fp32 tensor, in ``model.parameters()`` order.

    Sharded ``DTensor`` parameters are all-gathered (``DTensor.full_tensor``), a collective: all ranks of
    the mesh must call this together. The result is a snapshot: plain (replicated) parameters are copied,
    so later optimizer steps do not change it. ``flat_full_parameters`` concatenates it.
    """
    return [full_tensor(param.detach()) for param in model.parameters()]


def full_tensor(tensor: Tensor) -> Tensor:
    """A fresh full fp32 copy of ``tensor``; a ``DTensor`` is all-gathered first (a collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()  # all-gather of the shards (a replicated DTensor may share storage)
    return tensor.float().clone()  # .float() of an fp32 tensor is the tensor itself: copy it


def flat_full_parameters(model: nn.Module) -> Tensor:
    """``full_parameters`` concatenated into one flat fp32 vector (N,), the order of ``model.parameters()``."""
    return torch.cat([param.flatten() for param in full_parameters(model)])


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[nn.Parameter], max_norm: float, *, stage_group: ProcessGroup | None = None
) -> Tensor:
    """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before clipping.

    ``torch.nn.utils.clip_grad_norm_`` refuses a mix of ``DTensor`` and plain gradients, which is what a
    tensor-parallel ``GPT`` has. Here the norm of a sharded gradient is reduced over the mesh (a
    collective: all ranks call this together), replicated gradients count once, and every rank scales its
    local shard by the same coefficient, as ``clip_grad_norm_`` would on the unsharded model. With pipeline
    stages, ``stage_group`` (the ranks holding the other stages of this replica) sums the squared norms of
    all stages, so every stage clips by the replica's global norm.
    """
    from torch.distributed.tensor import DTensor

    if max_norm <= 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    grads = [param.grad for param in parameters if param.grad is not None]
    squared_norms = []
    for grad in grads:  # one entry per parameter tensor, not per element
        norm = grad.norm(dtype=torch.float32)
        squared_norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).square())
    total_squared = torch.stack(squared_norms).sum() if squared_norms else torch.zeros(())
    if stage_group is not None:
        dist.all_reduce(total_squared, op=dist.ReduceOp.SUM, group=stage_group)
    total_norm = total_squared.sqrt()  # scalar, identical on every rank
    clip_coefficient = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)  # same epsilon as torch
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        local.mul_(clip_coefficient.to(local.dtype))
    return total_norm
