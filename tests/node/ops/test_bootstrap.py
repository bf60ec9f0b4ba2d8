"""``dtnode bootstrap``: a DHT peer and nothing else. Two keyed DHT peers that know only its printed
multiaddr find each other's records through it; it listens on its DHT port alone (no gRPC server);
SIGTERM stops it with exit 0; settings that cannot work are one line and exit 2 before any socket."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from protocol.auth.key import SwarmKey
from protocol.discovery.dht_node import DhtConfig, DhtNode
from scripts.common import ForkedProcess
from tests.node.swarm_cluster import Cluster, fork_node, tail, wait_for
from tests.scripts.processes import listening_tcp_sockets, processes_in_groups

TIMEOUT = timedelta(seconds=10)
BANNER = re.compile(r"dtnode join --name NAME --peers (\S+)")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def read_log(log_path: Path) -> str:
    return log_path.read_text(errors="replace")


@contextlib.contextmanager
def bootstrap_node(flags: list[str], log_path: Path) -> Iterator[tuple[ForkedProcess, str]]:
    """``dtnode bootstrap FLAGS`` forked, its output in ``log_path``, once it printed the join command:
    yields the process and the multiaddr the command names; kills its process group if it still runs."""
    log_path.write_bytes(b"")
    bootstrap = fork_node(["bootstrap", *flags], log_path)
    try:
        wait_for(
            lambda: BANNER.search(read_log(log_path)) is not None or bootstrap.poll() is not None,
            60,
            "the banner",
        )
        match = BANNER.search(read_log(log_path))
        assert match is not None, read_log(log_path)
        yield bootstrap, match[1]
    finally:
        if bootstrap.poll() is None:
            os.killpg(bootstrap.pid, signal.SIGKILL)
            bootstrap.wait(10)


@pytest.mark.timeout(90)
def test_peers_that_know_only_the_bootstrap_node_find_each_other(tmp_path: Path) -> None:
    key_path = tmp_path / "swarm.key"
    key = SwarmKey.generate()
    key.write(key_path)
    port = free_port()
    log_path = tmp_path / "bootstrap.log"
    flags = ["--dht-listen", f"127.0.0.1:{port}", "--swarm-key-file", str(key_path),
             "--identity-path", str(tmp_path / "boot.identity")]  # fmt: skip
    with bootstrap_node(flags, log_path) as (bootstrap, multiaddr):
        log = read_log(log_path)
        assert f"key fingerprint {key.fingerprint}" in log and "trains nothing" in log
        assert multiaddr.startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/"), multiaddr
        # The DHT port and nothing else: no gRPC server, no metrics.
        assert listening_tcp_sockets(processes_in_groups([bootstrap.pid])) == [f"127.0.0.1:{port}"]

        config = DhtConfig(listen="127.0.0.1:0", initial_peers=(multiaddr,))
        with DhtNode(config, swarm_key=key) as first, DhtNode(config, swarm_key=key) as second:
            expires = get_dht_time() + 30
            assert first.store(
                "dtnode/demo/peers", "first", expiration_time=expires, subkey="a", timeout=TIMEOUT
            )
            found = second.get("dtnode/demo/peers", latest=True, timeout=TIMEOUT)
            assert found is not None and isinstance(found.value, dict), found
            assert found.value["a"].value == "first"
        assert bootstrap.poll() is None, read_log(log_path)
        os.kill(bootstrap.pid, signal.SIGTERM)
        assert bootstrap.wait(30) == 0, read_log(log_path)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bootstrap"], "--dht-listen must be set, HOST:PORT on a fixed port"),
        (["bootstrap", "--dht-listen", "127.0.0.1:0", "--dht-announce", "10.0.0.1:4001"],
         "--dht-announce needs a fixed DHT port"),
        (["bootstrap", "--dht-listen", "127.0.0.1:4001", "--dht-announce", "10.0.0.1:0"],
         "--dht-announce needs the real port others dial, not 0"),
        (["bootstrap", "--dht-listen", "127.0.0.1:4001", "--swarm-key-file", "/nonexistent/swarm.key"],
         "/nonexistent/swarm.key"),
    ],
)  # fmt: skip
def test_settings_that_cannot_work_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from node.ops.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    # One line, "dtnode bootstrap: error: --flag: what is wrong" (node/ops/cli_errors.py puts the flag first).
    assert re.match(r"dtnode( bootstrap)?: error: ", err) and err.count("\n") == 1, err
    flag, _, what = message.partition(" ")
    assert message in err or f"{flag}: {what}" in err, err


@pytest.mark.timeout(150)
def test_two_nodes_that_know_only_the_bootstrap_node_train_together(tmp_path: Path) -> None:
    """Training nodes started with --peers <the bootstrap's multiaddr> only find each other through it
    and share every round (the start barrier sees both). Each first waits the join timeout (30 s) for
    a node of its run to show a record: a joiner publishes none until it holds the swarm's state, and
    the bootstrap node has none. They do not log the bootstrap node as a lost peer (it has no record)."""
    log_path = tmp_path / "bootstrap.log"
    with bootstrap_node(["--dht-listen", f"127.0.0.1:{free_port()}"], log_path) as (bootstrap, multiaddr):
        with Cluster(tmp_path, forked=True) as cluster:
            flags = ["--max-rounds", "2", "--inner-steps", "3", "--start-peers", "2",
                     "--listen", "127.0.0.1:0", "--dht-listen", "127.0.0.1:0"]  # fmt: skip
            nodes = [cluster.start(flags, peers=multiaddr) for _ in range(2)]
            assert cluster.wait_all(120) == [0, 0], "\n".join(tail(node) for node in nodes)
        assert not any("reconnected to" in node.log() for node in nodes), tail(nodes[0])
        records = [node.records() for node in nodes]
        for node_records in records:
            assert [r["round"] for r in node_records] == [1, 2], node_records
            assert all(r["peers"] == 2 for r in node_records), node_records
        assert [r["param_hash"] for r in records[0]] == [r["param_hash"] for r in records[1]]
        os.kill(bootstrap.pid, signal.SIGTERM)
        assert bootstrap.wait(30) == 0, read_log(log_path)
