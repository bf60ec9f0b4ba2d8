"""The training loop: loss falls, checkpoint -> resume equals an uninterrupted run, graceful stop."""

from __future__ import annotations

import inspect
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from node.config import ConfigError, NodeConfig
from node.ops.metrics import read_metrics
from node.train.trainer import Trainer
from tests.node.swarm_cluster import fork_node


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(inspect.getsource(inspect) * 2)  # ~250 KB of Python source
    return path


def small_config(corpus_file: Path, run_dir: Path, **overrides: object) -> NodeConfig:
    settings: dict[str, object] = dict(
        model="nano", seq_len=32, batch_size=4, inner_steps=3, eval_batches=2, warmup_steps=2,
        total_steps=30, data=str(corpus_file), run_dir=str(run_dir), log_every=100, inner_lr=3e-3,
    )  # fmt: skip
    settings.update(overrides)
    return NodeConfig.from_flat(**settings)


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == kind]


@pytest.mark.timeout(120)
def test_resume_mid_round_equals_uninterrupted_run(corpus_file: Path, tmp_path: Path) -> None:
    # Reference: 4 rounds of H=3 without interruption (evaluated every round: the eval changes nothing).
    Trainer(small_config(corpus_file, tmp_path / "ref", max_rounds=4, eval_every=1)).run()
    # Interrupted: stop after inner step 4 (mid-round 2), then resume up to round 4.
    Trainer(small_config(corpus_file, tmp_path / "cut", max_steps=4)).run()
    resumed = Trainer(small_config(corpus_file, tmp_path / "cut", max_rounds=4))
    assert resumed.resumed_from is not None and resumed.progress.step == 4 and resumed.progress.round == 1
    resumed.run()

    ref_steps, cut_steps = records(tmp_path / "ref", "step"), records(tmp_path / "cut", "step")
    assert [r["step"] for r in cut_steps] == list(range(1, 13))
    assert [r["loss"] for r in cut_steps] == [r["loss"] for r in ref_steps]  # bit-identical losses
    ref_rounds, cut_rounds = records(tmp_path / "ref", "round"), records(tmp_path / "cut", "round")
    assert [r["round"] for r in cut_rounds] == [1, 2, 3, 4]
    assert [r["param_hash"] for r in cut_rounds] == [r["param_hash"] for r in ref_rounds]
    assert ref_rounds[-1]["eval_loss"] < ref_rounds[0]["eval_loss"]  # it learns


@pytest.mark.timeout(120)
def test_round_limit_is_over_the_whole_run(corpus_file: Path, tmp_path: Path) -> None:
    Trainer(small_config(corpus_file, tmp_path, max_rounds=1)).run()
    again = Trainer(small_config(corpus_file, tmp_path, max_rounds=1))
    again.run()  # already done: no new records
    assert [r["round"] for r in records(tmp_path, "round")] == [1]
    Trainer(small_config(corpus_file, tmp_path, max_rounds=2)).run()
    rounds = records(tmp_path, "round")
    assert [r["round"] for r in rounds] == [1, 2]
    assert set(rounds[0]) >= {
        "kind", "round", "eval_loss", "peers", "bytes_sent", "bytes_recv",
        "seconds_compute", "seconds_comm", "param_hash",
    }  # fmt: skip
    step = records(tmp_path, "step")[0]
    assert set(step) >= {"kind", "round", "step", "loss", "lr", "tokens", "tokens_per_s"}
    assert (tmp_path / "config.toml").read_text().count("max_rounds = 2") == 1
    assert "sha256 = " in (tmp_path / "corpus.txt").read_text()


@pytest.mark.timeout(120)
def test_resume_refuses_another_model_or_corpus(corpus_file: Path, tmp_path: Path) -> None:
    Trainer(small_config(corpus_file, tmp_path, max_rounds=1)).run()
    with pytest.raises(ConfigError, match="does not fit model"):
        Trainer(small_config(corpus_file, tmp_path, model="tiny", max_rounds=2))
    other = tmp_path / "other.txt"
    other.write_text(inspect.getsource(os) * 2)
    with pytest.raises(ConfigError, match="trained on corpus"):
        Trainer(small_config(other, tmp_path, max_rounds=2))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_gracefully_with_checkpoint(corpus_file: Path, tmp_path: Path, signum: int) -> None:
    # `dtnode join` forked from the preloaded server (a fresh interpreter spends ~3 CPU-s importing);
    # the signal goes to the node's process alone, as a terminal's or a service manager's would.
    argv = [
        "join", "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "1000",
        "--data", str(corpus_file), "--run-dir", str(tmp_path / "run"), "--eval-batches", "1",
    ]  # fmt: skip
    log_path = tmp_path / "node.log"
    process = fork_node(argv, log_path)
    run_dir = tmp_path / "run"
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(read_metrics(metrics)) >= 3):
            assert time.monotonic() < deadline, "node did not start training"
            assert process.poll() is None, log_path.read_text(errors="replace")
            time.sleep(0.2)
        os.kill(process.pid, signum)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
    output = log_path.read_text(errors="replace")
    assert process.returncode == 0, output
    steps = records(run_dir, "step")
    checkpoint = (run_dir / "checkpoints" / "LATEST").read_text()
    assert checkpoint == f"step-{steps[-1]['step']:010d}"
    assert "stop requested" in output


@pytest.mark.timeout(120)
def test_outer_momentum_zero_is_plain_sgd_whatever_the_nesterov_flag(
    corpus_file: Path, tmp_path: Path
) -> None:
    # torch refuses Nesterov without momentum; the node takes momentum 0 as plain SGD instead: the
    # outer step is θ - lr·Δ, so the lr 0.5 step lands halfway between the start and the lr 1 step.
    landed = {}
    for lr in (1.0, 0.5):
        config = small_config(corpus_file, tmp_path / str(lr), max_rounds=1, outer_lr=lr, outer_momentum=0.0)
        assert config.outer.nesterov
        trainer = Trainer(config)
        assert trainer.diloco.outer.settings()["nesterov"] is False
        start = trainer.diloco.global_params.clone()
        trainer.run()
        landed[lr] = trainer.diloco.global_params.clone()
    assert not torch.equal(landed[1.0], start)
    torch.testing.assert_close(landed[0.5], (start + landed[1.0]) / 2, rtol=0, atol=1e-6)
