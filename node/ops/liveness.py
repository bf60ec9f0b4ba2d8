"""``RUN_DIR/liveness.json``: whether the training loop is alive and in the swarm, for a node that
listens on no port.

A ``--client-mode`` node serves no gRPC, so ``dtnode health`` cannot ask it for the standard health
status (``node/ops/health.py``); a container's HEALTHCHECK reads this file instead. The node's
:class:`LivenessSink` (a sink of :class:`~node.ops.metrics.MetricsWriter`, so it sees every step and
round record as it is written) replaces the file atomically: once at start, after every round record,
after the first step record and then at most once a second, and once more when the node stops::

    {"pid": 12, "state": "training", "round": 7, "step": 70,
     "time": 1764338400.0,              # the latest record (Unix time)
     "started": 1764338000.0,           # when this process's node began training (null: not yet)
     "last_shared": 1764338390.0,       # the latest round averaged with a peer or taken from the swarm
     "bound_seconds": 112.0, "bound": "2 x P + J + S = 2 x 33.5 + 15 + 30 s (P: ...)"}

:func:`liveness_verdict` reads it against the clock. Healthy while every one of these holds:

- **alive**: the latest record is at most B old. B = 2 x P + J + S is the bound within which a live
  node that can reach a peer writes a round record whatever else freezes or dies (ARCHITECTURE.md, "No
  stall under faults"): P the round period (the median wall time of the last 5 rounds; before the
  first, the inner phase measured so far, ``--inner-steps`` x the median step, or ``--round-seconds``,
  plus J for forming the group), J the join window (``--join-window``), S the all-reduce's stall
  timeout (30 s). Records come at least that often, since a step or a round record ends every wait.
  Before its first two steps the node is starting (joining, fetching the swarm's state, the start
  barrier, each up to ``--sync-deadline``): B is then 2 x ``--sync-deadline`` + J + S.
- **in the swarm**: its latest round with a peer (averaged with at least one other contribution, or
  the swarm's state adopted) is at most 2 x B old, counted from its first step (two rounds in a row
  that fell back or ran alone are allowed for; a swarm gone for longer is not).
- **running**: it has not stopped (``state`` is not ``stopped``).

So a node frozen (SIGSTOP), deadlocked or killed turns unhealthy within B, and one whose swarm is gone
within 2 x B. A whole state fetch longer than the round's bound (a joiner's, on a slow link, mid-run)
also reads as stuck while it lasts. Reading the file imports nothing heavy: a health check runs every
few seconds.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

LIVENESS_FILE = "liveness.json"
RECENT_ROUNDS = 5  # rounds whose median wall time is P
RECENT_STEPS = 32  # step intervals whose median is a step's time
STEP_WRITE_INTERVAL = timedelta(seconds=1)  # the file is replaced at most this often for step records
SWARM_BOUNDS = 2  # no round with a peer for this many B: out of the swarm


@dataclass(frozen=True, kw_only=True)
class LivenessBounds:
    """What the bound B is made of, from the node's settings."""

    inner_steps: int
    """``--inner-steps``: a phase's steps when rounds are due by steps."""
    round_seconds: float
    """``--round-seconds``: a phase's length when rounds are due by time (0: by steps)."""
    join_window: timedelta
    """J, ``--join-window``: what forming a group, and a fault in it, may add to a round."""
    stall_timeout: timedelta
    """S, the all-reduce's stall timeout: what a peer lost in the all-reduce may add to a round."""
    sync_deadline: timedelta
    """``--sync-deadline``: the longest a joiner's state fetch, or its start barrier, may take."""

    def __post_init__(self) -> None:
        if self.inner_steps < 1 or self.round_seconds < 0:
            raise ValueError(f"inner_steps must be >= 1 and round_seconds >= 0, got {self}")


