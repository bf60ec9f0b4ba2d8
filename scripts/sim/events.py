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
from typing import Protocol


class Event:
    """One scheduled callback; ``cancel()`` makes the queue skip it."""

    __slots__ = ("action", "at", "cancelled")

    def __init__(self, at: float, action: Callable[[], None]) -> None:
        self.at = at
        self.action = action
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class ScheduledEvent(Protocol):
    """What the queue needs of an event: when it runs, whether it is cancelled, and its action."""

    at: float

    @property
    def cancelled(self) -> bool: ...

    def action(self) -> None: ...


class EventQueue:
    """Simulated time and what happens next (``heapq``; see the module docstring)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        # (time, sequence, event): tuples compare in C, and the sequence breaks ties in schedule order
        self._heap: list[tuple[float, int, Event | ScheduledEvent]] = []
        self._sequence = itertools.count()
        self.num_events_run = 0

    def at(self, when: float, action: Callable[[], None]) -> Event:
        """Run ``action`` at simulated time ``when`` (now, if ``when`` is in the past)."""
        if when < self.now:
            when = self.now
        event = Event(when, action)
        heapq.heappush(self._heap, (when, next(self._sequence), event))
        return event

    def schedule(self, event: ScheduledEvent, when: float) -> None:
        """Run ``event`` (again) at ``when`` (now, if in the past): for an event object that is
        scheduled many times, as a node's heartbeat is (no new ``Event`` per run)."""
        if when < self.now:
            when = self.now
        event.at = when
        heapq.heappush(self._heap, (when, next(self._sequence), event))

    def after(self, delay: float, action: Callable[[], None]) -> Event:
        return self.at(self.now + delay, action)

    def run_until(self, end: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Run events in time order until simulated time ``end``, or until ``stop()`` is true."""
        heap = self._heap
        while heap and heap[0][0] <= end and not stop():
            at, _, event = heapq.heappop(heap)
            if event.cancelled:
                continue
            self.now = at
            self.num_events_run += 1
            event.action()
        if not stop():
            self.now = max(self.now, end)

    def __len__(self) -> int:
        return len(self._heap)
