"""Combined layouts on 4 gloo ranks (dp=2 x tp=2, and tp=2 x pp=2) train like the single-process model.

Reference: the same nano ``GPT`` (same seed), the same AdamW (``build_inner_optimizer``) and the same fixed
batches of 4 sequences, trained in the test process without any parallelism.

- dp=2 x tp=2: every dp replica is tensor-parallel over its tp pair; dp rank ``d`` trains on half ``d`` of
  each batch, the gradients are averaged over the dp axis (``average_gradients`` on ``mesh["dp"]``) and
  clipped with ``clip_grad_norm`` (active: the norms are ~3 > 1); the reference clips with torch's
  ``clip_grad_norm_``. The step's loss is the mean of the two halves' losses, which is the batch mean.
- tp=2 x pp=2: each of the 2 pipeline stages (``build_stage``) is tensor-parallel over its tp pair, and the
  stages run 1F1B over ``mesh["pp"]`` with 2 micro-batches. No clipping: the global norm would need a
  reduction over the pipeline axis as well, which ``clip_grad_norm`` does not do.

Tolerances, as in ``test_tensor_parallel``: only the float summation order differs (row-parallel
all-reduce, dp all-reduce of half-batch gradients, micro-batch accumulation), so losses are held to 1e-5
relative; the parameters after 10 AdamW steps to 1e-4 relative per tensor (Adam's division by the running
RMS amplifies roundoff on near-zero gradient elements). A missing all-reduce or a wrong shard gives
errors of order 1. The measured errors are printed (``pytest -s``).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from node.config import NodeConfig
from node.model.gpt import GPT, cross_entropy_loss
from node.model.replica import build_inner_optimizer
from node.parallel.mesh import build_mesh, validate_mesh_shape
from node.parallel.pipeline import PipelineRunner, build_stage
from node.parallel.tensor import apply_tensor_parallel, clip_grad_norm, full_parameters
from node.parallel.zero import average_gradients
from tests.node.parallel_support import (
    build_model,
    fixed_batches,
    relative_error,
    spawned_workers,
    worker_process_group,
)

NUM_RANKS = 4
LOSS_TOLERANCE = 1e-5
TRAINED_PARAMS_TOLERANCE = 1e-4
WORKER_DEADLINE = timedelta(seconds=120)


class TrainResult(TypedDict):
    losses: list[float]
    params: dict[str, torch.Tensor]  # full (unsharded) parameters after the last step, by name


def _named_full_parameters(model: GPT) -> dict[str, torch.Tensor]:
    names = [name for name, _ in model.named_parameters()]
    return dict(zip(names, full_parameters(model), strict=True))  # a collective over the tp axis


def _train_reference(*, clip: bool) -> TrainResult:
    model = build_model()
    config = NodeConfig()
    optimizer = build_inner_optimizer(model, config)
    losses = []
    for inputs, targets in fixed_batches():
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": _named_full_parameters(model)}


def _train_data_and_tensor_parallel(mesh: DeviceMesh) -> TrainResult:
    """dp=2 x tp=2: tensor parallel inside each replica, gradients averaged over dp, each dp rank on half."""
    dp_group = mesh["dp"].get_group()
    dp_rank, num_dp_ranks = mesh["dp"].get_local_rank(), mesh["dp"].size()
    model = apply_tensor_parallel(build_model(), mesh["tp"])
    config = NodeConfig()
    optimizer = build_inner_optimizer(model, config)
    losses = []
    for inputs, targets in fixed_batches():
        local_inputs = inputs.chunk(num_dp_ranks)[dp_rank]  # (B / dp, T)
        local_targets = targets.chunk(num_dp_ranks)[dp_rank]
        loss = cross_entropy_loss(model(local_inputs), local_targets)
        loss.backward()
        average_gradients(model, dp_group)
        clip_grad_norm(model.parameters(), config.inner.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        batch_loss = loss.detach().clone()
        dist.all_reduce(batch_loss, group=dp_group)  # equal halves: the batch mean is the mean of halves
        losses.append(batch_loss.item() / num_dp_ranks)
    return {"losses": losses, "params": _named_full_parameters(model)}


def _train_tensor_and_pipeline_parallel(mesh: DeviceMesh) -> TrainResult:
    """tp=2 x pp=2: each pipeline stage tensor-parallel over its tp pair, 1F1B over the pp axis."""
    stage_index, num_stages = mesh["pp"].get_local_rank(), mesh["pp"].size()
    stage_model = apply_tensor_parallel(build_stage(build_model(), stage_index, num_stages), mesh["tp"])
    runner = PipelineRunner(
        stage_model,
        stage_index=stage_index,
        num_stages=num_stages,
        num_microbatches=2,
        schedule="1f1b",
        device=torch.device("cpu"),
        group=mesh["pp"].get_group(),
    )
    optimizer = build_inner_optimizer(stage_model, NodeConfig())
    losses = []
    for inputs, targets in fixed_batches():
        loss = runner.forward_backward(inputs, targets)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": _named_full_parameters(stage_model)}


def _layout_worker(rank: int, layout: str, store_path: str, out_dir: str) -> None:
    with worker_process_group(rank, NUM_RANKS, store_path, backend="gloo", timeout=timedelta(seconds=60)):
        if layout == "dp2_tp2":
            result = _train_data_and_tensor_parallel(build_mesh(dp=2, tp=2))
        else:
            assert layout == "tp2_pp2", layout
            result = _train_tensor_and_pipeline_parallel(build_mesh(tp=2, pp=2))
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")


def _run_workers(layout: str, tmp_path: Path, *, clip: bool) -> tuple[list[TrainResult], TrainResult]:
    """Every rank's result for ``layout``, and the single-process reference (trained while they start)."""
    worker_args = [(rank, layout, str(tmp_path / "store"), str(tmp_path)) for rank in range(NUM_RANKS)]
    with spawned_workers(_layout_worker, worker_args, WORKER_DEADLINE):
        reference = _train_reference(clip=clip)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(NUM_RANKS)], reference


