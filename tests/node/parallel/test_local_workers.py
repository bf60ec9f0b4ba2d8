"""``dtnode join --local-workers K --dp/--tp/--pp`` trains like a single-process node.

Each layout runs the real CLI (``--no-swarm``: one node, whose outer step averages only itself) for one
outer round of H=4 inner steps on the nano preset, and so does the reference, a single-process node with
the same config and data. The node's layout must not change what it computes beyond float summation
order:

- the 4 inner-step losses (``metrics.jsonl``) within 1e-5 relative of the reference's;
- the global params after the outer Nesterov step (``model.safetensors``) within 1e-5 relative (one norm
  over the whole vector) — and they moved from the initial params by far more than that, so a wrong shard,
  a missing all-reduce or a stage left out fails.

The LR is constant from step 1 (no warmup) so the 4 steps move the weights as much as possible. Four, not
more: a tensor-parallel node's step costs ~7x the single process's (DTensor's dispatch on a model this
small; measured 2.2 s against 0.3 s for 10 steps), so the steps are most of a layout's CPU, and every step after the first already runs the same code
(AdamW with its state, the collectives of the layout) as the tenth would.

Each node is forked from the server that imported the node once (``fork_node`` of
``tests/node/swarm_cluster.py``: a short node's start is mostly imports); it still runs the CLI in a process
of its own and starts its local ranks itself (forked from it: ``--threads 1`` on CPU without a swarm,
``node/parallel/local.py``). The GPU test starts fresh interpreters, whose ranks are spawned.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from node.model.gpt import GPT, model_config
from tests.node.swarm_cluster import fork_node

LOSS_TOLERANCE = 1e-5
PARAMS_TOLERANCE = 1e-5
RUN_TIMEOUT_SECONDS = 240
INNER_STEPS = 4

COMMON_ARGS = [
    "--no-swarm", "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1",
    "--inner-steps", str(INNER_STEPS), "--max-rounds", "1", "--lr-schedule", "constant", "--warmup-steps", "1",
    "--threads", "1", "--checkpoint-every", "0", "--log-every", "100",
    "--outer-sharding", "on",  # (auto keeps it flat on CPU; test_local_workers_swarm runs that)
]  # fmt: skip

LAYOUTS = {
    "tp2": ["--local-workers", "2", "--tp", "2"],
    "pp2-gpipe": ["--local-workers", "2", "--pp", "2", "--pp-schedule", "gpipe", "--microbatches", "2"],
    "pp2-1f1b": ["--local-workers", "2", "--pp", "2", "--pp-schedule", "1f1b", "--microbatches", "2"],
    "pp2-interleaved": [
        "--local-workers",
        "2",
        "--pp",
        "2",
        "--pp-schedule",
        "interleaved",
        "--microbatches",
        "2",
    ],
    "dp2-zero1": ["--local-workers", "2", "--dp", "2", "--zero", "1"],
    "dp2-zero3": ["--local-workers", "2", "--dp", "2", "--zero", "3", "--local-bucket-mb", "0.3"],
    # 0.1 MB pieces: the 3.7 MB vector crosses the ranks in 37 buckets, parameters spanning several.
    "tp2-pp2": [
        "--local-workers",
        "4",
        "--tp",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--local-bucket-mb",
        "0.1",
    ],
    "dp2-tp2": ["--local-workers", "4", "--dp", "2", "--tp", "2"],
    "tp2-sequence-parallel": ["--local-workers", "2", "--tp", "2", "--sequence-parallel"],
    "dp2-tp2-zero3": ["--local-workers", "4", "--dp", "2", "--tp", "2", "--zero", "3"],
    # No layout flag: the planner's choice for 2 workers.
    "planner": ["--local-workers", "2"],
    # Recomputed activations and 2 accumulated batches of 2 are the same step as one batch of 4.
    "recompute-accumulate": ["--activation-checkpointing", "--grad-accumulation", "2", "--batch-size", "2"],
    "pp2-recompute-accumulate": [
        "--local-workers",
        "2",
        "--pp",
        "2",
        "--microbatches",
        "2",
        "--activation-checkpointing",
        "--grad-accumulation",
        "2",
        "--batch-size",
        "2",
    ],  # fmt: skip
}
BF16_LOSS_TOLERANCE = 2e-2  # bf16 rounds every matmul input to 8 significant bits
BF16_PARAMS_TOLERANCE = 1e-2


def run_cli(argv: list[str], log_path: Path, *, timeout: float, fresh: bool = False) -> tuple[int, str]:
    """``dtnode ARGV`` to its end: its exit code and its output (stdout and stderr, in ``log_path``).

    Forked from the preloaded server, or ``fresh``: ``python -m node.ops.cli`` in a new interpreter."""
    if fresh:
        command = [sys.executable, "-m", "node.ops.cli", *argv]
        result = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
        )
        return result.returncode, result.stdout
    log_path.write_bytes(b"")
    node = fork_node(argv, log_path)
    try:
        code = node.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)  # the node and its local ranks (its session)
        node.wait(10)
        raise AssertionError(f"dtnode ran past {timeout} s: {log_path.read_text()[-3000:]}") from None
    return code, log_path.read_text()


def run_node(
    run_dir: Path, corpus: Path, extra: list[str], *, fresh: bool = False
) -> tuple[list[float], torch.Tensor]:
    """Run ``dtnode join`` to its end; its inner-step losses and its exported global params (flat).

    ``fresh``: in a new interpreter rather than forked from the preloaded one."""
    argv = ["join", "--run-dir", str(run_dir), "--data", str(corpus), *COMMON_ARGS, *extra]
    log_path = run_dir.with_name(f"{run_dir.name}.log")  # beside the run dir
    returncode, output = run_cli(argv, log_path, timeout=RUN_TIMEOUT_SECONDS, fresh=fresh)
    assert returncode == 0, output[-3000:]
    # With local workers the outer state is sharded over them (node/parallel/outer.py).
    sharded = "DiLoCo outer state sharded over" in output
    assert sharded == ("--local-workers" in extra and extra[extra.index("--local-workers") + 1] != "1")
    if sharded and "cuda" not in extra:  # on CPU, one thread, no swarm: forked from the node, not spawned
        assert "ranks started by fork" in output, output[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss"] for record in records if record["kind"] == "step"]
    tensors = load_file(str(run_dir / "model.safetensors"))
    names = [name for name, _ in GPT(model_config("nano", seq_len=32)).named_parameters()]
    return losses, torch.cat([tensors[name].reshape(-1) for name in names])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import inspect

    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(inspect.getsource(inspect) * 2)
    return path


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[float], torch.Tensor]:
    return run_node(tmp_path_factory.mktemp("reference"), corpus, [])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_trains_like_a_single_process(
    layout: str, corpus: Path, reference: tuple[list[float], torch.Tensor], tmp_path: Path
) -> None:
    reference_losses, reference_params = reference
    losses, params = run_node(tmp_path / layout, corpus, LAYOUTS[layout])
    assert len(losses) == len(reference_losses) == INNER_STEPS
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True)]
    params_error = relative_error(params, reference_params)
    print(f"{layout}: max loss error {max(loss_errors):.2e}, global params error {params_error:.2e}")
    assert max(loss_errors) <= LOSS_TOLERANCE, (losses, reference_losses)
    assert params_error <= PARAMS_TOLERANCE
    torch.manual_seed(0)  # the node's --seed: its initial params
    initial = torch.cat([p.detach().reshape(-1) for p in GPT(model_config("nano", seq_len=32)).parameters()])
    assert relative_error(reference_params, initial) > 1000 * PARAMS_TOLERANCE  # the round moved them


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [[], ["--local-workers", "2", "--tp", "2"]], ids=["single", "tp2"])
def test_bf16_autocast_stays_close_to_fp32(
    layout: list[str], corpus: Path, reference: tuple[list[float], torch.Tensor], tmp_path: Path
) -> None:
    reference_losses, reference_params = reference
    losses, params = run_node(tmp_path / "bf16", corpus, [*layout, "--precision", "bf16"])
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True)]
    print(
        f"bf16 {layout}: max loss error {max(loss_errors):.2e}, params {relative_error(params, reference_params):.2e}"
    )
    assert max(loss_errors) <= BF16_LOSS_TOLERANCE
    assert max(loss_errors) > 1e-6  # it did compute in bf16
    assert relative_error(params, reference_params) <= BF16_PARAMS_TOLERANCE


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--local-workers", "2", "--tp", "2", "--pp", "2"], "must equal the number of local workers"),
        (["--local-workers", "3", "--tp", "3"], "does not divide num_heads"),
        (["--local-workers", "2", "--pp", "2", "--microbatches", "3"], "must divide the per-replica batch"),
        (["--local-workers", "2", "--pp", "2", "--zero", "3"], "does not run with pipeline stages"),
        (
            ["--local-workers", "2", "--tp", "2", "--overlap", "--swarm-streams", "2"],
            "dtnode join: error: --overlap: does not run with --swarm-streams > 1 on a node with local workers",
        ),
    ],
)
def test_an_impossible_layout_is_a_clear_error(
    extra: list[str], message: str, corpus: Path, tmp_path: Path
) -> None:
    argv = ["join", "--run-dir", str(tmp_path / "run"), "--data", str(corpus), *COMMON_ARGS, *extra]
    returncode, output = run_cli(argv, tmp_path / "run.log", timeout=100)
    assert returncode == 2, output[-2000:]
    assert message in output


@pytest.mark.timeout(300)
def test_an_overlapped_node_with_local_workers_trains_like_a_single_process(
    corpus: Path, tmp_path: Path
) -> None:
    """With --overlap the outer step (on the ranks' ranges of the sharded outer state) runs on the
    averaging thread while the next inner steps run: both go through the node's one command channel,
    one call at a time, and three overlapped rounds end where a single process's do."""
    rounds = ["--overlap", "--inner-steps", "2", "--max-rounds", "3"]
    single_losses, single_params = run_node(tmp_path / "single", corpus, rounds)
    losses, params = run_node(tmp_path / "tp2", corpus, [*LAYOUTS["tp2"], *rounds])
    assert len(losses) == len(single_losses) == 6
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, single_losses, strict=True)) <= LOSS_TOLERANCE
    assert relative_error(params, single_params) <= PARAMS_TOLERANCE


