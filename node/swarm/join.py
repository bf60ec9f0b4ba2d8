"""A fresh joiner fetches the swarm's state while it builds its model and data.

A node joining a running swarm must hold the swarm's global state (about 8 bytes per parameter:
fp32 params and outer momentum) before its first useful inner step. The fetch does not need the
model, only the DHT view and the state sources; the corpus and the model take seconds to build.
So a fresh node (no checkpoint in its run dir, hence round 0) starts the fetch on a thread as soon
as its swarm side is up, and ``SwarmSession.start`` takes the result once the trainer exists, if
the fetched lineage is still the one it must adopt.

Only a swarm past round 0 is fetched ahead: at round 0 every node holds the same seeded init
params (the same lineage), which only the trainer's param_hash can confirm.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from protocol.membership.lineage import LineageDecision
from protocol.statesync.errors import StateSyncError
from protocol.statesync.fetch import FetchReport
from protocol.swarm.node import SwarmNode

log = logging.getLogger(__name__)

JOIN_TIMEOUT = timedelta(seconds=30)
"""How long a joiner waits to see a peer of the run in the DHT before it trains alone."""

# A fresh node's param_hash is unknown until its model exists; this stand-in is never published.
_UNKNOWN_HASH = "0" * 64


class Prefetch:
    """The swarm's canonical state, fetched on a background thread (see the module docstring)."""

    def __init__(self, swarm: SwarmNode, *, join_timeout: timedelta) -> None:
        self.swarm = swarm
        self.join_timeout = join_timeout
        self.decision: LineageDecision | None = None
        self.report: FetchReport | None = None
        self._thread = threading.Thread(target=self._run, name="dtnode-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        view = self.swarm.wait_for_peers(1, self.join_timeout)
        if not [p for p in view if p.peer_id != self.swarm.peer_id]:
            return
        decision = self.swarm.lineage(round=0, param_hash=_UNKNOWN_HASH)
        if decision.in_canonical or decision.canonical.round == 0:
            return
        log.info("joining: adopting the swarm's state (round %d, param_hash %s) from %d source(s)",
                 decision.canonical.round, decision.canonical.param_hash[:12],
                 len(decision.sync_sources))  # fmt: skip
        try:
            self.report = self.swarm.fetch_state(decision, announce=True)
            self.decision = decision
        except (StateSyncError, ValueError, TimeoutError) as error:
            log.warning("could not fetch the swarm's state ahead (joining): %s", error)

    def result(self) -> tuple[LineageDecision, FetchReport] | None:
        """Wait for the fetch (bounded by the join timeout and the sync deadline); None if none was made."""
        budget = self.join_timeout + self.swarm.config.sync_deadline + self.swarm.config.dht_call_timeout
        started = time.monotonic()
        self._thread.join(budget.total_seconds())
        if self._thread.is_alive():
            log.warning(
                "the state fetch ahead did not end within %.0fs; fetching again", budget.total_seconds()
            )
            return None
        log.debug("prefetch joined after %.2fs", time.monotonic() - started)
        if self.decision is None or self.report is None:
            return None
        return self.decision, self.report
