"""Rounds due by time (``--round-seconds``): a phase ends once it has lasted the round's time, and
with ``--overlap`` not before the round in flight has landed, so a slow all-reduce never blocks the
training thread: the node trains on and the round simply lasts longer.

A Trainer with an averager that holds round 1 until the trainer has done ten more inner steps (a
deterministic stand-in for a link slower than the phase): phase 2 must run on for those steps
instead of ending after its 0.01 s and waiting for the swarm.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from node.ops.metrics import read_metrics
from node.outer.seam import Averaged, RoundOutcome, RoundRequest
from node.train.trainer import Trainer
from tests.node.swarm.test_swarm_session import corpus_file, small_config

__all__ = ["corpus_file"]  # fixture

HELD_FOR_STEPS = 10


class HeldAverager:
    """A swarm of one whose round 1 returns only once the trainer did HELD_FOR_STEPS more steps."""

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.step_at_start: dict[int, int] = {}
        self.released = threading.Event()

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        assert self.trainer is not None
        round_index = request.round_index
        start = self.step_at_start[round_index] = self.trainer.progress.step
        if round_index == 1:
            deadline = time.monotonic() + 60  # bounded: a phase that blocks would never get there
            while self.trainer.progress.step < start + HELD_FOR_STEPS and time.monotonic() < deadline:
                time.sleep(0.01)
            self.released.set()
        return RoundOutcome(Averaged(vector))


@pytest.mark.timeout(120)
def test_an_overlapped_phase_trains_on_until_the_round_in_flight_lands(
    corpus_file: Path, tmp_path: Path
) -> None:
    averager = HeldAverager()
    config = small_config(corpus_file, tmp_path, round_seconds=0.01, overlap=True, max_rounds=3)
    trainer = Trainer(config, averager=averager)
    averager.trainer = trainer
    trainer.run()
    rounds = read_metrics(tmp_path / "metrics.jsonl", kind="round")
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert averager.released.is_set()
    # Round 1 was applied at the end of phase 2, which ran on while round 1 was held.
    assert rounds[0]["step"] >= averager.step_at_start[1] + HELD_FOR_STEPS
    assert rounds[0]["seconds_blocked"] < 1.0  # it had landed: nothing to wait for
