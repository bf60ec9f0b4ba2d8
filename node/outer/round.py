"""One outer round, one home: the phase clock, DiLoCo's outer step through the swarm, adoption.

Both loops, the daemon's (``node/train/trainer.py``) and the Python API's (``node/api.py``), drive one
:class:`OuterRound`. They count each inner step (:meth:`OuterRound.count_step`) and call
:meth:`OuterRound.at_step_boundary`; everything about the outer round happens in here:

    at_step_boundary()
      ├─ the phase is due (H steps, or --round-seconds; trained on while a node fetches our state)
      ├─ by steps: the swarm's round is due, its speeds are uneven and we lag: end the phase short
      ├─ the round in flight (--overlap) landed and sends us to adopt the swarm's state
      ├─ we adopted mid-phase and the swarm's next round forms now (catch-up): skip to its step
      │        └─> _end_phase():
      │              Phase 1: Δ = θ_global − θ_local (DiLoCo), or the phase's own Δ_k (overlap)
      │              Phase 2: the swarm's RoundOutcome for Δ (SwarmSession.average), inline or
      │                       awaited from the round in flight; Δ̄ applied to θ_global (DiLoCo)
      │              Phase 3: the one ``match`` on its decision: Averaged/FellBack count the round,
      │                       Adopt loads the swarm's state (the one adoption path, also at join)
      │              Phase 4: our data moves to the group's agreed position and shard
      │                       (``NextShard``), the new state is served; ``on_applied``
      │                       (the daemon records the round and checkpoints, before phase 5)
      │              Phase 5 (overlap): hand this phase's Δ_k to the swarm on the averaging thread;
      │                       the model trains on from θ_global − Δ_k meanwhile
      └─ else (overlap): the round in flight landed: serve its state now, not a phase later

With ``--fragments F`` (``_fragment_boundary``) each round synchronises one fragment, on the
schedule of ``node/outer/fragments.py``: Δ_f of the fragment due goes to the swarm as its own round,
lands τ steps later (the same ``_act_on``), and the fragment's local params are mixed with its new
global ones; ARCHITECTURE.md, "Streamed fragments", is the swarm's contract.

The swarm never calls back into here: every call into :class:`~node.outer.seam.SwarmSide` passes
what it needs (``node/outer/seam.py``), and the round in flight is a future polled at step
boundaries. Counters are global over the run: ``step`` = inner steps done, ``round`` = outer rounds
applied; the current phase belongs to round ``round + 1`` (``+ 1`` more while one is in flight).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from node.outer.fragments import FragmentedOuterState, FragmentSchedule
from node.outer.host_copy import HostCopies
from node.outer.pace import StepTimes, send_window
from node.outer.seam import (
    MAX_DUE_WAIT,
    Adopt,
    AdoptedState,
    Averaged,
    Averager,
    Boundary,
    FellBack,
    JoinRequest,
    RoundDecision,
    RoundOutcome,
    RoundRequest,
    RoundStats,
    SwarmSide,
)
from node.outer.uneven import AwaitRound, EndShort, ShortPhases, TrainOn, uneven
from node.swarm.state import run_identity, state_snapshot

# How often the phase's throughput goes to the swarm side during a phase (the record carries it
# from the next heartbeat on): often enough for `dtnode status`, rarely enough to cost nothing.
ADVERTISE_RATE_EVERY_S = 1.0

if TYPE_CHECKING:
    from node.outer.diloco import DiLoCo
    from protocol.statesync.snapshot import Snapshot
    from protocol.swarm.streams import StreamRunner

log = logging.getLogger("dtnode")

RoundKind = Literal["averaged", "solo", "fell_back", "adopted"]
"""averaged: with a group of two or more; solo: a round of this node alone (a group of one, or no
swarm), its own Δ the mean; fell_back: a group's all-reduce failed, or no group formed; adopted."""


@dataclass
class RoundProgress:
    """The loop's counters, over the whole run (a resumed run continues them)."""

    step: int = 0  # inner steps done
    round: int = 0  # outer rounds applied
    tokens: int = 0  # training tokens (or samples) processed
    round_tokens: int = 0  # tokens (or samples) since the last outer step: the next Δ's weight
    round_compute_seconds: float = 0.0  # inner compute since the last outer step


