"""An owner serves its part only after every voter knows the part is committed.

Were it to serve a puller first and die mid-serve, the voters would hold a version nobody may use
(they were never told it is committed) and every member would fall back; the fault test with the
owner killed after its first served chunk (tests/protocol/allreduce/test_faults.py, serve_chunk) hit
that window now and then under load. Here the window is made wide on purpose: owner 0's commit tells
are held back, and no chunk of part 0 may reach anyone before they have all landed.

A voter settles a version once: it takes the commit notice, or it acts on the replica being stranded
(its producer taken for gone) and then refuses a late notice, which its producer counts as no taker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch
import uvloop

from protocol.allreduce import GroupSpec
from protocol.allreduce import allreduce as allreduce_module
from protocol.allreduce import round as round_module
from protocol.allreduce.round import RoundState
from protocol.codecs import get_codec
from protocol.errors import ProtocolError
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from tests.protocol.allreduce.support import (
    FAST_CONFIG,
    allreduce_all,
    exact_mean,
    local_peers,
    members_of,
    socket_free_round_state,
)

NUM_PEERS = 4
NUM_ELEMENTS = 40_000
HELD_BACK_SECONDS = 1.5  # how long owner 0 waits before each commit tell


@pytest.mark.timeout(60)
def test_no_chunk_of_a_part_is_served_before_its_voters_are_told(monkeypatch: pytest.MonkeyPatch) -> None:
    tells_done: list[float] = []  # when each of owner 0's commit tells landed
    first_chunk_of_part_0: dict[int, float] = {}  # puller -> when its first chunk of part 0 arrived
    real_push_replica = round_module.push_replica
    real_pull_average = allreduce_module.pull_average

    async def slow_commit_tells(
        state: Any, target: int, reduced: Any, deadline: float, **kwargs: Any
    ) -> None:
        committed = kwargs.get("committed", False)
        if committed and state.my_index == 0:
            await asyncio.sleep(HELD_BACK_SECONDS)
        await real_push_replica(state, target, reduced, deadline, **kwargs)
        if committed and state.my_index == 0:
            tells_done.append(time.monotonic())

    async def timed_pull(
        state: Any,
        target: int,
        part_index: int,
        deadline: float,
        decode_chunk: Callable[[pb.AverageHeader, int, int, bytes], Awaitable[None]],
    ) -> Any:
        async def decode(header: pb.AverageHeader, offset: int, size: int, payload: bytes) -> None:
            if part_index == 0:
                first_chunk_of_part_0.setdefault(state.my_index, time.monotonic())
            await decode_chunk(header, offset, size, payload)

        return await real_pull_average(state, target, part_index, deadline, decode)

    monkeypatch.setattr(round_module, "push_replica", slow_commit_tells)
    monkeypatch.setattr(allreduce_module, "pull_average", timed_pull)
    generator = torch.Generator().manual_seed(7)
    vectors = [torch.randn(NUM_ELEMENTS, generator=generator) * (i + 1) for i in range(NUM_PEERS)]

    async def scenario() -> tuple[GroupSpec, list[Any]]:
        async with local_peers(NUM_PEERS) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            return group, await allreduce_all(peers, vectors, group, get_codec("none"))

    group, results = uvloop.run(scenario())
    assert len(tells_done) == NUM_PEERS // 2  # owner 0's two voters (members 1 and 2) were told
    assert 3 in first_chunk_of_part_0, "member 3 (no voter of part 0) pulled part 0 from its owner"
    assert first_chunk_of_part_0[3] >= max(tells_done), (first_chunk_of_part_0, tells_done)
    for result in results:
        assert not result.fell_back, result.failures
        assert result.producers[0] == "p0"
        assert torch.equal(
            result.averaged, exact_mean(vectors, [1.0] * NUM_PEERS, group, result.contributors)
        )


def _voter_of_part_1(num_members: int) -> tuple[RoundState, pb.AverageHeader]:
    """Member 0 of a group, holding member 1's complete (not yet committed) replica of part 1."""
    state = socket_free_round_state(num_members, NUM_ELEMENTS, FAST_CONFIG)
    group, codec = state.group, state.codec
    size = group.part_num_elements(1)
    header = pb.AverageHeader(
        part_index=1, producer_index=1, codec=codec.spec(), num_elements=size,
        contributor_indices=list(range(num_members)), weight_sum=float(num_members),
    )  # fmt: skip
    return state, header


@pytest.mark.timeout(30)
@pytest.mark.parametrize("walked_on", [False, True])
def test_a_voter_that_walked_on_past_a_stranded_replica_refuses_its_late_commit(walked_on: bool) -> None:
    """The producer of part 1 failed us after we took its replica: the replica is stranded. A late
    commit notice (the producer was only frozen) is taken as long as nobody acted on it; once we walked
    on past it (our own chain walk, as a puller sent on would), it is refused with ABORTED and the
    replica is never served or used: the members that walked on may not be the only ones left out."""

    async def scenario() -> tuple[grpc.StatusCode, bool, bool]:
        state, header = _voter_of_part_1(5)
        state.open_replica(header, 1, committed=False)
        payload = get_codec("none").encode(torch.ones(header.num_elements)).numpy().tobytes()
        await state.add_replica_chunk(1, 0, header.num_elements, payload)
        state.complete_replica(1)
        state.mark_failed(1, "stalled")
        assert state.stranded(1)
        if walked_on:
            assert await state.wait_decided(1, time.monotonic() + 5) is None
        with pytest.raises(ProtocolError) as refusal:
            state.open_replica(header, 1, committed=True)
        part = state.parts[1]
        await state.client.close()
        return refusal.value.code, part.servable, state.stranded(1)

    code, servable, stranded = uvloop.run(scenario())
    if walked_on:
        assert code is grpc.StatusCode.ABORTED  # the producer counts it as no taker
        assert not servable and stranded
    else:
        assert code is grpc.StatusCode.ALREADY_EXISTS  # the notice is taken: it may be served and used
        assert servable and not stranded
