"""A node with local workers is one peer of the swarm: real `dtnode join` processes on loopback.

- A single-process node and a node of 2 tensor-parallel local ranks share every round with one
  param_hash; a third node of 2 data-parallel ranks joins mid-run, adopts the swarm's state (written to
  every local rank) and matches from its first round on. All three all-reduce on 2 streams
  (``--swarm-streams 2``): the single-process node serves stream 1 in its own process, the others on
  their local rank 1, with the int8 codec's residual kept per stream.
- A local worker that dies is reported by name and the node exits non-zero instead of hanging, its other
  processes gone with it.

Every node is forked from the server that imported the node once (``Cluster(forked=True)``); each still
spawns its local ranks itself. The nodes train on a 0.2 MB text file (``small_corpus``), not the default
31.5 MB stdlib corpus, whose loading costs each node ~2 CPU-seconds, and in rounds of 5 inner steps, not
FAST_FLAGS' 10: the nodes train without pause (on while a joiner starts), so the CPU a test costs is its
wall time, which is set by how soon its nodes reach their rounds.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1.health_pb2 import HealthCheckRequest
from grpc_health.v1.health_pb2_grpc import HealthStub

from protocol.auth.channels import SwarmAuth, open_channel
from protocol.auth.key import SwarmKey
from tests.node.ops.test_swarm_cli import assert_one_lineage
from tests.node.swarm_cluster import Cluster, tail, wait_for

TENSOR_PARALLEL = ["--local-workers", "2", "--tp", "2"]
DATA_PARALLEL = ["--local-workers", "2", "--dp", "2"]


def small_corpus(tmp_path: Path) -> list[str]:
    """Flags that train on a 0.2 MB text file written under ``tmp_path``, in rounds of 5 inner steps."""
    path = tmp_path / "text.txt"
    path.write_text(inspect.getsource(inspect) * 2)
    return ["--data", str(path), "--inner-steps", "5"]


def child_pids(pid: int) -> list[int]:
    result = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True, timeout=10
    )
    return [int(line) for line in result.stdout.split()]


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def worker_pids(pid: int) -> list[int]:
    """The local ranks of a ``--no-swarm`` node (no DHT process): its children, spawned or forked, but not
    multiprocessing's resource tracker."""
    pids = []
    for child in child_pids(pid):
        try:
            command = open(f"/proc/{child}/cmdline", "rb").read()  # noqa: SIM115 (a one-shot read)
        except FileNotFoundError:
            continue
        if b"resource_tracker" not in command:
            pids.append(child)
    return pids


@pytest.mark.timeout(420)
def test_nodes_with_and_without_local_workers_share_every_round(tmp_path):
    with Cluster(tmp_path, forked=True) as cluster:
        # No round limit: stopped by SIGTERM below. A join window of 30 s, not 5: with parallel tests on
        # the cores a node's 10 steps have taken 11 s, and a node left out of a round would fail the
        # check below, which is about layouts sharing rounds, not about the window.
        flags = ["--min-peers", "2", "--swarm-streams", "2", "--join-window", "30", *small_corpus(tmp_path)]
        first = cluster.start(flags)
        peers = cluster.first_multiaddr(first)
        # The tp node keeps its outer state sharded over its ranks; the dp joiner whole on rank 0.
        parallel = cluster.start([*flags, *TENSOR_PARALLEL, "--outer-sharding", "on"], peers=peers)
        wait_for(lambda: len(parallel.records()) >= 2, 150, "two rounds of the tp node", parallel)
        joiner = cluster.start([*flags, *DATA_PARALLEL], peers=peers)
        wait_for(lambda: len(joiner.hashes()) >= 2, 180, "two rounds of the dp joiner", joiner)
        for node in cluster.nodes:
            node.signal(signal.SIGTERM)
        # A node stops after its round in flight and its leave record (tens of seconds when parallel
        # tests share the cores).
        assert cluster.wait_all(150) == [0, 0, 0], "\n\n".join(tail(n) for n in cluster.nodes)
        assert "2 local workers: dp=1 x tp=2 x pp=1" in parallel.log()
        assert "2 local workers: dp=2 x tp=1 x pp=1" in joiner.log()
        assert "adopting the swarm's state" in joiner.log()
        assert "outer state sharded over 2 local ranks" in parallel.log()
        assert "outer state sharded" not in joiner.log()
        for node in cluster.nodes:
            assert "all-reduce on 2 streams" in node.log(), tail(node)
        # Only a node's last round may fall back alone (its peers left at the SIGTERM first).
        assert all(r["peers"] >= 2 and not r["fell_back"] for r in parallel.records()[:-1]), (
            parallel.records()
        )
        rounds = sorted(set(first.averaged_hashes()) & set(parallel.averaged_hashes()))
        assert len(rounds) >= 2, (first.records(), parallel.records())
        assert_one_lineage([node.averaged_hashes() for node in cluster.nodes], rounds)
        joined = sorted(set(joiner.averaged_hashes()) & set(first.averaged_hashes()))
        assert joined, (joiner.records(), first.records())
        assert_one_lineage([first.averaged_hashes(), joiner.averaged_hashes()], joined)
        losses = [r["eval_loss"] for r in parallel.records()]
        assert losses[-1] < losses[0], losses


