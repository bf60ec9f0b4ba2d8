"""A fresh joiner's state fetch ahead of its trainer (node/join.py), against real SwarmNodes on loopback.

The fetched snapshot must be the one the swarm serves, byte for byte, and verified against its
advertised param_hash; a swarm still at round 0 (every node on the same seeded init) is not
fetched, and a joiner that sees no peer gives up after its join timeout.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import timedelta

import pytest
import torch

from node.join import Prefetch
from protocol.membership.lineage import Lineage
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.node import SwarmNode
from tests.protocol.swarm.test_swarm_node import node_config, param_hash_of

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