class DataCursor(Protocol):
    """Where the loop reads its data: the daemon's batches, or nothing of the API user's but a shard."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def skip(self, num_steps: int) -> None: ...

    def reshard(self, shard_index: int, num_shards: int) -> None: ...

    def end_round(
        self, shard: tuple[int, int] | None, *, phase_shards: int | None = None, phase_tokens: int = 0
    ) -> None: ...

    def read_spare(self, lane: int, *, steps: int) -> None: ...


@dataclass(frozen=True, kw_only=True)
class RoundSettings:
    """When a phase ends and how its round runs."""

    inner_steps: int  # H: the phase ends after H inner steps ...
    round_seconds: float = 0.0  # ... or, if > 0, once it lasted this long (rounds due by time)
    overlap: bool = False  # average a phase's Δ while the next phase trains (Streaming DiLoCo)
    model: str  # the model's name in the served state (a preset, or "api:<Module>")
    corpus_sha256: str  # the data identity a joiner is checked against
    rank: int | None = None  # this node's place in the swarm's member order, fixed by its run
    architecture: str = ""  # the model's shapes as text (its config, or the module's parameters): identity
    fragments: FragmentSchedule | None = None  # --fragments F > 1: one fragment per round, on this schedule
    fragment_mix: float = 0.0  # α: the share of a landed fragment's local params kept
    pace_sends: bool = False  # fragments with τ > 0: spread a round's sends over its τ steps (pace.py)


@dataclass(frozen=True, kw_only=True)
class RoundApplied:
    """One round the loop went through, as its record reads it."""

    round_index: int  # the round (1-based) this was
    decision: RoundDecision
    stats: RoundStats
    param_hash: str  # of the global params the model's round now holds (the adopted ones after Adopt)
    pseudo_gradient_norm: float  # ‖Δ̄‖ (0 after Adopt)
    seconds_comm: float  # the swarm's round, start to answer
    seconds_waited: float  # how long the training thread was blocked on it
    compute_seconds: float  # inner compute of the phases no earlier record counted
    weight: float  # tokens (or samples) this node contributed
    model_is_global: bool  # the model holds θ_global now (a synchronous round, or an adoption)
    fragment: int | None = None  # the fragment this round synchronised (--fragments; None: the whole model)
    fragment_hash: str = ""  # SHA-256 of that fragment's global params after the round ("" after Adopt)

    @property
    def kind(self) -> RoundKind:
        match self.decision:
            case Averaged():
                alone = len(self.stats.members) <= 1 and self.stats.num_peers <= 1
                return "solo" if alone else "averaged"
            case FellBack():
                return "fell_back"
            case Adopt():
                return "adopted"

    @property
    def reason(self) -> str:
        """Why the round fell back, if it did."""
        match self.decision:
            case FellBack(reason=reason):
                return reason
            case _:
                return ""

    @property
    def caught_up(self) -> bool:
        """Adopted by stepping with the rounds' means from our own state, not by a whole fetch."""
        match self.decision:
            case Adopt(state=state):
                return state.caught_up
            case _:
                return False

    @property
    def num_peers(self) -> int:
        return self.stats.num_peers


@dataclass(frozen=True)
class _Landed:
    """A round's answer, applied to θ_global (unless it sends us to adopt)."""

    request: RoundRequest
    outcome: RoundOutcome
    seconds_comm: float
    norm: float
    param_hash: str
    # The state to serve after the round (overlap): built on the averaging thread once the step is
    # applied, so the training thread only publishes it (None: built when served, ``_serve``).
    served: Snapshot | None = None


