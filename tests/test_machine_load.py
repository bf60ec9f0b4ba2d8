"""The suite's load-scaled timeouts (tests/machine_load.py, tests/conftest.py): the deadline stretches
by the load factor and no further, and a test that hangs still fails."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.machine_load import MAX_LOAD_FACTOR, LoadScaledDeadline, load_factor

REPO_ROOT = Path(__file__).resolve().parents[1]


class TickingClock:
    """Advances one second each time it is read: the deadline's own arithmetic, not the machine's pace."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def run_deadline(seconds: float, loads: list[float]) -> float:
    """The wall seconds after which a deadline of ``seconds`` expires while the load factor reads ``loads``
    in turn (the last one from then on)."""
    expired = threading.Event()
    wall: list[float] = []
    readings = iter(loads)

    def load() -> float:
        return next(readings, loads[-1])

    def expire(wall_seconds: float) -> None:
        wall.append(wall_seconds)
        expired.set()

    LoadScaledDeadline(seconds, expire, poll=1e-4, load=load, clock=TickingClock())
    assert expired.wait(10)
    return wall[0]


@pytest.mark.timeout(20)
def test_the_deadline_is_idle_machine_seconds_times_the_load() -> None:
    assert run_deadline(5, [1.0]) == 5  # idle: the declared seconds
    assert run_deadline(5, [2.0]) == 10  # two runnable tasks per core: twice as long
    # The load rose while it ran: 1 s at factor 1, then 4 s of idle-machine time at factor 4.
    assert run_deadline(5, [1.0, 4.0]) == 1 + 4 * 4


@pytest.mark.timeout(20)
def test_a_cancelled_deadline_never_expires() -> None:
    expired = threading.Event()
    deadline = LoadScaledDeadline(0.2, lambda wall_seconds: expired.set())
    deadline.cancel()
    assert not expired.wait(0.5)


def test_the_load_factor_is_bounded() -> None:
    assert 1.0 <= load_factor() <= MAX_LOAD_FACTOR


@pytest.mark.timeout(120)
def test_a_test_that_hangs_still_fails_by_its_timeout(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "from tests.conftest import pytest_timeout_set_timer  # noqa: F401\n"
    )
    (tmp_path / "test_hang.py").write_text(
        "import time, pytest\n\n@pytest.mark.timeout(1)\ndef test_hangs():\n    time.sleep(300)\n"
    )
    finished = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=100,  # a hang that the timer missed: 300 s
    )
    assert finished.returncode == 1, finished.stdout + finished.stderr
    assert "Timeout (>1s on an idle machine" in finished.stdout, finished.stdout
