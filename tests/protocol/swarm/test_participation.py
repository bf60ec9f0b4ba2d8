"""The start barrier, serving the nodes still behind at the end of a run and the wait after a missed
round, over real sockets (SwarmNodes on loopback, hivemind DHT). Each wait ends on what the other
node publishes, not on a timer: the tests fail by their bounded deadlines if it does not."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch

from protocol.allreduce.config import AllReduceConfig
from protocol.membership.lineage import Lineage
from protocol.swarm.config import SwarmConfig
from protocol.swarm.node import SwarmNode
from protocol.swarm.participation import (
    await_lineage_past,
    await_start_peers,
    missed_round_wait,
    serve_stragglers,
)
from protocol.swarm.result import GroupAveraged, RoundMissed, RoundResult
from tests.protocol.swarm.test_swarm_node import ROUNDS, node_config, started_nodes, wait_for_lineages

HASH_A, HASH_B = "a" * 64, "b" * 64


@pytest.mark.timeout(90)
def test_the_start_barrier_holds_until_the_other_node_is_live() -> None:
    with started_nodes(2, f"barrier-{uuid.uuid4().hex[:12]}") as (first, second):
        first.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        live: list[set[str]] = []
        waiter = threading.Thread(
            target=lambda: live.append(
                set(await_start_peers(first, 2, timedelta(seconds=60), lambda: False).peer_ids)
            )
        )
        waiter.start()
        time.sleep(2.0)  # the second node has published nothing yet: the barrier holds
        assert waiter.is_alive() and not live
        second.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        waiter.join(30)
        assert not waiter.is_alive() and live == [{first.peer_id, second.peer_id}]


@pytest.mark.timeout(90)
def test_a_stop_request_ends_the_start_barrier() -> None:
    with started_nodes(1, f"barrier-stop-{uuid.uuid4().hex[:12]}") as (alone,):
        alone.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        started = time.monotonic()
        view = await_start_peers(alone, 3, timedelta(seconds=60), lambda: time.monotonic() - started > 1.0)
        assert set(view.peer_ids) <= {alone.peer_id}
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


@pytest.mark.timeout(120)
def test_a_node_that_missed_a_round_steps_on_within_the_missed_round_wait() -> None:
    """Two nodes begin round 1 without the third (its phase ran past their join window), then die
    without publishing: a killed group (a frozen one looks the same to the others). The third node
    misses the round; its own lineage stays canonical, so no lineage past it ever appears. It waits
    while the member that told it the round started is seen in the round (its record renewed), then
    ``missed_round_wait`` (the stall timeout of the group's all-reduce, a heartbeat and a DHT store:
    5.5 s here): at most a record TTL (8 s) and that wait, not the group's ``round_deadline`` plus a
    record TTL (28 s here, 5 min 20 s by default), recording no round meanwhile, as issue 31's stalled
    swarm did."""
    run_name = f"missed-{uuid.uuid4().hex[:12]}"
    rounds = dataclasses.replace(ROUNDS, min_peers=2, join_window=timedelta(seconds=1))

    def config(peers: tuple[str, ...]) -> SwarmConfig:
        return dataclasses.replace(
            node_config(run_name, peers),
            rounds=rounds,
            allreduce=AllReduceConfig(stall_timeout=timedelta(seconds=3)),
        )

    nodes: list[SwarmNode] = []
    closed: set[str] = set()
    try:
        for _ in range(3):
            nodes.append(SwarmNode(config(tuple(nodes[0].multiaddrs()) if nodes else ())))
        late, *group = nodes
        for node in nodes:
            node.publish(round=0, param_hash=HASH_A, tokens_per_s=1.0, snapshot=None)
        wait_for_lineages(nodes, {node.peer_id: Lineage(0, HASH_A) for node in nodes})

        def run(node: SwarmNode) -> RoundResult:
            return node.run_round(
                torch.ones(64),
                round=0,
                param_hash=HASH_A,
                num_tokens=10,
                tokens_per_s=1.0,
                error_feedback=None,
            )

        with ThreadPoolExecutor(max_workers=2) as pool:
            results = list(pool.map(run, group, timeout=60))
        assert all(isinstance(result, GroupAveraged) for result in results), results
        # The group publishes nothing past round 0 (it froze, died, or is the smaller side); the late
        # node asks to join round 1, hears that it began without it, and misses it.
        missed = run(late)
        assert isinstance(missed, RoundMissed), missed
        assert missed.told_by in {node.peer_id for node in group}  # a member said the round started
        for node in group:  # the group dies before it publishes (no tombstone: its records expire)
            node.close()
            closed.add(node.peer_id)
        wait = missed_round_wait(late.config)
        assert wait == timedelta(seconds=5.5)
        started = time.monotonic()
        decision = await_lineage_past(
            late, round=0, param_hash=HASH_A, told_by=missed.told_by, stop_requested=lambda: False
        )
        waited = time.monotonic() - started
        assert decision is None  # nothing past our lineage became canonical: step on our own Δ
        ttl = late.config.record_ttl.total_seconds()
        assert wait.total_seconds() - 0.5 <= waited <= ttl + wait.total_seconds() + 3.0, waited
    finally:
        for node in reversed(nodes):
            if node.peer_id not in closed:
                node.leave()
                node.close()
