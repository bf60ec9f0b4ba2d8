"""Suite-wide test hygiene and the order in which parallel workers take the tests.

``scripts/test.sh`` runs the suite on several pytest-xdist workers with ``--dist loadgroup``: each
test (or each ``xdist_group``, for modules whose tests share an expensive module fixture, such as a
running swarm) goes to the next idle worker, in collection order. Long tests taken last leave one
worker running them while the others idle, so collection puts the tests that declare the longest
``timeout`` first (longest-first scheduling; the declared timeout is the suite's own estimate of a
test's weight), keeping the collection order among equals.

Tests that call ``node.ops.cli.main`` in-process let it install its SIGINT/SIGTERM handlers (a node
finishes its step on a signal); left in place, they would swallow the Ctrl-C or SIGTERM meant for
pytest itself, so each test gets the handlers it started with back; and no test starts with
SIGINT or SIGTERM ignored at the process level, which its child processes would inherit.

The suite runs more workers than the machine has cores, so torch's intra-op threads only oversubscribe
them: on a loaded 2-core machine a second thread mostly spins in OpenMP's barriers (measured: a test of
in-process training 20.6 -> 2.9 CPU-seconds on one thread). Every worker computes on one thread, and so
does every process it starts (``OMP_NUM_THREADS``, unless the caller set it): a node's own ``--threads``
still wins.

A test's ``timeout`` is read as seconds on an idle machine: pytest-timeout's timer here is a
``tests.machine_load.LoadScaledDeadline``, which stretches it by the load the test runs under (a
compile that takes 55 s alone took over 600 s beside six busy workers), so a bound fails a test that
hangs, not one that shared the machine.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported here or in any child

import torch  # noqa: E402 - after the environment torch reads at import

from tests.machine_load import LoadScaledDeadline  # noqa: E402

_RESTORED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _declared_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return 0.0  # the ini default, not an estimate: the short unit tests
    seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0.0)
    return float(seconds or 0.0)


def pytest_configure(config: pytest.Config) -> None:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_declared_timeout, reverse=True)  # stable: collection order among equals


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout's timer with ``settings.timeout`` as idle-machine seconds (``tests/machine_load.py``).
    It ends the test as pytest-timeout would: with the "signal" method a failure raised in the test's
    thread, with "thread" (or off the main thread) a stack dump and the worker's exit."""
    import pytest_timeout

    def as_failed(wall_seconds: float) -> Any:  # what the failure message quotes as the timeout
        return settings._replace(timeout=f"{settings.timeout:g}s on an idle machine, {wall_seconds:.0f}")

    if settings.method == "signal" and threading.current_thread() is threading.main_thread():
        main_thread = threading.get_ident()
        expired_after: list[float] = []

        def on_alarm(signum: int, frame: FrameType | None) -> None:
            __tracebackhide__ = True
            pytest_timeout.timeout_sigalrm(item, as_failed(expired_after[0] if expired_after else 0.0))

        def expire(wall_seconds: float) -> None:
            expired_after.append(wall_seconds)
            signal.pthread_kill(main_thread, signal.SIGALRM)

        previous = signal.signal(signal.SIGALRM, on_alarm)
        deadline = LoadScaledDeadline(settings.timeout, expire)

        def cancel() -> None:
            deadline.cancel()  # joined: no alarm is sent after this
            signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)

        item.cancel_timeout = cancel  # type: ignore[attr-defined]  # pytest-timeout's cancel hook calls it
    else:
        deadline = LoadScaledDeadline(
            settings.timeout, lambda wall_seconds: pytest_timeout.timeout_timer(item, as_failed(wall_seconds))
        )
        item.cancel_timeout = deadline.cancel  # type: ignore[attr-defined]
    return True


def _ignored_by_the_process(signum: int) -> bool:
    """Whether the kernel has ``signum`` ignored here (children inherit that, and Python keeps it)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signum - 1)))
    return False  # no /proc: nothing to check


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    # An ignored SIGINT/SIGTERM is inherited by every child a test starts, so its Ctrl-C tests could
    # never pass: a suite started in the background by a non-interactive shell (`bash scripts/test.sh &`)
    # begins with SIGINT ignored, and C code can leave it so behind Python's back.
    for signum, default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
        if _ignored_by_the_process(signum):
            signal.signal(signum, default)
    saved = {signum: signal.getsignal(signum) for signum in _RESTORED_SIGNALS}
    yield
    for signum, handler in saved.items():
        if handler is not None and signal.getsignal(signum) is not handler:  # None: not set from Python
            signal.signal(signum, handler)
