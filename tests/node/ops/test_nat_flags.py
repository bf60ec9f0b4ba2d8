"""Flags for nodes behind NAT: --announce / --dht-announce need fixed ports and advertise exactly
them (an outside port of a port forward too), --client-mode needs --peers and announces nothing,
--use-relay and --client-mode reach the DHT's settings."""

from __future__ import annotations

import json
import re
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
        (
            {"dht_announce": "10.0.0.1:40101", "dht_listen": "0.0.0.0:0"},
            "--dht-announce needs a fixed DHT port",
        ),
        ({"client_mode": True}, "--client-mode needs --peers"),
        (
            {"client_mode": True, "peers": PEER, "announce": "10.0.0.1:40100", "dht_announce": "10.0.0.1:1"},
            "--client-mode accepts no connections, so it has no address to announce: drop --announce and "
            "--dht-announce",
        ),
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


FIXED = {"listen": "0.0.0.0:7000", "dht_listen": "0.0.0.0:7001"}


@pytest.mark.parametrize(
    ("announce", "message"),
    [
        ({"announce": "10.0.0.1:0"}, "--announce port must be in 1..65535"),
        ({"announce": "10.0.0.1:http"}, "--announce port must be in 1..65535"),
        ({"announce": "bad host!"}, "--announce host must be an IP address or a DNS name"),
        ({"announce": "[::1"}, "--announce must be HOST, HOST:PORT"),
        ({"dht_announce": "10.0.0.1"}, "--dht-announce must be HOST:PORT"),
        ({"dht_announce": "/ip4/10.0.0.1/tcp/0"}, "--dht-announce multiaddr needs /tcp/PORT"),
        ({"dht_announce": "/ip4/10.0.0.1/tcp/1/p2p/" + PEER.rpartition("/")[2]}, "must not name a peer id"),
        ({"client_mode": True, "peers": PEER, "swarm_streams": 2}, "--client-mode accepts no connections"),
    ],
)
def test_malformed_announce_addresses_are_refused_before_any_socket(
    announce: dict[str, object], message: str
) -> None:
    config = load_config(flags={**FIXED, **announce}, environ={})
    with pytest.raises(ConfigError, match=re.escape(message)):
        swarm_config(config)  # what the checks before sockets run (node/ops/preflight.py)


@pytest.mark.parametrize(
    ("flags", "grpc", "dht"),
    [
        ({"announce": "203.0.113.7"}, ("203.0.113.7", None), "/ip4/203.0.113.7/tcp/7001"),
        ({"announce": "203.0.113.7:40100"}, ("203.0.113.7", 40100), "/ip4/203.0.113.7/tcp/7001"),
        (
            {"announce": "gpu.example.org:40100", "dht_announce": "gpu.example.org:40101"},
            ("gpu.example.org", 40100),
            "/dns/gpu.example.org/tcp/40101",
        ),
        ({"announce": "[2001:db8::7]:40100"}, ("2001:db8::7", 40100), "/ip6/2001:db8::7/tcp/7001"),
        ({"announce": "2001:db8::7"}, ("2001:db8::7", None), "/ip6/2001:db8::7/tcp/7001"),
        (
            {"dht_announce": "/dns4/relay.example.org/tcp/4001"},
            (None, None),
            "/dns4/relay.example.org/tcp/4001",
        ),
    ],
)
def test_announced_hosts_and_outside_ports_reach_the_swarm_settings(
    flags: dict[str, object], grpc: tuple[str | None, int | None], dht: str
) -> None:
    config = swarm_config(load_config(flags={**FIXED, **flags}, environ={}))
    assert (config.announce_host, config.announce_port) == grpc
    assert config.dht.announce_multiaddr == dht
    assert config.dht.hivemind_kwargs()["announce_maddrs"] == [dht]


@pytest.mark.timeout(60)
def test_announce_with_an_outside_port_advertises_that_port(tmp_path: Path) -> None:
    """Behind a port forward (outside 127.0.0.2:P+1 -> inside 127.0.0.1:P): the record, the printed join
    command and node.json name the outside ports, the server is bound to the inside one."""
    grpc_port, dht_port = free_port(), free_port()
    config = load_config(
        flags={
            "listen": f"127.0.0.1:{grpc_port}",
            "dht_listen": f"127.0.0.1:{dht_port}",
            "announce": "127.0.0.2:40100",
            "dht_announce": "127.0.0.2:40101",
            "run_dir": str(tmp_path / "run"),
        },
        environ={},
    )
    swarm = start_swarm(config)
    try:
        assert swarm.server.port == grpc_port  # bound inside
        assert swarm.grpc_address == "127.0.0.2:40100"  # dialled outside
        identity = json.loads((tmp_path / "run" / "node.json").read_text())
        assert identity["grpc_address"] == "127.0.0.2:40100" and identity["client_mode"] is False
        assert identity["multiaddrs"][0].startswith("/ip4/127.0.0.2/tcp/40101/p2p/")
        record = swarm._local_record(round=0, param_hash="0" * 64)
        assert record.grpc_address == "127.0.0.2:40100"
    finally:
        swarm.close()
