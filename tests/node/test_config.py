"""Config precedence (flag > env > TOML > default) and every kind of user mistake."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from node.config import ConfigError, NodeConfig, load_config


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(environ={})
    assert config == NodeConfig()
    assert config.outer_lr == 0.7 and config.outer_momentum == 0.9 and config.outer_nesterov


def test_precedence_flag_over_env_over_toml_over_default(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, "inner_steps = 7\nbatch_size = 3\nmodel = 'nano'\ninner_lr = 0.002\n")
    env = {"DTNODE_INNER_STEPS": "9", "DTNODE_BATCH_SIZE": "5"}
    config = load_config(config_file=toml, environ=env, flags={"inner_steps": 11})
    assert config.inner_steps == 11  # flag
    assert config.batch_size == 5  # env
    assert config.model == "nano" and config.inner_lr == 0.002  # TOML
    assert config.outer_lr == 0.7  # default


def test_config_file_from_env_and_bool_parsing(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, "outer-offload = true\n")  # dashes are accepted in TOML keys
    config = load_config(environ={"DTNODE_CONFIG": str(toml), "DTNODE_OUTER_NESTEROV": "false"})
    assert config.outer_offload is True and config.outer_nesterov is False


def test_the_setup_scripts_variables_are_not_settings() -> None:
    environ = {"DTNODE_TORCH_PIP_ARGS": "--index-url http://x", "DTNODE_VENV": "/opt/venv"}
    assert load_config(environ=environ) == load_config(environ={})


def test_to_toml_round_trips(tmp_path: Path) -> None:
    config = NodeConfig(model="nano", inner_steps=3, name='we"ird', outer_offload=True)
    path = write_toml(tmp_path, config.to_toml())
    assert load_config(config_file=path, environ={}) == config


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"flags": {"inner_steps": 0}}, "--inner-steps must be >= 1"),
        ({"flags": {"model": "huge"}}, "model must be one of"),
        ({"flags": {"lr_schedule": "linear"}}, "--lr-schedule must be one of"),
        ({"flags": {"outer_momentum": 1.5}}, "--outer-momentum must be in"),
        ({"flags": {"shard_index": 2, "num_shards": 2}}, "--shard-index must be in"),
        ({"flags": {"data": "/no/such/file"}}, "data path does not exist"),
        ({"flags": {"bogus": 1}}, "unknown setting(s): bogus"),
        ({"environ": {"DTNODE_BOGUS": "1"}}, "DTNODE_BOGUS: unknown setting"),
        ({"environ": {"DTNODE_INNER_STEPS": "many"}}, "inner_steps expects int"),
        ({"environ": {"DTNODE_OUTER_OFFLOAD": "maybe"}}, "expects true/false"),
        ({"config_file": "/no/such/node.toml"}, "config file not found"),
    ],
)
def test_bad_config_is_a_config_error(kwargs: dict, message: str) -> None:
    kwargs.setdefault("environ", {})
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(**kwargs)


def test_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(config_file=write_toml(tmp_path, "inner_steps = = 3"), environ={})
    with pytest.raises(ConfigError, match="unknown setting"):
        load_config(config_file=write_toml(tmp_path, "inner_stepz = 3"), environ={})
    with pytest.raises(ConfigError, match="inner_steps expects int"):
        load_config(config_file=write_toml(tmp_path, "inner_steps = 'x'"), environ={})


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=60, env=env
    )


@pytest.mark.timeout(120)
def test_cli_errors_are_one_line_exit_2(tmp_path: Path) -> None:
    cases = [
        ("join", "--inner-steps", "0"),
        ("join", "--model", "huge"),
        ("join", "--inner-steps", "x"),
        ("join", "--no-such-flag"),
        ("join", "--config", str(tmp_path / "missing.toml")),
        ("join", "--data", str(tmp_path / "missing.txt")),
    ]
    for args in cases:
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "error" in lines[0], (args, result.stderr)
        assert "Traceback" not in result.stderr


@pytest.mark.timeout(60)
def test_cli_help_documents_every_field_and_version() -> None:
    result = run_cli("join", "--help")
    assert result.returncode == 0
    from dataclasses import fields

    for f in fields(NodeConfig):
        assert "--" + f.name.replace("_", "-") in result.stdout, f.name
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("dtnode ")
