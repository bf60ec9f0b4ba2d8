"""A uvloop event loop on a daemon thread, for synchronous callers (the node's training loop).

Every protocol facade that the daemon calls from its own thread (the all-reduce peer, state sync)
runs its grpc.aio servers and calls on one of these; the daemon can share one loop between them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from datetime import timedelta
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


class BackgroundLoop:
    """A uvloop event loop on a daemon thread; `run()` executes a coroutine there and waits for it."""

    def __init__(self, name: str = "allreduce-loop") -> None:
        self.loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._run_forever, name=name, daemon=True)
        self._thread.start()

    def _run_forever(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: timedelta) -> T:
        """Run the coroutine on the loop; TimeoutError (and the coroutine is cancelled) after `timeout`."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout.total_seconds())
        except FutureTimeoutError as error:
            future.cancel()
            raise TimeoutError(f"background loop did not finish within {timeout}") from error

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Start the coroutine on the loop without waiting; cancel the returned future to stop it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self, timeout: timedelta = timedelta(seconds=10)) -> None:
        """Stop the loop and join its thread."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout.total_seconds())
        if not self._thread.is_alive():
            self.loop.close()
