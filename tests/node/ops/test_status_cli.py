"""`dtnode status`: against a real 2-node swarm (each peer's round and param_hash checked against its
own metrics.jsonl), against a served status (JSON and text), and against no node at all (exit 1)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc.aio
import pytest

from node.ops.cli import main
from node.ops.status import status_to_json
from protocol.auth.channels import SwarmAuth, add_port, new_server
from protocol.auth.key import SwarmKey
from protocol.loop import BackgroundLoop
from protocol.swarm.status import NodePhase, NodeStatus, StatusServicer, add_status_to_server
from tests.node.swarm_cluster import REPO_ROOT, Cluster, Node, tail, wait_for
from tests.protocol.swarm.test_status import sample_status

PHASES = {phase.value for phase in NodePhase}


def dtnode_status(*args: str) -> subprocess.CompletedProcess[str]:
    """``dtnode status ARGS`` as its own process (as an operator runs it)."""
    return subprocess.run(
        [sys.executable, "-m", "node.ops.cli", "status", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def mismatches(status: dict[str, Any], nodes: list[Node]) -> list[str]:
    """What in ``status`` disagrees with the nodes' own node.json and metrics.jsonl (empty: all agree)."""
    by_id = {node.identity()["peer_id"]: node for node in nodes}
    problems = []
    listed = sorted(peer["peer_id"] for peer in status["peers"])
    if listed != sorted(by_id):
        problems.append(f"peers {listed}, expected {sorted(by_id)}")
    for peer in status["peers"]:
        node = by_id.get(peer["peer_id"])
        if node is None:
            continue
        # The round's param_hash as the node itself wrote it after that round.
        expected = node.hashes().get(peer["round"])
        if peer["round"] < 1 or peer["param_hash"] != expected:
            problems.append(
                f"{node.name}: round {peer['round']} {peer['param_hash'][:12]}, metrics say {expected}"
            )
        if peer["grpc_address"] != node.identity()["grpc_address"]:
            problems.append(f"{node.name}: address {peer['grpc_address']}")
    return problems