class OuterRound:
    """The outer round of one node; see the module docstring.

    ``swarm`` None: a swarm of one (``averager`` a ``SoloAverager``), or a fake in tests. ``on_applied``
    is called on the training thread with each round applied, before the next is handed to the swarm:
    the daemon writes its record and checkpoints there (its checkpoint then holds no round in flight).
    """

    def __init__(
        self,
        diloco: DiLoCo,
        *,
        averager: Averager,
        swarm: SwarmSide | None,
        settings: RoundSettings,
        data: DataCursor,
        stop_requested: Callable[[], bool],
        on_applied: Callable[[RoundApplied], None] | None = None,
        open_streams: Callable[[], StreamRunner] | None = None,
    ) -> None:
        self.diloco = diloco
        self.averager = averager
        self.swarm = swarm
        self.settings = settings
        self.data = data
        self.stop_requested = stop_requested
        self.on_applied = on_applied
        self.open_streams = open_streams
        self.progress = RoundProgress()
        # --fragments: the outer state is the fragments' (node/outer/fragments.py), one per round.
        self.fragments: FragmentedOuterState | None = None
        if settings.fragments is not None:
            outer = diloco.outer
            if (
                not isinstance(outer, FragmentedOuterState)
                or outer.num_fragments != settings.fragments.num_fragments
            ):
                raise ValueError("a fragment schedule needs DiLoCo's outer state in as many fragments")
            self.fragments = outer
        self.host = HostCopies(diloco)  # the one host copy of θ_global per version (node/outer/host_copy.py)
        self._last_snapshot: Snapshot | None = None  # the state served last (its pieces' hashes stand)
        # The phase under way: its monotonic start (None: the first of this process), its first step,
        # and since when it runs past its end because a node is fetching our state.
        self._phase_started: float | None = None
        self._phase_start_step: int | None = None
        self._extended_since: float | None = None
        self._last_boundary: float | None = None  # when the previous step was counted (API timing)
        self._rate_advertised = 0.0  # when the phase's throughput last went to the swarm side
        # Overlap: the round in flight on the averaging thread, and the (step, data position) at the
        # end of its phase (what its served state carries).
        overlapped = settings.overlap or (
            settings.fragments is not None and settings.fragments.overlap_steps > 0
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="outer-averaging") if overlapped else None
        self._in_flight: Future[_Landed] | None = None
        self._submitted_boundary: Boundary | None = None
        # Fragments: the step after which the round in flight lands, and a landed round's mix that is
        # still due (fragment, step): the run ended with it in flight (finish), so its checkpoint
        # holds the mix to do, as an uninterrupted run does it.
        self._land_step: int | None = None
        self._pending_mix: tuple[int, int] | None = None
        self._unrecorded_compute = 0.0  # inner compute of phases no round record counted yet (overlap)
        self._served: tuple[int, str] | None = None  # the lineage this node serves now
        # Rounds due by steps with uneven speeds (_short_phase_due, node/outer/uneven.py): the rule's
        # state across phases, and the time the loop waited for the round to be due before the phase
        # ended, which its round record counts as blocked.
        self._short_phases = ShortPhases()
        self._unrecorded_wait = 0.0
        self._last_rate = 0.0  # tokens (or samples) per second of the last phase that ended
        self._step_times = StepTimes()  # the last inner steps' compute times: a paced round's window

    # --- lifecycle ---

    def restore(
        self,
        progress: RoundProgress,
        *,
        phase_start_step: int | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Continue from a checkpoint's counters (before :meth:`start`); ``phase_start_step``: the first
        step of the phase under way, if the checkpoint kept it (else the last round's step);
        ``state``: :meth:`state_dict` as the checkpoint kept it."""
        self.progress = progress
        self._phase_start_step = phase_start_step
        pending = (state or {}).get("pending_mix")
        self._pending_mix = (int(pending[0]), int(pending[1])) if pending is not None else None

    def state_dict(self) -> dict[str, Any]:
        """What the round carries past a checkpoint besides the counters: a landed fragment's mix
        still due (``{"pending_mix": [fragment, step]}``); empty otherwise (always without fragments)."""
        return {"pending_mix": list(self._pending_mix)} if self._pending_mix is not None else {}

    def start(self, swarm_state: dict[str, torch.Tensor] | None = None) -> None:
        """Join the swarm: adopt its state if ours is not its own (the one adoption path), serve the
        state we hold, pass the start barrier (which may hand us the barrier lineage's round-0 state,
        and assigns our data shard); then restore the swarm's part of a checkpoint
        (``swarm_state``: the codec's residual) unless the state it belongs to was replaced."""
        self._last_boundary = time.monotonic()
        swarm = self.swarm
        if swarm is None:
            return
        fragments = self.fragments
        architecture = self.settings.architecture
        if fragments is not None:  # nodes of other F average other vectors: another run
            architecture += f" fragments={fragments.num_fragments} plan={fragments.plan.digest()}"
        answer = swarm.join(
            JoinRequest(
                num_elements=self.diloco.num_elements,
                corpus_sha256=self.settings.corpus_sha256,
                held=self.snapshot(),
                stepper=lambda mean, start: self.diloco.stepped(mean, start=start),
                stop_requested=self.stop_requested,
                open_streams=self.open_streams,
                identity=run_identity(
                    model=self.settings.model,
                    architecture=architecture,
                    num_elements=self.diloco.num_elements,
                    corpus_sha256=self.settings.corpus_sha256,
                ),
                rank=self.settings.rank,
                fragment_sizes=fragments.fragment_sizes() if fragments is not None else (),
                fragment_stepper=fragments.stepped if fragments is not None else None,
                fragment_assemble=fragments.assemble if fragments is not None else None,
            )
        )
        if answer.adopt is not None:
            self._adopt(answer.adopt)
            self._read_spare(answer.spare_lane)
        if answer.serve:
            self._serve()
        start = swarm.await_start_peers()
        if start.adopt is not None:  # our round-0 params were not the barrier's lineage: take it
            self._adopt(start.adopt)
            self._serve()
        if start.shard is not None:  # the barrier's nodes read disjoint data from the first step
            self.data.reshard(*start.shard)
            self._read_spare(start.spare_lane)  # beside the shards of the nodes past the barrier, if any
        if swarm_state and not swarm.num_adoptions:
            swarm.load_state_dict(swarm_state)

    def close(self) -> None:
        """Stop the averaging thread (after :meth:`finish`)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)

    # --- the loop's two calls ---

    def count_step(self, tokens: int, compute_seconds: float | None = None) -> None:
        """One inner step trained ``tokens`` (or samples: the Δ's weight) in ``compute_seconds`` (None:
        the wall time since the previous step, for a loop that does not time its own steps)."""
        now = time.monotonic()
        if compute_seconds is None:
            compute_seconds = now - (self._last_boundary if self._last_boundary is not None else now)
        self._last_boundary = now
        progress = self.progress
        self._start_step()  # the phase under way starts before this step (once per process or adoption)
        progress.step += 1
        progress.tokens += tokens
        progress.round_tokens += tokens
        progress.round_compute_seconds += compute_seconds
        self._step_times.add(compute_seconds)
        if self.swarm is not None and now - self._rate_advertised >= ADVERTISE_RATE_EVERY_S:
            # Peers and `dtnode status` see the throughput during the phase, not only after it (a
            # first round, or a joiner's, would show 0 for its whole length).
            self._rate_advertised = now
            self.swarm.advertise_rate(self.tokens_per_s, step_seconds=self._step_times.median())

    def at_step_boundary(self) -> RoundApplied | None:
        """Between two inner steps: end the phase if it is over (see the module docstring) and return
        the round applied then, if any."""
        if self.swarm is not None:
            self._read_spare(self.swarm.moved_spare_lane())  # another node reads our spare lane: move
        if self.fragments is not None:
            return self._fragment_boundary()
        if self._phase_due():
            return self._paced(short=False)
        landed = self._landed()
        if landed is not None and isinstance(landed.outcome.decision, Adopt):
            # Overlap: the round in flight sent us to adopt the swarm's state; this phase's steps are
            # on params it replaces, so adopt now rather than at the phase's end, a round behind the
            # swarm again (then catch up as any adopter does, below).
            log.info("adopting the swarm's state mid-phase (the round in flight was not ours)")
            return self._end_phase()
        if self.swarm is not None and self.swarm.phase_should_end():
            # Catching up after adopting the swarm's state: join the round the swarm is forming now
            # with the steps done so far (weighted by their tokens), or, if the swarm already moved
            # past our state, let the round's lineage check catch us up; on the swarm's step count
            # and data position (if the round sends us to adopt again, the adopted state sets both).
            done = self.progress.step - self._start_step()
            missing = 0 if self.settings.round_seconds else max(self._phase_length() - done, 0)
            log.info("ending the phase %d steps early to join the swarm's round", missing)
            self.data.skip(missing)
            self.progress.step += missing
            return self._end_phase()
        if self._short_phase_due():
            # Lagging in a swarm of uneven speeds: the steps done so far go to the round now
            # (weighted by their tokens), on the swarm's step count (the LR schedule's, the served
            # state's) and at the group's agreed data position (Phase 4: from the most tokens a
            # member trained).
            done = self.progress.step - self._start_step()
            log.info(
                "ending the phase after %d of %d steps: the swarm's round is due", done, self._phase_length()
            )
            self.progress.step += self._phase_length() - done
            return self._paced(short=True)
        if landed is not None and self.swarm is not None and self._submitted_boundary is not None:
            # Overlap: the round in flight was applied (polled at this step boundary): serve it now,
            # not at the phase's end, so the swarm's lineage check sees every member of the round on
            # its new params at once; every member serves the same step and data position.
            self._serve(landed.request.round_index, boundary=self._submitted_boundary, built=landed.served)
        return None

    def finish(self) -> RoundApplied | None:
        """The run ends (overlap): apply the round still in flight, so the run ends on the swarm's
        latest params, with the model holding them (with fragments: its mix stays due at its step,
        kept by :meth:`state_dict`, so a resumed run mixes where an uninterrupted one does)."""
        if self.fragments is not None:
            applied = None
            if self._in_flight is not None:
                applied = self._land_fragment(mix_now=False)
            self.close()
            return applied
        landed = self._wait_in_flight()
        applied = None
        if landed is not None:
            applied = self._act_on(landed, boundary=self._submitted_boundary, model_is_global=True)
            if not isinstance(landed.outcome.decision, Adopt):
                self.diloco.load_global_into_model()
            if self.on_applied is not None:
                self.on_applied(applied)
        self.close()
        return applied

    # --- what the loop reads ---

    @property
    def phase_start_step(self) -> int:
        """The first inner step of the phase under way."""
        return self._start_step()

    @property
    def in_flight(self) -> bool:
        """A round is being averaged on the averaging thread (overlap)."""
        return self._in_flight is not None

    @property
    def phase(self) -> int:
        """The outer round the inner phase under way belongs to (1-based)."""
        return self.progress.round + 1 + self.in_flight

    @property
    def tokens_per_s(self) -> float:
        """This node's inner-phase throughput so far in the phase (0 before its first step)."""
        progress = self.progress
        return (
            progress.round_tokens / progress.round_compute_seconds if progress.round_compute_seconds else 0.0
        )

    def snapshot(self, round: int | None = None, boundary: Boundary | None = None) -> Snapshot:
        """The global state as served to joiners (``swarm_state.state_snapshot``), made of the round's
        one host copy: after ``round`` (default the rounds applied), at ``boundary``'s data position
        (default the one now). Its step is the lineage's, the same at every member (``lineage_step``),
        not this node's own: a node keeps training while a round does not form, so members' own
        steps part (a member's step after round 4 was 61, another's 53), and a joiner fetches from
        every member at once only what they serve byte for byte."""
        data = boundary[1] if boundary is not None else self.data.state_dict()
        round = self.progress.round if round is None else round
        host = self.host.get()
        common: dict[str, Any] = dict(
            param_hash=host.param_hash, copy=False, round=round, step=self.lineage_step(round),
            data=data, model=self.settings.model, corpus_sha256=self.settings.corpus_sha256,
        )  # fmt: skip
        if host.fragments is not None:  # a piece per fragment: a round makes (and hashes) one
            served = state_snapshot(fragments=host.fragments, reuse=self._last_snapshot, **common)
        else:
            served = state_snapshot(global_params=host.params, outer_momentum=host.momentum, **common)
        self._last_snapshot = served
        return served

    def lineage_step(self, round: int) -> int:
        """The inner step after which round ``round`` is due on the schedule every member shares: r·H,
        or with fragments ``FragmentSchedule.round_step``. A node's own step is at least this far at
        that round (more where it went on training while the round formed, or ran rounds by time)."""
        schedule = self.settings.fragments
        return round * self.settings.inner_steps if schedule is None else schedule.round_step(round)

    # --- the phase clock ---

    def _start_step(self) -> int:
        if self._phase_start_step is None:
            step, schedule = self.progress.step, self.settings.fragments
            self._phase_start_step = (
                step - step % self.settings.inner_steps
                if schedule is None
                else schedule.previous_round_step(step)
            )
        return self._phase_start_step

    def _phase_length(self) -> int:
        """Inner steps from the phase's first step to its round: H, or with fragments to the next
        step a fragment's round is due after."""
        schedule, start = self.settings.fragments, self._start_step()
        return self.settings.inner_steps if schedule is None else schedule.next_round_step(start) - start

    def _phase_due(self) -> bool:
        """Whether the inner phase is over: after H steps, or after ``--round-seconds``; in either case
        not while a node fetches our lineage's state, then at most MAX_DUE_WAIT longer.

        Rounds due by time let nodes of uneven speeds reach each round together, each contributing
        the tokens it trained (the mean is weighted by tokens): a fast node never idles at the barrier
        for a slow one (hivemind's target batch size and Psyche's fixed time windows are the same
        idea). With ``--overlap`` such a phase also runs on until the round in flight has landed, so
        a link slower than the phase never blocks the training thread: the round lasts longer. A phase
        runs on while a node is fetching our lineage's state (``SwarmSession.lineage_peer_due``) so
        that it joins this round instead of arriving one round late."""
        settings, progress, now = self.settings, self.progress, time.monotonic()
        if self._phase_started is None:
            self._phase_started = now - progress.round_compute_seconds
        if settings.round_seconds:
            if progress.round_tokens == 0 or now - self._phase_started < settings.round_seconds:
                return False
            if self._in_flight is not None and not self._in_flight.done():
                return False  # overlap: train on until the round in flight lands
        elif progress.step - self._start_step() < self._phase_length():
            return False
        if self.swarm is None or not self.swarm.lineage_peer_due():
            return True
        if self._extended_since is None:
            self._extended_since = now
            log.info("a node is fetching our lineage's state: training on until it joins")
        return now - self._extended_since >= MAX_DUE_WAIT.total_seconds()

    def _short_phase_due(self) -> bool:
        """Rounds due by steps (the default): whether to end the phase short of H now, because the
        swarm's round is due, its speeds are uneven (the step times its lineage announces, ours
        included, span ``SLOW_STEP_RATIO`` or more) and we lag (``node/outer/uneven.py``, which
        decides; ARCHITECTURE.md, "Participation"). Nodes of equal speed never end short. Not with
        ``--round-seconds`` (rounds due by time already), ``--overlap`` or ``--fragments`` (their
        rounds land at fixed steps)."""
        settings, swarm, started = self.settings, self.swarm, self._phase_started
        if swarm is None or settings.round_seconds or settings.overlap or self.fragments is not None:
            return False
        done = self.progress.step - self._start_step()
        missing = self._phase_length() - done
        step_seconds = self._step_times.median()
        if done < 1 or missing < 1 or started is None or step_seconds is None:
            return False
        peers = swarm.step_seconds_range()
        if not uneven(step_seconds, peers, self._phase_length()):
            return False  # asks nothing more of the swarm: equal speeds cost one view lookup a step
        verdict = self._short_phases.at_step(
            elapsed=time.monotonic() - started, done=done, missing=missing, forming=swarm.round_forming(),
            step_seconds=step_seconds, peers=peers,
        )  # fmt: skip
        match verdict:
            case TrainOn():
                return False
            case EndShort():
                return True
            case AwaitRound(seconds=seconds):
                waited_from = time.monotonic()
                formed = swarm.await_round_forming(seconds)
                self._unrecorded_wait += time.monotonic() - waited_from
                return self._short_phases.waited(formed=formed, elapsed=time.monotonic() - started)

    def _paced(self, *, short: bool) -> RoundApplied | None:
        """:meth:`_end_phase`, then the uneven-speed rule learns how the phase ended (``short``: by
        :meth:`_short_phase_due`) and whether its round was averaged with a group."""
        applied = self._end_phase()
        self._short_phases.phase_ended(
            short=short, averaged=applied is not None and applied.kind == "averaged"
        )
        return applied

    def _restart_phase(self) -> None:
        self._phase_started, self._phase_start_step = time.monotonic(), self.progress.step
        self._extended_since = None

    # --- the round ---

    def _end_phase(self) -> RoundApplied | None:
        """Phases 1-5 of the module docstring; the round applied now (None for the first overlapped
        phase, whose round is still in flight: its compute goes to round 1's record)."""
        progress = self.progress
        rate = self._last_rate = self.tokens_per_s
        self._unrecorded_compute += progress.round_compute_seconds  # (overlap: phase 1's is round 1's)
        weight, progress.round_tokens, progress.round_compute_seconds = float(progress.round_tokens), 0, 0.0
        delta: torch.Tensor | None = None
        if not self.settings.overlap:
            landed: _Landed | None = self._average_and_apply(
                self.diloco.pseudo_gradient(), self._request(weight, rate)
            )
            seconds_waited = (landed.seconds_comm if landed is not None else 0.0) + self._unrecorded_wait
            self._unrecorded_wait = 0.0
            if landed is not None and not isinstance(landed.outcome.decision, Adopt):
                self.diloco.load_global_into_model()  # the model restarts from θ_global
        else:
            delta = self.diloco.phase_delta()  # before the round lands: the model still holds this phase
            waited_from = time.perf_counter()
            landed = self._wait_in_flight()
            seconds_waited = time.perf_counter() - waited_from
        applied = None
        if landed is not None:
            adopted = isinstance(landed.outcome.decision, Adopt)
            boundary = self._submitted_boundary if self.settings.overlap else None
            # Without overlap (or after adopting) the model restarts from θ_global: it holds it now.
            applied = self._act_on(
                landed, boundary=boundary, model_is_global=not self.settings.overlap or adopted,
                seconds_waited=seconds_waited,
            )  # fmt: skip
            if adopted:
                delta = None  # this phase's progress belongs to other params
            if self.on_applied is not None:
                self.on_applied(applied)  # before the next round is in flight: a consistent checkpoint
        if delta is not None:
            self._submitted_boundary = (progress.step, self.data.state_dict())
            request = self._request(weight, rate)
            self.diloco.restart_from(delta)  # before the averaging thread may step θ_global
            assert self._executor is not None and self._in_flight is None
            self._in_flight = self._executor.submit(
                self._average_and_apply, delta.clone(), request, boundary=self._submitted_boundary
            )
        self._restart_phase()
        return applied

    def _request(self, weight: float, rate: float) -> RoundRequest:
        """The next round's request: round ``rounds applied + 1``, from the global params now (with
        fragments: of the fragment that round synchronises)."""
        round_index, schedule = self.progress.round + 1, self.settings.fragments
        paced = schedule is not None and self.settings.pace_sends
        return RoundRequest(
            round_index=round_index,
            weight=weight,
            lineage=(round_index - 1, self.diloco.param_hash()),
            tokens_per_s=rate,
            fragment=schedule.fragment_of_round(round_index) if schedule is not None else None,
            send_window=(
                send_window(self._step_times.median(), schedule.overlap_steps)
                if paced and schedule is not None
                else None
            ),
        )

    # --- fragments (--fragments F > 1): one fragment per round, each landing τ steps after it went ---
    #
    # Round r synchronises fragment r mod F after inner step s_r (FragmentSchedule): Δ_f goes to the
    # swarm as that round's own vector; with τ = 0 its mean is applied at once, else on the averaging
    # thread while the loop trains τ more steps (every fragment's local params train on; none of them
    # is touched by the round). It *lands* after step s_r + τ: the round is acted on (_act_on: counted,
    # or the swarm's state adopted), then the fragment's local params are mixed with its new global
    # ones. τ ≤ H/F, so the round in flight lands before or as the next one is due: the swarm's rounds
    # stay one sequence, and after each every member holds the same whole θ_global (its param_hash is
    # the lineage, as without fragments; ARCHITECTURE.md, "Streamed fragments").

    def _fragment_boundary(self) -> RoundApplied | None:
        """``at_step_boundary`` with fragments: a mix left due by a resumed checkpoint, the phase's
        round (after landing the one in flight), the round in flight landing, or a catch-up."""
        fragments, step = self.fragments, self.progress.step
        assert fragments is not None
        if self._pending_mix is not None and step >= self._pending_mix[1]:
            fragments.mix(self._pending_mix[0], self.settings.fragment_mix)
            self._pending_mix = None
        if self._phase_due():
            return self._end_fragment_phase()
        if self._in_flight is not None and self._land_step is not None and step >= self._land_step:
            return self._land_fragment()
        if self.swarm is not None and self._in_flight is None and self.swarm.phase_should_end():
            # Catching up after adopting the swarm's state (as without fragments, at_step_boundary).
            missing = max(self._phase_length() - (step - self._start_step()), 0)
            log.info("ending the phase %d steps early to join the swarm's round", missing)
            self.data.skip(missing)
            self.progress.step += missing
            return self._end_fragment_phase()
        return None

    def _end_fragment_phase(self) -> RoundApplied | None:
        """The due fragment's round: land the one in flight first (τ = H/F), then average Δ_f now (τ = 0:
        the round applied is returned) or hand it to the averaging thread until step s_r + τ."""
        fragments, schedule, progress = self.fragments, self.settings.fragments, self.progress
        assert fragments is not None and schedule is not None
        rate = self._last_rate = self.tokens_per_s
        self._unrecorded_compute += progress.round_compute_seconds
        weight, progress.round_tokens, progress.round_compute_seconds = float(progress.round_tokens), 0, 0.0
        applied = None
        if self._in_flight is not None:  # (τ > 0: the round applied now is this one)
            applied = self._land_fragment()
            if isinstance(applied.decision, Adopt):
                return applied  # the adopted state's step starts the next phase (_adopt)
        request = self._request(weight, rate)
        assert request.fragment is not None
        delta = fragments.fragment(request.fragment).delta()  # Δ_f, a vector of its own
        if self._executor is None:
            now = self._average_and_apply(delta, request)
            applied = self._apply_fragment(now, boundary=None, seconds_waited=now.seconds_comm)
        else:
            self._submitted_boundary = (progress.step, self.data.state_dict())
            self._land_step = progress.step + schedule.overlap_steps
            self._in_flight = self._executor.submit(
                self._average_and_apply, delta, request, boundary=self._submitted_boundary
            )
        self._restart_phase()
        return applied

    def _land_fragment(self, *, mix_now: bool = True) -> RoundApplied:
        """The round in flight lands: wait for it (it is due), act on it, mix its fragment.

        A paced round not landed yet stays paced: sending its rest at full rate would put the link's
        cap back on it for a second or more, the peak pacing is for (``PACE_MARGIN`` trades this
        wait against the peak: ``node/outer/pace.py``). Only a node asked to stop sends the rest at
        full rate."""
        waited_from = time.perf_counter()
        in_flight = self._in_flight
        if (
            self.settings.pace_sends
            and self.swarm is not None
            and in_flight is not None
            and not in_flight.done()
            and self.stop_requested()
        ):
            self.swarm.lift_pace(self.progress.round + 1)  # (the round in flight: the next one applied)
        landed = self._wait_in_flight()
        assert landed is not None
        seconds_waited = time.perf_counter() - waited_from
        applied = self._apply_fragment(
            landed, boundary=self._submitted_boundary, seconds_waited=seconds_waited, mix_now=mix_now
        )
        self._land_step = None
        return applied

    def _apply_fragment(
        self, landed: _Landed, *, boundary: Boundary | None, seconds_waited: float, mix_now: bool = True
    ) -> RoundApplied:
        """A fragment's round acted on (the one ``match``, ``_act_on``), its fragment mixed (now, or
        at its land step after a resume: ``mix_now`` False), then ``on_applied``."""
        assert self.fragments is not None and landed.request.fragment is not None
        adopted = isinstance(landed.outcome.decision, Adopt)
        applied = self._act_on(
            landed, boundary=boundary, model_is_global=adopted, seconds_waited=seconds_waited
        )
        if not adopted:
            if mix_now:
                self.fragments.mix(landed.request.fragment, self.settings.fragment_mix)
            else:
                assert self._land_step is not None
                self._pending_mix = (landed.request.fragment, self._land_step)
        if self.on_applied is not None:
            self.on_applied(applied)  # before the next round is in flight: a consistent checkpoint
        return applied

    @torch.no_grad()
    def _step_fragment(self, fragment: int, mean: torch.Tensor) -> float:
        """The outer step of fragment ``fragment`` with its round's mean (on the averaging thread with
        τ > 0: the loop reads no global params meanwhile); returns ‖Δ̄_f‖."""
        assert self.fragments is not None
        part = self.fragments.fragment(fragment)
        averaged = mean.to(part.device, torch.float32)
        if averaged.shape != (part.num_elements,):
            raise RuntimeError(f"the mean has shape {tuple(averaged.shape)}, expected ({part.num_elements},)")
        with self.diloco.consistent():
            part.step(averaged)
        return float(averaged.norm())

    def _average_and_apply(
        self, delta: torch.Tensor, request: RoundRequest, *, boundary: Boundary | None = None
    ) -> _Landed:
        """Phase 2: the swarm's answer for ``delta``, its mean applied to θ_global (on the averaging
        thread with overlap: the training thread does not touch θ_global during a phase).

        With overlap (``boundary``: the step and data position its state is served at) the state to
        serve after the round is built here too, once the step is applied: the round's one host copy
        of θ_global and the momentum and the snapshot's hashes (a copy and four SHA-256 passes over
        2 × 4 bytes a parameter) are then off the training thread, which only publishes it. Nothing
        steps θ_global between here and its serving: the next round goes in flight after this one is
        acted on, and an adoption replaces the state (nothing is built for it)."""
        started = time.perf_counter()
        outcome = self.averager.average(delta, request)
        seconds_comm = time.perf_counter() - started
        norm = 0.0
        served = None
        match outcome.decision:
            case Averaged(mean=mean) | FellBack(own=mean):
                if request.fragment is None:
                    norm = self.diloco.apply_mean(mean)
                else:
                    norm = self._step_fragment(request.fragment, mean)
                if boundary is not None and self.swarm is not None:
                    served = self.snapshot(request.round_index, boundary)
                    self.swarm.prepare_publish(served)  # what is served beside it (the round's mean)
            case Adopt():
                pass  # loaded by the training thread (_act_on)
        return _Landed(request, outcome, seconds_comm, norm, self.diloco.param_hash(), served)

    def _landed(self) -> _Landed | None:
        """The round in flight once it has landed, else None (polled at step boundaries)."""
        future = self._in_flight
        if future is None or not future.done() or future.exception() is not None:
            return None
        return future.result()

    def _wait_in_flight(self) -> _Landed | None:
        """Wait for the round in flight (the averager returns within its own deadlines); None if none."""
        if self._in_flight is None:
            return None
        landed = self._in_flight.result()
        self._in_flight = None
        return landed

    def _act_on(
        self,
        landed: _Landed,
        *,
        boundary: Boundary | None,
        model_is_global: bool,
        seconds_waited: float = 0.0,
    ) -> RoundApplied:
        """Phases 3-4: the one place a round's decision is acted on: count the round it stepped
        through, or load the state it was sent to; then the swarm reshards and the new state is
        served (at ``boundary``, the round's end, with overlap)."""
        decision, param_hash, swarm = landed.outcome.decision, landed.param_hash, self.swarm
        match decision:
            case Adopt(state=state):
                self._adopt(state)
                param_hash, boundary = state.param_hash, None
                if swarm is not None:
                    self._read_spare(swarm.after_adopt(state))
            case Averaged() | FellBack():
                self.progress.round = landed.request.round_index
                agreed = swarm.after_step(landed.outcome.stats.members) if swarm is not None else None
                if agreed is None:  # no group: our own data position goes on
                    self.data.end_round(None)
                else:  # one data position for the whole group, whatever each member read the phase with
                    self.data.end_round(
                        (agreed.shard_index, agreed.num_shards),
                        phase_shards=agreed.phase_shards,
                        phase_tokens=agreed.phase_tokens,
                    )
        if swarm is not None:
            self._serve(boundary=boundary, built=landed.served)
        compute_seconds, self._unrecorded_compute = self._unrecorded_compute, 0.0
        fragment = landed.request.fragment
        fragment_hash = ""
        if fragment is not None and self.fragments is not None and not isinstance(decision, Adopt):
            fragment_hash = self.fragments.fragment(fragment).hash()
        return RoundApplied(
            round_index=landed.request.round_index,
            decision=decision,
            stats=landed.outcome.stats,
            param_hash=param_hash,
            pseudo_gradient_norm=landed.norm,
            seconds_comm=landed.seconds_comm,
            seconds_waited=seconds_waited,
            compute_seconds=compute_seconds,
            weight=landed.request.weight,
            model_is_global=model_is_global,
            fragment=fragment,
            fragment_hash=fragment_hash,
        )

    def _adopt(self, state: AdoptedState) -> None:
        """Continue from the swarm's global state: params, outer momentum, counters, data position.

        The inner steps since the last round are dropped (their Δ belongs to other params); the
        inner optimizer's state is this node's own and is kept, as in DiLoCo."""
        self.diloco.load_global_state(state.global_params, state.outer_momentum)
        if self.diloco.param_hash() != state.param_hash:
            raise RuntimeError("the adopted params do not match their param_hash")
        # The swarm's data position (the served state names no shard: the first until the next round
        # assigns ours; the swarm side names a spare lane to read meanwhile, _read_spare).
        self.data.load_state_dict({"shard_index": 0, **state.metadata["data"]})
        progress = self.progress
        progress.step, progress.round = int(state.metadata["step"]), state.round
        progress.round_tokens, progress.round_compute_seconds = 0, 0.0
        self._phase_started = self._phase_start_step = None  # the next phase starts from the swarm's step
        self._pending_mix = None  # the model holds the swarm's global params: nothing left to mix
        self._short_phases.reset()  # the swarm's pace is measured again from its next round
        log.info("now at round %d, step %d, param_hash %s", state.round, progress.step, state.param_hash[:12])

    def _read_spare(self, lane: int | None) -> None:
        """Until the next round, read spare data lane ``lane`` (if any): this node begins its phase
        after the lineage's members began theirs, and they read the round's shards
        (``node/data/batches.py``, "Spare lanes")."""
        if lane is not None:
            # Rounds due by time have no fixed phase length: an endless lane (batches.py, "Spare lanes").
            steps = 0 if self.settings.round_seconds else self.settings.inner_steps
            self.data.read_spare(lane, steps=steps)

    def _serve(
        self, round: int | None = None, *, boundary: Boundary | None = None, built: Snapshot | None = None
    ) -> None:
        """Serve the global state now (after ``round``, default the rounds applied), unless it is the
        one served already; ``built``: that state's snapshot if the averaging thread built it
        (``_average_and_apply``), used when it is of the lineage served now."""
        assert self.swarm is not None
        lineage = (self.progress.round if round is None else round, self.diloco.param_hash())
        if round is None and self._served == lineage:
            return
        if round is not None and self._served is not None and self._served[0] >= round:
            return  # a landed round served already (or a newer one)
        # Advertised with the phase's throughput (the last phase's right after a round).
        rate = self.tokens_per_s if self.progress.round_tokens else self._last_rate
        if built is None or (built.round_id, built.state_id) != lineage:
            built = self.snapshot(round, boundary)
        self.swarm.publish(built, tokens_per_s=rate)
        self._served = lineage
