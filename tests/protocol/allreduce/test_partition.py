"""One-way partitions: a member cannot reach some live members, which can still reach it.

Such a member walks past the owners it cannot reach and takes their parts over, while those owners
(alive) reduce the same parts too. The contract is that every member that does not fall back ends
with bit-identical results, so at most one version of each part may ever be decoded. The partition
is injected deterministically in the client layer: the cut member's channels to the members it
cannot reach dial a closed port instead, so every connection attempt fails at once.
"""

from __future__ import annotations

from datetime import timedelta

import grpc.aio
import pytest
import torch
import uvloop

from protocol.allreduce import AllReduceConfig, AllReducePeer, AllReduceResult, GroupSpec
from protocol.allreduce.client import PeerClient
from protocol.codecs import get_codec
from tests.protocol.allreduce.support import FAST_CONFIG, allreduce_all, exact_mean, local_peers, members_of

NUM_ELEMENTS = 20_000
CLOSED_PORT_ADDRESS = "127.0.0.1:1"  # nothing listens on port 1: connecting is refused at once


class PartitionedClient(PeerClient):
    """A PeerClient that cannot connect to some addresses (its side of a one-way partition)."""

    def __init__(self, options: list[tuple[str, int]], unreachable: set[str]) -> None:
        super().__init__(options)
        self._unreachable = unreachable

    def channel(self, address: str) -> grpc.aio.Channel:
        return super().channel(CLOSED_PORT_ADDRESS if address in self._unreachable else address)


def cut_off(peer: AllReducePeer, unreachable: list[AllReducePeer], config: AllReduceConfig) -> None:
    """From now on `peer` cannot connect to the `unreachable` peers; they can still connect to it."""
    peer.client = PartitionedClient(config.grpc_options(server=False), {p.address for p in unreachable})


def run_partitioned(num_peers: int, cut_member: int, unreachable: list[int]) -> list[AllReduceResult]:
    generator = torch.Generator().manual_seed(num_peers)
    vectors = [torch.randn(NUM_ELEMENTS, generator=generator) * (i + 1) for i in range(num_peers)]

    async def scenario() -> tuple[GroupSpec, list[AllReduceResult]]:
        async with local_peers(num_peers) as peers:
            cut_off(peers[cut_member], [peers[i] for i in unreachable], FAST_CONFIG)
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            deadline = timedelta(seconds=8)
            return group, await allreduce_all(peers, vectors, group, get_codec("none"), deadline=deadline)

    group, results = uvloop.run(scenario())
    agreeing = [result for result in results if not result.fell_back]
    for index, result in enumerate(results):
        if result.fell_back:
            assert torch.equal(result.averaged, vectors[index])
    for result in agreeing:
        assert torch.equal(result.averaged, agreeing[0].averaged), [r.producers for r in agreeing]
        assert result.contributors == agreeing[0].contributors
        assert result.producers == agreeing[0].producers
        # Independent check: exactly torch's fp32 mean over the contributors the result names.
        reference = exact_mean(vectors, [1.0] * num_peers, group, result.contributors)
        assert torch.equal(result.averaged, reference)
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("num_peers", "cut_member", "unreachable"),
    [
        (4, 2, [0, 1]),  # the benchmark's failure in small: parts 0 and 1 reduced twice
        (4, 3, [0, 1]),
        (5, 3, [0, 1]),
    ],
)
def test_members_that_do_not_fall_back_agree_across_a_one_way_partition(
    num_peers: int, cut_member: int, unreachable: list[int]
) -> None:
    run_partitioned(num_peers, cut_member, unreachable)


@pytest.mark.timeout(60)
def test_a_first_backup_cut_from_its_owner_still_lets_everyone_finish() -> None:
    """Member 1 cannot reach owner 0: one of the two versions of part 0 reaches a majority (2 of 3)."""
    results = run_partitioned(3, 1, [0])
    assert not any(result.fell_back for result in results), [r.failures for r in results]
