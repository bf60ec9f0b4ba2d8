"""A fetch's end estimated from its progress (what a joiner announces while it syncs)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from protocol.statesync.progress import FetchEstimate


def test_the_rate_so_far_applied_to_what_is_left_at_most_once_per_period() -> None:
    ticks = iter([100.0, 100.0, 102.0, 102.5, 103.0, 104.0])  # monotonic: creation, then each call
    announced: list[float] = []
    estimate = FetchEstimate(announced.append, every=timedelta(seconds=1), clock=lambda: 5000.0,
                             monotonic=lambda: next(ticks))  # fmt: skip
    estimate(0, 1000)  # t=100: nothing verified yet, no rate: nothing said
    estimate(200, 1000)  # t=102: 100 bytes/s, 800 left -> 8 s from the clock's now
    estimate(300, 1000)  # t=102.5: within a second of the last: not said
    estimate(450, 1000)  # t=103: 150 bytes/s, 550 left
    estimate(1000, 1000)  # t=104: done (said even if it came early)
    assert announced == pytest.approx([5008.0, 5000.0 + 550 / 150, 5000.0])
