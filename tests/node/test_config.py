"""Config precedence (flag > env > TOML > default), the sections and their flat names, the TOML
file in sections (and the deprecated flat one), and every kind of user mistake."""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import get_args

import pytest

from node.config import (
    FLAT_NAMES,
    SECTIONS,
    Aggregation,
    Codec,
    ConfigError,
    InnerConfig,
    NodeConfig,
    flat_values,
    load_config,
    replace,
)


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    config = load_config(environ={})
    assert config == NodeConfig()
    assert config.outer.lr == 0.7 and config.outer.momentum == 0.9 and config.outer.nesterov


def test_precedence_flag_over_env_over_toml_over_default(tmp_path: Path) -> None:
    toml = write_toml(
        tmp_path, "[inner]\nsteps = 7\nbatch_size = 3\nlr = 0.002\n\n[architecture]\npreset = 'nano'\n"
    )
    env = {"DTNODE_INNER_STEPS": "9", "DTNODE_BATCH_SIZE": "5"}
    config = load_config(config_file=toml, environ=env, flags={"inner_steps": 11})
    assert config.inner.steps == 11  # flag
    assert config.inner.batch_size == 5  # env
    assert config.architecture.preset == "nano" and config.inner.lr == 0.002  # TOML
    assert config.outer.lr == 0.7  # default


def test_config_file_from_env_and_bool_parsing(tmp_path: Path) -> None:
    toml = write_toml(tmp_path, "[outer]\noffload = true\n[parallel]\nlocal-workers = 1\n")  # dashes too
    config = load_config(environ={"DTNODE_CONFIG": str(toml), "DTNODE_OUTER_NESTEROV": "false"})
    assert config.outer.offload is True and config.outer.nesterov is False
    assert config.parallel.local_workers == 1


def test_the_setup_scripts_variables_are_not_settings() -> None:
    environ = {"DTNODE_TORCH_PIP_ARGS": "--index-url http://x", "DTNODE_VENV": "/opt/venv"}
    assert load_config(environ=environ) == load_config(environ={})


