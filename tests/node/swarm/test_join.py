"""A fresh joiner's state fetch ahead of its trainer (node/swarm/join.py), against real SwarmNodes on loopback.

The fetched snapshot must be the one the swarm serves, byte for byte, and verified against its
advertised param_hash; a swarm still at round 0 (every node on the same seeded init) is not
fetched, and a joiner that sees no peer gives up after its join timeout. While it fetches, a
joiner says so (a ``syncing`` record) and publishes no state of its own, so fresh joiners never
count as a lineage, however many join at once.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from node.swarm.join import Prefetch
from node.swarm.session import SwarmSession
from node.train.trainer import Trainer
from protocol.membership.lineage import Lineage
from protocol.membership.records import PeerRecord
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.node import SwarmNode
from tests.node.swarm.test_swarm_session import corpus_file, small_config
from tests.protocol.swarm.test_swarm_node import node_config, param_hash_of, started_nodes, wait_for_lineages

__all__ = ["corpus_file"]  # fixture

pytestmark = pytest.mark.timeout(90)


@pytest.fixture()
def source_and_joiner() -> Iterator[tuple[SwarmNode, SwarmNode]]:
    run_name = f"join-test-{uuid.uuid4().hex[:12]}"
    with ExitStack() as stack:
        source = SwarmNode(node_config(run_name, ()))
        stack.callback(source.close)
        joiner = SwarmNode(node_config(run_name, tuple(source.multiaddrs())))
        stack.callback(joiner.close)
        yield source, joiner


def publish_state(source: SwarmNode, round: int) -> tuple[str, dict[str, torch.Tensor], bytes]:
    generator = torch.Generator().manual_seed(round)
    tensors = {
        "global_params": torch.randn(20_011, generator=generator),
        "outer_momentum": torch.randn(20_011),
    }
    param_hash = param_hash_of(tensors["global_params"])
    metadata = json.dumps({"round": round, "step": 40 * round}).encode()
    snapshot = Snapshot(round_id=round, state_id=param_hash, tensors=dict(tensors), metadata=metadata)
    source.publish(round=round, param_hash=param_hash, tokens_per_s=100.0, snapshot=snapshot)
    return param_hash, tensors, metadata


def test_a_fresh_joiner_fetches_the_swarm_state_while_its_trainer_is_built(
    source_and_joiner: tuple[SwarmNode, SwarmNode],
) -> None:
    source, joiner = source_and_joiner
    param_hash, tensors, metadata = publish_state(source, round=4)
    ahead = Prefetch(joiner, join_timeout=timedelta(seconds=20)).result()
    assert ahead is not None
    decision, report = ahead
    assert decision.canonical == Lineage(4, param_hash) and decision.sync_sources == (source.peer_id,)
    fetched = report.snapshot
    assert fetched.round_id == 4 and fetched.state_id == param_hash and fetched.metadata == metadata
    assert fetched.sha256("global_params").hex() == param_hash
    for name, tensor in tensors.items():
        assert torch.equal(fetched.tensors[name], tensor)


def test_a_swarm_at_round_zero_is_not_fetched_ahead(source_and_joiner: tuple[SwarmNode, SwarmNode]) -> None:
    source, joiner = source_and_joiner
    publish_state(source, round=0)
    assert Prefetch(joiner, join_timeout=timedelta(seconds=20)).result() is None


def test_a_joiner_that_sees_no_peer_gives_up_after_its_join_timeout() -> None:
    with ExitStack() as stack:
        alone = SwarmNode(node_config(f"join-test-{uuid.uuid4().hex[:12]}", ()))
        stack.callback(alone.close)
        started = time.monotonic()
        assert Prefetch(alone, join_timeout=timedelta(seconds=2)).result() is None
        assert 2.0 <= time.monotonic() - started < 10.0


def record_publishes(nodes: list[SwarmNode], monkeypatch: pytest.MonkeyPatch) -> list[PeerRecord]:
    """Every record ``nodes`` publish from now on (all go through their registries), in order."""
    published: list[PeerRecord] = []
    for node in nodes:
        assert node.registry is not None
        real = node.registry.publish
        monkeypatch.setattr(node.registry, "publish", lambda r, real=real: (published.append(r), real(r))[1])
    return published


@pytest.mark.timeout(180)
def test_fresh_joiners_that_outnumber_the_swarm_adopt_its_state_and_never_form_a_lineage(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fresh nodes join a one-node swarm at once. Both start from the same seeded init: had they
    published it, it would be the larger lineage (2 peers to 1) and the swarm would go back to round 0."""
    with started_nodes(3, f"join-test-{uuid.uuid4().hex[:12]}") as (source_node, *joiner_nodes):
        source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=1))
        source.run()  # round 1
        state = source.round.snapshot()
        source_node.publish(round=1, param_hash=state.state_id, tokens_per_s=1.0, snapshot=state)
        published = record_publishes(joiner_nodes, monkeypatch)
        prefetches = [Prefetch(node, join_timeout=timedelta(seconds=20)) for node in joiner_nodes]
        sessions = [
            SwarmSession(node, joining=True, prefetch=prefetch)
            for node, prefetch in zip(joiner_nodes, prefetches, strict=True)
        ]
        joiners = [
            Trainer(small_config(corpus_file, tmp_path / f"joiner-{i}"), swarm=session)
            for i, session in enumerate(sessions)
        ]
        init_hash = joiners[0].diloco.param_hash()
        assert joiners[1].diloco.param_hash() == init_hash != state.state_id  # one seeded init
        # What Trainer.run does first: join the swarm (adopt its state, serve it, the start barrier).
        threads = [threading.Thread(target=trainer.round.start) for trainer in joiners]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
            assert not thread.is_alive()

        for trainer in joiners:
            assert (trainer.progress.round, trainer.diloco.param_hash()) == (1, state.state_id)
        # Each said it fetched the swarm's state, then published that state; never its own init.
        for node in joiner_nodes:
            mine = [(r.status, r.round, r.param_hash) for r in published if r.peer_id == node.peer_id]
            assert mine[0] == ("syncing", 1, state.state_id) and mine[-1] == ("active", 1, state.state_id)
            assert all(r.param_hash != init_hash for r in published)
        syncing = [r for r in published if r.status == "syncing" and r.ready_at is not None]
        assert syncing, "a joiner announces when it expects to hold the state, from the fetch's progress"
        lineage = Lineage(1, state.state_id)
        wait_for_lineages([source_node], {node.peer_id: lineage for node in (source_node, *joiner_nodes)})
        decision = source_node.lineage(round=1, param_hash=state.state_id)
        assert decision.in_canonical and decision.num_canonical_peers == 3


