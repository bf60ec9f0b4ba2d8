"""The layout planner: memory formula against hand arithmetic, bubble, constraints, choice rule, CLI."""

from __future__ import annotations

import pytest

from node.model.gpt import ModelConfig, model_config
from node.ops.cli import main
from node.parallel.plan import Layout, bubble_fraction, estimate_memory, plan_layout


def test_memory_matches_hand_computation() -> None:
    # nano: C=128, L=4, 4 heads (K = 4 * 32 = 128), F = round_up(int(8*128/3)=341, 64) = 384, V = 260.
    config = model_config("nano")
    memory = estimate_memory(
        config, Layout(dp=2, tp=2, pp=2), seq_len=8, microbatch_size=2, num_microbatches=4
    )
    # block_params = (2*128*128 + 2*128*128 + 3*128*384) / 2 + 2*128 = 212992 / 2 + 256 = 106752
    # L_s = ceil(4 / 2) = 2; P_dev = 2 * 106752 + 2*260*128 + 128 = 213504 + 66560 + 128 = 280192
    assert memory.params_bytes == 4 * 280192 == 1120768
    assert memory.grads_bytes == 1120768
    # ZeRO-1 over dp=2: 8 * ceil(280192 / 2) = 8 * 140096
    assert memory.optimizer_bytes == 1120768
    # A = 4*128 + (3*128 + 3*128 + 4*384) / 2 = 512 + 1152 = 1664 per token per block;
    # per token: 2 * 1664 + 128 + 2*260 = 3976; in flight min(pp=2, m=4) = 2 micro-batches of 2 x 8 tokens.
    assert memory.activation_bytes == 4 * (2 * 2 * 8) * 3976 == 508928
    assert memory.total_bytes == 3 * 1120768 + 508928


def test_unsplit_model_counts_exactly_the_model_parameters() -> None:
    # Independent reference: ModelConfig.num_params() (pp=1 charges the end pieces exactly once).
    config = model_config("tiny", num_kv_heads=2)
    memory = estimate_memory(
        config, Layout(dp=1, tp=1, pp=1), seq_len=4, microbatch_size=1, num_microbatches=1
    )
    assert memory.params_bytes == 4 * config.num_params()
    assert memory.optimizer_bytes == 8 * config.num_params()
    # Without a pipeline micro-batches are accumulated one at a time: activations do not grow with m.
    accumulated = estimate_memory(
        config, Layout(dp=1, tp=1, pp=1), seq_len=4, microbatch_size=1, num_microbatches=8
    )
    assert accumulated.activation_bytes == memory.activation_bytes


def test_bubble_formula() -> None:
    assert bubble_fraction(1, 1) == 0.0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    with pytest.raises(ValueError):
        bubble_fraction(0, 4)


def test_roomy_devices_get_pure_data_parallelism() -> None:
    plan = plan_layout(
        model_config("nano"), num_devices=4, device_memory_bytes=2**30, seq_len=16, batch_size=8
    )
    assert plan.layout == Layout(dp=4, tp=1, pp=1)
    assert plan.num_microbatches == 1 and plan.microbatch_size == 2
    assert plan.bubble_fraction == 0.0
    assert plan.reasons and len(plan.rejected) == 5  # (dp,tp,pp) with dp*tp*pp = 4: six in all


def test_model_too_big_for_one_device_is_split() -> None:
    config = model_config("nano")
    replicated = estimate_memory(
        config, Layout(dp=2, tp=1, pp=1), seq_len=8, microbatch_size=1, num_microbatches=1
    )
    device_memory = 10_000_000
    assert replicated.total_bytes > device_memory  # neither replica fits alone
    plan = plan_layout(
        config, num_devices=2, device_memory_bytes=device_memory, seq_len=8, batch_size=2, headroom=0.0
    )
    assert plan.layout.dp == 1 and plan.layout.tp * plan.layout.pp == 2
    assert plan.layout == Layout(dp=1, tp=2, pp=1)  # tp before pp
    assert plan.memory.total_bytes <= device_memory
    assert any(r.layout.dp == 2 and "budget" in r.reason for r in plan.rejected)


def test_pipeline_prefers_four_microbatches_per_stage() -> None:
    # 6 heads: tp=4 is impossible, so with memory for about a quarter of the blocks pp must help tp.
    # Short sequences keep activations small, so the parameters decide what fits.
    config = ModelConfig(seq_len=32, dim=96, num_layers=8, num_heads=6, mlp_hidden_dim=192)
    single = estimate_memory(
        config, Layout(dp=1, tp=2, pp=2), seq_len=4, microbatch_size=4, num_microbatches=8
    )
    plan = plan_layout(
        config, num_devices=4, device_memory_bytes=single.total_bytes, seq_len=4, batch_size=32, headroom=0.0
    )
    assert plan.layout == Layout(dp=1, tp=2, pp=2)
    assert plan.num_microbatches == 8  # the fewest divisors of 32 with m >= 4 * pp
    assert plan.bubble_fraction == pytest.approx(1 / 9)
    assert any(r.layout.tp == 4 and "does not divide num_heads" in r.reason for r in plan.rejected)


def test_tp_that_does_not_divide_heads_is_never_chosen() -> None:
    config = ModelConfig(seq_len=16, dim=96, num_layers=8, num_heads=6, num_kv_heads=3, mlp_hidden_dim=192)
    for num_devices in range(1, 9):
        for device_memory in (300_000, 600_000, 1_000_000, 2_000_000, 10**9):
            try:
                plan = plan_layout(
                    config,
                    num_devices=num_devices,
                    device_memory_bytes=device_memory,
                    seq_len=16,
                    batch_size=8,
                )
            except ValueError:
                continue
            tp = plan.layout.tp
            assert 6 % tp == 0 and 3 % tp == 0 and 192 % tp == 0
            assert plan.layout.dp * tp * plan.layout.pp == num_devices


def test_nothing_fits_raises() -> None:
    with pytest.raises(ValueError, match="no layout of 2 device"):
        plan_layout(model_config("nano"), num_devices=2, device_memory_bytes=1000, seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="num_devices"):
        plan_layout(model_config("nano"), num_devices=0, device_memory_bytes=2**30, seq_len=8, batch_size=2)


def test_cli_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "7b", "--gpus", "8", "--gpu-mem", "24"]) == 0
    out = capsys.readouterr().out
    assert "dp=1 tp=8 pp=1" in out.splitlines()[0]
    for word in (
        "params",
        "grads",
        "optimizer",
        "activations",
        "pipeline bubble",
        "why:",
        "also considered:",
    ):
        assert word in out
    assert main(["plan", "--model", "7b", "--gpus", "1", "--gpu-mem", "24"]) == 2
    assert "no layout" in capsys.readouterr().err
