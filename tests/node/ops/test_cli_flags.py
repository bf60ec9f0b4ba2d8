"""The join flags: help groups, no prefix matching, errors that name the flag, typed TOML and env,
checks before any socket opens, the warm-up warning, and ``dtnode health``."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from dataclasses import fields
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from node.config import FLAT_NAMES, SECTIONS, ConfigError, NodeConfig, flat_choices, load_config
from node.ops.cli import build_parser, main
from node.ops.cli_flags import add_config_flags, codec_names, setting_groups
from node.ops.preflight import run_length_steps, run_warnings


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "node.ops.cli", *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def test_every_setting_is_in_its_sections_help_group_in_declaration_order() -> None:
    groups = setting_groups()
    assert list(groups) == list(SECTIONS)
    for section, names in groups.items():
        assert [FLAT_NAMES[name] for name in names] == [
            f"{section}.{f.name}" for f in fields(SECTIONS[section])
        ]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    by_title = add_config_flags(parser)
    for title, group in by_title.items():
        assert [action.dest for action in group._group_actions] == groups[title]
        assert group.title is not None and group.title.startswith(f"[{title}] ")


def test_codec_choices_are_the_codecs() -> None:
    from protocol.codecs import CODEC_NAMES

    assert codec_names() == CODEC_NAMES == flat_choices()["codec"]


def test_a_setting_with_a_literal_type_has_its_values_as_choices() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_config_flags(parser)
    choices = {action.dest: tuple(action.choices) for action in parser._actions if action.choices}
    assert choices == flat_choices()
    assert choices["lr_schedule"] == ("cosine", "wsd", "constant")
    assert choices["aggregation"] == ("mean", "clipped", "trimmed")


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["join", "--inner-step", "5"],
            "dtnode join: error: --inner-step: no such flag; did you mean --inner-steps?",
        ),
        (
            ["join", "--inner-steps=5", "--coddec=int8"],
            "dtnode join: error: --coddec: no such flag; did you mean --codec?",
        ),
        (
            ["swarm", "--nodes", "2", "--node", "3"],
            "dtnode swarm: error: --node: no such flag; did you mean --nodes?",
        ),
        (["join", "--zzz"], "dtnode join: error: --zzz: no such flag (see dtnode join --help)"),
        (["jion"], "dtnode: error: command: must be one of"),
    ],
)
def test_a_flag_prefix_or_typo_is_refused_with_the_nearest_flag(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prefix is never taken for the flag (``--inner-step 5`` is not ``--inner-steps 5``), but named."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1, err


def test_the_full_flag_parses() -> None:
    args = build_parser().parse_args(["join", "--inner-steps", "5", "--codec", "int4"])
    assert (args.inner_steps, args.codec) == (5, "int4")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["join", "--inner-steps", "0"], "dtnode join: error: --inner-steps: must be >= 1, got 0"),
        (
            ["join", "--max-wait", "5", "--join-window", "15"],
            "dtnode join: error: --max-wait: must be at least --join-window (15), got 5",
        ),
        (
            ["join", "--codec", "int3"],
            "dtnode join: error: --codec: must be one of none, fp16, bf16, int8, int4, topk, topk4, got 'int3'",
        ),
        (
            ["join", "--model", "nanoo"],
            "dtnode join: error: --model: must be one of nano, tiny, small, 350m, 1b, 7b, got 'nanoo' (did you mean nano?)",
        ),
        (
            ["join", "--lr-schedule", "linear"],
            "dtnode join: error: --lr-schedule: must be one of cosine, wsd",
        ),
        (["join", "--inner-steps", "x"], "dtnode join: error: --inner-steps: must be an int, got 'x'"),
        (["join", "--inner-lr", "fast"], "dtnode join: error: --inner-lr: must be a float, got 'fast'"),
        (
            ["plan", "--model", "nanoo", "--gpus", "1", "--gpu-mem", "1"],
            "dtnode plan: error: --model: must be one of nano, tiny, small, 350m, 1b, 7b, got 'nanoo' (did you mean nano?)",
        ),
    ],
)
def test_an_error_names_the_flag(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as exited:  # argparse's own errors
        code = int(exited.code or 0)
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert len(err.strip().splitlines()) == 1


def test_a_toml_string_for_a_number_or_bool_is_an_error_naming_the_key(tmp_path: Path) -> None:
    toml = tmp_path / "node.toml"
    toml.write_text('inner_steps = "5"\n')
    with pytest.raises(ConfigError, match=r"node\.toml: inner_steps expects int, got the string '5'"):
        load_config(config_file=toml, environ={})
    toml.write_text('overlap = "true"\n')
    with pytest.raises(ConfigError, match="overlap expects bool"):
        load_config(config_file=toml, environ={})
    toml.write_text("inner_lr = 0.5\ninner_steps = 2.0\n")
    with pytest.raises(ConfigError, match="inner_steps expects int, got 2.0"):
        load_config(config_file=toml, environ={})
    toml.write_text('inner_lr = 1\nname = "x"\n')  # an integer for a real is a number all the same
    config = load_config(config_file=toml, environ={})
    assert config.inner.lr == 1.0 and isinstance(config.inner.lr, float) and config.run.name == "x"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("DTNODE_INNER_STEPS", "5.0", "DTNODE_INNER_STEPS: inner_steps expects int, got '5.0'"),
        ("DTNODE_INNER_LR", "fast", "inner_lr expects float"),
        ("DTNODE_OVERLAP", "2", "overlap expects true/false"),
    ],
)
def test_an_env_value_of_the_wrong_type_is_an_error(name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(environ={name: value})
    assert load_config(environ={"DTNODE_INNER_STEPS": " 7 "}).inner.steps == 7


def test_a_warmup_longer_than_the_run_is_warned_about() -> None:
    short = NodeConfig.from_flat(max_rounds=3, inner_steps=12, warmup_steps=50)
    assert run_length_steps(short) == 36
    (warning,) = run_warnings(short)
    assert "--warmup-steps 50 exceeds the run (36 inner steps)" in warning
    assert run_length_steps(NodeConfig.from_flat(max_rounds=3, inner_steps=12, max_steps=20)) == 20
    assert run_warnings(NodeConfig.from_flat(max_rounds=3, inner_steps=12, warmup_steps=36)) == []
    assert run_warnings(NodeConfig.from_flat(warmup_steps=10**6)) == []  # a run without an end


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(120)
def test_a_bad_layout_exits_2_before_any_socket_opens(tmp_path: Path) -> None:
    port = free_port()
    run_dir = tmp_path / "run"
    result = run_cli(
        "join", "--model", "nano", "--local-workers", "2", "--tp", "3", "--run-dir", str(run_dir),
        "--listen", f"127.0.0.1:{port}", "--max-rounds", "1",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "dp * tp * pp = 1 * 3 * 1 = 3 must equal the number of local workers (2" in result.stderr
    # Nothing of the swarm side started: no gRPC server or DHT log line, no banner, no node.json.
    assert "To join it" not in result.stdout and result.stdout == ""
    assert "gRPC server" not in result.stderr and "DHT" not in result.stderr
    assert not (run_dir / "node.json").exists()
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_cuda_device_exits_2_before_any_socket_opens(tmp_path: Path) -> None:
    result = run_cli("join", "--model", "nano", "--device", "cuda", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2, result.stderr
    assert "no CUDA device" in result.stderr and result.stdout == ""
    assert not (tmp_path / "run" / "node.json").exists()


@pytest.mark.timeout(60)
def test_a_missing_swarm_key_exits_2_before_any_socket_opens(tmp_path: Path) -> None:
    result = run_cli(
        "join", "--model", "nano", "--swarm-key-file", str(tmp_path / "no.key"),
        "--run-dir", str(tmp_path / "run"), "--listen", "127.0.0.1:0",
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "no.key" in result.stderr and result.stdout == ""
    assert not (tmp_path / "run" / "node.json").exists()


@pytest.fixture
def health_server() -> Iterator[tuple[str, health.HealthServicer]]:
    """A gRPC server with the stock health service on loopback, as every node serves it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(grace=None)


