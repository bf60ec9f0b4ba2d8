"""Paced fragment rounds (``--pace-sends``): how long an overlapped fragment round may take to send.

A fragment's round overlaps the next τ inner steps (Streaming DiLoCo, Douillard et al. 2025): the loop
needs its mean only after step s_r + τ. Sent at full link rate it fills a capped uplink for as long as
its bytes take and leaves it idle for the rest of the τ steps, so the link's busiest second is its cap
whatever F. Spread over those steps instead (the paper's "rate = its bytes / (τ × step time)") the
same bytes keep the link's peak near that rate:

    send window = PACE_MARGIN × τ × (median inner-step time of the last STEP_TIMES_KEPT steps)

The swarm side turns the window into a rate once the round's group is formed, from the bytes this
node sends in it (``protocol/allreduce/pace.py``, ``member_send_bytes``: its contributions and its
part's average to each other member), and the protocol paces the round's chunk writes at that rate,
never past the round's deadlines. The margin leaves the rest of the τ steps for what is not sending:
forming the group, the last chunks' way through the slowest member, the outer step and the served
state built after it. A round the loop has to wait on (it did not land by s_r + τ, or it is the
run's last) stays paced: its rest at full rate would fill the link for a second or more, the peak
pacing is for. Only a node asked to stop sends the rest at full rate (``SwarmSide.lift_pace``).
Pacing changes when bytes go, never which, so a paced swarm ends on the param_hash an unpaced one
does.
"""

from __future__ import annotations

import statistics
from collections import deque
from datetime import timedelta

PACE_MARGIN = 0.6
"""The share of the τ overlapped steps' time a fragment round's sends are spread over. Measured on
4 tiny nodes at 20 Mbit/s, F = 4, τ = 2 (BENCHMARKS.md, "Streamed fragments in the daemon: peak
bandwidth"): 0.6 lowered the busiest second to 0.82x of unpaced for ~15 s more waiting on rounds a
node in a 280 s run; 0.8 to 0.69x for ~45 s (rounds took their window plus ~2 s of forming and
applying, and step times there vary 2-6 s, so a longer window lands late more often)."""

STEP_TIMES_KEPT = 8
"""Inner steps whose times the window is measured from (the median: an eval or a checkpoint at one
step boundary does not stretch it)."""

MIN_STEP_TIMES = 2
"""Fewer steps measured (a run's first round): no window, the round is sent at full rate."""


class StepTimes:
    """The last inner steps' durations, in seconds."""

    def __init__(self, kept: int = STEP_TIMES_KEPT) -> None:
        self._seconds: deque[float] = deque(maxlen=kept)

    def add(self, seconds: float) -> None:
        if seconds > 0:
            self._seconds.append(seconds)

    def median(self) -> float | None:
        """The median step time, None before MIN_STEP_TIMES steps."""
        return statistics.median(self._seconds) if len(self._seconds) >= MIN_STEP_TIMES else None


def send_window(
    step_seconds: float | None, overlap_steps: int, margin: float = PACE_MARGIN
) -> timedelta | None:
    """How long a round overlapped with ``overlap_steps`` steps of ``step_seconds`` spreads its sends
    over: ``margin`` of their time. None (full rate) for a synchronous round or no step time yet."""
    if not 0 < margin <= 1:
        raise ValueError(f"the pace margin must be in (0, 1], got {margin}")
    if step_seconds is None or step_seconds <= 0 or overlap_steps <= 0:
        return None
    return timedelta(seconds=margin * overlap_steps * step_seconds)
