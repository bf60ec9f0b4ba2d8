"""A round's end (node/train/round_end.py, node/train/held_out.py): the held-out eval off the training thread gives
the inline eval's numbers, does not hold the next phase, and the round end makes one host copy of
the params, shared by the served snapshot, the checkpoint and the eval."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import node.outer.host_copy as host_copy_module
import node.outer.round as round_module
from node import load_model
from node.model.gpt import cross_entropy_loss
from node.outer.round import RoundApplied
from node.outer.state import tensor_hash
from node.swarm.state import GLOBAL_PARAMS, OUTER_MOMENTUM
from node.train.held_out import HeldOutEval
from node.train.trainer import Trainer
from protocol.statesync.snapshot import Snapshot
from tests.node.outer.scripted_swarm import ScriptedSwarm
from tests.node.train.test_checkpoint_writer import records, small_config, start_run, wait_until
from tests.node.train.test_trainer import corpus_file

__all__ = ["corpus_file"]  # fixture

aten = torch.ops.aten


def exported_eval_loss(trainer: Trainer) -> float:
    """Independent reference: the held-out loss of the model the run exported (its global params),
    loaded afresh from disk and run on the trainer's held-out batches."""
    model = load_model(trainer.run_dir)
    with torch.no_grad():
        losses = [cross_entropy_loss(model(x), y).item() for x, y in trainer.eval_set]
    return sum(losses) / len(losses)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [False, True])
def test_background_eval_gives_the_inline_eval_of_the_global_params(
    corpus_file: Path, tmp_path: Path, overlap: bool
) -> None:
    runs = {}
    for mode in ("off", "on"):
        trainer = Trainer(
            small_config(
                corpus_file,
                tmp_path / mode,
                max_rounds=3,
                eval_every=1,
                eval_background=mode,
                overlap=overlap,
            )
        )
        assert (trainer.round_end.background is not None) == (mode == "on")
        trainer.run()
        runs[mode] = (trainer, records(tmp_path / mode, "round"))
    inline, background = runs["off"][1], runs["on"][1]
    assert [r["round"] for r in background] == [r["round"] for r in inline] == [1, 2, 3]
    assert [r["param_hash"] for r in background] == [r["param_hash"] for r in inline]
    assert all(isinstance(r["eval_loss"], float) for r in inline)
    # Same params, same batches: the same numbers, bit for bit.
    assert [r["eval_loss"] for r in background] == [r["eval_loss"] for r in inline]
    # ... and they are the loss of the global params (the last round's: what the run exported).
    for trainer, rounds in runs.values():
        assert rounds[-1]["eval_loss"] == exported_eval_loss(trainer)


