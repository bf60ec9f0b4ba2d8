"""fetch_state against real providers on loopback: parallel sources, deaths, stalls, corruption, lies,
snapshots replaced mid-transfer. Faults fire at counted chunks or manifests (ServeFaultPlan), never
after a sleep; every fetched snapshot is compared byte for byte with the one published."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
import torch
import uvloop

from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.gen.dtnode.v1 import statesync_pb2_grpc as pb_grpc
from protocol.statesync import (
    FetchOptions,
    FetchReport,
    ServeFaultPlan,
    Snapshot,
    StateSyncConfig,
    StateSyncError,
    fetch_state,
    fetch_state_with_report,
)
from protocol.statesync.config import MAX_CHUNKS_PER_RANGE
from tests.machine_load import stretched
from tests.protocol.statesync.support import (
    FETCH_OPTIONS,
    TEST_CONFIG,
    MiB,
    assert_identical,
    make_snapshot,
    providers,
)

SNAPSHOT = make_snapshot()  # ~21 MB; built once (hashing takes a moment)


async def _fetch(
    addresses: list[str],
    *,
    expected: str | None = SNAPSHOT.state_id,
    deadline: timedelta = timedelta(seconds=20),
    **knobs: Any,
) -> FetchReport:
    options = replace(FETCH_OPTIONS, **knobs)
    return await fetch_state_with_report(
        addresses, expected_state_id=expected, deadline=deadline, options=options
    )


@pytest.mark.timeout(30)
def test_three_providers_in_parallel_give_the_exact_snapshot_and_all_serve() -> None:
    async def scenario() -> tuple[FetchReport, list[int]]:
        async with providers(3, SNAPSHOT) as servers:
            report = await _fetch([s.address for s in servers], expected=None)
            return report, [s.provider.num_ranges_served for s in servers]

    report, ranges_served = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert report.snapshot.sha256("global_params").hex() == SNAPSHOT.state_id  # the param_hash
    assert all(n > 0 for n in ranges_served), ranges_served
    assert all(n > 0 for n in report.bytes_by_source.values()), report.bytes_by_source
    assert sum(report.bytes_by_source.values()) == SNAPSHOT.num_bytes
    assert report.excluded == {}


@pytest.mark.timeout(30)
def test_a_round_mean_of_one_small_tensor_comes_from_both_of_its_sources() -> None:
    """A 0.93 MB tensor (a nano model's int8 round mean) with the default blocks and ranges: both
    sources send part of it. Before, it was one 4 MiB block, hence one range, and one source sent
    every byte of it (8 s at 1 Mbit/s where two would take 4)."""
    payload = torch.randint(0, 256, (934_056,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    mean = Snapshot(
        round_id=5, state_id="round-mean:x", tensors={"round_mean_payload": payload}, metadata=b"{}"
    )

    async def scenario() -> FetchReport:
        async with providers(2, mean) as servers:
            return await _fetch([s.address for s in servers], expected=mean.state_id)

    report = uvloop.run(scenario())
    assert_identical(report.snapshot, mean)
    assert all(n >= 64 * 1024 for n in report.bytes_by_source.values()), report.bytes_by_source
    assert sum(report.bytes_by_source.values()) == mean.num_bytes
    assert mean.block_bytes == 64 * 1024


@pytest.mark.timeout(30)
@pytest.mark.parametrize("action", ["die", "abort"])
def test_a_provider_failing_mid_transfer_is_replaced_by_the_others(action: str) -> None:
    plans = [None, ServeFaultPlan(point="chunk", action=action, after=5), None]

    async def scenario() -> FetchReport:
        async with providers(3, SNAPSHOT, fault_plans=plans) as servers:
            return await _fetch([s.address for s in servers])

    report = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    [(failed, reason)] = report.excluded.items()
    assert "UNAVAILABLE" in reason
    assert sum(report.bytes_by_source.values()) == SNAPSHOT.num_bytes


@pytest.mark.timeout(30)
def test_a_provider_whose_server_stops_mid_transfer_is_replaced_without_waiting_for_the_stall_timeout() -> (
    None
):
    # Provider 1 freezes at its 4th chunk; at that exact point the test stops its gRPC server for real.
    plans = [None, ServeFaultPlan(point="chunk", action="stall", after=3), None]

    async def scenario() -> tuple[FetchReport, float, str]:
        async with providers(3, SNAPSHOT, fault_plans=plans) as servers:

            async def kill_at_fault() -> None:
                await servers[1].provider.fault_fired.wait()
                await servers[1].stop(timedelta(0))

            killer = asyncio.create_task(kill_at_fault())
            started = time.monotonic()
            report = await _fetch([s.address for s in servers], stall_timeout=timedelta(seconds=60))
            elapsed = time.monotonic() - started
            await killer
            return report, elapsed, servers[1].address

    report, elapsed, killed = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert list(report.excluded) == [killed]
    assert elapsed < 15  # the connection loss was noticed, not a 60 s stall timeout


@pytest.mark.timeout(30)
def test_corrupt_bytes_are_caught_by_the_block_hash_and_fetched_from_honest_providers() -> None:
    plans = [None, None, ServeFaultPlan(point="chunk", action="corrupt", after=2)]

    async def scenario() -> tuple[FetchReport, str]:
        async with providers(3, SNAPSHOT, fault_plans=plans) as servers:
            return await _fetch([s.address for s in servers]), servers[2].address

    report, liar = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert list(report.excluded) == [liar]
    assert report.excluded[liar].startswith("corrupt")


@pytest.mark.timeout(30)
def test_a_source_advertising_a_wrong_manifest_is_outvoted() -> None:
    plans = [ServeFaultPlan(point="manifest", action="corrupt"), None, None]

    async def scenario() -> tuple[FetchReport, str]:
        async with providers(3, SNAPSHOT, fault_plans=plans) as servers:
            return await _fetch([s.address for s in servers], expected=None), servers[0].address

    report, liar = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert list(report.excluded) == [liar] and "disagrees" in report.excluded[liar]
    assert report.bytes_by_source[liar] == 0


@pytest.mark.timeout(30)
def test_all_providers_stalled_fail_fast_with_a_clear_error() -> None:
    plans = [ServeFaultPlan(point="chunk", action="stall", after=n) for n in (0, 3, 6)]

    async def scenario() -> float:
        async with providers(3, SNAPSHOT, fault_plans=plans) as servers:
            started = time.monotonic()
            with pytest.raises(StateSyncError, match="every source failed.*stalled.*stalled.*stalled"):
                await _fetch([s.address for s in servers], stall_timeout=timedelta(milliseconds=500))
            return time.monotonic() - started

    assert uvloop.run(scenario()) < 5  # three stall timeouts in parallel, not the 20 s deadline


@pytest.mark.timeout(30)
def test_stalled_providers_and_a_long_stall_timeout_end_at_the_deadline() -> None:
    plans = [ServeFaultPlan(point="chunk", action="stall", after=2)] * 2

    async def scenario() -> float:
        async with providers(2, SNAPSHOT, fault_plans=plans) as servers:
            started = time.monotonic()
            with pytest.raises(StateSyncError, match="did not finish within"):
                await _fetch(
                    [s.address for s in servers],
                    deadline=timedelta(seconds=2),
                    stall_timeout=timedelta(seconds=60),
                )
            return time.monotonic() - started

    elapsed = uvloop.run(scenario())
    # Ended by the 2 s deadline, not by the 60 s stall timeout: 1.5 s of slack on an idle machine
    # (at most 15 s on a loaded one).
    assert 2.0 <= elapsed < 2.0 + stretched(1.5)


@pytest.mark.timeout(30)
def test_all_providers_dead_fail_within_the_deadline() -> None:
    async def scenario() -> float:
        async with providers(3, SNAPSHOT) as servers:
            addresses = [s.address for s in servers]
            for server in servers:
                await server.stop(timedelta(0))
            started = time.monotonic()
            with pytest.raises(StateSyncError, match="no source serves.*UNAVAILABLE"):
                await _fetch(addresses, deadline=timedelta(seconds=5))
            return time.monotonic() - started

    assert uvloop.run(scenario()) < 5


@pytest.mark.timeout(30)
def test_a_publish_mid_transfer_lets_the_transfer_finish_from_the_previous_snapshot() -> None:
    newer = make_snapshot(seed=1, round_id=8, num_params=MiB)
    plans = [ServeFaultPlan(point="chunk", action="pause", after=3)]

    async def scenario() -> tuple[FetchReport, list[str]]:
        async with providers(1, SNAPSHOT, fault_plans=plans) as [server]:

            async def publish_at_pause() -> None:
                await server.provider.fault_fired.wait()
                server.provider.publish(newer)  # SNAPSHOT becomes the previous one, still kept
                server.provider.resume()

            publisher = asyncio.create_task(publish_at_pause())
            report = await _fetch([server.address], max_parallel=2)
            await publisher
            return report, server.provider.kept_state_ids

    report, kept = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert kept == [newer.state_id, SNAPSHOT.state_id]
    assert report.excluded == {}


@pytest.mark.timeout(30)
def test_a_snapshot_dropped_while_fetched_is_served_until_its_fetch_ends_then_not_found() -> None:
    # Source 0 pauses in the middle of its first range; meanwhile it publishes two newer snapshots,
    # so SNAPSHOT is no longer among the two kept. A fetcher still takes it, so source 0 keeps serving
    # it: the next ranges come from source 0 too (before, they got NOT_FOUND: on a slow link a fetch
    # that outlasted two rounds failed at 98% and began again on a newer state). Once nobody has
    # fetched it for the stall timeout, the next publish drops it: a fresh fetch gets NOT_FOUND from
    # source 0 and falls back to source 1.
    newer = [make_snapshot(seed=s, round_id=7 + s, num_params=MiB) for s in (1, 2, 3)]
    plans = [ServeFaultPlan(point="chunk", action="pause", after=3), None]
    config = replace(TEST_CONFIG, stall_timeout=timedelta(seconds=1))

    async def scenario() -> tuple[FetchReport, list[str], list[str], str]:
        async with providers(2, SNAPSHOT, config=config, fault_plans=plans) as servers:
            first = servers[0]

            async def publish_at_pause() -> None:
                await first.provider.fault_fired.wait()
                for snapshot in newer[:2]:
                    first.provider.publish(snapshot)
                first.provider.resume()

            publisher = asyncio.create_task(publish_at_pause())
            report = await _fetch([first.address], max_parallel=1)  # source 0 alone
            await publisher
            kept_while_fetched = first.provider.kept_state_ids
            await asyncio.sleep(1.5)  # nobody fetches SNAPSHOT for longer than the stall timeout
            first.provider.publish(newer[2])
            again = await _fetch([s.address for s in servers])
            assert_identical(again.snapshot, SNAPSHOT)
            assert "GetManifest: NOT_FOUND" in again.excluded[first.address]
            return report, kept_while_fetched, first.provider.kept_state_ids, first.address

    report, kept_while_fetched, kept_after, first = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert report.excluded == {} and report.bytes_by_source[first] == SNAPSHOT.num_bytes
    assert kept_while_fetched == [newer[1].state_id, newer[0].state_id, SNAPSHOT.state_id]
    assert kept_after == [newer[2].state_id, newer[1].state_id]


@pytest.mark.timeout(30)
def test_a_busy_provider_is_retried_not_dropped() -> None:
    async def scenario() -> tuple[FetchReport, int, int]:
        config = replace(TEST_CONFIG, max_concurrent_transfers=1)
        async with providers(1, SNAPSHOT, config=config) as [server]:
            report = await _fetch([server.address], max_parallel=4)
            provider = server.provider
            return report, provider.num_ranges_served, provider.num_refusals["RESOURCE_EXHAUSTED"]

    report, ranges_served, num_busy = uvloop.run(scenario())
    assert_identical(report.snapshot, SNAPSHOT)
    assert report.excluded == {}
    assert num_busy > 0  # four streams asked of a provider that serves one at a time
    assert ranges_served == len(range(0, 16 * MiB, 2 * MiB)) + len(range(0, 4 * MiB, 2 * MiB)) + 1


@pytest.mark.timeout(30)
def test_ranges_are_cut_to_the_chunk_bound_a_provider_enforces() -> None:
    # Small chunks asked, large ranges allowed: 4 MiB in 512-byte chunks would take 8192 chunks, more
    # than a provider serves per FetchRange (INVALID_ARGUMENT); the fetcher cuts 2 MiB ranges instead.
    small = make_snapshot(num_params=MiB)  # 4 MiB of params, 1 MiB of momentum
    config = StateSyncConfig(
        max_chunk_bytes=1024, max_range_bytes=4 * MiB, stall_timeout=timedelta(seconds=5)
    )

    async def scenario() -> tuple[FetchReport, int]:
        async with providers(1, small, config=config) as [server]:
            report = await _fetch(
                [server.address], expected=small.state_id, chunk_bytes=512, range_bytes=4 * MiB
            )
            return report, server.provider.num_refusals["INVALID_ARGUMENT"]

    report, num_refused = uvloop.run(scenario())
    assert_identical(report.snapshot, small)
    assert report.excluded == {} and num_refused == 0
    assert 512 * MAX_CHUNKS_PER_RANGE == 2 * MiB


def test_a_provider_whose_own_ranges_take_too_many_chunks_is_a_config_error() -> None:
    # It would refuse, as "tiny chunks", a range it advertises in the chunks it caps.
    with pytest.raises(ValueError, match="max_range_bytes"):
        StateSyncConfig(max_chunk_bytes=1024, max_range_bytes=1024 * MAX_CHUNKS_PER_RANGE + 1)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("sources", "knobs"),
    [
        ([], {}),
        (["a:1", "a:1"], {}),
        (["a:1"], {"max_parallel": 0}),
        (["a:1"], {"chunk_bytes": 0}),
        (["a:1"], {"range_bytes": -1}),
        (["a:1"], {"deadline": timedelta(0)}),
        (["a:1"], {"stall_timeout": timedelta(0)}),
    ],
)
def test_bad_arguments_are_value_errors(sources: list[str], knobs: dict[str, Any]) -> None:
    deadline = knobs.pop("deadline", timedelta(seconds=1))
    with pytest.raises(ValueError):
        uvloop.run(
            fetch_state(sources, expected_state_id=None, deadline=deadline, options=FetchOptions(**knobs))
        )


@pytest.mark.timeout(30)
def test_a_companion_is_served_by_its_own_id_beside_its_snapshot_and_dropped_with_it() -> None:
    companion = make_snapshot(seed=1, num_params=MiB // 4, state_id="round-mean:" + SNAPSHOT.state_id)
    newer, newest = make_snapshot(seed=2, round_id=8), make_snapshot(seed=3, round_id=9)

    config = replace(TEST_CONFIG, stall_timeout=timedelta(seconds=1))

    async def scenario() -> tuple[FetchReport, FetchReport, list[list[str]], str]:
        async with providers(2, None, config=config) as servers:
            for server in servers:
                server.provider.publish(SNAPSHOT, companions=[companion])
            addresses = [s.address for s in servers]
            newest_offered = await _fetch(addresses, expected=None)  # the snapshot, never its companion
            fetched = await _fetch(addresses, expected=companion.state_id)
            kept = [servers[0].provider.kept_state_ids]
            servers[0].provider.publish(newer)  # the previous publish is kept whole
            kept.append(servers[0].provider.kept_state_ids)
            await asyncio.sleep(1.5)  # the fetches above ended more than a stall timeout ago
            servers[0].provider.publish(newest)
            kept.append(servers[0].provider.kept_state_ids)
            try:
                await _fetch(addresses[:1], expected=companion.state_id, deadline=timedelta(seconds=5))
            except StateSyncError as error:
                gone = str(error)
            else:
                gone = ""
            return newest_offered, fetched, kept, gone

    newest_offered, fetched, kept, gone = uvloop.run(scenario())
    assert_identical(newest_offered.snapshot, SNAPSHOT)
    assert_identical(fetched.snapshot, companion)
    assert sum(fetched.bytes_by_source.values()) == companion.num_bytes
    assert kept == [
        [SNAPSHOT.state_id, companion.state_id],
        [newer.state_id, SNAPSHOT.state_id, companion.state_id],
        [newest.state_id, newer.state_id],
    ]
    assert "no longer keep" in gone


@pytest.mark.timeout(30)
def test_companions_outlive_their_snapshot_for_num_companions_kept_publishes() -> None:
    """num_snapshots_kept 2, num_companions_kept 4 (a node with --fragments 2): after four more
    publishes the first publish's state is gone but its round mean is still fetched; after one more
    the mean is gone too. Before, companions were dropped with their snapshot."""
    states = [make_snapshot(seed=10 + i, round_id=i, num_params=MiB // 16) for i in range(6)]
    means = [
        make_snapshot(seed=20 + i, round_id=i, num_params=MiB // 64, state_id=f"round-mean:{i}")
        for i in range(6)
    ]
    config = replace(TEST_CONFIG, num_companions_kept=4)

    async def scenario() -> tuple[list[list[str]], FetchReport, str]:
        async with providers(1, None, config=config) as (server,):
            kept = []
            for state, mean in zip(states[:5], means[:5], strict=True):
                server.provider.publish(state, companions=[mean])
                kept.append(server.provider.kept_state_ids)
            fetched = await _fetch([server.address], expected=means[1].state_id)
            server.provider.publish(states[5], companions=[means[5]])
            kept.append(server.provider.kept_state_ids)
            try:
                await _fetch([server.address], expected=means[1].state_id, deadline=timedelta(seconds=5))
            except StateSyncError as error:
                return kept, fetched, str(error)
            return kept, fetched, ""

    kept, fetched, gone = uvloop.run(scenario())
    assert kept[4] == [states[4].state_id, means[4].state_id, states[3].state_id, means[3].state_id,
                       means[2].state_id, means[1].state_id]  # fmt: skip
    assert_identical(fetched.snapshot, means[1])
    assert kept[5] == [states[5].state_id, means[5].state_id, states[4].state_id, means[4].state_id,
                       means[3].state_id, means[2].state_id]  # fmt: skip
    assert "no longer keep" in gone
    with pytest.raises(ValueError, match="num_companions_kept"):
        replace(TEST_CONFIG, num_companions_kept=1)


def test_a_companion_needs_its_own_state_id() -> None:
    from protocol.statesync.provider import StateProvider

    with pytest.raises(ValueError, match="distinct state ids"):
        StateProvider(TEST_CONFIG).publish(SNAPSHOT, companions=[SNAPSHOT])


@pytest.mark.timeout(30)
def test_a_state_is_served_lately_while_any_of_its_ranges_still_streams() -> None:
    """A fetcher streams several ranges of one state at once. The first range to end must not mark
    the state idle while another still streams: ``served_lately`` is what holds a node's phase for
    the joiner it sends its state to (``participation.peer_due``). Before, the first stream to end
    overwrote the "in flight" mark, and 2 s later (``within``) the node ended its phase mid-fetch."""
    plans = [ServeFaultPlan(point="chunk", action="pause", after=0)]  # the first chunk sent pauses its stream
    within = 0.2

    async def scenario() -> list[bool]:
        async with providers(1, SNAPSHOT, fault_plans=plans) as [server]:
            provider, seen = server.provider, []
            async with grpc.aio.insecure_channel(server.address) as channel:
                stub = pb_grpc.StateSyncStub(channel)

                async def fetch_range(offset: int) -> int:
                    request = pb.FetchRangeRequest(
                        state_id=SNAPSHOT.state_id, tensor_name="global_params", offset=offset,
                        length=MiB, max_chunk_bytes=256 * 1024,
                    )  # fmt: skip
                    return sum([len(message.data) async for message in stub.FetchRange(request, timeout=20)])

                paused = asyncio.create_task(fetch_range(0))
                await provider.fault_fired.wait()  # the first stream holds its first chunk
                assert await fetch_range(MiB) == MiB  # a second range of the same state streams and ends
                await asyncio.sleep(3 * within)
                seen.append(provider.served_lately(within))  # the first still streams
                provider.resume()
                assert await paused == MiB
                seen.append(provider.served_lately(within))  # just ended
                await asyncio.sleep(3 * within)
                seen.append(provider.served_lately(within))  # idle for longer than `within`
            return seen

    assert uvloop.run(scenario()) == [True, True, False]