@pytest.mark.timeout(60)
def test_health_exits_0_when_serving_and_1_otherwise(
    health_server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", address]) == 0
    assert capsys.readouterr().out.strip() == f"{address}: SERVING"
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["health", address]) == 1
    assert capsys.readouterr().out.strip() == f"{address}: NOT_SERVING"
    servicer.set("dtnode.v1.AllReduce", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", address, "--service", "dtnode.v1.AllReduce"]) == 0
    assert main(["health", address, "--service", "no.such.Service"]) == 1  # NOT_FOUND
    assert "NOT_FOUND" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_health_of_an_address_nobody_serves_is_1_and_a_bad_address_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    address = f"127.0.0.1:{free_port()}"
    assert main(["health", address, "--timeout", "3"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out
    assert main(["health", "nowhere"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert main(["health", address, "--tls"]) == 2
    assert "dtnode health: error: --tls: needs --swarm-key-file" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_health_without_addr_asks_the_local_node_of_the_settings(
    health_server: tuple[str, health.HealthServicer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    address, servicer = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = address.rpartition(":")[2]
    monkeypatch.setenv("DTNODE_LISTEN", f"0.0.0.0:{port}")  # as the image sets it: loopback, that port
    assert main(["health"]) == 0
    assert capsys.readouterr().out.strip() == f"127.0.0.1:{port}: SERVING"
    # Port 0 (any free port): the address the node recorded in its run dir.
    monkeypatch.setenv("DTNODE_LISTEN", "0.0.0.0:0")
    monkeypatch.setenv("DTNODE_RUN_DIR", str(tmp_path))
    assert main(["health"]) == 2 and "node.json" in capsys.readouterr().err
    (tmp_path / "node.json").write_text(json.dumps({"grpc_address": address}))
    assert main(["health"]) == 0
