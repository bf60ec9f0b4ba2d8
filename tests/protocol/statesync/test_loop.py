"""The blocking facade, as the training loop uses it: serve, join, fall behind and re-sync."""

from __future__ import annotations

from datetime import timedelta

import pytest

from protocol.loop import BackgroundLoop
from protocol.statesync import StateSyncError, SyncStateSync
from tests.protocol.statesync.support import FETCH_OPTIONS, TEST_CONFIG, MiB, assert_identical, make_snapshot


@pytest.mark.timeout(30)
def test_join_then_resync_after_falling_behind() -> None:
    first = make_snapshot(seed=3, round_id=10, num_params=MiB)
    second = make_snapshot(seed=4, round_id=11, num_params=MiB)
    shared = BackgroundLoop(name="test-statesync")
    try:
        with (
            SyncStateSync(host="127.0.0.1", config=TEST_CONFIG) as old_a,
            SyncStateSync(host="127.0.0.1", config=TEST_CONFIG, loop=shared) as old_b,
            SyncStateSync(host="127.0.0.1", config=TEST_CONFIG, loop=shared) as joiner,
        ):
            sources = [old_a.address, old_b.address]
            for node in (old_a, old_b):
                node.publish(first)
            joined = joiner.fetch(
                sources, expected_state_id=None, deadline=timedelta(seconds=10), options=FETCH_OPTIONS
            )
            assert_identical(joined, first)
            joiner.publish(joined)  # the joiner now serves what it fetched

            # The swarm moves on; the joiner fell behind and re-syncs the same way, also from the
            # third node, which still serves only the older state and is left out.
            for node in (old_a, old_b):
                node.publish(second)
            report = joiner.fetch_with_report(
                [*sources, joiner.address],
                expected_state_id=second.state_id,
                deadline=timedelta(seconds=10),
                options=FETCH_OPTIONS,
            )
            assert_identical(report.snapshot, second)
            assert list(report.excluded) == [joiner.address]
            with pytest.raises(StateSyncError, match="no source serves 'unknown'"):
                joiner.fetch(sources, expected_state_id="unknown", deadline=timedelta(seconds=5))
    finally:
        shared.close()