def step_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {record["step"]: record["loss"] for record in records if record["kind"] == "step"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["dp2-zero1", "tp2"])
def test_a_resumed_node_with_local_workers_continues_exactly(
    layout: str, corpus: Path, tmp_path: Path
) -> None:
    """Two rounds straight vs one round, a restart from its checkpoint, and the second round: the same
    losses and params, so every rank's share of the inner AdamW state came back (afresh, step 4 differs)."""
    rounds = ["--inner-steps", "3", "--checkpoint-every", "1"]
    straight_losses, straight_params = run_node(
        tmp_path / "straight", corpus, [*LAYOUTS[layout], *rounds, "--max-rounds", "2"]
    )
    resumed_dir = tmp_path / "resumed"
    run_node(resumed_dir, corpus, [*LAYOUTS[layout], *rounds, "--max-rounds", "1"])
    _, resumed_params = run_node(resumed_dir, corpus, [*LAYOUTS[layout], *rounds, "--max-rounds", "2"])
    resumed_losses = step_losses(resumed_dir)
    assert sorted(resumed_losses) == list(range(1, 7))
    for step in range(4, 7):
        assert resumed_losses[step] == pytest.approx(straight_losses[step - 1], rel=1e-6, abs=0)
    assert relative_error(resumed_params, straight_params) <= 1e-6


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL); this machine has fewer"
)
@pytest.mark.parametrize("layout", ["tp2", "pp2-1f1b", "dp2-zero1"])
def test_layout_on_two_gpus_trains_like_one_gpu(layout: str, corpus: Path, tmp_path: Path) -> None:
    """The same code path over NCCL: a layout on 2 GPUs against a single-process node on one GPU."""
    reference_losses, reference_params = run_node(
        tmp_path / "one-gpu", corpus, ["--device", "cuda"], fresh=True
    )
    losses, params = run_node(tmp_path / layout, corpus, ["--device", "cuda", *LAYOUTS[layout]], fresh=True)
    loss_errors = [abs(a - b) / abs(b) for a, b in zip(losses, reference_losses, strict=True)]
    assert max(loss_errors) <= 1e-4  # GPU kernels (TF32 off by default for matmuls in fp32) reorder sums
    assert relative_error(params, reference_params) <= 1e-4
