"""The node's device-efficiency settings: meta-device init, --compile, --precision auto, fused AdamW,
the --eval-every auto rule (node/model/meta_init.py, node/model/efficiency.py, node/model/replica.py)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch

from node.config import ConfigError, NodeConfig, replace
from node.model.efficiency import (
    EVAL_BUDGET,
    STEP_COST_IN_FORWARDS,
    eval_interval,
    resolve_compile,
    resolve_eval_background,
    resolve_precision,
)
from node.model.gpt import GPT, model_config
from node.model.meta_init import build_model
from node.model.replica import SingleReplica, build_inner_optimizer
from node.outer.diloco import ModuleParams

CPU = torch.device("cpu")


@pytest.mark.parametrize("tie", [False, True])
def test_meta_build_is_the_cpu_build_bit_for_bit(tie: bool) -> None:
    config = model_config("nano", tie_embeddings=tie)
    torch.manual_seed(7)
    reference = GPT(config)  # today's construction: on CPU, default init, then init_weights
    rng_after_reference = torch.get_rng_state()
    torch.manual_seed(7)
    built = build_model(config, CPU)
    assert torch.equal(torch.get_rng_state(), rng_after_reference)  # what is drawn next is the same too
    expected, got = reference.state_dict(), built.state_dict()
    assert list(got) == list(expected)
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    assert torch.equal(built.rope_cos, reference.rope_cos) and torch.equal(built.rope_sin, reference.rope_sin)
    assert not any(p.is_meta for p in built.parameters())
    if tie:
        assert built.output is not None and built.tok_embeddings is not None
        assert built.output.weight is built.tok_embeddings.weight


def test_auto_settings_on_cpu() -> None:
    assert resolve_precision("auto", CPU) == "fp32"
    assert resolve_precision("bf16", CPU) == "bf16" and resolve_precision("fp32", CPU) == "fp32"
    assert resolve_compile("auto", CPU, local_workers=False) is False
    assert resolve_compile("on", CPU, local_workers=False) is True
    assert resolve_compile("auto", torch.device("cuda"), local_workers=False) is True
    assert resolve_compile("auto", torch.device("cuda"), local_workers=True) is False
    with pytest.raises(ConfigError, match="--compile on"):
        resolve_compile("on", CPU, local_workers=True)
    with pytest.raises(ConfigError, match="compile"):
        NodeConfig.from_flat(compile="sometimes")
    # The held-out eval on its own thread: on with CUDA, inline on CPU and with local workers.
    assert resolve_eval_background("auto", CPU, local_workers=False) is False
    assert resolve_eval_background("on", CPU, local_workers=False) is True
    assert resolve_eval_background("auto", torch.device("cuda"), local_workers=False) is True
    assert resolve_eval_background("auto", torch.device("cuda"), local_workers=True) is False
    assert resolve_eval_background("off", torch.device("cuda"), local_workers=False) is False
    with pytest.raises(ConfigError, match="--eval-background on"):
        resolve_eval_background("on", CPU, local_workers=True)
    with pytest.raises(ConfigError, match="eval_background"):
        NodeConfig.from_flat(eval_background="later")


def test_eval_every_auto_keeps_eval_within_its_budget() -> None:
    defaults = NodeConfig()
    every = eval_interval(defaults)
    # The defaults (8 eval batches, H=50): one eval ≈ 8 forwards against 50 steps ≈ 150 forwards.
    assert every == 6
    cost = defaults.eval.batches / (STEP_COST_IN_FORWARDS * defaults.inner.steps * every)
    assert (
        cost
        <= EVAL_BUDGET
        < defaults.eval.batches / (STEP_COST_IN_FORWARDS * defaults.inner.steps * (every - 1))
    )
    assert eval_interval(replace(defaults, eval_every=2)) == 2
    assert eval_interval(replace(defaults, inner_steps=1000)) == 1
    assert eval_interval(replace(defaults, eval_batches=1, inner_steps=10)) == math.ceil(1 / 0.3)
    # --fragments 4: a round every H/4 = 12.5 steps, so 4 x as many rounds between evals give the
    # budget's share of compute again (8 / (3 x 12.5 x 22) <= 1% < 8 / (3 x 12.5 x 21)).
    assert eval_interval(replace(defaults, fragments=4)) == 22


def test_inner_adamw_is_fused_only_on_cuda() -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = build_inner_optimizer(model, NodeConfig())
    assert not optimizer.defaults.get("fused")  # CPU: torch's default implementation
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]


# The smallest model that still has every kind of op of the GPT (embedding, RMSNorm, RoPE attention,
# SwiGLU, the output head and its loss, their backward): one block, 2 heads of 16. Inductor builds a C++
# kernel per fused op, so the compile's cost follows the ops, not their width: cold, 22 kernels and ~36
# CPU-seconds (the 4-block nano preset: 31 kernels, ~56), ~50 where g++ also builds inductor's
# precompiled header (once per machine, outside the kernel cache).
SMALLEST = {"seq_len": 8, "dim": 32, "num_layers": 1, "num_heads": 2}


def replica_losses(compile: bool) -> list[float]:
    seq_len = SMALLEST["seq_len"]
    config = NodeConfig.from_flat(
        model="nano", seq_len=seq_len, batch_size=2, inner_lr=3e-3, compile="on" if compile else "off"
    )
    torch.manual_seed(0)
    replica = SingleReplica(model_config("nano", **SMALLEST), config, CPU, compile=compile)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        tokens = torch.randint(0, 260, (2, seq_len + 1), generator=generator)
        losses.append(replica.train_step([(tokens[:, :-1], tokens[:, 1:])], 3e-3))
    batch = torch.randint(0, 260, (2, seq_len + 1), generator=generator)
    # model.eval() under no_grad: a graph (and kernels) of its own
    losses.append(replica.eval_loss([(batch[:, :-1], batch[:, 1:])]))
    return losses


# Idle-machine seconds (tests/machine_load.py): the cold compile takes 50-70 s alone on 2 cores.
@pytest.mark.timeout(240)
def test_compiled_replica_matches_eager_on_cpu(tmp_path: Path) -> None:
    eager = replica_losses(compile=False)
    # Inductor builds the kernels in this process: no pool of compile workers, each a fresh interpreter
    # importing torch. Its caches start empty and in this test's own folder (fresh_cache): the test
    # costs a cold compile wherever it runs, and neither reads nor fills the user's kernel cache. What is
    # compiled, and how the product calls torch.compile, are unchanged.
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    try:
        with fresh_cache(dir=str(tmp_path)), inductor_config.patch(compile_threads=1):
            compiled = replica_losses(compile=True)
    except Exception as error:  # noqa: BLE001 - inductor's failure types vary with the toolchain
        if "Compiler" in type(error).__name__ or "compiler" in str(error).lower():
            pytest.skip(f"torch.compile cannot build kernels on this machine: {str(error).splitlines()[0]}")
        raise
    finally:
        torch._dynamo.reset()  # the worker's next tests run no compiled code
    # Fused kernels reorder float sums: equal within float32 rounding, not bit for bit.
    assert compiled == pytest.approx(eager, rel=1e-4, abs=1e-5)


def test_flat_outer_state_hashes_once_per_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import node.outer.state as outer_state

    calls = []
    monkeypatch.setattr(outer_state, "tensor_hash", lambda flat: calls.append(1) or reference_hash(flat))
    model = torch.nn.Linear(3, 4)
    state = outer_state.FlatOuterState(
        ModuleParams(list(model.parameters())), device=CPU, lr=0.7, momentum=0.9, nesterov=True
    )
    first = state.hash()
    assert (
        state.hash() == first == reference_hash(state.params()) and len(calls) == 1
    )  # asked twice, hashed once
    state.step(torch.ones(16))  # the outer step writes the params in place: hashed anew
    assert state.hash() == reference_hash(state.params()) != first and len(calls) == 2
    state.load(torch.zeros(16), None)
    assert state.hash() == reference_hash(torch.zeros(16)) and len(calls) == 3


def reference_hash(flat: torch.Tensor) -> str:
    return hashlib.sha256(flat.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
