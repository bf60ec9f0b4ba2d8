"""A synchronous facade for the training loop: serve snapshots and fetch one, without an event loop.

`SyncStateSync` runs a StateSyncServer on a uvloop event loop in a daemon thread (its own, or one
shared with other protocol pieces) and blocks the caller only for `fetch`:

    with SyncStateSync(host="0.0.0.0", port=0) as sync:
        if joining:
            snapshot = sync.fetch(peer_addresses, expected_state_id=param_hash,
                                  deadline=timedelta(minutes=10))
        ...
        sync.publish(Snapshot(round_id=r, state_id=param_hash, tensors=..., metadata=...))

`publish` does not block on the network and may be called from any thread.
"""

from __future__ import annotations

from datetime import timedelta
from types import TracebackType

from protocol.loop import BackgroundLoop
from protocol.statesync.config import DEFAULT_FETCH_OPTIONS, FetchOptions, StateSyncConfig
from protocol.statesync.faults import ServeFaultPlan
from protocol.statesync.fetch import FetchReport, fetch_state_with_report
from protocol.statesync.provider import StateProvider
from protocol.statesync.server import StateSyncServer
from protocol.statesync.snapshot import Snapshot

RESULT_MARGIN = timedelta(seconds=5)
"""How much longer than a fetch's deadline the caller waits before declaring the loop wedged."""


class SyncStateSync:
    """Blocking wrapper around a StateSyncServer and fetch_state; fetch from one thread at a time."""

    def __init__(
        self,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        config: StateSyncConfig | None = None,
        fault_plan: ServeFaultPlan | None = None,
        loop: BackgroundLoop | None = None,
        start_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        self._owns_loop = loop is None
        self._loop = loop or BackgroundLoop(name="statesync-loop")
        try:
            self._server = self._loop.run(
                StateSyncServer.start(host=host, port=port, config=config, fault_plan=fault_plan),
                start_timeout,
            )
        except BaseException:
            if self._owns_loop:
                self._loop.close()
            raise

    @property
    def address(self) -> str:
        """host:port other nodes fetch from."""
        return self._server.address

    @property
    def port(self) -> int:
        return self._server.port

    @property
    def provider(self) -> StateProvider:
        return self._server.provider

    def publish(self, snapshot: Snapshot) -> None:
        """Serve `snapshot` from now on (the previous one stays available for transfers under way)."""
        self._server.provider.publish(snapshot)

    def fetch_with_report(
        self,
        sources: list[str],
        *,
        expected_state_id: str | None,
        deadline: timedelta,
        options: FetchOptions = DEFAULT_FETCH_OPTIONS,
    ) -> FetchReport:
        """Blocking `fetch_state_with_report` (see there); returns or raises within deadline + RESULT_MARGIN."""
        coroutine = fetch_state_with_report(
            sources, expected_state_id=expected_state_id, deadline=deadline, options=options
        )
        return self._loop.run(coroutine, deadline + RESULT_MARGIN)

    def fetch(
        self,
        sources: list[str],
        *,
        expected_state_id: str | None,
        deadline: timedelta,
        options: FetchOptions = DEFAULT_FETCH_OPTIONS,
    ) -> Snapshot:
        """Blocking `fetch_state` (see there): the verified snapshot, or StateSyncError."""
        return self.fetch_with_report(
            sources, expected_state_id=expected_state_id, deadline=deadline, options=options
        ).snapshot

    def close(self, grace: timedelta | None = None) -> None:
        """Stop the server gracefully (transfers under way get `grace`), then the loop if we own it."""
        try:
            self._loop.run(self._server.stop(grace), (grace or timedelta(seconds=2)) + RESULT_MARGIN)
        finally:
            if self._owns_loop:
                self._loop.close()

    def __enter__(self) -> SyncStateSync:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
