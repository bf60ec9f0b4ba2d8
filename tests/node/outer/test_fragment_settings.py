"""The fragment settings (--fragments, --fragment-mix, --overlap-steps) in every layer, their refusals,
and the schedule the daemon's rounds follow (node/outer/fragments.py FragmentSchedule)."""

from __future__ import annotations

from pathlib import Path

import pytest

from node.config import ConfigError, NodeConfig, load_config
from node.outer.fragments import FragmentSchedule, due_fragments, fragment_schedule


def test_the_fragment_settings_load_from_flags_environment_and_toml(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text("[inner]\nsteps = 8\n[outer]\nfragments = 2\nfragment_mix = 0.25\noverlap_steps = 1\n")
    from_toml = load_config(config_file=toml, environ={})
    assert (from_toml.outer.fragments, from_toml.outer.fragment_mix, from_toml.outer.overlap_steps) == (
        2,
        0.25,
        1,
    )
    env = {"DTNODE_FRAGMENTS": "4", "DTNODE_OVERLAP_STEPS": "2"}
    from_env = load_config(config_file=toml, environ=env)
    assert (from_env.outer.fragments, from_env.outer.fragment_mix, from_env.outer.overlap_steps) == (
        4,
        0.25,
        2,
    )
    flags = {"fragments": 3, "fragment_mix": 0.5}
    from_flags = load_config(config_file=toml, environ=env, flags=flags)
    assert (from_flags.outer.fragments, from_flags.outer.fragment_mix, from_flags.outer.overlap_steps) == (
        3,
        0.5,
        2,
    )
    assert load_config(config_file=toml, environ=env).to_toml().count("fragments = 4") == 1
    assert (
        NodeConfig().outer.fragments == 1 and fragment_schedule(NodeConfig()) is None
    )  # default: whole rounds


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fragments": 0}, "fragments must be >= 1"),
        ({"fragments": 2, "fragment_mix": 1.0}, r"fragment_mix must be in \[0, 1\)"),
        ({"fragments": 2, "overlap_steps": -1}, "overlap_steps must be >= 0"),
        ({"fragments": 2, "overlap": True}, "overlap_steps instead"),
        ({"overlap_steps": 1}, "apply to fragments > 1"),
        ({"fragment_mix": 0.5}, "apply to fragments > 1"),
    ],
)
def test_impossible_fragment_settings_are_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_flat(**settings)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fragments": 4, "inner_steps": 3}, "at least as many inner steps"),
        ({"fragments": 4, "inner_steps": 8, "overlap_steps": 3}, r"\[0, 2\] steps"),
        ({"fragments": 2, "inner_steps": 8, "round_seconds": 5.0}, "drop --round-seconds"),
        ({"fragments": 2, "inner_steps": 8, "swarm_streams": 2}, "drop --swarm-streams"),
    ],
)
def test_settings_fragments_cannot_run_with_are_refused_naming_the_flags(
    settings: dict, message: str
) -> None:
    config = NodeConfig.from_flat(**settings)
    with pytest.raises(ConfigError, match=message):
        fragment_schedule(config)


def test_the_rounds_form_one_sequence_fragment_r_mod_f_at_its_offset() -> None:
    schedule = fragment_schedule(NodeConfig.from_flat(fragments=4, inner_steps=10, overlap_steps=2))
    assert schedule == FragmentSchedule(inner_steps=10, num_fragments=4, overlap_steps=2)
    # Independent reference: the steps after which due_fragments names a fragment, in order.
    due = [
        (step, fragments)
        for step in range(1, 41)
        if (fragments := due_fragments(step, inner_steps=10, num_fragments=4))
    ]
    assert all(len(fragments) == 1 for _, fragments in due)  # H >= F: one fragment at a time
    assert [(schedule.round_step(r), [schedule.fragment_of_round(r)]) for r in range(1, len(due) + 1)] == due
    assert [step for step, _ in due][:5] == [2, 5, 7, 10, 12]  # offsets 0, 2, 5, 7 of H = 10
    assert schedule.previous_round_step(9) == 7 and schedule.previous_round_step(10) == 10
    assert schedule.previous_round_step(1) == 0 and schedule.next_round_step(0) == 2
    assert schedule.next_round_step(10) == 12


def test_max_rounds_counts_fragment_rounds() -> None:
    assert NodeConfig.from_flat(max_rounds=3, inner_steps=10).rounds_end_step == 30
    config = NodeConfig.from_flat(max_rounds=6, inner_steps=10, fragments=4)
    assert config.rounds_end_step == FragmentSchedule(inner_steps=10, num_fragments=4).round_step(6) == 15
    assert config.schedule_horizon == 15
