"""Tensor parallelism on a model read from a Hugging Face Llama ``config.json`` with grouped-query attention.

The config has 4 query heads over 2 key/value heads, split over tp=2 ranks: each rank holds 2 query heads
and the 1 kv head they share. Reference: the same model (same seed) in the test process without
parallelism, on the same batches. Each rank must give the same logits, loss and full gradients after a
backward pass (within 1e-5: TP changes only the summation order), and after 3 AdamW steps the same full
parameters (1e-4, as in ``test_tensor_parallel.py``, whose docstring explains the tolerances).
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from node.config import NodeConfig
from node.model.gpt import GPT, cross_entropy_loss
from node.model.hf import read_hf_config
from node.model.replica import build_inner_optimizer
from node.parallel.tensor import (
    apply_tensor_parallel,
    build_tensor_parallel_mesh,
    distributed_backend,
    full_parameters,
    full_tensor,
)
from tests.node.parallel_support import relative_error, spawned_workers, worker_process_group

NUM_RANKS = 2
STEP_TOLERANCE = 1e-5
TRAINED_PARAMS_TOLERANCE = 1e-4
HF_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 211,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 24,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def build_model(config_file: str) -> GPT:
    torch.manual_seed(11)
    return GPT(read_hf_config(config_file))


def batches(vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens = torch.randint(0, vocab_size, (3, 4, 25), generator=torch.Generator().manual_seed(12))
    return [(batch[:, :-1], batch[:, 1:]) for batch in tokens]


def run(model: GPT) -> dict[str, object]:
    """Logits of the first batch, then per batch: loss, backward, AdamW step; first grads, last params."""
    optimizer = build_inner_optimizer(model, NodeConfig())
    data = batches(model.config.vocab_size)
    with torch.no_grad():
        logits = model(data[0][0]).float().clone()
    losses, first_grads = [], []
    for inputs, targets in data:
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        if not first_grads:
            first_grads = [full_tensor(p.grad) for p in model.parameters() if p.grad is not None]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"logits": logits, "losses": losses, "first_grads": first_grads, "params": full_parameters(model)}


def _worker(rank: int, store_path: str, out_dir: str, config_file: str) -> None:
    with worker_process_group(
        rank, NUM_RANKS, store_path, backend=distributed_backend(), timeout=timedelta(seconds=60)
    ):
        model = apply_tensor_parallel(build_model(config_file), build_tensor_parallel_mesh(NUM_RANKS))
        layer = model.layers["0"].attention
        # The local shards: half the query heads and half the kv heads (head_dim 16).
        assert layer.wq.weight.to_local().shape[0] == 2 * 16 and layer.wk.weight.to_local().shape[0] == 16
        torch.save(run(model), Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.timeout(120)
def test_tp2_on_a_gqa_hf_config_matches_one_process(tmp_path: Path) -> None:
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(HF_CONFIG))
    args = [(rank, str(tmp_path / "store"), str(tmp_path), str(config_file)) for rank in range(NUM_RANKS)]
    with spawned_workers(_worker, args, deadline=timedelta(seconds=90)):
        reference = run(build_model(str(config_file)))
    model = build_model(str(config_file))
    assert (model.config.num_heads, model.config.num_kv_heads) == (4, 2)
    for rank in range(NUM_RANKS):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(result["logits"], reference["logits"], rtol=0.0, atol=STEP_TOLERANCE)
        torch.testing.assert_close(
            torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=STEP_TOLERANCE, atol=0.0
        )
        for got, want in zip(result["first_grads"], reference["first_grads"], strict=True):
            assert relative_error(got, want) < STEP_TOLERANCE
        for got, want in zip(result["params"], reference["params"], strict=True):
            assert relative_error(got, want) < TRAINED_PARAMS_TOLERANCE
