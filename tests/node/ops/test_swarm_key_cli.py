"""A closed swarm through `dtnode join --swarm-key-file KEY --tls`: real processes on loopback.

Two nodes with the key run a round over mutual TLS with signed calls and signed DHT records, and
the key appears in none of their logs and run-dir files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from protocol.auth import SwarmKey
from tests.node.swarm_cluster import Cluster, tail


@pytest.mark.timeout(240)
def test_closed_tls_swarm_runs_a_round_and_keeps_the_key_secret(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    key_path = tmp_path_factory.mktemp("key") / "swarm.key"  # outside the cluster dir we search
    SwarmKey.generate().write(key_path)
    secret = key_path.read_text().strip()
    flags = ["--max-rounds", "1", "--min-peers", "2", "--swarm-key-file", str(key_path), "--tls"]
    with Cluster(tmp_path, forked=True) as cluster:
        first = cluster.start(flags)
        cluster.start(flags, peers=cluster.first_multiaddr(first))
        assert cluster.wait_all(180) == [0, 0], "\n\n".join(tail(node) for node in cluster.nodes)
        for node in cluster.nodes:
            records = node.records()
            assert [record["round"] for record in records] == [1], tail(node)
            assert records[0]["peers"] == 2 and not records[0]["fell_back"], records
            log = node.log()
            assert "closed swarm: key fingerprint" in log and "mutual TLS" in log
            assert "swarm is open" not in log
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert files
    for path in files:
        content = path.read_bytes()
        assert secret.encode() not in content and bytes.fromhex(secret) not in content, path


@pytest.mark.timeout(180)
def test_status_reaches_a_tls_node_only_with_the_key(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.node.ops.test_status_cli import dtnode_status
    from tests.node.swarm_cluster import wait_for
    from tests.node.test_config import run_cli

    key_path = tmp_path_factory.mktemp("key") / "swarm.key"
    SwarmKey.generate().write(key_path)
    other_key = tmp_path_factory.mktemp("other") / "other.key"
    SwarmKey.generate().write(other_key)
    with Cluster(tmp_path, forked=True) as cluster:
        # Alive but idle while the status commands run: the start barrier holds its first inner step
        # (up to 10 minutes) for a second node that never comes; its gRPC server already answers.
        node = cluster.start(["--swarm-key-file", str(key_path), "--tls", "--start-peers", "2"])
        wait_for(lambda: (node.run_dir / "node.json").exists(), 60, "node.json", node)
        address = node.identity()["grpc_address"]
        wait_for(lambda: dtnode_status(address, "--timeout", "2", "--swarm-key-file", str(key_path), "--tls").returncode == 0, 60, "a status answer", node)  # fmt: skip
        result = dtnode_status(address, "--json", "--swarm-key-file", str(key_path), "--tls")
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["peer_id"] == node.identity()["peer_id"]
        # Plaintext, or TLS with another swarm's certificate: refused, within the timeout.
        for extra in ([], ["--swarm-key-file", str(other_key), "--tls"]):
            started = time.monotonic()
            refused = dtnode_status(address, "--timeout", "3", *extra)
            assert refused.returncode == 1, refused.stdout + refused.stderr
            assert "did not answer" in refused.stderr and "--tls" in refused.stderr
            assert time.monotonic() - started < 30
        # `dtnode health` (the Docker HEALTHCHECK) reaches a --tls node with the key only.
        healthy = run_cli("health", address, "--swarm-key-file", str(key_path), "--tls")
        assert healthy.returncode == 0 and healthy.stdout.strip() == f"{address}: SERVING", healthy
        assert run_cli("health", address, "--timeout", "3").returncode == 1
