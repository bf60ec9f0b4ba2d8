"""Tests for node.model.gpt: shapes, parameter counts, causality, RoPE, init, loss, overfitting, stage splits."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from node.model.gpt import (
    GPT,
    MODEL_PRESETS,
    Attention,
    ModelConfig,
    apply_rotary_embedding,
    cross_entropy_loss,
    estimate_flops_per_token,
    model_config,
    precompute_rope,
)

NOMINAL_PARAMS = {"nano": 1e6, "tiny": 10e6, "small": 50e6, "350m": 350e6, "1b": 1e9, "7b": 7e9}


def _nano(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(model_config("nano", **overrides))


def _random_tokens(batch_size: int, seq_len: int, vocab_size: int = 260, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)


def test_forward_shapes_nano() -> None:
    model = _nano()
    tokens = _random_tokens(2, 32)
    logits = model(tokens)
    assert logits.shape == (2, 32, 260)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_sequence_longer_than_config_is_rejected() -> None:
    model = _nano(seq_len=16)
    with pytest.raises(ValueError, match="exceeds"):
        model(_random_tokens(1, 17))


def test_presets_cover_nominal_names() -> None:
    assert set(MODEL_PRESETS) == set(NOMINAL_PARAMS)
    assert [MODEL_PRESETS[name].seq_len for name in ("nano", "tiny", "small", "350m", "1b", "7b")] == [
        128,
        256,
        512,
        2048,
        2048,
        2048,
    ]


@pytest.mark.parametrize("preset", list(NOMINAL_PARAMS))
def test_preset_param_count_near_nominal(preset: str) -> None:
    num_params = MODEL_PRESETS[preset].num_params()
    assert abs(num_params / NOMINAL_PARAMS[preset] - 1) <= 0.25, f"{preset}: {num_params:,}"


@pytest.mark.parametrize(
    "config",
    [
        MODEL_PRESETS["nano"],
        MODEL_PRESETS["tiny"],
        ModelConfig(seq_len=8, dim=64, num_layers=3, num_heads=4, num_kv_heads=2, tie_embeddings=True),
        ModelConfig(vocab_size=100, seq_len=8, dim=48, num_layers=2, num_heads=6, mlp_hidden_dim=100),
    ],
    ids=["nano", "tiny", "gqa-tied", "custom-mlp"],
)
def test_analytic_param_count_matches_module(config: ModelConfig) -> None:
    assert config.num_params() == GPT(config).num_params()


def test_param_count_by_hand() -> None:
    # dim 64, 4 heads of 16, 2 kv heads (kv width 32), mlp round_up(int(170.67), 64) = 192, vocab 260.
    config = ModelConfig(seq_len=8, dim=64, num_layers=2, num_heads=4, num_kv_heads=2)
    per_layer = 64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 192 + 2 * 64
    assert config.resolved_mlp_hidden_dim == 192
    assert config.num_params() == 2 * per_layer + 2 * 260 * 64 + 64


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dim": 100, "num_heads": 3}, "divisible by num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "divisible by num_kv_heads"),
        ({"dim": 12, "num_heads": 4}, "even"),
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"vocab_size": -1}, "vocab_size must be positive"),
        ({"num_kv_heads": 0}, "num_kv_heads must be positive"),
        ({"init_std": 0.0}, "init_std must be positive"),
    ],
)
def test_config_validation(overrides: dict[str, object], message: str) -> None:
    kwargs: dict[str, object] = {"seq_len": 8, "dim": 64, "num_layers": 2, "num_heads": 4} | overrides
    with pytest.raises(ValueError, match=message):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


def test_model_config_overrides_and_errors() -> None:
    config = model_config("tiny", seq_len=64, vocab_size=512)
    assert (config.seq_len, config.vocab_size, config.dim) == (64, 512, MODEL_PRESETS["tiny"].dim)
    with pytest.raises(ValueError, match="nano, tiny, small, 350m, 1b, 7b"):
        model_config("huge")
    with pytest.raises(ValueError, match="unknown ModelConfig fields"):
        model_config("nano", width=3)
    with pytest.raises(ValueError, match="divisible"):
        model_config("nano", num_heads=3)


def test_attention_is_causal() -> None:
    model = _nano(seq_len=16)
    tokens = _random_tokens(2, 16)
    position = 7
    logits = model(tokens)

    future_changed = tokens.clone()
    future_changed[:, position + 1 :] = (future_changed[:, position + 1 :] + 1) % 260
    logits_future_changed = model(future_changed)
    torch.testing.assert_close(logits_future_changed[:, : position + 1], logits[:, : position + 1])
    assert not torch.allclose(logits_future_changed[:, position + 1 :], logits[:, position + 1 :])

    present_changed = tokens.clone()
    present_changed[:, position] = (present_changed[:, position] + 1) % 260
    logits_present_changed = model(present_changed)
    torch.testing.assert_close(logits_present_changed[:, :position], logits[:, :position])
    assert (logits_present_changed[:, position] - logits[:, position]).abs().max() > 1e-3


def test_rotary_matches_complex_reference() -> None:
    batch_size, seq_len, num_heads, head_dim, theta = 2, 6, 3, 8, 500.0
    x = torch.randn(batch_size, seq_len, num_heads, head_dim, dtype=torch.float64)
    cos, sin = precompute_rope(head_dim, seq_len, theta)
    rotated = apply_rotary_embedding(x.float(), cos, sin)

    # Reference: pairs as complex numbers times exp(j * t * theta^(-2i/d)), in float64.
    frequencies = torch.tensor(
        [theta ** (-2 * i / head_dim) for i in range(head_dim // 2)], dtype=torch.float64
    )
    angles = torch.arange(seq_len, dtype=torch.float64)[:, None] * frequencies[None, :]  # (T, D/2)
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]  # (1, T, 1, D/2)
    x_complex = torch.view_as_complex(x.reshape(batch_size, seq_len, num_heads, head_dim // 2, 2))
    expected = torch.view_as_real(x_complex * rotation).flatten(-2)
    torch.testing.assert_close(rotated, expected.float(), atol=1e-6, rtol=1e-5)


def test_rotary_hand_computed_pair() -> None:
    # head_dim 2: one pair with frequency 1, so position t rotates (1, 0) by t radians.
    cos, sin = precompute_rope(head_dim=2, seq_len=3, theta=10000.0)
    x = torch.tensor([1.0, 0.0]).expand(1, 3, 1, 2)
    rotated = apply_rotary_embedding(x, cos, sin)[0, :, 0]  # (T, 2)
    expected = torch.tensor([[1.0, 0.0], [math.cos(1.0), math.sin(1.0)], [math.cos(2.0), math.sin(2.0)]])
    torch.testing.assert_close(rotated, expected)


def test_rotary_scores_depend_only_on_relative_position() -> None:
    seq_len, head_dim = 12, 16
    cos, sin = precompute_rope(head_dim, seq_len, 10000.0)
    q = torch.randn(head_dim).expand(1, seq_len, 1, head_dim)  # the same query at every position
    k = torch.randn(head_dim).expand(1, seq_len, 1, head_dim)  # the same key at every position
    q_rotated = apply_rotary_embedding(q, cos, sin)[0, :, 0]  # (T, D)
    k_rotated = apply_rotary_embedding(k, cos, sin)[0, :, 0]
    scores = q_rotated @ k_rotated.T  # (T, T): score of query position m against key position n
    for shift in (1, 3, 7):
        torch.testing.assert_close(scores[shift:, shift:], scores[:-shift, :-shift], atol=1e-5, rtol=1e-5)
    # ...and they do depend on the offset: the diagonal differs from the first off-diagonal.
    assert not torch.allclose(scores.diagonal(0)[:-1], scores.diagonal(-1))


def test_attention_heads_split_like_tensor_parallel() -> None:
    """Two modules holding half the heads each (wq/wk/wv rows, wo columns) sum to the full attention."""
    torch.manual_seed(0)
    config = ModelConfig(seq_len=16, dim=64, num_layers=1, num_heads=4, num_kv_heads=2)
    full = Attention(config)
    x = torch.randn(2, 16, 64)
    cos, sin = precompute_rope(config.head_dim, 16, config.rope_theta)
    q_width, kv_width = 2 * config.head_dim, 1 * config.head_dim  # per shard: 2 query heads, 1 kv head
    outputs = []
    for shard in range(2):
        part = copy.deepcopy(full)
        q_rows = slice(shard * q_width, (shard + 1) * q_width)
        kv_rows = slice(shard * kv_width, (shard + 1) * kv_width)
        part.wq.weight = nn.Parameter(full.wq.weight[q_rows].clone())
        part.wk.weight = nn.Parameter(full.wk.weight[kv_rows].clone())
        part.wv.weight = nn.Parameter(full.wv.weight[kv_rows].clone())
        part.wo.weight = nn.Parameter(full.wo.weight[:, q_rows].clone())
        outputs.append(part(x, cos, sin))
    torch.testing.assert_close(outputs[0] + outputs[1], full(x, cos, sin))


def test_same_global_seed_gives_identical_params() -> None:
    first, second = _nano(), _nano()
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    torch.manual_seed(1)
    other = GPT(model_config("nano"))
    name = "layers.0.attention.wq.weight"
    assert not torch.equal(other.state_dict()[name], first.state_dict()[name])


def test_init_is_per_parameter_so_stages_match_full_model() -> None:
    full = _nano()
    stage = copy.deepcopy(full)
    del stage.layers["0"], stage.layers["1"]
    stage.tok_embeddings = None
    full.init_weights(seed=42)
    stage.init_weights(seed=42)
    full_state = full.state_dict()
    assert set(stage.state_dict()) < set(full_state)
    for name, tensor in stage.state_dict().items():
        torch.testing.assert_close(tensor, full_state[name], rtol=0, atol=0, msg=name)


def test_meta_construction_then_materialize_matches_cpu_init() -> None:
    config = model_config("nano")
    with torch.device("meta"):
        lazy = GPT(config)
    assert lazy.num_params() == config.num_params()
    assert all(param.is_meta for param in lazy.parameters())
    lazy.to_empty(device="cpu")
    lazy.init_weights(seed=7)
    eager = GPT(config)
    eager.init_weights(seed=7)
    tokens = _random_tokens(1, 16)
    torch.testing.assert_close(lazy(tokens), eager(tokens), rtol=0, atol=0)


def test_init_statistics() -> None:
    config = model_config("nano")
    model = _nano()
    residual_std = config.init_std / math.sqrt(2 * config.num_layers)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name
            continue
        expected_std = residual_std if name.endswith(("wo.weight", "w2.weight")) else config.init_std
        assert abs(param.mean().item()) < 0.05 * expected_std, name
        assert param.std().item() == pytest.approx(expected_std, rel=0.05), name


def test_tied_embeddings_share_storage() -> None:
    model = _nano(tie_embeddings=True)
    assert model.output is not None and model.tok_embeddings is not None
    assert model.output.weight is model.tok_embeddings.weight


def test_cross_entropy_matches_naive_reference() -> None:
    logits = torch.randn(2, 5, 11).to(torch.bfloat16)
    targets = torch.randint(0, 11, (2, 5))
    loss = cross_entropy_loss(logits, targets)
    assert loss.dtype == torch.float32
    log_probs = logits.double().log_softmax(-1)
    expected = -log_probs.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=1e-5)


def test_initial_loss_is_near_uniform() -> None:
    model = _nano(seq_len=64)
    tokens = _random_tokens(4, 65)
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - math.log(260)) < 0.3


def test_adamw_overfits_a_fixed_batch() -> None:
    model = _nano(seq_len=32)
    tokens = _random_tokens(4, 33)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_pipeline_stages_compose_to_full_model() -> None:
    full = _nano(seq_len=32)
    first_stage, last_stage = copy.deepcopy(full), copy.deepcopy(full)
    del first_stage.layers["2"], first_stage.layers["3"]
    first_stage.norm = None
    first_stage.output = None
    del last_stage.layers["0"], last_stage.layers["1"]
    last_stage.tok_embeddings = None
    assert list(last_stage.layers) == ["2", "3"]  # surviving layers keep their names

    tokens = _random_tokens(2, 32)
    hidden = first_stage(tokens)
    assert hidden.shape == (2, 32, 128)
    torch.testing.assert_close(last_stage(hidden), full(tokens))


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_flops_estimate_matches_flop_counter(tie_embeddings: bool) -> None:
    """With the math SDPA backend every matmul is visible to torch's FLOP counter: the counts agree."""
    config = model_config("nano", seq_len=32, tie_embeddings=tie_embeddings)
    model = GPT(config)
    batch_size = 2
    tokens = _random_tokens(batch_size, 32)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        cross_entropy_loss(model(tokens), tokens).backward()
    counted_per_token = counter.get_total_flops() / (batch_size * 32)
    assert estimate_flops_per_token(config) == pytest.approx(counted_per_token, rel=1e-9)
