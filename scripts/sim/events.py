"""The simulator's clock: one event queue (a binary heap) and the simulated time it advances.

Every simulated thing that happens later (a message arrives, a DHT record becomes visible, a
formation's deadline passes, a node crashes) is a callback scheduled at a simulated time. The queue
pops them in time order; ties are broken by the order they were scheduled in, so a run is a pure
function of its seed (no wall clock, no hash order). Simulated time is seconds, a ``float``, the
same unit the product's state machines take as ``now``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True)
class Event:
    """One scheduled callback; ``cancel()`` makes the queue skip it."""

    at: float
    sequence: int
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class EventQueue:
    """Simulated time and what happens next (``heapq``; see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._heap: list[Event] = []
        self._sequence = itertools.count()
        self.num_events_run = 0

    def at(self, when: float, action: Callable[[], None]) -> Event:
        """Run ``action`` at simulated time ``when`` (now, if ``when`` is in the past)."""
        event = Event(max(when, self.now), next(self._sequence), action)
        heapq.heappush(self._heap, event)
        return event

    def after(self, delay: float, action: Callable[[], None]) -> Event:
        return self.at(self.now + delay, action)

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order until simulated time ``end``, or until ``stop()`` is true."""
        while self._heap and self._heap[0].at <= end and not stop():
            event = heapq.heappop(self._heap)
            if event.cancelled:
                continue
            self.now = event.at
            self.num_events_run += 1
            event.action()
        if not stop():
            self.now = max(self.now, end)

    def __len__(self) -> int:
        return len(self._heap)
