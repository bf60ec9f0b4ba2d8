"""The node's side of swarm keys: `dtnode keygen`, `--swarm-key-file`, and the key staying secret."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from node.config import ConfigError, NodeConfig
from node.ops.cli import EXIT_USAGE, build_parser, run_keygen
from node.swarm.setup import swarm_config
from protocol.auth import SwarmKey
from protocol.auth.channels import SwarmAuth

pytestmark = pytest.mark.timeout(30)


def test_keygen_writes_a_private_key_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "swarm.key"
    assert run_keygen(build_parser().parse_args(["keygen", str(path)])) == 0
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = SwarmKey.from_file(path)
    out = capsys.readouterr().out
    assert key.fingerprint in out and path.read_text().strip() not in out
    before = path.read_bytes()
    assert (
        run_keygen(build_parser().parse_args(["keygen", str(path)])) == EXIT_USAGE
    )  # never overwrite a key others may hold
    assert "cannot create" in capsys.readouterr().err
    assert path.read_bytes() == before


def test_swarm_key_file_flag_reaches_the_swarm_config_without_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    SwarmKey.generate().write(path)
    secret = path.read_text().strip()
    args = build_parser().parse_args(["join", "--swarm-key-file", str(path)])
    assert args.swarm_key_file == str(path)
    config = NodeConfig.from_flat(swarm_key_file=str(path))
    swarm = swarm_config(config)
    assert swarm.auth == SwarmAuth(SwarmKey.from_file(path), tls=False)
    for text in (repr(swarm), repr(config), config.to_toml()):  # what logs and the run dir get
        assert secret not in text
    assert swarm_config(NodeConfig()).auth is None
    assert swarm_config(NodeConfig.from_flat(swarm_key_file=str(path), tls=True)).auth == SwarmAuth(
        SwarmKey.from_file(path), tls=True
    )
    with pytest.raises(ConfigError, match="--tls needs --swarm-key-file"):
        NodeConfig.from_flat(tls=True)


def test_unusable_key_files_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read the swarm key file"):
        swarm_config(NodeConfig.from_flat(swarm_key_file=str(tmp_path / "missing.key")))
    readable = tmp_path / "readable.key"
    SwarmKey.generate().write(readable)
    readable.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        swarm_config(NodeConfig.from_flat(swarm_key_file=str(readable)))
    short = tmp_path / "short.key"
    short.write_text("00ff" * 4)
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="at least 32 random bytes"):
        swarm_config(NodeConfig.from_flat(swarm_key_file=str(short)))
