"""How loaded this machine is, and a wall-clock deadline that stretches with the load.

The suite runs where its users run it: on 2 cores shared by six pytest-xdist workers and whatever
else the machine does (a load of 5-17 on a CI box). There CPU-bound work takes about
``runnable tasks / cores`` times as long as alone, so a wall-clock bound picked on a quiet machine
measures the machine, not the code. The suite reads a test's ``@pytest.mark.timeout(seconds)`` as
*seconds on an idle machine* and runs it on a :class:`LoadScaledDeadline` (``tests/conftest.py``): a
test that hangs still fails, at most ``MAX_LOAD_FACTOR`` times later than on an idle machine.

The load factor is ``max(1-minute load average, tasks runnable right now) / usable cores``, at least
1: the average alone lags a minute behind a load that has just risen (a suite's first tests start
before its workers have raised it), the instantaneous count alone is noisy.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

MAX_LOAD_FACTOR = 10.0
"""The most a deadline stretches: load 17 on 2 cores (measured on a CI box) is a factor of 8.5."""


def load_factor() -> float:
    """How many times longer than on an idle machine CPU-bound work takes now (1 to MAX_LOAD_FACTOR)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:  # "0.61 0.42 0.30 3/210 17608": averages over 1, 5, 15 min; runnable / all tasks; last pid
        fields = Path("/proc/loadavg").read_text().split()
        runnable = int(fields[3].split("/")[0]) - 1  # not counting the thread reading this
        load = max(float(fields[0]), float(runnable))
    except (OSError, IndexError, ValueError):  # no /proc: the averages alone
        load = os.getloadavg()[0]
    return min(MAX_LOAD_FACTOR, max(1.0, load / cores))


def stretched(idle_seconds: float) -> float:
    """``idle_seconds`` of the machine's own slack (after a deadline the code keeps, say), as long as the
    load now makes them: a bound that ``code_seconds + stretched(slack)`` keeps tells the code's
    deadline from a longer one only while ``MAX_LOAD_FACTOR * slack`` stays short of the longer one."""
    return idle_seconds * load_factor()


class LoadScaledDeadline:
    """Calls ``expire(wall_seconds)`` once, when ``seconds`` of idle-machine time have passed: wall time
    divided by the load factor, sampled every ``poll`` seconds by a daemon thread. ``cancel`` stops it
    (after it returns ``expire`` is not called)."""

    def __init__(
        self,
        seconds: float,
        expire: Callable[[float], None],
        *,
        poll: float = 1.0,
        load: Callable[[], float] = load_factor,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if seconds <= 0 or poll <= 0:
            raise ValueError(f"seconds and poll must be positive, got {seconds} and {poll}")
        self.seconds = seconds
        self._expire, self._poll, self._load, self._clock = expire, poll, load, clock
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"deadline {seconds:g}s", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = last = self._clock()
        progress = 0.0  # idle-machine seconds so far
        while True:
            factor = self._load()
            # At this load the deadline is (seconds - progress) * factor away: wake then, or sooner to resample.
            if self._cancelled.wait(min(self._poll, (self.seconds - progress) * factor)):
                return
            now = self._clock()
            progress += (now - last) / factor
            last = now
            if progress >= self.seconds:
                if not self._cancelled.is_set():
                    self._expire(now - started)
                return

    def cancel(self) -> None:
        self._cancelled.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
