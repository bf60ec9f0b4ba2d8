"""When a fetch will end, from its progress so far: what a joiner announces while it syncs."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta


class FetchEstimate:
    """A fetch's ``on_progress`` hook that turns its progress into the time the fetch should end
    on ``clock``: the rate so far (counted from this object's creation, just before the fetch, so
    its manifests' round trips make the estimate rather late than early) applied to what is left,
    handed to ``announce`` at most once per ``every`` and once more at the end."""

    def __init__(
        self,
        announce: Callable[[float], None],
        *,
        every: timedelta,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._announce = announce
        self._every = every.total_seconds()
        self._clock, self._monotonic = clock, monotonic
        self._started = monotonic()
        self._next = self._started

    def __call__(self, verified: int, total: int) -> None:
        now = self._monotonic()
        if verified <= 0 or (now < self._next and verified < total):
            return
        self._next = now + self._every
        remaining = (total - verified) * (now - self._started) / verified
        self._announce(self._clock() + remaining)