def test_to_toml_round_trips_in_sections(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = NodeConfig.from_flat(model="nano", inner_steps=3, name='we"ird', outer_offload=True)
    text = config.to_toml()
    assert list(tomllib.loads(text)) == list(SECTIONS)
    assert "[inner]\nsteps = 3\n" in text and '[architecture]\npreset = "nano"\n' in text
    path = write_toml(tmp_path, text)
    with caplog.at_level(logging.WARNING):
        assert load_config(config_file=path, environ={}) == config
    assert not caplog.records  # the sectioned form is not deprecated


def test_a_flat_toml_file_still_loads_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A config.toml written before the sections (flat names at the top) gives the same config."""
    flat = "inner_steps = 7\nmodel = 'nano'\noverlap = true\ncodec = 'int4'\n"
    with caplog.at_level(logging.WARNING):
        config = load_config(config_file=write_toml(tmp_path, flat), environ={})
    assert config == NodeConfig.from_flat(inner_steps=7, model="nano", overlap=True, codec="int4")
    (record,) = caplog.records
    message = record.getMessage()
    assert "node.toml" in message and "deprecated" in message and "[inner] steps = ..." in message
    assert "\n" not in message


def test_the_flat_names_are_every_section_field_once_in_order() -> None:
    locations = [tuple(location.split(".")) for location in FLAT_NAMES.values()]
    expected = [(name, f.name) for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    assert locations == expected
    assert [f.name for f in dataclasses.fields(NodeConfig)] == list(SECTIONS)
    for cls in SECTIONS.values():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"


def test_replace_takes_flat_names_and_checks_each_section_once() -> None:
    config = replace(NodeConfig(), inner_steps=5, inner_lr=0.01, codec="int4", max_wait=10.0, join_window=5.0)
    assert (config.inner.steps, config.inner.lr, config.rounds.codec) == (5, 0.01, "int4")
    assert (config.rounds.max_wait, config.rounds.join_window) == (10.0, 5.0)  # valid only together
    assert flat_values(config)["inner_steps"] == 5
    assert config == NodeConfig(inner=InnerConfig(steps=5, lr=0.01), rounds=config.rounds)
    with pytest.raises(ConfigError, match="unknown setting\\(s\\): inner_stepz"):
        replace(config, inner_stepz=5)
    with pytest.raises(ConfigError, match="inner_steps must be >= 1, got 0"):
        replace(config, inner_steps=0)
    with pytest.raises(ConfigError, match="inner_steps must be >= 1"):
        InnerConfig(steps=0)  # a section checks itself


def test_the_choice_types_are_the_wire_contract() -> None:
    from protocol.allreduce.robust import AGGREGATIONS
    from protocol.codecs import CODEC_NAMES

    assert get_args(Codec) == CODEC_NAMES
    assert get_args(Aggregation) == AGGREGATIONS


def test_the_resolved_config_line_names_every_setting() -> None:
    line = NodeConfig.from_flat(inner_steps=7).describe()
    assert "inner.steps=7" in line and "run.name='dtnode'" in line and "\n" not in line
    assert len(line.split(" ")) >= len(FLAT_NAMES)


def test_the_config_line_does_not_name_a_preset_a_model_config_replaces(tmp_path: Path) -> None:
    """Under --model-config the model is the file's, not --model's default preset: the line says so."""
    config_json = tmp_path / "config.json"
    config_json.write_text("{}")
    line = NodeConfig.from_flat(model_config=str(config_json)).describe()
    assert "architecture.preset='tiny'" not in line
    assert "architecture.preset=(unused: the model is --model-config's)" in line
    assert f"architecture.hf_config='{config_json}'" in line
    assert "architecture.preset='tiny'" in NodeConfig.from_flat().describe()


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
        ({"flags": {"listen": "127.0.0.1"}}, "--listen must be HOST:PORT (port 0 = any free port)"),
        # '²' is a digit to str.isdigit, not to int(): once a bare ValueError from int()
        ({"flags": {"dht_listen": "127.0.0.1:²"}}, "--dht-listen must be HOST:PORT"),
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
    with pytest.raises(ConfigError, match=r"node\.toml: unknown setting\(s\): \[inner\] stepz"):
        load_config(config_file=write_toml(tmp_path, "[inner]\nstepz = 3"), environ={})
    with pytest.raises(
        ConfigError, match=r"node\.toml: unknown section\(s\) \[model\]; the sections are run, "
    ):
        load_config(config_file=write_toml(tmp_path, "[model]\npreset = 'nano'"), environ={})
    with pytest.raises(ConfigError, match=r"node\.toml: \[inner\] steps expects int, got the string '3'"):
        load_config(config_file=write_toml(tmp_path, "[inner]\nsteps = '3'"), environ={})
    with pytest.raises(ConfigError, match="inner_steps is set twice"):
        load_config(config_file=write_toml(tmp_path, "inner_steps = 2\n[inner]\nsteps = 3"), environ={})
    with pytest.raises(ConfigError, match="inner_steps expects int"):
        load_config(config_file=write_toml(tmp_path, "inner_steps = 'x'"), environ={})


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.ops.cli", *args], capture_output=True, text=True, timeout=60, env=env
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
    for name in FLAT_NAMES:
        assert "--" + name.replace("_", "-") in result.stdout, name
    for section in SECTIONS:
        assert f"[{section}] " in result.stdout, section  # one help group per section
    version = run_cli("--version")
    assert version.returncode == 0 and version.stdout.startswith("dtnode ")


def test_a_typod_setting_in_the_environment_or_toml_is_answered_with_the_nearest(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(environ={"DTNODE_INNER_STEP": "5"})
    assert str(refused.value) == (
        "environment variable DTNODE_INNER_STEP: unknown setting(s): inner_step (did you mean inner_steps?)"
    )
    toml = tmp_path / "node.toml"
    toml.write_text("[inner]\nstep = 5\n")
    with pytest.raises(ConfigError) as refused:
        load_config(config_file=toml, environ={})
    assert str(refused.value) == f"{toml}: unknown setting(s): [inner] step (did you mean steps?)"