def _assert_matches_reference(results: list[TrainResult], reference: TrainResult) -> None:
    """Every rank's losses match; the union of the ranks' parameters is the reference's, tensor by tensor."""
    reference_losses = torch.tensor(reference["losses"])
    worst_loss = max(
        float(((torch.tensor(result["losses"]) - reference_losses).abs() / reference_losses).max())
        for result in results
    )
    params: dict[str, torch.Tensor] = {}
    for result in results:
        for name, param in result["params"].items():
            if name in params:  # held by several ranks (dp replicas, tp peers): they must agree exactly
                torch.testing.assert_close(param, params[name], rtol=0, atol=0)
            params[name] = param
    assert sorted(params) == sorted(reference["params"])
    worst_param = max(relative_error(params[name], want) for name, want in reference["params"].items())
    print(f"worst relative error: loss {worst_loss:.2e}, parameter {worst_param:.2e}")
    assert worst_loss < LOSS_TOLERANCE
    assert worst_param < TRAINED_PARAMS_TOLERANCE
    # Training moved the weights far more than the tolerance: "equal" does not mean "nothing happened".
    initial = _named_full_parameters(build_model())
    name = "tok_embeddings.weight"
    assert relative_error(reference["params"][name], initial[name]) > 100 * TRAINED_PARAMS_TOLERANCE


@pytest.mark.timeout(180)
def test_data_parallel_by_tensor_parallel_matches_single_process(tmp_path: Path) -> None:
    results, reference = _run_workers("dp2_tp2", tmp_path, clip=True)
    _assert_matches_reference(results, reference)


@pytest.mark.timeout(180)
def test_tensor_parallel_by_pipeline_parallel_matches_single_process(tmp_path: Path) -> None:
    results, reference = _run_workers("tp2_pp2", tmp_path, clip=False)
    _assert_matches_reference(results, reference)


def test_mesh_shape_must_match_world_size() -> None:
    validate_mesh_shape(2, 2, 1, 4)
    with pytest.raises(ValueError, match="must equal the world size 4"):
        validate_mesh_shape(2, 2, 2, 4)
    with pytest.raises(ValueError, match="at least 1"):
        validate_mesh_shape(0, 2, 2, 0)
