"""Flags for nodes behind NAT: --announce needs fixed ports and advertises exactly them,
--client-mode needs --peers, --use-relay and --client-mode reach the DHT's settings."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from node.api import api_config
from node.config import ConfigError, load_config
from node.swarm.setup import start_swarm, swarm_config

PEER = "/ip4/127.0.0.1/tcp/4100/p2p/12D3KooWMuv7gDCCfsaTuAsYXbh7jikSCtJDwxVgxnrhuHCkbgV2"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"announce": "10.0.0.1", "listen": "0.0.0.0:0", "dht_listen": "0.0.0.0:7001"},
            "--announce needs a fixed gRPC port: set --listen HOST:PORT",
        ),
        (
            {"announce": "10.0.0.1", "listen": "0.0.0.0:7000"},
            "--announce needs a fixed DHT port",
        ),
        ({"client_mode": True}, "--client-mode needs --peers"),
    ],
)
def test_nat_settings_that_cannot_work_are_refused(flags: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(flags=flags, environ={})


def test_fixed_ports_with_announce_and_a_client_without_any_are_accepted() -> None:
    load_config(
        flags={"announce": "10.0.0.1", "listen": "0.0.0.0:7000", "dht_listen": "0.0.0.0:7001"}, environ={}
    )
    # A client is dialled by nobody: no port of its own needs to be fixed or announced.
    client = load_config(flags={"client_mode": True, "peers": PEER}, environ={})
    assert client.network.client_mode and client.network.listen.endswith(":0")


def test_relay_and_client_mode_reach_the_dht_settings() -> None:
    plain = swarm_config(load_config(flags={"peers": PEER}, environ={})).dht
    assert not plain.use_relay and not plain.client_mode
    assert plain.hivemind_kwargs()["use_auto_relay"] is False
    assert plain.hivemind_kwargs()["client_mode"] is False
    both = swarm_config(
        load_config(flags={"peers": PEER, "use_relay": True, "client_mode": True}, environ={})
    )
    kwargs = both.dht.hivemind_kwargs()
    assert kwargs["use_relay"] is True and kwargs["use_auto_relay"] is True and kwargs["client_mode"] is True
    assert both.client_mode  # the swarm side too: our record says so, and we collect our messages


def test_the_python_api_takes_client_mode() -> None:
    config = api_config(client_mode=True, peers=PEER)
    assert config.network.client_mode and swarm_config(config).client_mode
    with pytest.raises(ConfigError, match="--client-mode needs --peers"):
        api_config(client_mode=True)


@pytest.mark.timeout(60)
def test_announce_with_fixed_ports_advertises_the_announced_host_at_the_listen_port(tmp_path: Path) -> None:
    grpc_port, dht_port = free_port(), free_port()
    config = load_config(
        flags={
            "listen": f"127.0.0.1:{grpc_port}",
            "dht_listen": f"127.0.0.1:{dht_port}",
            "announce": "127.0.0.2",  # another loopback address: what a NAT's public side would be
            "run_dir": str(tmp_path / "run"),
        },
        environ={},
    )
    swarm = start_swarm(config)
    try:
        assert swarm.grpc_address == f"127.0.0.2:{grpc_port}"
        identity = json.loads((tmp_path / "run" / "node.json").read_text())
        assert identity["grpc_address"] == f"127.0.0.2:{grpc_port}"
        assert identity["multiaddrs"][0].startswith(f"/ip4/127.0.0.2/tcp/{dht_port}/p2p/")
        # The record others read names the same address.
        record = swarm._local_record(round=0, param_hash="0" * 64)
        assert record.grpc_address == f"127.0.0.2:{grpc_port}"
    finally:
        swarm.close()
