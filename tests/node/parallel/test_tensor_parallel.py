"""Tensor parallelism over 2 gloo ranks trains like the single-process model.

Reference: the same nano ``GPT`` (same seed), the same AdamW (``build_inner_optimizer``) and the same fixed
batches, run in the test process without any parallelism; it clips with torch's ``clip_grad_norm_``,
the tp ranks with ``node.parallel.tensor.clip_grad_norm`` (clipping is active: the norms are ~3 > 1).
Each tp rank must report the same losses and gradient norms at every step, the same full gradients after
the first backward and the same full parameters after the last step.

Tolerances: TP changes only the float summation order (the row-parallel all-reduce adds two partial
matmuls), about 1e-7 relative per step. Losses and first-step gradients are held to 1e-5. The parameters
after 10 AdamW steps get 1e-4: Adam divides each gradient element by its own running RMS, so an element
whose gradient is at roundoff level moves by up to ``lr`` in either direction, and the trajectories drift
apart (measured: 3.4e-5 on the token embedding, 2.5e-5 even with plain SGD at lr 0.5). A real sharding
bug (a missing all-reduce, heads split wrongly) gives errors of order 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import pytest
import torch
import torch.distributed as dist

from node.config import NodeConfig
from node.model.gpt import GPT, cross_entropy_loss, model_config
from node.model.replica import build_inner_optimizer
from node.parallel.tensor import (
    apply_tensor_parallel,
    build_tensor_parallel_mesh,
    clip_grad_norm,
    distributed_backend,
    flat_full_parameters,
    full_parameters,
    full_tensor,
    validate_tensor_parallel_size,
)
from tests.node.parallel_support import (
    SEQ_LEN,
    build_model,
    fixed_batches,
    relative_error,
    spawned_workers,
    worker_process_group,
)

NUM_RANKS = 2
STEP_TOLERANCE = 1e-5  # losses and first-step gradients
TRAINED_PARAMS_TOLERANCE = 1e-4  # after the 10 AdamW steps; see the module docstring


class TrainResult(TypedDict):
    losses: list[float]
    grad_norms: list[float]  # before clipping
    first_grads: list[torch.Tensor]  # full gradients of step 1, before clipping
    params: list[torch.Tensor]  # full parameters after the last step


ClipGradNorm = Callable[[Iterable[torch.nn.Parameter], float], torch.Tensor]


def _train(model: GPT, clip: ClipGradNorm) -> TrainResult:
    """One step of the trainer's inner loop (forward, backward, clip, AdamW) per fixed batch.

    Returns each step's loss and gradient norm (before clipping), the full gradients of step 1 (before
    clipping) and the full parameters after the last step.
    """
    config = NodeConfig()
    optimizer = build_inner_optimizer(model, config)
    losses: list[float] = []
    grad_norms: list[float] = []
    first_grads: list[torch.Tensor] = []
    for inputs, targets in fixed_batches():
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        if not first_grads:
            first_grads = [full_tensor(param.grad) for param in model.parameters() if param.grad is not None]
        grad_norms.append(float(clip(model.parameters(), config.inner.grad_clip)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {  # plain tensors and floats only: torch.load(weights_only=True) reads it back
        "losses": losses,
        "grad_norms": grad_norms,
        "first_grads": first_grads,
        "params": full_parameters(model),
    }


def _tensor_parallel_worker(rank: int, store_path: str, out_dir: str) -> None:
    with worker_process_group(
        rank, NUM_RANKS, store_path, backend=distributed_backend(), timeout=timedelta(seconds=60)
    ):
        model = apply_tensor_parallel(build_model(), build_tensor_parallel_mesh(NUM_RANKS))
        sharded = [name for name, param in model.named_parameters() if isinstance(param, dist.tensor.DTensor)]
        assert len(sharded) == 7 * model.config.num_layers, sharded  # wq wk wv wo w1 w3 w2 per block
        torch.save(_train(model, clip_grad_norm), Path(out_dir) / f"rank{rank}.pt")


def _assert_relatively_close(
    actual: list[torch.Tensor], expected: list[torch.Tensor], tolerance: float
) -> None:
    assert [tensor.shape for tensor in actual] == [tensor.shape for tensor in expected]
    for index, (got, want) in enumerate(zip(actual, expected, strict=True)):
        error = relative_error(got, want)
        assert error < tolerance, f"parameter {index}: relative error {error:.2e}"


@pytest.mark.timeout(120)
def test_two_rank_tensor_parallel_matches_single_process(tmp_path: Path) -> None:
    worker_args = [(rank, str(tmp_path / "store"), str(tmp_path)) for rank in range(NUM_RANKS)]
    with spawned_workers(_tensor_parallel_worker, worker_args, deadline=timedelta(seconds=90)):
        # Overlaps with the workers' start-up.
        reference = _train(build_model(), torch.nn.utils.clip_grad_norm_)

    # Training moved the weights far more than the tolerance: "equal" does not mean "nothing happened".
    initial_params = full_parameters(build_model())
    moved = (reference["params"][0] - initial_params[0]).norm() / initial_params[0].norm()
    assert moved > 100 * TRAINED_PARAMS_TOLERANCE
    for rank in range(NUM_RANKS):
        result: TrainResult = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=STEP_TOLERANCE, atol=0.0
        )
        torch.testing.assert_close(
            torch.tensor(result["grad_norms"]),
            torch.tensor(reference["grad_norms"]),
            rtol=STEP_TOLERANCE,
            atol=0.0,
        )
        _assert_relatively_close(result["first_grads"], reference["first_grads"], STEP_TOLERANCE)
        _assert_relatively_close(result["params"], reference["params"], TRAINED_PARAMS_TOLERANCE)


def test_rejects_tp_size_that_does_not_divide_heads() -> None:
    validate_tensor_parallel_size(GPT(model_config("nano", seq_len=SEQ_LEN)), 4)  # 4 heads, hidden 384
    with pytest.raises(ValueError, match="num_heads"):
        validate_tensor_parallel_size(GPT(model_config("nano", seq_len=SEQ_LEN)), 3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        validate_tensor_parallel_size(GPT(model_config("nano", seq_len=SEQ_LEN, num_kv_heads=2)), 4)
    with pytest.raises(ValueError, match="mlp_hidden_dim"):
        validate_tensor_parallel_size(GPT(model_config("nano", seq_len=SEQ_LEN, mlp_hidden_dim=390)), 4)


def test_full_parameters_of_plain_model_is_a_snapshot_in_parameter_order() -> None:
    model = GPT(model_config("nano", seq_len=SEQ_LEN))
    expected = torch.cat([param.detach().flatten() for param in model.parameters()])
    snapshot = flat_full_parameters(model)
    assert torch.equal(snapshot, expected)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert torch.equal(snapshot, expected)  # a copy, not a view of the live parameters
