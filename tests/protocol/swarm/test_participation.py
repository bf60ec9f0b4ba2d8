"""The start barrier and serving the nodes still behind at the end of a run, over real sockets
(two SwarmNodes on loopback, hivemind DHT). Each wait ends on what the other node publishes, not
on a timer: the tests fail by their bounded deadlines if it does not."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import pytest

from protocol.swarm.participation import await_start_peers, serve_stragglers
from tests.protocol.swarm.test_swarm_node import started_nodes

HASH_A, HASH_B = "a" * 64, "b" * 64


@pytest.mark.timeout(90)
def test_the_start_barrier_holds_until_the_other_node_is_live() -> None:
    with started_nodes(2, f"barrier-{uuid.uuid4().hex[:12]}") as (first, second):
        first.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        live: list[int] = []
        waiter = threading.Thread(
            target=lambda: live.append(await_start_peers(first, 2, timedelta(seconds=60), lambda: False))
        )
        waiter.start()
        time.sleep(2.0)  # the second node has published nothing yet: the barrier holds
        assert waiter.is_alive() and not live
        second.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        waiter.join(30)
        assert not waiter.is_alive() and live == [2]


@pytest.mark.timeout(90)
def test_a_stop_request_ends_the_start_barrier() -> None:
    with started_nodes(1, f"barrier-stop-{uuid.uuid4().hex[:12]}") as (alone,):
        alone.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        started = time.monotonic()
        assert (
            await_start_peers(alone, 3, timedelta(seconds=60), lambda: time.monotonic() - started > 1.0) == 1
        )
        assert time.monotonic() - started < 10


@pytest.mark.timeout(90)
def test_a_finished_node_serves_until_the_node_behind_it_caught_up() -> None:
    with started_nodes(2, f"stragglers-{uuid.uuid4().hex[:12]}") as (done, behind):
        done.publish(round=3, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        behind.publish(round=2, param_hash=HASH_B, tokens_per_s=1.0, snapshot=None)
        deadline = time.monotonic() + 30
        while behind.peer_id not in done.view() and time.monotonic() < deadline:
            time.sleep(0.25)
        result: list[int] = []
        server = threading.Thread(target=lambda: result.append(serve_stragglers(done)))
        server.start()
        time.sleep(2.0)  # the other node is a round behind: we keep serving
        assert server.is_alive()
        behind.publish(round=3, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)  # it caught up
        server.join(30)
        assert not server.is_alive() and result == [1]