class LivenessSink:
    """Keeps ``path`` (``RUN_DIR/liveness.json``) up to date from the node's metrics records.

    ``clock``: Unix time (injected by the tests). Written from the training thread only (the metrics
    writer's), each time as a whole new file renamed over the old one: a reader never sees half a file.
    """

    def __init__(self, path: Path, bounds: LivenessBounds, *, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.bounds = bounds
        self.clock = clock
        self._round_walls: deque[float] = deque(maxlen=RECENT_ROUNDS)
        self._step_intervals: deque[float] = deque(maxlen=RECENT_STEPS)
        self._previous_step: float | None = None  # when the last step record came, None after a round
        self._steps_seen = 0
        self._started: float | None = None
        self._last_shared: float | None = None
        self._last_written = -float("inf")
        self._stopped = False
        self._round = 0
        self._step = 0
        self._write(self.clock())

    def write(self, record: dict[str, Any]) -> None:
        now = self.clock()
        self._round, self._step = int(record.get("round") or 0), int(record.get("step") or 0)
        if record["kind"] == "step":
            self._steps_seen += 1
            first = self._started is None
            if first:
                self._started = now
            if self._previous_step is not None:  # an interval with no round record in it: one step's time
                self._step_intervals.append(now - self._previous_step)
            self._previous_step = now
            if not first and now - self._last_written < STEP_WRITE_INTERVAL.total_seconds():
                return
        elif record["kind"] == "round":
            self._previous_step = None  # the next interval holds the round's wait, not a step
            if record.get("seconds_wall") is not None:
                self._round_walls.append(float(record["seconds_wall"]))
            if shared_with_a_peer(record):
                self._last_shared = now
        self._write(now)

    def close(self) -> None:
        """The node stops: the file says so (a stopped node is not healthy)."""
        self._stopped = True
        self._write(self.clock())

    def bound(self) -> tuple[float, str]:
        """B in seconds, and how it was made (see the module's docstring)."""
        bounds = self.bounds
        join, stall = bounds.join_window.total_seconds(), bounds.stall_timeout.total_seconds()
        if self._round_walls:
            period = statistics.median(self._round_walls)
            how = f"the median of the last {len(self._round_walls)} rounds' wall time"
        elif self._step_intervals and self._steps_seen >= 2:
            if bounds.round_seconds > 0:
                phase, how = bounds.round_seconds, f"--round-seconds {bounds.round_seconds:g}"
            else:
                step = statistics.median(self._step_intervals)
                phase, how = bounds.inner_steps * step, f"{bounds.inner_steps} steps of {step:.3g} s"
            period, how = phase + join, f"no round yet: {how} + J"
        else:
            sync = bounds.sync_deadline.total_seconds()
            seconds = 2 * sync + join + stall
            return seconds, f"starting: 2 x {sync:g} + {join:g} + {stall:g} s (2 x --sync-deadline + J + S)"
        seconds = 2 * period + join + stall
        return seconds, f"2 x P + J + S = 2 x {period:.3g} + {join:g} + {stall:g} s (P: {how})"

    def _write(self, now: float) -> None:
        seconds, how = self.bound()
        record = {
            "pid": os.getpid(),
            "state": "stopped"
            if self._stopped
            else ("training" if self._started is not None else "starting"),
            "round": self._round,
            "step": self._step,
            "time": now,
            "started": self._started,
            "last_shared": self._last_shared,
            "bound_seconds": seconds,
            "bound": how,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        partial.write_text(json.dumps(record) + "\n")
        os.replace(partial, self.path)
        self._last_written = now


def shared_with_a_peer(record: dict[str, Any]) -> bool:
    """A round record of a round this node shared with the swarm: averaged with at least one other
    node's contribution, or the swarm's state adopted (not solo, not fallen back to its own Δ)."""
    if record.get("adopted"):
        return True
    return not record.get("solo") and not record.get("fell_back") and int(record.get("peers") or 0) >= 2


def read_liveness(run_dir: Path) -> dict[str, Any] | None:
    """The node's liveness record in ``run_dir``, None if there is none (or it cannot be read)."""
    try:
        record = json.loads((run_dir / LIVENESS_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def liveness_verdict(record: dict[str, Any] | None, now: float) -> tuple[bool, str]:
    """(healthy, why) for a liveness record read at Unix time ``now`` (the rules of the docstring)."""
    if record is None:
        return False, f"no {LIVENESS_FILE} (the node has not started here)"
    try:
        bound = float(record["bound_seconds"])
        age = now - float(record["time"])
        state = str(record["state"])
        started = None if record.get("started") is None else float(record["started"])
        last_shared = None if record.get("last_shared") is None else float(record["last_shared"])
        where = f"round {int(record['round'])} step {int(record['step'])}"
    except (KeyError, TypeError, ValueError) as error:
        return False, f"{LIVENESS_FILE} is malformed ({error!r})"
    if state == "stopped":
        return False, f"stopped at {where}"
    if age > bound:
        return False, f"stuck: no step or round for {age:.0f} s (bound {bound:.0f} s: {record.get('bound')})"
    if started is None:  # no step yet: joining, fetching the swarm's state, at the start barrier
        return True, f"starting; last record {age:.0f} s ago (bound {bound:.0f} s)"
    since_shared = now - (started if last_shared is None else last_shared)
    if since_shared > SWARM_BOUNDS * bound:
        return False, (
            f"out of the swarm: no round with a peer for {since_shared:.0f} s "
            f"(bound {SWARM_BOUNDS} x {bound:.0f} s) at {where}"
        )
    shared = "none yet" if last_shared is None else f"{since_shared:.0f} s ago"
    return (
        True,
        f"training at {where}; last record {age:.0f} s ago (bound {bound:.0f} s), round with a peer {shared}",
    )
