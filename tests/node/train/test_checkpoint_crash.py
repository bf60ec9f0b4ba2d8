"""A real node (``dtnode join``) SIGKILLed inside its checkpoint writes resumes from the last complete
checkpoint with the param_hash it saved (scripts/tools/checkpoint_crash.py; the full run takes 20 trials)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts.script_loader import load_script

crash = load_script("checkpoint_crash")


@pytest.mark.timeout(170)
def test_sigkill_during_checkpoint_writes_resumes_from_last_complete(tmp_path: Path) -> None:
    summary = crash.run_trials(3, random_seed=7, max_kill_save=2, work_dir=tmp_path, log=lambda line: None)
    trials = summary["trials"]
    assert [t["problems"] for t in trials] == [[], [], []], trials
    assert len({t["stage"] for t in trials}) == 3  # three different write stages
    for trial in trials:
        assert trial["killed_in"].startswith("step-")  # the kill came inside a save, as planned
    # Each run completed a save before its kill: every restart resumes from a newer checkpoint.
    latest = [t["expected_latest"] for t in trials]
    assert None not in latest and latest == sorted(set(latest)), latest
    final = summary["final_run"]
    assert final["problems"] == [] and final["exit_code"] == 0, final
    (resumed,) = final["resumed"]
    assert resumed["name"] == trials[-1]["expected_latest"]
    assert summary["ok"]
