"""Suite-wide test hygiene and the order in which parallel workers take the tests.

``scripts/test.sh`` runs the suite on several pytest-xdist workers with ``--dist loadgroup``: each
test (or each ``xdist_group``, for modules whose tests share an expensive module fixture, such as a
running swarm) goes to the next idle worker, in collection order. Long tests taken last leave one
worker running them while the others idle, so collection puts the tests that declare the longest
``timeout`` first (longest-first scheduling; the declared timeout is the suite's own estimate of a
test's weight), keeping the collection order among equals.

Tests that call ``node.cli.main`` in-process let it install its SIGINT/SIGTERM handlers (a node
finishes its step on a signal); left in place, they would swallow the Ctrl-C or SIGTERM meant for
pytest itself, so each test gets the handlers it started with back.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

_RESTORED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _declared_timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return 0.0  # the ini default, not an estimate: the short unit tests
    seconds = marker.args[0] if marker.args else marker.kwargs.get("timeout", 0.0)
    return float(seconds or 0.0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_declared_timeout, reverse=True)  # stable: collection order among equals


@pytest.fixture(autouse=True)
def _restore_signal_handlers() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in _RESTORED_SIGNALS}
    yield
    for signum, handler in saved.items():
        if handler is not None and signal.getsignal(signum) is not handler:  # None: not set from Python
            signal.signal(signum, handler)
