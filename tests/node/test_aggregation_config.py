"""`--aggregation`, `--clip-factor` and `--trim` reach the all-reduce's config; bad values are user errors."""

from __future__ import annotations

import pytest

from node.config import ConfigError, NodeConfig, load_config
from node.swarm.setup import swarm_config


def test_flags_reach_the_allreduce_config() -> None:
    config = load_config(flags={"aggregation": "trimmed", "trim": 2, "clip_factor": 3.0}, environ={})
    rule = swarm_config(config).allreduce.aggregation_rule
    assert (rule.kind, rule.trim_per_side, rule.clip_factor) == ("trimmed", 2, 3.0)
    default = swarm_config(NodeConfig()).allreduce
    assert (default.aggregation, default.clip_factor, default.trim_per_side) == ("mean", 2.0, 1)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"aggregation": "median"}, "aggregation"),
        ({"clip_factor": -1.0}, "clip_factor"),
        ({"trim": -1}, "trim"),
    ],
)
def test_bad_values_are_config_errors(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NodeConfig.from_flat(**flags)


def test_error_feedback_decay_reaches_the_swarm_config() -> None:
    config = load_config(flags={"codec": "topk", "error_feedback_decay": 0.95}, environ={})
    assert swarm_config(config).error_feedback_decay == 0.95
    assert swarm_config(NodeConfig()).error_feedback_decay == 1.0
    with pytest.raises(ConfigError, match=r"error_feedback_decay must be in \[0, 1\]"):
        NodeConfig.from_flat(error_feedback_decay=1.5)
