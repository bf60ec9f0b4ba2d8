"""Checkpoints written in the background (node/train/checkpoint_writer.py) and the round record's wall-time
utilization and eval cadence (node/train/trainer.py, node/ops/metrics.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import node.train.checkpoint as checkpoint_module
from node.config import NodeConfig
from node.ops.metrics import read_metrics
from node.outer.state import tensor_hash
from node.train.checkpoint import LATEST, latest_checkpoint, load_checkpoint
from node.train.checkpoint_writer import CheckpointWriter, snapshot_state
from node.train.trainer import Trainer
from tests.node.train.test_trainer import corpus_file
from tests.node.train.test_trainer import small_config as trainer_config

__all__ = ["corpus_file"]  # fixture


def small_config(corpus_file: Path, run_dir: Path, **overrides: object) -> NodeConfig:
    """test_trainer's settings, as a node without a swarm."""
    return trainer_config(corpus_file, run_dir, **{"swarm": False, **overrides})


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return read_metrics(run_dir / "metrics.jsonl", kind=kind)


class BlockedFirstWrite:
    """Stands in for safetensors' ``save_file`` in node/train/checkpoint.py: the first call waits for
    ``release`` (the disk is slow); ``entered`` says it has begun, ``returned`` that it is done."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.entered, self.release, self.returned = threading.Event(), threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self, tensors: dict[str, torch.Tensor], filename: str, *args: Any) -> None:
        self.calls += 1
        if self.calls == 1:
            self.entered.set()
            assert self.release.wait(60), "the test never released the write"
        self.real(tensors, filename, *args)
        if self.calls == 1:
            self.returned.set()


def start_run(trainer: Trainer) -> tuple[threading.Thread, list[BaseException]]:
    """Run ``trainer`` on a daemon thread; what it raised lands in the returned list."""
    failure: list[BaseException] = []

    def train() -> None:
        try:
            trainer.run()
        except BaseException as error:  # noqa: BLE001 - checked on the test's thread
            failure.append(error)

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    return thread, failure


def wait_until(condition: Any, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.mark.timeout(180)
def test_steps_go_on_while_a_checkpoint_is_written_and_resume_from_it_is_bit_exact(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reference: 3 rounds of H=3, uninterrupted.
    Trainer(small_config(corpus_file, tmp_path / "ref", max_rounds=3)).run()

    # The run under test stops after step 5; the checkpoint of round 1 (step 3) is held on its way
    # to disk until the test lets it go.
    blocked = BlockedFirstWrite(checkpoint_module.save_file)
    monkeypatch.setattr(checkpoint_module, "save_file", blocked)
    trainer = Trainer(small_config(corpus_file, tmp_path / "cut", max_steps=5))
    thread, failure = start_run(trainer)
    try:
        assert blocked.entered.wait(60), "round 1's checkpoint was never written"
        # While that write is stuck, the inner steps of round 2 (4 and 5) run: the write is not on
        # the training thread's path. (A synchronous save would hold step 4 until the release.)
        went_on = wait_until(lambda: len(records(tmp_path / "cut", "step")) >= 5, 60)
        stuck_meanwhile = not blocked.returned.is_set()
    finally:
        blocked.release.set()
        thread.join(60)
    assert not failure, failure
    assert went_on and stuck_meanwhile, "the inner steps waited for the checkpoint write"
    steps = records(tmp_path / "cut", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]

    # The checkpoint written while steps 4-5 changed the params holds step 3's state: resume from it
    # (LATEST pointed back at it) and the run is the uninterrupted one, bit for bit.
    root = tmp_path / "cut" / "checkpoints"
    saved_round = records(tmp_path / "cut", "round")[0]
    state, meta = load_checkpoint(root / "step-0000000003")
    assert meta["step"] == 3 and meta["param_hash"] == saved_round["param_hash"]
    assert tensor_hash(state["outer"]["global_params"]) == meta["param_hash"]
    (root / LATEST).write_text("step-0000000003")
    resumed = Trainer(small_config(corpus_file, tmp_path / "cut", max_rounds=3))
    assert resumed.progress.step == 3
    resumed.run()
    ref_steps = records(tmp_path / "ref", "step")
    cut_steps = records(tmp_path / "cut", "step")[5:]  # the resumed run's steps: 4..9
    assert [s["step"] for s in cut_steps] == list(range(4, 10))
    assert [s["loss"] for s in cut_steps] == [s["loss"] for s in ref_steps[3:]]
    ref_hashes = [r["param_hash"] for r in records(tmp_path / "ref", "round")]
    assert [r["param_hash"] for r in records(tmp_path / "cut", "round")] == ref_hashes


@pytest.mark.timeout(120)
def test_utilization_is_inner_compute_over_wall_time(corpus_file: Path, tmp_path: Path) -> None:
    # 8 held-out batches every round: eval alone is a large share of a 3-step round, so a
    # utilization that counted only the time blocked on the swarm would read ~1.
    Trainer(small_config(corpus_file, tmp_path, max_rounds=3, eval_batches=8, eval_every=1)).run()
    steps, rounds = records(tmp_path, "step"), records(tmp_path, "round")
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for previous, record in zip(rounds, rounds[1:], strict=False):
        # From the records alone: each step's seconds are its tokens (the growth of the cumulative
        # count) over its tokens/s; the wall time is the gap between the round records' timestamps.
        compute = sum(
            (s["tokens"] - before["tokens"]) / s["tokens_per_s"]
            for before, s in zip(steps, steps[1:], strict=False)
            if previous["step"] < s["step"] <= record["step"]
        )
        wall = record["time"] - previous["time"]
        assert record["seconds_compute"] == pytest.approx(compute, rel=1e-6)
        assert record["seconds_wall"] == pytest.approx(wall, abs=0.05)
        assert record["utilization"] == pytest.approx(record["seconds_compute"] / record["seconds_wall"])
        assert record["utilization"] < 0.9, record  # the evals are in the wall time
        assert record["blocked_share"] == pytest.approx(record["seconds_blocked"] / record["seconds_wall"])


@pytest.mark.timeout(120)
def test_eval_runs_every_n_rounds_and_on_the_last(corpus_file: Path, tmp_path: Path) -> None:
    Trainer(small_config(corpus_file, tmp_path, max_rounds=5, eval_every=3)).run()
    losses = {r["round"]: r["eval_loss"] for r in records(tmp_path, "round")}
    assert [round for round, loss in losses.items() if loss is not None] == [3, 5]  # not round 1
    assert all(isinstance(losses[r], float) for r in (3, 5))


def test_snapshot_is_a_copy_of_every_tensor() -> None:
    weight = torch.arange(4.0)
    state = {"model": {"w": weight}, "opt": {"groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]}, "step": 3}
    snapshot = snapshot_state(state)
    weight.add_(1.0)  # the loop steps on after the snapshot
    assert torch.equal(snapshot["model"]["w"], torch.arange(4.0))
    assert snapshot["opt"] == {"groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]} and snapshot["step"] == 3


def test_a_failed_background_write_raises_on_the_loop_and_the_next_waits(tmp_path: Path) -> None:
    order: list[str] = []
    gate = threading.Event()

    def write(root: Path, name: str, state: Any, meta: dict[str, Any], *, keep: int) -> Path:
        if name == "bad":
            raise OSError("disk full")
        gate.wait(10)
        order.append(name)
        return root / name

    writer = CheckpointWriter(tmp_path, keep=2, write=write)
    state = {"outer": {"global_params": torch.zeros(3)}}
    writer.submit("first", state, {"step": 1, "round": 1})
    assert writer.poll() is None and writer.in_flight  # still writing
    threading.Timer(0.2, gate.set).start()
    writer.submit("second", state, {"step": 2, "round": 2})  # waits for "first" to land
    assert order == ["first"]
    saved = writer.wait()
    assert saved is not None and order == ["first", "second"]
    assert saved.meta["param_hash"] == tensor_hash(torch.zeros(3))
    writer.submit("bad", state, {"step": 3, "round": 3})
    assert wait_until(lambda: not writer.in_flight or writer._pending.done(), 10)  # type: ignore[union-attr]
    with pytest.raises(OSError, match="disk full"):
        writer.poll()
    writer.close()


@pytest.mark.timeout(120)
def test_exit_waits_for_the_write_in_flight(corpus_file: Path, tmp_path: Path) -> None:
    Trainer(small_config(corpus_file, tmp_path, max_rounds=2)).run()
    latest = latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == "step-0000000006"
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if ".tmp-" in p.name]
