"""How long the training thread waits for a round under the daemon's schedules, and the utilization.

The simulated nodes train a phase, then form the round and average (``node.py``): the round's
seconds ``C`` (formation, the all-reduce, the waits for records) all come after the phase, which is
the daemon's default, synchronous schedule. The daemon can hide them behind training
(``node/outer/round.py``; ARCHITECTURE.md, "Overlap" and "Streamed fragments"):

- synchronous (no flag): the loop waits for the whole round, ``exposed = C``;
- ``--overlap`` (whole model): phase k's round runs on the averaging thread while phase k+1 trains;
  at phase k+1's end the loop waits for it (``OuterRound._end_phase``), then hands Δ_{k+1} over:
  ``exposed = max(0, C - phase)`` (the round is hidden whole when it fits in a phase);
- ``--fragments F --overlap-steps τ``: a fragment's round goes in flight every H/F steps and lands
  τ steps later, the loop waiting for it there if it has not (``OuterRound._land_fragment``):
  ``exposed = max(0, C_f - τ · step)``, ``C_f`` the round of one fragment's vector.

Compute utilization is the daemon's figure (``node/ops/metrics.py``): inner compute over the wall
seconds of a round record, ``phase / (phase + exposed)``.

The model assumes that a round lasts as long beside training as alone: the simulator counts CPU as
free, and a real node's averaging thread shares the host with the inner steps (on CPU, a round in
the background took 14.5 s instead of 8.7 s: BENCHMARKS.md, "Utilization with and without overlap").
"""

from __future__ import annotations


def exposed_seconds(round_seconds: float, hidden_seconds: float) -> float:
    """The part of a round the training thread waits for, when ``hidden_seconds`` of training run
    beside it (0 for a synchronous round, the phase with ``--overlap``, τ steps with fragments)."""
    if round_seconds < 0 or hidden_seconds < 0:
        raise ValueError("round_seconds and hidden_seconds must be >= 0")
    return max(0.0, round_seconds - hidden_seconds)


def utilization(phase_seconds: float, round_seconds: float, hidden_seconds: float) -> float:
    """Inner compute over wall time of one round record, in the steady state."""
    if phase_seconds <= 0:
        raise ValueError(f"phase_seconds must be positive, got {phase_seconds}")
    return phase_seconds / (phase_seconds + exposed_seconds(round_seconds, hidden_seconds))
