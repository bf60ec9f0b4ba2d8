"""Uneven speeds with rounds due by steps (the default): when a node of a swarm of uneven speeds ends
its inner phase short of H.

A round is due for the swarm when its first members reach H inner steps: they say they are ready
(``SwarmSide.round_forming``). Nodes differ in speed (1x-4x is usual on the internet), and with a
fixed H every round would keep the fast ones waiting for the slowest. So in a swarm of uneven
speeds a node that lags ends its phase at its next step boundary once the round is due, with the
steps it trained: its Δ is weighted by its tokens, as every Δ is, and it moves on the swarm's step
count and the group's agreed data position like every member (``OuterRound``).

**Uneven is measured, never read from wall-clock lag.** Every node announces its step time, the
median of its last inner steps (``PeerRecord.step_seconds``, from ``node/outer/pace.py``'s
``StepTimes``). A node may end a phase short only while the step times of its lineage (its peers'
and its own) span at least :data:`SLOW_STEP_RATIO`, and a phase at the slowest of them lags one at
the fastest by more than :data:`SHORT_PHASE_GRACE_S` (:func:`uneven`). In a swarm of equal speeds
neither holds, whatever lag the start barrier or a loaded machine puts between its nodes: they
train exactly H steps every round, so a seeded swarm of them ends on the same param_hash run after
run (``tests/node/ops/test_reproducible_swarm.py`` with busy CPU loops beside it). The rule before
this gate ended phases short on lag alone, which on a loaded machine ended phases of equal nodes,
and was reverted (BENCHMARKS.md, "Uneven speeds with the defaults"). In a swarm of uneven speeds
the rounds' lengths follow wall-clock time anyway (the slowest node's short phases), so every node
there may end short, not only the slowest: a node 1.2x slower than the fastest does not hold the
round for a fifth of its phase.

Past the gate, :class:`ShortPhases` decides at each step boundary (its caller supplies the clock
and the swarm's answers, so the daemon's loop and the simulator's node drive the same rule):

1. The round is due (a peer of the lineage is ready) and we would reach H more than the grace
   (:func:`grace`: max(1.5 s, a tenth of the phase so far)) later: end the phase now, and remember
   the swarm's *pace*, when in the phase the round became due (at the earliest our previous step
   boundary, since we look once a step).
2. Having ended a phase short, the next phase trains up to its last step boundary before the pace
   and waits there for the round to be due (``SwarmSide.await_round_forming``, at most a step and a
   grace past the pace), then ends: the first members find us ready, and we are never ready before
   them, so nobody reads our readiness as the round being due. The wait counts as blocked time.
3. A node that would reach H within the grace of its last pace is not lagging: it trains H.

Not with ``--round-seconds`` (rounds due by time already), ``--overlap`` or ``--fragments`` (their
rounds land at fixed steps): the caller does not ask.
"""

from __future__ import annotations

from dataclasses import dataclass

SLOW_STEP_RATIO = 1.5
"""A swarm's speeds are uneven when the longest step time its lineage announces is at least this many
times the shortest (and a phase lags by more than SHORT_PHASE_GRACE_S: :func:`uneven`). Four nano
nodes of one configuration on 2 loaded cores (~0.75 s steps, load 6-8) had medians of 8 steps at
most 1.26x apart; a nano node at 4x the batch is 2.3-4x slower per step. A swarm whose nodes are
all within 1.5x of each other trains H everywhere, and its fastest wait for its slowest (at most a
third of their phase)."""

SHORT_PHASE_GRACE_S = 1.5
SHORT_PHASE_GRACE_SHARE = 0.1
"""A lagging node ends short unless it would reach H within max(GRACE_S, GRACE_SHARE x the phase) of
the swarm's round being due (:func:`grace`): a nearly finished phase is not cut for a step or two,
and the fastest nodes wait for a lagging one about that long."""


