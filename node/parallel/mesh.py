"""The node's named 3-D device mesh ``("pp", "dp", "tp")``, from which each parallelism takes its axis.

Layout (as in torchtitan's ``ParallelDims`` and Megatron-LM's rank ordering)
---------------------------------------------------------------------------
The ``world_size = pp * dp * tp`` ranks are arranged row-major in a ``(pp, dp, tp)`` grid, so ``tp`` is
the innermost axis: a tensor-parallel group is a run of consecutive ranks. Tensor parallelism all-reduces
activations twice per block, forward and backward, and is by far the most communication-hungry, so its
ranks should be the closest ones (same socket / NVLink island on a GPU host). Data parallelism
all-reduces gradients once per step and pipeline parallelism sends only activations between neighbour
stages, so they take the outer axes. With ``pp=1, dp=2, tp=2`` the tp pairs are ``{0, 1}`` and
``{2, 3}`` and the dp pairs ``{0, 2}`` and ``{1, 3}``; with ``pp=2, dp=1, tp=2`` stage 0 is ``{0, 1}``,
stage 1 is ``{2, 3}`` and the pipeline groups are ``{0, 2}`` and ``{1, 3}``.

Every axis is present even when its size is 1, so callers can always write ``mesh["tp"]`` (a 1-D mesh
for ``apply_tensor_parallel``), ``mesh["dp"].get_group()`` (for ``average_gradients``) or
``mesh["pp"].get_group()`` (for ``PipelineRunner``) without caring which parallelisms are active.
The caller initialises the default process group first (``init_process_group``).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from node.parallel.tensor import TENSOR_PARALLEL_AXIS, device_type

PIPELINE_PARALLEL_AXIS = "pp"
DATA_PARALLEL_AXIS = "dp"
MESH_AXES = (PIPELINE_PARALLEL_AXIS, DATA_PARALLEL_AXIS, TENSOR_PARALLEL_AXIS)  # outermost first


def validate_mesh_shape(dp: int, tp: int, pp: int, world_size: int) -> None:
    """Raise ``ValueError`` unless every axis size is positive and ``dp * tp * pp == world_size``."""
    for name, size in (("dp", dp), ("tp", tp), ("pp", pp)):
        if size < 1:
            raise ValueError(f"the {name} size must be at least 1, got {size}")
    if dp * tp * pp != world_size:
        raise ValueError(
            f"dp * tp * pp = {dp} * {tp} * {pp} = {dp * tp * pp} must equal the world size {world_size}"
        )


def build_mesh(dp: int = 1, tp: int = 1, pp: int = 1) -> DeviceMesh:
    """The 3-D mesh named ``("pp", "dp", "tp")`` over the default process group; see the module docstring.

    A collective: every rank calls it with the same sizes. Raises ``ValueError`` when a size is not
    positive or ``dp * tp * pp`` differs from the world size.
    """
    if not dist.is_initialized():
        raise ValueError("build_mesh needs the default process group: call init_process_group first")
    validate_mesh_shape(dp, tp, pp, dist.get_world_size())
    return init_device_mesh(device_type(), (pp, dp, tp), mesh_dim_names=MESH_AXES)