@pytest.mark.timeout(240)
def test_status_json_against_a_running_two_node_swarm(tmp_path: Path) -> None:
    with Cluster(tmp_path, forked=True) as cluster:
        flags = ["--min-peers", "2"]  # no round limit: the cluster is killed at the end
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        second = cluster.start(flags, peers=peers)
        for node in (first, second):
            wait_for(lambda node=node: len(node.hashes()) >= 1, 150, "a round of two", node)
        # The view and the metrics are written at slightly different moments: poll until they agree.
        deadline = time.monotonic() + 45
        while True:
            result = dtnode_status("--json", "--run-dir", str(first.run_dir))  # the address from node.json
            assert result.returncode == 0, result.stderr + "\n" + tail(first)
            status = json.loads(result.stdout)
            problems = mismatches(status, cluster.nodes)
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert not problems, f"{problems}\n{json.dumps(status, indent=1)}"
        assert status["peer_id"] == first.identity()["peer_id"] and status["run_name"] == cluster.name
        assert status["published"] and first.hashes().get(status["round"]) == status["param_hash"]
        assert status["phase"] in PHASES - {"starting"}, status["phase"]
        assert status["rounds_formed"] >= 1 and status["group"] is not None
        ids = {node.identity()["peer_id"] for node in cluster.nodes}
        assert set(status["group"]["member_ids"]) == ids  # min_peers 2: every round has both
        assert [p["is_self"] for p in status["peers"]].count(True) == 1
        for peer in status["peers"]:
            assert peer["bandwidth_bytes_per_s"] > 0 and peer["in_group"]
            assert 0.0 <= peer["seconds_since_heartbeat"] <= 16.0  # within one record TTL
            assert 0.0 < peer["seconds_until_expiry"] <= 16.0

        # `dtnode health` without ADDR asks the address the node recorded (the port it bound), not the
        # --listen setting of its environment (a container image's DTNODE_LISTEN may name another).
        env = dict(os.environ, DTNODE_LISTEN="0.0.0.0:1", DTNODE_RUN_DIR=str(first.run_dir))
        healthy = subprocess.run([sys.executable, "-m", "node.ops.cli", "health"], cwd=REPO_ROOT, env=env,
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        local = first.identity()["local_address"]
        assert (
            local.startswith("127.0.0.1:")
            and local.rpartition(":")[2] == status["grpc_address"].rpartition(":")[2]
        )
        assert healthy.returncode == 0 and healthy.stdout.strip() == f"{local}: SERVING", healthy

        # ADDR given, plain text (stdout is a pipe): one line per peer, named by the tail of its id.
        text = dtnode_status(second.identity()["grpc_address"])
        assert text.returncode == 0, text.stderr
        assert f"node {second.identity()['peer_id']}" in text.stdout
        for peer_id in ids:
            assert sum(peer_id[-10:] in line for line in text.stdout.splitlines()) >= 1, text.stdout


@pytest.mark.timeout(180)
def test_status_shows_each_peers_throughput_during_its_first_phase(tmp_path: Path) -> None:
    """TOK/S while the nodes train their first phase (100000 inner steps: longer than the test), before
    any round: each node advertises its phase's throughput so far with its heartbeat, not only at a
    round's end (on the code before, every peer showed 0 until its first round ended). The reference
    is the node's own step records: the phase's tokens over its compute seconds lies between the
    slowest and the fastest step's rate."""
    with Cluster(tmp_path, forked=True) as cluster:
        flags = ["--min-peers", "2", "--inner-steps", "100000"]
        first = cluster.start(flags)
        second = cluster.start(flags, peers=cluster.first_multiaddr(first))
        deadline = time.monotonic() + 60
        rates: dict[str, float] = {}
        while time.monotonic() < deadline:
            result = dtnode_status("--json", "--run-dir", str(first.run_dir))
            if result.returncode == 0:
                status = json.loads(result.stdout)
                assert status["round"] == 0 and not first.hashes(), "the first phase ended: make it longer"
                rates = {peer["peer_id"]: peer["tokens_per_s"] for peer in status["peers"]}
                if len(rates) == 2 and all(rate > 0 for rate in rates.values()):
                    break
            time.sleep(1.0)
        assert len(rates) == 2 and all(rate > 0 for rate in rates.values()), f"{rates}\n{tail(first)}"
        for node in (first, second):
            step_rates = [record["tokens_per_s"] for record in node.records("step")]
            advertised = rates[node.identity()["peer_id"]]
            assert 0.99 * min(step_rates) <= advertised <= 1.01 * max(step_rates), (advertised, step_rates)


@contextmanager
def served(status: NodeStatus, auth: SwarmAuth | None = None) -> Iterator[str]:
    """A grpc.aio server with the status service only (made as a node makes its server, so with
    ``auth.tls`` it speaks mutual TLS only), on a loop thread; yields its address."""
    loop = BackgroundLoop(name="status-test")
    server: grpc.aio.Server | None = None

    async def start() -> int:
        nonlocal server
        server = new_server(options=[], auth=auth)
        add_status_to_server(server, StatusServicer(lambda: status))
        port = add_port(server, "127.0.0.1:0", auth=auth)
        await server.start()
        return port

    try:
        port = loop.run(start(), timedelta(seconds=10))
        yield f"127.0.0.1:{port}"
    finally:
        if server is not None:
            loop.run(server.stop(0.1), timedelta(seconds=10))
        loop.close()


@pytest.mark.timeout(30)
def test_json_and_text_of_a_served_status(capsys: pytest.CaptureFixture[str]) -> None:
    status = sample_status()
    with served(status) as address:
        assert main(["status", address, "--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed == json.loads(json.dumps(status_to_json(status)))
        assert printed["phase"] == "allreduce" and printed["peers"][2]["seconds_since_heartbeat"] == 7.5
        assert main(["status", address]) == 0
        text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0] == "node me (run 'demo', gRPC 10.0.0.2:7000)"
    assert "phase: allreduce toward round 4 (fragment 2 in flight), for 7.5 s" in lines
    assert f"params: round 3, param_hash {'a' * 64}" in lines
    assert "syncing to join: new to round 3, due in 4 s, newer to round 3" in lines
    header = next(i for i, line in enumerate(lines) if line.startswith("PEER"))
    rows = [line.split() for line in lines[header + 1 :]]
    # far: not self, round 2; me: self (marked *); other: ready for round 4, in the group.
    assert [row[:3] for row in rows] == [["far", "10.0.0.3:7000", "2"], ["*me", "10.0.0.2:7000", "3"],
                                         ["other", "10.0.0.5:7000", "3"]]  # fmt: skip
    assert rows[2][4] == "4" and rows[2][-1] == "yes" and rows[0][-1] != "yes"


@pytest.mark.timeout(30)
def test_an_unreachable_node_is_exit_1_within_the_timeout(capsys: pytest.CaptureFixture[str]) -> None:
    # First (so that the timed call below times the wait, not the first import of the status code on
    # a loaded machine): nothing listens, refused at once.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["status", f"127.0.0.1:{port}", "--json"]) == 1
    err = capsys.readouterr().err
    assert f"127.0.0.1:{port}" in err and "UNAVAILABLE" in err
    with socket.socket() as listener:  # accepts TCP but never answers: the deadline must end the wait
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        started = time.monotonic()
        assert main(["status", f"127.0.0.1:{listener.getsockname()[1]}", "--timeout", "1"]) == 1
        assert time.monotonic() - started < 4.0
    assert "did not answer within 1 s" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_a_tls_status_answers_only_with_the_swarm_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key_path, other_path = tmp_path / "swarm.key", tmp_path / "other.key"
    SwarmKey.generate().write(key_path)
    SwarmKey.generate().write(other_path)
    status = sample_status()
    with served(status, SwarmAuth(SwarmKey.from_file(key_path), tls=True)) as address:
        assert main(["status", address, "--json", "--swarm-key-file", str(key_path), "--tls"]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(status_to_json(status)))
        # Plaintext: the TLS server closes the connection; refused at once, and told what a TLS node needs.
        started = time.monotonic()
        assert main(["status", address, "--timeout", "5"]) == 1
        assert time.monotonic() - started < 4.0
        err = capsys.readouterr().err
        assert "UNAVAILABLE" in err and "--swarm-key-file KEY --tls" in err
        # Another swarm's certificate fails the handshake both ways: refused too.
        assert main(["status", address, "--timeout", "5", "--swarm-key-file", str(other_path), "--tls"]) == 1
        assert "this swarm's key" in capsys.readouterr().err


@pytest.mark.timeout(30)
def test_user_mistakes_are_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--run-dir", str(tmp_path)]) == 2
    assert f"no {tmp_path / 'node.json'}" in capsys.readouterr().err
    (tmp_path / "node.json").write_text(json.dumps({"peer_id": "x"}))
    assert main(["status", "--run-dir", str(tmp_path)]) == 2
    assert "has no grpc_address" in capsys.readouterr().err
    assert main(["status", "not-an-address"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
