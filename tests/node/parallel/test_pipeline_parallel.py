"""Pipeline parallelism: stage splitting, and 2-rank gloo training matching a single-process reference."""

from __future__ import annotations

import itertools
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from node.model.gpt import GPT, cross_entropy_loss, model_config
from node.parallel.pipeline import PipelineRunner, build_stage, split_stages
from tests.node.parallel_support import (
    BATCH_SIZE,
    NUM_STEPS,
    SEQ_LEN,
    build_model,
    relative_error,
    spawned_workers,
    worker_process_group,
)

NUM_STAGES = 2
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.1


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(99)
    batches = []
    for _ in range(NUM_STEPS):
        sequence = torch.randint(0, 260, (BATCH_SIZE, SEQ_LEN + 1), generator=generator)
        batches.append((sequence[:, :-1], sequence[:, 1:]))  # tokens, targets (B, T)
    return batches


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=WEIGHT_DECAY
    )


def _reference(num_microbatches: int | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain single-process training. ``None``: whole batches, the mean loss over all B*T positions.

    With ``num_microbatches``: gradient accumulation over equal chunks of the batch, then divided by the
    chunk count; the same mean mathematically, summed in the pipeline's order in floating point.
    """
    model = build_model()
    optimizer = _optimizer(model)
    losses = []
    for tokens, targets in _batches():
        optimizer.zero_grad()
        if num_microbatches is None:
            loss = cross_entropy_loss(model(tokens), targets)
            loss.backward()
        else:
            chunk_losses = []
            for token_chunk, target_chunk in zip(
                tokens.chunk(num_microbatches), targets.chunk(num_microbatches), strict=True
            ):
                chunk_loss = cross_entropy_loss(model(token_chunk), target_chunk)
                chunk_loss.backward()
                chunk_losses.append(chunk_loss.detach())
            for param in model.parameters():
                assert param.grad is not None
                param.grad /= num_microbatches
            loss = torch.stack(chunk_losses).mean()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def _flat(parameters: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameters[name].flatten() for name in sorted(parameters)])


def _pipeline_worker(rank: int, store_path: str, out_dir: str, schedule: str, num_microbatches: int) -> None:
    with worker_process_group(rank, NUM_STAGES, store_path, backend="gloo", timeout=timedelta(seconds=30)):
        stage_model = build_stage(build_model(), rank, NUM_STAGES)
        runner = PipelineRunner(
            stage_model,
            stage_index=rank,
            num_stages=NUM_STAGES,
            num_microbatches=num_microbatches,
            schedule=schedule,  # type: ignore[arg-type]
            device=torch.device("cpu"),
        )
        optimizer = _optimizer(stage_model)
        losses = []
        for tokens, targets in _batches():
            optimizer.zero_grad()
            loss = runner.forward_backward(tokens, targets)
            optimizer.step()
            losses.append(loss.item())
        parameters = {name: p.detach().clone() for name, p in stage_model.named_parameters()}
        torch.save({"losses": losses, "parameters": parameters}, Path(out_dir) / f"rank{rank}.pt")


def test_split_stages_balanced_and_complete() -> None:
    model = GPT(model_config("small", seq_len=16))  # 10 layers
    layer_params = sum(p.numel() for p in model.layers["0"].parameters())
    embedding_params = model.config.vocab_size * model.config.dim
    for num_stages in range(1, 11):
        ranges = split_stages(model, num_stages)
        assert len(ranges) == num_stages
        covered = [layer for start, end in ranges for layer in range(start, end)]
        assert covered == list(range(10)), ranges  # every layer once, in order, no empty stage
        assert all(end > start for start, end in ranges)
        costs = [(end - start) * layer_params for start, end in ranges]
        costs[0] += embedding_params
        costs[-1] += embedding_params + model.config.dim
        # Brute force over all split points: the returned split has the smallest maximum stage cost.
        best = min(
            max(
                (b - a) * layer_params
                + (embedding_params if i == 0 else 0)
                + (embedding_params + model.config.dim if i == num_stages - 1 else 0)
                for i, (a, b) in enumerate(itertools.pairwise((0, *cuts, 10)))
            )
            for cuts in itertools.combinations(range(1, 10), num_stages - 1)
        )
        assert max(costs) == best


def test_split_stages_rejects_bad_counts_and_tied_embeddings() -> None:
    model = GPT(model_config("nano", seq_len=16))  # 4 layers
    assert split_stages(model, 2) == [(0, 2), (2, 4)]
    with pytest.raises(ValueError, match="non-empty"):
        split_stages(model, 5)
    with pytest.raises(ValueError, match="at least 1"):
        split_stages(model, 0)
    tied = GPT(model_config("nano", seq_len=16, tie_embeddings=True))
    with pytest.raises(ValueError, match="tie_embeddings"):
        build_stage(tied, 0, 2)


def test_build_stage_partitions_the_parameters() -> None:
    model = GPT(model_config("nano", seq_len=16))
    stages = [build_stage(model, index, 2) for index in range(2)]
    assert stages[0].norm is None and stages[0].output is None and stages[1].tok_embeddings is None
    names = [name for stage in stages for name, _ in stage.named_parameters()]
    assert sorted(names) == sorted(name for name, _ in model.named_parameters())  # disjoint and complete
    full = dict(model.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            assert torch.equal(param, full[name]) and param is not full[name]
    tokens = torch.randint(0, 260, (2, 16))
    torch.testing.assert_close(stages[1](stages[0](tokens)), model(tokens), rtol=0, atol=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("schedule", "num_microbatches"), [("gpipe", 2), ("1f1b", 4)])
def test_pipeline_training_matches_single_process(
    tmp_path: Path, schedule: str, num_microbatches: int
) -> None:
    worker_args = [
        (rank, str(tmp_path / "store"), str(tmp_path), schedule, num_microbatches)
        for rank in range(NUM_STAGES)
    ]
    with spawned_workers(_pipeline_worker, worker_args, deadline=timedelta(seconds=90)):
        reference_losses, reference_parameters = _reference()  # overlaps with the workers' start-up
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(NUM_STAGES)]
    for result in results:  # the loss is broadcast from the last stage to every stage
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference_losses), rtol=1e-5, atol=0
        )
    pipeline_parameters = {name: p for result in results for name, p in result["parameters"].items()}
    assert sorted(pipeline_parameters) == sorted(reference_parameters)
    pipeline_flat, reference_flat = _flat(pipeline_parameters), _flat(reference_parameters)
    # Against whole-batch training the only difference is fp32 summation order, which AdamW's division by
    # sqrt(v) amplifies over 10 steps to a few 1e-6.
    assert relative_error(pipeline_flat, reference_flat) < 1e-5
    # Against gradient accumulation over the same micro-batches the arithmetic is the same: much tighter.
    _, accumulated_parameters = _reference(num_microbatches)
    assert relative_error(pipeline_flat, _flat(accumulated_parameters)) < 1e-7
    # The parameters really moved: the comparison is not between two untouched initialisations.
    initial_flat = _flat({name: p.detach() for name, p in build_model().named_parameters()})
    assert relative_error(reference_flat, initial_flat) > 1e-2
