"""Streamed fragments in the daemon's loop without a swarm: a run stopped with a fragment's round in
flight resumes bit for bit (its checkpoint holds the fragment's mix still due), and each round's
record names its fragment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from node.train.trainer import Trainer
from tests.node.run_support import one_torch_thread
from tests.node.train.test_trainer import corpus_file, records, small_config

__all__ = ["corpus_file"]  # the module-scoped fixture, shared with test_trainer.py

# H = 8 in F = 2 fragments: fragment 1's rounds after steps 4, 12, fragment 0's after 8, 16; each lands
# (mean applied, fragment mixed half-way) τ = 2 steps later.
FRAGMENTS = {"inner_steps": 8, "fragments": 2, "overlap_steps": 2, "fragment_mix": 0.5, "total_steps": 40}


@pytest.mark.timeout(240)
def test_resume_with_a_fragment_in_flight_equals_the_uninterrupted_run(
    corpus_file: Path, tmp_path: Path
) -> None:
    with one_torch_thread():
        # Reference: 4 rounds without interruption, evaluated at every round (an eval puts the local
        # params back: the steps after it must not see θ_global).
        Trainer(small_config(corpus_file, tmp_path / "ref", max_rounds=4, eval_every=1, **FRAGMENTS)).run()
        # Interrupted after step 5: round 1 (fragment 1, after step 4) is in flight, due to land after 6.
        Trainer(small_config(corpus_file, tmp_path / "cut", max_steps=5, **FRAGMENTS)).run()
        latest = tmp_path / "cut" / "checkpoints" / (tmp_path / "cut" / "checkpoints" / "LATEST").read_text()
        meta = json.loads((latest / "state.json").read_text())["meta"]
        assert (meta["step"], meta["round"], meta["outer_round"]) == (5, 1, {"pending_mix": [1, 6]})
        resumed = Trainer(small_config(corpus_file, tmp_path / "cut", max_rounds=4, **FRAGMENTS))
        assert resumed.resumed_from is not None and resumed.progress.step == 5
        resumed.run()

    ref_steps, cut_steps = records(tmp_path / "ref", "step"), records(tmp_path / "cut", "step")
    assert [r["step"] for r in cut_steps] == list(range(1, 17))
    assert [r["loss"] for r in cut_steps] == [r["loss"] for r in ref_steps]  # bit-identical losses
    ref_rounds, cut_rounds = records(tmp_path / "ref", "round"), records(tmp_path / "cut", "round")
    assert [(r["round"], r["fragment"], r["step"]) for r in ref_rounds] == [
        (1, 1, 6),
        (2, 0, 10),
        (3, 1, 14),
        (4, 0, 16),
    ]
    assert [(r["round"], r["fragment"]) for r in cut_rounds] == [(1, 1), (2, 0), (3, 1), (4, 0)]
    for key in ("param_hash", "fragment_hash"):
        assert [r[key] for r in cut_rounds] == [r[key] for r in ref_rounds]
    assert len({r["param_hash"] for r in ref_rounds}) == 4  # every round stepped the global params
