"""ZeRO over 2 gloo data-parallel ranks trains like one process on the whole batch, with half the AdamW state.

Reference: the same nano ``GPT`` (same seed), AdamW from ``build_inner_optimizer`` and gradient clipping,
run in the test process on each whole fixed batch of 4 sequences. Each dp rank trains on its own half
(2 sequences) of the same batches. Because the halves have equal size, the mean of the ranks' losses is
the reference's loss, and the averaged gradients are the reference's gradients.

Checked for ZeRO-1 (``ZeroRedundancyOptimizer`` + ``average_gradients``) and ZeRO-3 (FSDP2
``fully_shard``): the per-step mean loss (1e-5 relative), the full parameters after 10 steps (1e-4
relative: AdamW divides each gradient element by its own running RMS and so amplifies the different
summation order; see ``test_tensor_parallel``) and each rank's optimizer-state bytes, which must be about
half of the reference's (0.3 to 0.7: ZeRO-1 assigns whole parameters, so shares differ by up to one
parameter). Measured: losses 9e-8, parameters 5.9e-6 for both stages; shares 0.4999-0.5001. Without
ZeRO-1's gradient averaging the losses are off by 2e-3 and the parameters by 0.44, and the test fails.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TypedDict

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from node.config import NodeConfig
from node.model.gpt import GPT, cross_entropy_loss
from node.model.replica import build_inner_optimizer
from node.parallel.tensor import device_type, distributed_backend, full_parameters
from node.parallel.zero import (
    apply_fully_shard,
    average_gradients,
    build_zero_optimizer,
    optimizer_state_bytes,
)
from tests.node.parallel_support import (
    BATCH_SIZE,
    build_model,
    fixed_batches,
    relative_error,
    spawned_workers,
    worker_process_group,
)

NUM_RANKS = 2  # BATCH_SIZE // NUM_RANKS sequences per rank
STEP_TOLERANCE = 1e-5  # mean loss per step
TRAINED_PARAMS_TOLERANCE = 1e-4  # after the 10 AdamW steps; see the module docstring


class TrainResult(TypedDict):
    losses: list[float]  # this process's loss on its slice of each batch
    params: list[torch.Tensor]  # full parameters after the last step
    state_bytes: int  # optimizer-state bytes held by this process after the last step


def _train(model: GPT, optimizer: torch.optim.Optimizer, rank: int | None, stage: int) -> TrainResult:
    """One inner step per fixed batch; ``rank=None`` is the reference (whole batch), else that rank's half."""
    config = NodeConfig()
    per_rank = BATCH_SIZE // NUM_RANKS
    losses: list[float] = []
    for inputs, targets in fixed_batches():
        if rank is not None:
            inputs = inputs[rank * per_rank : (rank + 1) * per_rank]  # (B / dp, T)
            targets = targets[rank * per_rank : (rank + 1) * per_rank]  # (B / dp, T)
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        if rank is not None and stage == 1:
            average_gradients(model)  # ZeRO-3 reduce-scatters inside backward
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.inner.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": full_parameters(model),
        "state_bytes": optimizer_state_bytes(optimizer),
    }


def _zero_worker(rank: int, stage: int, store_path: str, out_dir: str) -> None:
    with worker_process_group(
        rank, NUM_RANKS, store_path, backend=distributed_backend(), timeout=timedelta(seconds=60)
    ):
        model = build_model()
        optimizer: torch.optim.Optimizer
        if stage == 1:
            optimizer = build_zero_optimizer(model, NodeConfig())
        else:
            apply_fully_shard(model, init_device_mesh(device_type(), (NUM_RANKS,), mesh_dim_names=("dp",)))
            optimizer = build_inner_optimizer(model, NodeConfig())
        torch.save(_train(model, optimizer, rank, stage), Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [1, 3])
def test_two_rank_zero_matches_single_process_with_half_the_state(stage: int, tmp_path: Path) -> None:
    worker_args = [(rank, stage, str(tmp_path / "store"), str(tmp_path)) for rank in range(NUM_RANKS)]
    with spawned_workers(_zero_worker, worker_args, deadline=timedelta(seconds=90)):
        reference_model = build_model()  # overlaps with the workers' start-up
        reference_optimizer = build_inner_optimizer(reference_model, NodeConfig())
        reference = _train(reference_model, reference_optimizer, None, stage)

    results: list[TrainResult] = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(NUM_RANKS)]
    mean_losses = torch.tensor([result["losses"] for result in results]).mean(dim=0)  # (num_steps,)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"]), rtol=STEP_TOLERANCE, atol=0.0)
    # Training moved the weights far more than the tolerance: "equal" does not mean "nothing happened".
    initial_params = full_parameters(build_model())
    assert relative_error(reference["params"][0], initial_params[0]) > 100 * TRAINED_PARAMS_TOLERANCE
    for rank, result in enumerate(results):
        errors = [
            relative_error(got, want) for got, want in zip(result["params"], reference["params"], strict=True)
        ]
        assert max(errors) < TRAINED_PARAMS_TOLERANCE, f"rank {rank}: parameter relative errors {errors}"
        share = result["state_bytes"] / reference["state_bytes"]
        assert 0.3 < share < 0.7, f"rank {rank} holds {share:.3f} of the unsharded optimizer state"
