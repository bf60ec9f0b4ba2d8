"""Peer discovery over real hivemind DHT peers on loopback: join, heartbeat, leave, crash, hostile records.

Three DHT peers are shared by the module (the 2nd and 3rd join through the 1st's visible
multiaddrs); each test uses its own run name, hence its own DHT key. The crash test runs a fourth
peer in a subprocess and SIGKILLs its whole process group (python, DHT process and p2pd alike).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from protocol.discovery.dht_node import DhtConfig, DhtNode
from protocol.discovery.registry import SwarmRegistry
from protocol.membership.records import SwarmView
from tests.protocol.discovery.support import PROTOCOL_VERSION, live_processes_in_group, make_record, poll

REPO_ROOT = Path(__file__).resolve().parents[3]
# Short leases so that expiry is observable in a test: ttl = 3 * period + 2 * call_timeout.
PERIOD = timedelta(seconds=0.5)
CALL_TIMEOUT = timedelta(seconds=1)
SHORT_TTL = 3 * PERIOD + 2 * CALL_TIMEOUT  # 3.5 s
SEE_NEW_PEER_WITHIN = timedelta(seconds=3)


# One xdist worker takes the whole module: its tests share three running DHT peers (a module fixture).
# Whichever test runs first starts them and whichever runs last stops them, within its own timeout:
# each test's timeout holds its own work plus that (stopping one peer takes up to its 3 s grace and
# a 3 s join when a loaded machine keeps it from stopping in time; the three stop at once).
pytestmark = pytest.mark.xdist_group("protocol.discovery.test_swarm")


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[DhtNode]]:
    started: list[DhtNode] = []
    try:
        started.append(DhtNode(DhtConfig(rpc_timeout=CALL_TIMEOUT)))
        bootstrap = tuple(started[0].visible_multiaddrs())
        for _ in range(2):
            started.append(DhtNode(DhtConfig(initial_peers=bootstrap, rpc_timeout=CALL_TIMEOUT)))
        yield started
    finally:
        with ThreadPoolExecutor(max_workers=3) as pool:
            list(pool.map(DhtNode.shutdown, started))


class Registries:
    """Makes registries for a test and closes every one at teardown, even when the test fails."""

    def __init__(self) -> None:
        self.made: list[SwarmRegistry] = []

    def __call__(
        self, nodes: list[DhtNode], run_name: str, ttl: timedelta = SHORT_TTL
    ) -> list[SwarmRegistry]:
        for node in nodes:
            self.made.append(
                SwarmRegistry(
                    node,
                    run_name=run_name,
                    protocol_version=PROTOCOL_VERSION,
                    period=PERIOD,
                    ttl=ttl,
                    call_timeout=CALL_TIMEOUT,
                )
            )
        return self.made[-len(nodes) :]


@pytest.fixture
def registries() -> Iterator[Registries]:
    made = Registries()
    yield made
    for registry in made.made:
        registry.close()


def without_expiry(view: SwarmView) -> list[object]:
    return [dataclasses.replace(peer, expires_at=0.0) for peer in view]


@pytest.mark.timeout(40)
def test_three_peers_see_all_records(registries: Registries, nodes: list[DhtNode]) -> None:
    members = registries(nodes, "see-all")
    records = [make_record(node.peer_id, port=5000 + i) for i, node in enumerate(nodes)]
    published_at = get_dht_time()
    for registry, record in zip(members, records, strict=True):
        registry.publish(record)
    expected_ids = tuple(sorted(node.peer_id for node in nodes))
    for registry in members:
        view = poll(registry.fetch, lambda v: v.peer_ids == expected_ids, within=SEE_NEW_PEER_WITHIN)
        assert view.peer_ids == expected_ids
        assert without_expiry(view) == sorted(records, key=lambda r: r.peer_id)
        # expires_at is on the DHT clock: publish time + ttl.
        for peer in view:
            assert published_at + SHORT_TTL.total_seconds() <= peer.expires_at
            assert peer.expires_at <= get_dht_time() + SHORT_TTL.total_seconds()
    for registry in members:
        registry.leave()


@pytest.mark.timeout(40)
def test_heartbeat_keeps_a_record_alive_past_its_ttl(registries: Registries, nodes: list[DhtNode]) -> None:
    writer, reader = registries(nodes[1:], "heartbeat")
    writer.publish(make_record(nodes[1].peer_id)).result(timeout=5)
    first = poll(reader.fetch, lambda v: nodes[1].peer_id in v, within=SEE_NEW_PEER_WITHIN)
    first_expiry = first.peers[0].expires_at
    time.sleep(max(0.0, first_expiry - get_dht_time()) + 2 * PERIOD.total_seconds())
    later = reader.fetch()
    assert later.now > first_expiry  # the first lease is over ...
    assert later.peer_ids == (nodes[1].peer_id,)  # ... but renewals keep the peer listed
    assert later.peers[0].expires_at > later.now
    writer.leave()
    reader.close()


@pytest.mark.timeout(40)
def test_leave_removes_a_peer_at_once(registries: Registries, nodes: list[DhtNode]) -> None:
    long_ttl = timedelta(seconds=60)  # leaving must not wait for this
    members = registries(nodes, "leave", ttl=long_ttl)
    for registry, node in zip(members, nodes, strict=True):
        registry.publish(make_record(node.peer_id))
    everyone = tuple(sorted(node.peer_id for node in nodes))
    for registry in members:
        assert (
            poll(registry.fetch, lambda v: v.peer_ids == everyone, within=SEE_NEW_PEER_WITHIN).peer_ids
            == everyone
        )

    started = time.monotonic()
    assert members[2].leave() is True
    for registry in members[:2]:
        view = registry.fetch()  # no polling: the first read after leave() must already agree
        assert nodes[2].peer_id not in view
        assert view.left_peer_ids == {nodes[2].peer_id}
    assert time.monotonic() - started < 0.1 * long_ttl.total_seconds()
    for registry in members[:2]:
        registry.leave()


@pytest.mark.timeout(60)
def test_a_killed_peer_lingers_until_its_ttl_then_disappears(
    registries: Registries, nodes: list[DhtNode], tmp_path: Path
) -> None:
    (reader,) = registries(nodes[:1], "crash")
    stderr_path = tmp_path / "peer_process.stderr"
    with open(stderr_path, "wb") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.protocol.discovery.peer_process", "--run-name", "crash",
             "--peers", *nodes[0].visible_multiaddrs(), "--period", str(PERIOD.total_seconds()),
             "--ttl", str(SHORT_TTL.total_seconds()), "--call-timeout", str(CALL_TIMEOUT.total_seconds())],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True,
        )  # fmt: skip
    try:
        assert child.stdout is not None
        ready, _, _ = select.select([child.stdout], [], [], 30.0)
        assert ready, f"the peer process did not start: {stderr_path.read_text()[-2000:]}"
        line = child.stdout.readline()
        assert line, f"the peer process exited: {stderr_path.read_text()[-2000:]}"
        child_id = json.loads(line)["peer_id"]
        assert child_id in poll(reader.fetch, lambda v: child_id in v, within=SEE_NEW_PEER_WITHIN)

        os.killpg(child.pid, signal.SIGKILL)  # the python process, its DHT process and its p2pd
        killed_at = get_dht_time()
        child.wait(timeout=5)
        leftovers = poll(
            lambda: live_processes_in_group(child.pid), lambda pids: not pids, within=timedelta(seconds=5)
        )
        assert not leftovers, f"processes of the killed peer survive: {leftovers}"

        lingering = reader.fetch()
        assert child_id in lingering, "a crashed peer's record stays until it expires"
        last_expiry = lingering.get(child_id).expires_at  # type: ignore[union-attr]
        assert last_expiry <= killed_at + SHORT_TTL.total_seconds() + 0.05  # no heartbeat after the kill

        gone = poll(reader.fetch, lambda v: child_id not in v, within=SHORT_TTL + timedelta(seconds=3))
        assert child_id not in gone
        assert gone.now >= last_expiry  # not dropped early ...
        assert gone.now - killed_at <= SHORT_TTL.total_seconds() + 2.0  # ... and dropped once the TTL is over
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=5)
        reader.close()


@pytest.mark.timeout(40)
def test_malformed_records_from_a_hostile_peer_are_skipped(
    registries: Registries, nodes: list[DhtNode], caplog: pytest.LogCaptureFixture
) -> None:
    honest, reader = registries(nodes[:2], "hostile")
    honest.publish(make_record(nodes[0].peer_id)).result(timeout=5)
    hostile = nodes[2]  # writes straight into the DHT, bypassing SwarmRegistry's checks
    expiration = get_dht_time() + 30
    bad_values = {
        "mallory": {"peer_id": "mallory", "round": "seven"},
        hostile.peer_id: "not a mapping",
        "impostor": make_record(nodes[0].peer_id, port=6666).to_dict(),  # claims another peer's id
    }
    for subkey, value in bad_values.items():
        assert hostile.store(
            reader.key, value, expiration_time=expiration, subkey=subkey, timeout=CALL_TIMEOUT
        )

    with caplog.at_level(logging.WARNING, logger="protocol.discovery.registry"):
        for _ in range(2):
            view = reader.fetch()
            assert view.peer_ids == (nodes[0].peer_id,)
            assert view.peers[0].grpc_address == "127.0.0.1:5000"
    skipped = [r.getMessage() for r in caplog.records if "skipping a bad peer record" in r.getMessage()]
    assert len(skipped) == len(bad_values), skipped  # each once, although fetched twice
    for subkey in bad_values:
        assert sum(f"subkey {subkey}:" in line for line in skipped) == 1
    honest.leave()
    reader.close()


@pytest.mark.timeout(40)  # like its neighbours: it may be the test that stops the three peers
def test_ttl_shorter_than_the_heartbeat_allows_is_rejected(
    registries: Registries, nodes: list[DhtNode]
) -> None:
    with pytest.raises(ValueError, match=r"ttl >= 3 \* period \+ 2 \* call_timeout"):
        registries(nodes[:1], "bad-ttl", ttl=SHORT_TTL - timedelta(milliseconds=1))
