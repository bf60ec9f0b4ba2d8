"""When a node's inner phase is over: after H steps, or after ``--round-seconds``, and not while a
node fetches our lineage's state.

Rounds due by time let nodes of uneven speeds reach each round together, each contributing the
tokens it trained (the mean is weighted by tokens): a fast node never idles at the barrier for a
slow one, and a slow one is never left out (hivemind's target batch size and Psyche's fixed time
windows are the same idea). With ``--overlap`` such a phase also runs on until the round in flight
has landed, so a link slower than the phase never blocks the training thread: the round simply lasts
longer. In either case a phase runs on while a node is fetching our lineage's state to join it
(``SwarmSession.lineage_peer_due``), at most ``MAX_DUE_WAIT`` longer, so that it joins this round
instead of arriving one round late.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from node.config import NodeConfig

log = logging.getLogger("dtnode")

MAX_DUE_WAIT = timedelta(minutes=2)
"""The longest an inner phase runs past its end while a node fetches our lineage's state."""


class PhaseClock:
    """The inner phase under way: its monotonic start, its first step, and since when it runs past its
    end because a node is fetching our state."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.started: float | None = None  # None: the first phase of this process (or after a resume)
        self.start_step = 0
        self._extended_since: float | None = None

    def restart(self, step: int) -> None:
        """The next phase starts now, at inner step ``step``."""
        self.started, self.start_step, self._extended_since = time.monotonic(), step, None

    def due(
        self, progress: Any, *, pending_done: Callable[[], bool], peer_due: Callable[[], bool] | None
    ) -> bool:
        """Whether the phase is over (see the module docstring). ``progress``: the loop's counters;
        ``pending_done``: the round in flight (overlap) has landed; ``peer_due``: a node is fetching
        our lineage's state (None without a swarm)."""
        config = self.config
        now = time.monotonic()
        if self.started is None:
            self.started = now - progress.round_compute_seconds
            self.start_step = progress.step - progress.step % config.inner_steps
        if config.round_seconds:
            if progress.round_tokens == 0 or now - self.started < config.round_seconds:
                return False
            if not pending_done():  # overlap: train on until the round in flight lands
                return False
        elif progress.step - self.start_step < config.inner_steps:
            return False
        if peer_due is None or not peer_due():
            return True
        if self._extended_since is None:
            self._extended_since = now
            log.info("a node is fetching our lineage's state: training on until it joins")
        return now - self._extended_since >= MAX_DUE_WAIT.total_seconds()
