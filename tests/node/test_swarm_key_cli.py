"""A closed swarm through `dtnode join --swarm-key-file KEY --tls`: real processes on loopback.

Two nodes with the key run a round over mutual TLS with signed calls and signed DHT records, and
the key appears in none of their logs and run-dir files.
"""

from __future__ import annotations

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
    with Cluster(tmp_path) as cluster:
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