def answers_health(address: str, auth: SwarmAuth | None) -> bool:
    """Whether the gRPC server at ``address`` answers a health check made with ``auth``."""

    async def check() -> bool:
        async with open_channel(address, options=[], auth=auth) as channel:
            try:
                await HealthStub(channel).Check(HealthCheckRequest(service=""), timeout=5)
            except grpc.aio.AioRpcError:
                return False
            return True

    return asyncio.run(check())


@pytest.mark.timeout(240)
def test_streams_on_local_ranks_speak_the_closed_swarms_mutual_tls(tmp_path):
    """A rank's stream server takes only the swarm's TLS callers, and its rounds go through."""
    key_path = tmp_path / "swarm.key"
    SwarmKey.generate().write(key_path)
    auth = SwarmAuth(SwarmKey.from_file(key_path), tls=True)
    flags = ["--min-peers", "2", "--swarm-streams", "2", "--swarm-key-file", str(key_path), "--tls"]
    flags += small_corpus(tmp_path)
    with Cluster(tmp_path, forked=True) as cluster:
        single = cluster.start(flags)
        parallel = cluster.start([*flags, *TENSOR_PARALLEL], peers=cluster.first_multiaddr(single))
        wait_for(lambda: len(parallel.records()) >= 2, 150, "two rounds of the tp node", parallel)
        streams = re.search(r"all-reduce on 2 streams: (\S+), (\S+)", parallel.log())
        assert streams is not None, tail(parallel)
        for address in streams.groups():  # the node server, then rank 1's stream server
            assert answers_health(address, auth), address
            assert not answers_health(address, None), f"{address} answers a plaintext caller"
        for node in cluster.nodes:
            node.signal(signal.SIGTERM)
        assert cluster.wait_all(90) == [0, 0], "\n\n".join(tail(n) for n in cluster.nodes)
        # Only a node's last round may fall back alone (its peer left at the SIGTERM first); such a round
        # steps on the node's own Δ, so the lineage is compared over the rounds both averaged.
        for node in cluster.nodes:
            assert all(r["peers"] == 2 and not r["fell_back"] for r in node.records()[:-1]), node.records()
        rounds = sorted(set(single.averaged_hashes()) & set(parallel.averaged_hashes()))
        assert len(rounds) >= 2, (single.records(), parallel.records())
        assert_one_lineage([single.averaged_hashes(), parallel.averaged_hashes()], rounds)
        shared = [r for r in parallel.records() if r["round"] in rounds]
        assert all(r["peers"] == 2 and not r["fell_back"] and r["streams"] == 2 for r in shared), shared


@pytest.mark.timeout(180)
def test_a_dead_local_worker_stops_the_node_with_a_clear_error(tmp_path):
    with Cluster(tmp_path, forked=True) as cluster:
        node = cluster.start(["--no-swarm", "--inner-steps", "1000", "--log-every", "1", *TENSOR_PARALLEL])
        wait_for(lambda: len(node.records("step")) >= 3, 120, "three inner steps", node)
        children = child_pids(node.process.pid)  # the rank, multiprocessing's resource tracker
        workers = worker_pids(node.process.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        started = time.monotonic()
        code = node.wait(60)
        assert code not in (0, None), tail(node)
        assert time.monotonic() - started < 60
        assert "local worker rank 1 exited with code -9" in node.log(), tail(node)
        # (Not passing ``node``: it has exited, which is the point, and its resource tracker may
        # still be on its way out at the first poll.)
        wait_for(lambda: not any(alive(pid) for pid in children), 15, "the node's processes to go")


@pytest.mark.timeout(180)
def test_a_sigkilled_daemon_takes_its_local_workers_with_it(tmp_path):
    with Cluster(tmp_path, forked=True) as cluster:
        node = cluster.start(["--no-swarm", "--inner-steps", "1000", "--log-every", "1", *TENSOR_PARALLEL])
        wait_for(lambda: len(node.records("step")) >= 3, 120, "three inner steps", node)
        workers = worker_pids(node.process.pid)
        assert len(workers) == 1, workers
        os.kill(node.process.pid, signal.SIGKILL)  # the daemon alone, not its process group
        node.wait(10)
        wait_for(lambda: not alive(workers[0]), 10, "the orphaned local worker to exit")
