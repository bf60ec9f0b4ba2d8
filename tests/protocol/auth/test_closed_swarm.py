"""A closed swarm of real SwarmNodes on loopback: two members with the key, one outsider without.

The members find each other through signed DHT records and average exactly; the outsider joins the
same DHT but never shows up in a member's view (its unsigned records are refused), cannot fetch
their state, and is warned that its own swarm is open. No log line carries the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from protocol.auth import OPEN_SWARM_WARNING, REFUSAL, SwarmKey
from protocol.auth.channels import SwarmAuth
from protocol.discovery.dht_node import DhtConfig
from protocol.membership.config import RoundConfig
from protocol.membership.lineage import Lineage
from protocol.statesync.errors import StateSyncError
from protocol.statesync.fetch import fetch_state
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.result import GroupAveraged
from protocol.swarm.streams import to_allreduce_group
from tests.protocol.allreduce.support import exact_mean
from tests.protocol.swarm.test_swarm_node import node_config, param_hash_of

SEE_WITHIN = timedelta(seconds=15)
ROUNDS = RoundConfig(
    min_peers=2,
    join_window=timedelta(seconds=2),
    max_wait=timedelta(seconds=20),
    proposal_timeout=timedelta(seconds=2),
    begin_timeout=timedelta(seconds=4),
)


def patient_dht(initial_peers: tuple[str, ...]) -> DhtConfig:
    """Loopback DHT with slack for a loaded 2-core CI machine (the DHT runs in processes of its own)."""
    return DhtConfig(
        listen="127.0.0.1:0",
        initial_peers=initial_peers,
        startup_timeout=timedelta(seconds=40),
        rpc_timeout=timedelta(seconds=8),
    )


# One xdist worker takes the whole module: its tests share running swarm members (a module fixture).
pytestmark = pytest.mark.xdist_group("protocol.auth.test_closed_swarm")


@pytest.fixture(scope="module")
def secret_and_key(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, SwarmKey]:
    path: Path = tmp_path_factory.mktemp("key") / "swarm.key"
    SwarmKey.generate().write(path)
    return path.read_text().strip(), SwarmKey.from_file(path)


@pytest.fixture(scope="module")
def swarm(secret_and_key: tuple[str, SwarmKey]) -> Iterator[list[SwarmNode]]:
    """[member A, member B, outsider C]: B and C join through A; C has no key."""
    _, key = secret_and_key
    run_name = f"auth-test-{uuid.uuid4().hex[:12]}"
    started: list[SwarmNode] = []
    with ExitStack() as stack:
        for swarm_key in (key, key, None):
            bootstrap = tuple(started[0].multiaddrs()) if started else ()
            config = dataclasses.replace(
                node_config(run_name, bootstrap),
                dht=patient_dht(bootstrap),
                rounds=ROUNDS,
                auth=None if swarm_key is None else SwarmAuth(swarm_key),
            )
            node = SwarmNode(config)
            stack.callback(node.close)
            stack.callback(node.leave)
            started.append(node)
        yield started


@pytest.mark.timeout(90)
def test_members_average_exactly_and_the_keyless_outsider_is_refused(
    swarm: list[SwarmNode], secret_and_key: tuple[str, SwarmKey], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret, _ = secret_and_key
    members, outsider = swarm[:2], swarm[2]
    param_hash = param_hash_of(torch.zeros(4))
    for node in swarm:
        node.publish(round=0, param_hash=param_hash, tokens_per_s=1000.0, snapshot=None)

    # The members see each other; a few heartbeats later they still do not see the outsider.
    deadline = time.monotonic() + SEE_WITHIN.total_seconds()
    member_ids = {node.peer_id for node in members}
    while not all(member_ids <= {record.peer_id for record in node.view()} for node in members):
        assert time.monotonic() < deadline, [node.view() for node in members]
        time.sleep(0.1)
    time.sleep(3 * outsider.config.heartbeat.total_seconds())
    for node in members:
        seen = {record.peer_id: Lineage.of(record) for record in node.view()}
        assert set(seen) == member_ids, seen
    # It did try: its heartbeats were refused by every keyed peer, and it was told why.
    assert "refuse records not signed with their swarm key: check --swarm-key-file" in caplog.text

    # The outsider cannot fetch a member's state: refused, with the reason.
    with pytest.raises(StateSyncError, match=f"UNAUTHENTICATED: {REFUSAL}"):
        asyncio.run(
            fetch_state([members[0].grpc_address], expected_state_id=None, deadline=timedelta(seconds=5))
        )

    # A round between the members (signed membership messages and all-reduce calls) is exact.
    generator = torch.Generator().manual_seed(5)
    vectors = [torch.randn(2_003, generator=generator) for _ in members]

    def run(index: int) -> RoundResult:
        return members[index].run_round(
            vectors[index],
            round=0,
            param_hash=param_hash,
            num_tokens=100,
            tokens_per_s=1000.0,
            error_feedback=None,
        )

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run, range(2), timeout=60))
    group = results[0].group
    assert group is not None and set(group.member_ids) == member_ids
    by_peer = {node.peer_id: vector for node, vector in zip(members, vectors, strict=True)}
    member_vectors = [by_peer[peer_id] for peer_id in group.member_ids]  # the reducer's order
    everyone = [list(group.member_ids)] * 2
    reference = exact_mean(member_vectors, [100.0, 100.0], to_allreduce_group(group), everyone)
    for result in results:
        assert isinstance(result, GroupAveraged) and result.group == group, result
        assert result.allreduce is not None and not result.allreduce.fell_back, result.allreduce.failures
        assert result.allreduce.contributors == everyone
        assert torch.equal(result.allreduce.averaged, reference)
    torch.testing.assert_close(reference, (vectors[0] + vectors[1]) / 2)  # and that is the plain mean
    assert secret not in caplog.text


@pytest.mark.timeout(60)
def test_a_node_without_a_key_is_warned_that_its_swarm_is_open(
    caplog: pytest.LogCaptureFixture, secret_and_key: tuple[str, SwarmKey]
) -> None:
    caplog.set_level(logging.INFO, logger="protocol.swarm.node")
    with SwarmNode(dataclasses.replace(node_config(f"open-{uuid.uuid4().hex[:8]}", ()), dht=patient_dht(()))):
        pass
    assert OPEN_SWARM_WARNING in caplog.text and "use --swarm-key-file" in caplog.text
    caplog.clear()
    _, key = secret_and_key
    with SwarmNode(
        dataclasses.replace(node_config(f"closed-{uuid.uuid4().hex[:8]}", ()), auth=SwarmAuth(key))
    ):
        pass
    assert OPEN_SWARM_WARNING not in caplog.text
    assert f"closed swarm: key fingerprint {key.fingerprint}" in caplog.text