@pytest.mark.timeout(180)
def test_next_phase_trains_while_the_eval_runs_and_the_record_waits_for_it(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real = HeldOutEval._mean_loss
    calls = []

    def held_first_eval(self: HeldOutEval) -> float:
        calls.append(1)
        if len(calls) == 1:  # round 1's eval: held until the test lets it go
            entered.set()
            assert release.wait(120), "the test never released the eval"
        return real(self)

    monkeypatch.setattr(HeldOutEval, "_mean_loss", held_first_eval)
    trainer = Trainer(small_config(corpus_file, tmp_path, max_rounds=2, eval_every=1, eval_background="on"))
    thread, failure = start_run(trainer)
    try:
        assert entered.wait(120), "round 1's eval never started"
        # While round 1's eval is held, round 2's inner steps (4..6) run; round 1's record waits for its loss.
        went_on = wait_until(lambda: len(records(tmp_path, "step")) >= 6, 120)
        held_meanwhile = records(tmp_path, "round") == []
    finally:
        release.set()
        thread.join(120)
    assert not failure, failure
    assert went_on, "the inner steps waited for the held-out eval"
    assert held_meanwhile, "round 1's record was written before its eval was in"
    rounds = records(tmp_path, "round")
    assert [r["round"] for r in rounds] == [1, 2] and all(isinstance(r["eval_loss"], float) for r in rounds)
    assert rounds[-1]["eval_loss"] == exported_eval_loss(trainer)


class HostCopyCounter(TorchDispatchMode):
    """Counts the numbers copied out of the params (θ_global and the model's parameters, and the copies
    made of them, transitively) into new tensors, on the thread that enters it. The outer step's own
    arithmetic (Δ = θ_global − θ_local, the Nesterov step, θ_local ← θ_global) copies none."""

    def __init__(self, live: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = {tensor.untyped_storage().data_ptr() for tensor in live}
        self.copies: set[int] = set()  # storages of the copies counted so far
        self.numbers = 0

    @staticmethod
    def _storage(tensor: object) -> int | None:
        return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else None

    def _count(self, source: torch.Tensor, target: torch.Tensor) -> None:
        if self._storage(source) in self.live | self.copies and self._storage(target) not in self.live:
            self.numbers += source.numel()
            self.copies.add(target.untyped_storage().data_ptr())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in (aten.clone.default, aten._to_copy.default):
            self._count(args[0], out)
        elif func is aten.copy_.default:
            self._count(args[1], args[0])
        return out


@pytest.mark.timeout(180)
def test_round_end_makes_one_host_copy_of_the_params(corpus_file: Path, tmp_path: Path) -> None:
    swarm = ScriptedSwarm()
    # Checkpoint every round, eval every round in the background, the state served after each.
    config = small_config(corpus_file, tmp_path, max_rounds=3, eval_every=1, eval_background="on")
    trainer = Trainer(config, swarm=swarm)
    live = [*trainer.diloco.params, trainer.diloco.outer.params()]
    counter = HostCopyCounter(live)
    copied_per_round: list[int] = []
    copied_between_rounds = 0
    at_step_boundary = trainer.round.at_step_boundary

    def counted_step_boundary() -> RoundApplied | None:
        nonlocal copied_between_rounds
        before = counter.numbers
        with counter:  # this thread only: the writer's and the eval's threads copy nothing of the live params
            applied = at_step_boundary()
        if applied is not None:  # a round's end: the round, its record, its checkpoint, its served state
            copied_per_round.append(counter.numbers - before)
        else:
            copied_between_rounds += counter.numbers - before
        return applied

    trainer.round.at_step_boundary = counted_step_boundary  # type: ignore[method-assign]
    trainer.run()
    num_params = trainer.diloco.num_elements
    assert len(copied_per_round) == 3 and [s.round_id for s in swarm.served] == [0, 1, 2, 3]
    assert copied_per_round == [num_params] * 3, "more than one host copy of the params per round end"
    assert copied_between_rounds == 0
    # The one copy is shared: the served snapshot holds it, the eval model's params are views of it.
    host = trainer.round_end.host.get()
    assert swarm.served[-1].tensors[GLOBAL_PARAMS].data_ptr() == host.params.data_ptr()
    assert swarm.served[-1].state_id == host.param_hash == records(tmp_path, "round")[-1]["param_hash"]
    background = trainer.round_end.background
    assert background is not None
    eval_param = next(background.model.parameters())
    assert eval_param.untyped_storage().data_ptr() == host.params.untyped_storage().data_ptr()
    # ... and the checkpoint written from it holds the round's state: resume is still exact.
    resumed = Trainer(small_config(corpus_file, tmp_path, max_rounds=3))
    assert resumed.diloco.param_hash() == host.param_hash and resumed.progress.round == 3
    assert torch.equal(torch.cat([p.detach().reshape(-1) for p in resumed.diloco.params]), host.params)


@pytest.mark.timeout(180)
def test_with_overlap_the_served_state_is_built_on_the_averaging_thread(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--overlap: the state served after a round (its host copy, param_hash and block hashes, ~1-2 s a
    round for 10M params on a CPU) is built on the averaging thread once the round's step is applied;
    the training thread only publishes it. What is served is unchanged: each snapshot's params hash to
    its state id and its round record's param_hash, its hashes are a fresh snapshot's of the same
    numbers, it names the step its phase ended at, and the last one is the run's final state."""
    built_on: list[tuple[int, str]] = []  # (round, thread) of every served snapshot built
    copied_on: list[str] = []  # the thread of every host copy of θ_global and the momentum
    real_snapshot, real_copy = round_module.state_snapshot, host_copy_module.host_copy

    def recorded_snapshot(**kwargs: Any) -> Snapshot:
        snapshot = real_snapshot(**kwargs)
        built_on.append((snapshot.round_id, threading.current_thread().name))
        return snapshot

    def recorded_copy(tensor: torch.Tensor) -> torch.Tensor:
        copied_on.append(threading.current_thread().name)
        return real_copy(tensor)

    monkeypatch.setattr(round_module, "state_snapshot", recorded_snapshot)
    monkeypatch.setattr(host_copy_module, "host_copy", recorded_copy)
    swarm = ScriptedSwarm()
    trainer = Trainer(small_config(corpus_file, tmp_path, max_rounds=3, overlap=True), swarm=swarm)
    training_thread = threading.current_thread().name
    trainer.run()

    # Round 0's state (held at the join, then served) is built by the training thread; every round's
    # after it once, on the averaging thread, the last one's too (applied by OuterRound.finish).
    assert built_on[:2] == [(0, training_thread)] * 2
    assert [round for round, _ in built_on[2:]] == [1, 2, 3]
    assert all(thread.startswith("outer-averaging") for _, thread in built_on[2:]), built_on
    # One host copy on the training thread: round 0's θ_global (no momentum before the first outer
    # step); θ_global and the momentum of rounds 1-3 on the averaging thread.
    assert copied_on.count(training_thread) == 1 and len(copied_on) == 1 + 2 * 3, copied_on
    # Served once each, in round order, with the figures the training thread built before.
    rounds = records(tmp_path, "round")
    assert [s.round_id for s in swarm.served] == [0, 1, 2, 3]
    for served, record in zip(swarm.served[1:], rounds, strict=True):
        params = served.tensors[GLOBAL_PARAMS]
        assert served.state_id == record["param_hash"] == tensor_hash(params)
        assert json.loads(served.metadata)["step"] == served.round_id * 3  # its phase's end (H = 3)
        fresh = Snapshot(
            round_id=served.round_id,
            state_id=served.state_id,
            tensors=dict(served.tensors),
            metadata=served.metadata,
        )
        assert fresh.entries == served.entries
    last = swarm.served[-1]
    assert torch.equal(last.tensors[GLOBAL_PARAMS], trainer.diloco.global_params)
    momentum = trainer.diloco.momentum_buffer()
    assert momentum is not None and torch.equal(last.tensors[OUTER_MOMENTUM], momentum)