def uneven(step_seconds: float | None, peers: tuple[float, float] | None, phase_steps: int) -> bool:
    """Whether a swarm's speeds are uneven: ``step_seconds`` our step time, ``peers`` the shortest and
    longest step time our lineage's peers announce (None on either side: not measured or not
    announced yet: not uneven), in phases of ``phase_steps`` steps. Uneven: the longest of them at
    least SLOW_STEP_RATIO times the shortest, and a phase at the longest lasts longer than one at
    the shortest by more than SHORT_PHASE_GRACE_S. Tiny steps on a loaded machine jitter most
    (medians of 20-200 ms steps of nodes of one configuration 2.8x apart beside two busy loops), but
    a phase of them never lags by that much."""
    if step_seconds is None or peers is None:
        return False
    fastest, slowest = min(step_seconds, peers[0]), max(step_seconds, peers[1])
    if fastest <= 0:
        return False
    return slowest >= SLOW_STEP_RATIO * fastest and phase_steps * (slowest - fastest) > SHORT_PHASE_GRACE_S


def grace(due: float) -> float:
    """How much later than the swarm's round is due (``due`` seconds into the phase) a node may reach
    H and still finish it (seconds)."""
    return max(SHORT_PHASE_GRACE_S, SHORT_PHASE_GRACE_SHARE * due)


@dataclass(frozen=True)
class TrainOn:
    """Train the next step."""


@dataclass(frozen=True)
class EndShort:
    """End the phase now, short of H."""


@dataclass(frozen=True)
class AwaitRound:
    """Wait at most ``seconds`` for the swarm's round to be due, then tell :meth:`ShortPhases.waited`."""

    seconds: float


Verdict = TrainOn | EndShort | AwaitRound


class ShortPhases:
    """One node's state across phases: whether its last phase ended short, and the swarm's pace then
    (seconds from that phase's start until its round was due; None: not known)."""

    def __init__(self) -> None:
        self.short = False
        self.pace: float | None = None

    def at_step(
        self,
        *,
        elapsed: float,
        done: int,
        missing: int,
        forming: bool,
        step_seconds: float | None,
        peers: tuple[float, float] | None,
    ) -> Verdict:
        """At a step boundary, ``elapsed`` seconds into the phase with ``done`` of its steps trained
        and ``missing`` to H; ``forming``: a peer of our lineage is ready (the round is due);
        ``step_seconds``: our announced step time; ``peers``: the shortest and longest our
        lineage's peers announce (:func:`uneven`). An :class:`EndShort` is final; after an :class:`AwaitRound` the caller
        reports what came of it (:meth:`waited`)."""
        if done < 1 or missing < 1 or not uneven(step_seconds, peers, done + missing):
            return TrainOn()
        phase_step = elapsed / done
        finish = elapsed + missing * phase_step  # when H steps would be done at this phase's pace
        pace = self.pace
        if pace is not None and finish <= pace + grace(pace):
            return TrainOn()  # not later than the swarm's last round
        if forming:  # due since our previous step boundary (or the last view refresh) at most
            if finish - elapsed <= grace(elapsed):
                return TrainOn()
            self.pace = max(elapsed - phase_step, 0.0)
            return EndShort()
        if not self.short or pace is None or elapsed + phase_step <= pace or finish - pace <= grace(pace):
            return TrainOn()  # another step fits before the swarm's pace
        # Ready first: wait for the first members here (not in the round's formation, where our
        # readiness would say the round is due), at most a step and a grace past the pace (a pace
        # first taken at a step boundary is up to a step early). If they are slower than that, train
        # on: the round ends our phase when it is due, and the pace is measured again.
        return AwaitRound(max(pace - elapsed, 0.0) + phase_step + grace(pace))

    def waited(self, *, formed: bool, elapsed: float) -> bool:
        """After an :class:`AwaitRound`: ``formed`` whether the round became due, ``elapsed`` seconds
        into the phase now. Returns whether to end the phase now (short)."""
        self.pace = elapsed if formed else None
        return formed

    def phase_ended(self, *, short: bool, averaged: bool) -> None:
        """A phase ended (``short``: on :class:`EndShort` or a formed wait) and its round was
        ``averaged`` with a group or not: the pace is kept only after a short phase that was averaged
        (after H steps, a fallback or an adoption it is measured anew)."""
        self.short = short and averaged
        if not self.short:
            self.pace = None

    def reset(self) -> None:
        """The node adopted the swarm's state: measure the pace again from its next round."""
        self.short, self.pace = False, None
