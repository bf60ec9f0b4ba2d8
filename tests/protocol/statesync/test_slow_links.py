"""fetch_state over the slowest uplink state sync supports, time-scaled: a slow live source finishes,
a frozen one is still dropped within the stall window.

The promise (protocol/statesync/config.py) is made at 1 Mbit/s with a 15 s stall window. Here both
are scaled by the same factor so a test takes seconds: a 1 s stall window and 15 Mbit/s links
(`SlowLink`, a user-space proxy per provider). The ratio that matters, how long a chunk takes to
cross the link against the stall window, is the real one. With 4 MiB chunks (the fetcher's default
until 2026-11-28) one chunk took 2.2 s here, 33.6 s at 1 Mbit/s: every source looked stalled.
The providers and the fetcher run with their default chunk and range sizes.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import uvloop

from protocol.statesync import (
    FetchOptions,
    FetchReport,
    ServeFaultPlan,
    StateSyncConfig,
    StateSyncError,
    fetch_state_with_report,
)
from protocol.statesync.config import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_FETCH_OPTIONS,
    DEFAULT_FETCH_STALL_TIMEOUT,
    SLOWEST_LINK_BYTES_PER_SECOND,
    STALL_MARGIN,
)
from tests.machine_load import stretched
from tests.protocol.statesync.slow_link import SlowLink
from tests.protocol.statesync.support import MiB, assert_identical, make_snapshot, providers

STALL = timedelta(seconds=1)
SCALE = DEFAULT_FETCH_STALL_TIMEOUT / STALL  # 15: time runs 15 times faster than on the real link
LINK_BYTES_PER_SECOND = SLOWEST_LINK_BYTES_PER_SECOND * SCALE  # 1.875 MB/s
OLD_CHUNK_BYTES = 4 * MiB
"""The fetcher's and provider's chunk until 2026-11-28."""

# 4 MiB of params, 1 MiB of momentum: the params' one range is a single 4 MiB chunk at the old size.
SNAPSHOT = make_snapshot(num_params=MiB)
# Defaults but the stall windows (scaled) and a short grace.
CONFIG = StateSyncConfig(stall_timeout=2 * STALL, server_grace=timedelta(milliseconds=100))
OPTIONS = FetchOptions(stall_timeout=STALL)


async def _fetch_through_slow_links(
    fault_plans: list[ServeFaultPlan | None],
) -> tuple[FetchReport | StateSyncError, float, list[str], list[int]]:
    """Fetch SNAPSHOT from one provider per plan, each behind its own slow link. Returns the report
    (or the error), the seconds it took, the links' addresses and the bytes each link carried."""
    async with providers(len(fault_plans), SNAPSHOT, config=CONFIG, fault_plans=fault_plans) as servers:
        links = [SlowLink(server.address, bytes_per_second=LINK_BYTES_PER_SECOND) for server in servers]
        for link in links:
            await link.__aenter__()
        try:
            addresses = [link.address for link in links]
            started = time.monotonic()
            outcome: FetchReport | StateSyncError
            try:
                outcome = await fetch_state_with_report(
                    addresses,
                    expected_state_id=SNAPSHOT.state_id,
                    deadline=timedelta(seconds=60),
                    options=OPTIONS,
                )
            except StateSyncError as error:
                outcome = error
            return outcome, time.monotonic() - started, addresses, [link.num_bytes_sent for link in links]
        finally:
            for link in links:
                await link.__aexit__(None, None, None)


def test_the_default_chunks_cross_the_slowest_link_well_inside_the_stall_window() -> None:
    # The fetcher's streams to one source share its uplink: a chunk of each crosses before the next.
    seconds = DEFAULT_FETCH_OPTIONS.max_parallel * DEFAULT_CHUNK_BYTES / SLOWEST_LINK_BYTES_PER_SECOND
    assert seconds * STALL_MARGIN <= DEFAULT_FETCH_STALL_TIMEOUT.total_seconds()
    assert SLOWEST_LINK_BYTES_PER_SECOND == 1_000_000 / 8  # 1 Mbit/s, the link the promise names


@pytest.mark.timeout(30)
def test_a_fetch_over_the_slowest_link_completes_where_one_old_chunk_outlasts_the_stall_window() -> None:
    assert OLD_CHUNK_BYTES / LINK_BYTES_PER_SECOND > 2 * STALL.total_seconds()  # the case that failed

    report, elapsed, _, carried = uvloop.run(_fetch_through_slow_links([None, None]))

    assert isinstance(report, FetchReport), report
    assert_identical(report.snapshot, SNAPSHOT)
    assert not report.excluded
    # The links were really that slow: the snapshot crossed the two links (both carried a share of it)
    # no faster than their rate together.
    assert sum(carried) >= SNAPSHOT.num_bytes and all(n >= MiB for n in carried), carried
    assert elapsed >= SNAPSHOT.num_bytes / (2 * LINK_BYTES_PER_SECOND)


@pytest.mark.timeout(30)
def test_a_source_frozen_mid_range_on_a_slow_link_is_dropped_and_the_other_finishes() -> None:
    # Provider 0 freezes (sockets open, nothing sent) at its 9th chunk, in the middle of a range.
    plans = [ServeFaultPlan(point="chunk", action="stall", after=8), None]

    report, elapsed, addresses, _ = uvloop.run(_fetch_through_slow_links(plans))

    assert isinstance(report, FetchReport), report
    assert_identical(report.snapshot, SNAPSHOT)
    assert list(report.excluded) == [addresses[0]]
    assert report.excluded[addresses[0]].startswith("stalled")
    # All of it crossed the live link once, plus one stall window: not the 60 s deadline.
    bound = SNAPSHOT.num_bytes / LINK_BYTES_PER_SECOND + STALL.total_seconds()
    assert elapsed < bound + stretched(3.0)


@pytest.mark.timeout(30)
def test_a_lone_frozen_source_on_a_slow_link_fails_within_a_stall_window() -> None:
    plans: list[ServeFaultPlan | None] = [ServeFaultPlan(point="chunk", action="stall", after=8)]

    error, elapsed, _, _ = uvloop.run(_fetch_through_slow_links(plans))

    assert isinstance(error, StateSyncError), error
    assert "every source failed" in str(error) and "stalled" in str(error)
    # Nine chunks cross, then one stall window, not the 60 s deadline.
    assert elapsed < 9 * DEFAULT_CHUNK_BYTES / LINK_BYTES_PER_SECOND + STALL.total_seconds() + stretched(3.0)
