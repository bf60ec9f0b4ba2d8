"""An owner serves its part only after every voter knows the part is committed.

Were it to serve a puller first and die mid-serve, the voters would hold a version nobody may use
(they were never told it is committed) and every member would fall back; the fault test with the
owner killed after its first served chunk (tests/protocol/allreduce/test_faults.py, serve_chunk) hit
that window now and then under load. Here the window is made wide on purpose: owner 0's commit tells
are held back, and no chunk of part 0 may reach anyone before they have all landed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
import uvloop

from protocol.allreduce import GroupSpec
from protocol.allreduce import allreduce as allreduce_module
from protocol.allreduce import round as round_module
from protocol.codecs import get_codec
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from tests.protocol.allreduce.support import allreduce_all, exact_mean, local_peers, members_of

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
