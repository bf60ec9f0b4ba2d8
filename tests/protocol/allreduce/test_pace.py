"""Paced sends (protocol/allreduce/pace.py): a round's chunk writes capped in bytes per second on real
gRPC peers on loopback, the cap relaxed so the round still meets its deadlines, and lifted at once."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
import torch
import uvloop

from protocol.allreduce import AllReduceResult, GroupSpec, Member
from protocol.allreduce import round as round_module
from protocol.allreduce.pace import SendPace, member_send_bytes
from protocol.codecs import get_codec
from tests.protocol.allreduce.support import FAST_CONFIG, allreduce_all, local_peers, members_of

NUM_ELEMENTS = 65_536  # fp32: 256 KiB a vector, 16 chunks of FAST_CONFIG's 4096 numbers


class RecordingPace(SendPace):
    """A SendPace that notes when each write was let through and how many bytes it carried."""

    made: list[RecordingPace] = []

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.writes: list[tuple[float, int]] = []
        RecordingPace.made.append(self)

    async def admit(self, num_bytes: int, deadline: float) -> None:
        await super().admit(num_bytes, deadline)
        self.writes.append((time.monotonic(), num_bytes))


@pytest.fixture
def recorded_paces(monkeypatch: pytest.MonkeyPatch) -> list[RecordingPace]:
    RecordingPace.made = []
    monkeypatch.setattr(round_module, "SendPace", RecordingPace)
    return RecordingPace.made


def _members(num_members: int) -> list[Member]:
    """Members as local_peers names them (addresses never dialled: only the group's parts matter)."""
    return [Member(peer_id=f"p{i}", address=f"127.0.0.1:{i + 1}") for i in range(num_members)]


def _vectors(num_peers: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(NUM_ELEMENTS, generator=generator) for _ in range(num_peers)]


def _rounds(
    num_peers: int, codec_name: str, send_rates: list[float | None], deadline: timedelta
) -> list[tuple[list[AllReduceResult], float]]:
    """One round per rate on the same peers and vectors: (every member's result, wall seconds)."""
    vectors = _vectors(num_peers)

    async def scenario() -> list[tuple[list[AllReduceResult], float]]:
        out = []
        async with local_peers(num_peers) as peers:
            for round_id, rate in enumerate(send_rates):
                group = GroupSpec.build(
                    round_id=round_id, members=members_of(peers), num_elements=NUM_ELEMENTS
                )
                started = time.monotonic()
                results = await allreduce_all(
                    peers, vectors, group, get_codec(codec_name), deadline=deadline, send_rate=rate
                )
                out.append((results, time.monotonic() - started))
        return out

    return uvloop.run(scenario())


@pytest.mark.timeout(60)
def test_a_paced_round_sends_at_its_rate_and_averages_the_same_numbers(
    recorded_paces: list[RecordingPace],
) -> None:
    rate = 128 * 1024.0  # bytes per second: member_send_bytes (256 KiB fp32, 2 members) in ~2 s
    (unpaced, _), (paced, seconds) = _rounds(2, "none", [None, rate], timedelta(seconds=20))
    for before, after in zip(unpaced, paced, strict=True):
        assert not after.fell_back, after.failures
        assert torch.equal(after.averaged, before.averaged)  # pacing moves bytes later, never others
    assert torch.equal(paced[0].averaged, torch.stack(_vectors(2)).mean(dim=0))

    group = GroupSpec.build(round_id=1, members=_members(2), num_elements=NUM_ELEMENTS)
    codec = get_codec("none")
    assert len(recorded_paces) == 2
    for index, pace in enumerate(recorded_paces):
        # Every payload byte the member wrote went through its pace: its contribution to the other
        # part and its own part's average (here as the replica), as the formula counts them.
        expected = member_send_bytes(group, index, codec, FAST_CONFIG.chunk_num_elements)
        assert expected == 2 * (NUM_ELEMENTS // 2) * 4
        assert pace.bytes_admitted == sum(n for _, n in pace.writes) == expected
        assert not pace.lifted
        # Bytes over time: never more than one burst ahead of the rate in any stretch of the round.
        start = pace.writes[0][0]
        burst = pace.burst_bytes
        for i, (t_i, _) in enumerate(pace.writes):
            sent_by_then = sum(n for _, n in pace.writes[: i + 1])
            assert sent_by_then <= burst + rate * (t_i - start) + 16 * 1024, (i, sent_by_then, t_i - start)
    # The whole round: at least (bytes - burst) / rate (the cap), and not much longer (the sends are
    # all it waits for on loopback; slack for a loaded machine).
    minimum = (2 * (NUM_ELEMENTS // 2) * 4 - recorded_paces[0].burst_bytes) / rate
    assert 0.95 * minimum <= seconds <= 2 * minimum + 3.0, seconds


@pytest.mark.timeout(60)
def test_a_pace_too_slow_for_the_deadline_is_relaxed_and_the_round_still_averages(
    recorded_paces: list[RecordingPace],
) -> None:
    # At 1 KiB/s the round's 256 KiB a member would take 256 s, and one chunk's wait is capped at a
    # quarter of the 2 s stall timeout (16 chunks: 8 s): both past the 4 s deadline. Relaxed, the
    # bytes are planned to go by 0.8 of the reduce-scatter phase (1.6 s).
    deadline = timedelta(seconds=4)
    (unpaced, _), (paced, seconds) = _rounds(3, "int8", [None, 1024.0], deadline)
    for before, after in zip(unpaced, paced, strict=True):
        assert not after.fell_back, after.failures
        assert torch.equal(after.averaged, before.averaged)
    assert seconds < deadline.total_seconds(), seconds
    for pace in recorded_paces:
        assert pace.writes[-1][0] <= pace.finish_by + 0.5  # (the last write went by its plan)
        assert pace.bytes_admitted == pace.total_bytes


def test_the_rate_is_relaxed_only_when_the_bytes_left_would_miss_finish_by() -> None:
    now = [100.0]
    pace = SendPace(
        rate=1000.0, total_bytes=10_000, finish_by=120.0, burst_bytes=0, max_wait=5.0, clock=lambda: now[0]
    )
    assert pace.rate_now(100) == 1000.0  # 10,000 B in 20 s fits at 1,000 B/s
    now[0] = 115.0
    assert pace.rate_now(100) == pytest.approx(10_000 / 5.0)  # 5 s left: 2,000 B/s
    now[0] = 120.0
    assert pace.rate_now(100) is None  # finish_by passed: not paced
    now[0] = 110.0
    pace.lift()
    assert pace.rate_now(100) is None
    with pytest.raises(ValueError, match="positive rate"):
        SendPace(rate=0.0, total_bytes=1, finish_by=1.0, burst_bytes=0, max_wait=1.0)


@pytest.mark.timeout(20)
def test_lift_lets_a_waiting_write_go_at_once() -> None:
    async def scenario() -> tuple[float, float]:
        pace = SendPace(
            rate=100.0, total_bytes=1000, finish_by=time.monotonic() + 600, burst_bytes=0, max_wait=60.0
        )
        started = time.monotonic()
        waiting = asyncio.ensure_future(pace.admit(1000, time.monotonic() + 600))  # 10 s at the rate
        await asyncio.sleep(0.2)
        pace.lift()
        await asyncio.wait_for(waiting, 5)
        lifted_after = time.monotonic() - started
        await asyncio.wait_for(pace.admit(10_000, time.monotonic() + 600), 1)  # lifted: no wait at all
        return lifted_after, pace.seconds_waited

    lifted_after, waited = uvloop.run(scenario())
    assert lifted_after < 2.0
    assert 0.1 < waited < 2.0


def test_member_send_bytes_of_a_sparse_round_counts_the_bundled_average() -> None:
    # Hand-counted: parts of 3 members over 30 numbers, 10 each; int8 blocks of 64 take 10 + 4 bytes a
    # part (one fp32 scale), top-k keeps its own sizes: a member sends its contribution to 2 parts and
    # its part's average to 2 members, and a sparse average bundles 3 contributions.
    group = GroupSpec.build(round_id=0, members=_members(3), num_elements=30)
    int8 = get_codec("int8")
    assert int8.encoded_num_bytes(10) == 14
    assert member_send_bytes(group, 0, int8, 4096) == 2 * 14 + 2 * 14
    topk = get_codec("topk")
    part = topk.encoded_num_bytes(10)
    assert member_send_bytes(group, 1, topk, 4096) == 2 * part + 2 * 3 * part


@pytest.mark.timeout(60)
def test_lift_paces_sends_the_rest_of_a_paced_round_at_full_rate(recorded_paces: list[RecordingPace]) -> None:
    # 256 KiB a member at 16 KiB/s: 16 s paced; lifted after 0.5 s, it ends in about that.
    vectors = _vectors(2)

    async def scenario() -> tuple[list[AllReduceResult], float]:
        async with local_peers(2) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            started = time.monotonic()
            running = asyncio.ensure_future(
                allreduce_all(
                    peers,
                    vectors,
                    group,
                    get_codec("none"),
                    deadline=timedelta(seconds=50),
                    send_rate=16 * 1024.0,
                )
            )
            await asyncio.sleep(0.5)
            for peer in peers:
                peer.lift_paces()
            results = await running
            return results, time.monotonic() - started

    results, seconds = uvloop.run(scenario())
    assert all(not r.fell_back for r in results)
    assert torch.equal(results[0].averaged, torch.stack(vectors).mean(dim=0))
    assert seconds < 5.0, seconds
    assert len(recorded_paces) == 2 and all(pace.lifted for pace in recorded_paces)