@pytest.mark.timeout(120)
def test_a_joiner_whose_fetch_fails_stays_syncing_and_publishes_no_state_of_its_own(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The swarm's state cannot be fetched (its node advertises round 1 but serves nothing): the
    joiner trains on its own params until the next round's lineage check, announced as syncing."""
    with started_nodes(2, f"join-test-{uuid.uuid4().hex[:12]}") as (source_node, joiner_node):
        swarm_hash = param_hash_of(torch.arange(10.0))
        source_node.publish(round=1, param_hash=swarm_hash, tokens_per_s=1.0, snapshot=None)
        published = record_publishes([joiner_node], monkeypatch)
        session = SwarmSession(joiner_node, joining=True)
        joiner = Trainer(small_config(corpus_file, tmp_path / "joiner"), swarm=session)
        joiner.round.start()  # what Trainer.run does first: join the swarm

        assert joiner.progress.round == 0 and session._state_sync_failures == 1
        assert published and all(
            (r.status, r.round, r.param_hash) == ("syncing", 1, swarm_hash) for r in published
        )
        deadline = time.monotonic() + 20
        while joiner_node.peer_id not in [r.peer_id for r in source_node.view().syncing]:
            assert time.monotonic() < deadline, "the source never saw the joiner's syncing record"
            time.sleep(0.2)
        assert source_node.lineage(round=1, param_hash=swarm_hash).num_canonical_peers == 1
