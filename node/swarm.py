"""The node's side of the swarm: DiLoCo rounds through agreed groups, joining, re-syncing, shards.

:class:`SwarmSession` is the :class:`~node.diloco.Averager` of a node in a swarm and the loop's
:class:`~node.swarm_seam.SwarmSide`. It talks to the swarm only through
:class:`protocol.swarm.node.SwarmNode` (which owns every socket) and to the loop only through the
:class:`~node.swarm_seam.GlobalStateAccess` it is started with. Each round's answer becomes one
decision the loop acts on (``AveragingOutcome.decision``):

========================  ===========================  ===========================================
swarm's answer            decision                     what follows
========================  ===========================  ===========================================
averaged                  Averaged(mean)               outer step; reshard the data among the group
averaged, fell back       FellBack(own Δ)              outer step on our own Δ; the next round's
failed (too few peers)                                 lineage check sends us to re-sync
missed (group without us) Adopt(state)                 the group's new state, stepped to with the
resync (wrong lineage)                                 rounds' means (``node/catch_up.py``) or
                                                       fetched whole, verified (``swarm_state``)
========================  ===========================  ===========================================

Adopting a state replaces the node's global params, outer momentum, round and step counters and
data position with the source's (``shards.py`` explains the data contract); the local inner steps
since the last round are discarded, since their Δ was computed against other params. A node whose
last round fell back stepped on its own Δ: no chain of means leads to its state, so it fetches the
whole state at once. Every fetch is announced, and the lineage's members train on while it runs
(ARCHITECTURE.md, "Participation").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch

from node.catch_up import catch_up_with_means, rejoin_due
from node.config import ConfigError
from node.diloco import AveragingOutcome
from node.join import JOIN_TIMEOUT, Prefetch
from node.swarm_seam import Adopt, Boundary, GlobalStateAccess, RoundDecision
from node.swarm_state import (
    AdoptedState,
    RoundMean,
    adopted_state,
    round_mean_snapshot,
)
from protocol.error_feedback import ErrorFeedback
from protocol.membership.lineage import LineageDecision
from protocol.membership.shards import assign_shard
from protocol.statesync.errors import StateSyncError
from protocol.statesync.fetch import FetchReport
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.participation import START_TIMEOUT, await_start_peers, peer_due, serve_stragglers
from protocol.swarm.streams import StreamRunner, stream_bounds

log = logging.getLogger(__name__)

MAX_DUE_WAIT_SECONDS = 120.0
"""How far ahead a syncing peer's estimate may lie for us to train on for it (Trainer's MAX_DUE_WAIT)."""

MAX_CATCH_UP_ROUNDS = 2
"""How many rounds behind a node may step to the swarm's state with their means: providers keep the
means of their last two publishes (StateSyncConfig.num_snapshots_kept)."""


class SwarmSession:
    """Averager for a node in a swarm; see the module docstring.

    ``joining``: the node was given peers, so before its first inner step it waits (up to
    ``join_timeout``) to see them and adopts the swarm's state if its own is not canonical;
    ``prefetch`` holds that state if it was fetched while the trainer was being built.
    """

    def __init__(
        self,
        swarm: SwarmNode,
        *,
        joining: bool,
        join_timeout: timedelta = JOIN_TIMEOUT,
        on_round: Callable[[RoundResult], None] | None = None,
        prefetch: Prefetch | None = None,
        start_peers: int = 1,
        start_timeout: timedelta = START_TIMEOUT,
    ) -> None:
        self.swarm = swarm
        self.start_peers = start_peers  # the start barrier: live nodes to wait for before training
        self.start_timeout = start_timeout
        self.prefetch = prefetch  # the canonical state fetched while the trainer was being built
        self.joining = joining
        self.join_timeout = join_timeout
        self.on_round = on_round
        self.error_feedback: ErrorFeedback | None = None
        self.streams: StreamRunner | None = None  # all-reduce streams 1..S-1 (--swarm-streams)
        self.last_result: RoundResult | None = None
        self.num_adoptions = 0
        self._catching_up = False  # adopted mid-phase: end our phase when the swarm's round forms
        self._adopted_lineage: tuple[int, str] = (0, "")
        self._loop: GlobalStateAccess | None = None  # the training loop's side of the seam (start)
        self._published: tuple[int, str] | None = None  # the lineage our last publish served
        # Between two rounds (e.g. while joining): state fetched and fetches failed, reported with
        # the next round's outcome (node/metrics.py).
        self._bytes_state_sync = 0
        self._state_sync_failures = 0
        # The last round's mean Δ̄ and the (round, param_hash) it stepped from: served beside the
        # new state (round_mean_snapshot) until the next publish.
        self._round_mean: RoundMean | None = None
        self.num_caught_up = 0  # missed rounds stepped through with the swarm's mean
        # Our last round stepped on our own Δ (it fell back): no member's chain of means leads to our
        # state, so a catch-up cannot start from it; the whole state is fetched at once.
        self._stepped_alone = False

    # --- lifecycle ---

    @property
    def loop(self) -> GlobalStateAccess:
        assert self._loop is not None, "start() the session first"
        return self._loop

    def start(self, loop: GlobalStateAccess) -> None:
        """Announce the node; a joiner adopts the swarm's state first if its own is not canonical;
        then the start barrier (``start_peers``): wait until that many nodes of the run are live."""
        self._join(loop)
        self._await_start_peers()

    def _await_start_peers(self) -> None:
        """The start barrier (``protocol/swarm/participation.py``)."""
        if self.start_peers > 1:
            await_start_peers(self.swarm, self.start_peers, self.start_timeout, self.loop.stop_requested)

    def _join(self, loop: GlobalStateAccess) -> None:
        self._loop = loop
        self.streams = None
        if loop.open_streams is not None:
            self.streams = loop.open_streams()
            self.swarm.attach_streams(self.streams)
        if self.swarm.codec.name != "none":
            self.error_feedback = ErrorFeedback(self._feedback_elements())
        if not self.joining:
            self.publish()
            return
        # A joiner publishes the state it holds only once it is the swarm's: a record of any other would
        # count for a lineage the swarm could be sent back to (several joiners on one seeded init).
        ahead = self.prefetch.result() if self.prefetch is not None else None
        view = self.swarm.wait_for_peers(1, self.join_timeout)
        if len([p for p in view if p.peer_id != self.swarm.peer_id]) == 0:
            log.warning("joined the DHT but saw no peer of run %r within %s; training alone until one appears",
                        self.swarm.config.run_name, self.join_timeout)  # fmt: skip
            self.publish()
            return
        round, param_hash = loop.lineage()
        decision = self.swarm.lineage(round=round, param_hash=param_hash)
        if decision.in_canonical:
            self.publish()
            return
        state, behind = None, False
        if ahead is not None and ahead[0].canonical == decision.canonical:
            state = self._checked(ahead[1])
        else:
            if (
                ahead is not None
                and 0 < decision.canonical.round - ahead[0].canonical.round <= MAX_CATCH_UP_ROUNDS
            ):
                # The swarm finished a round while we fetched: from the state we have, its mean
                # (its wire bytes) may take us the rest of the way (_catch_up).
                loop.adopt(self._checked(ahead[1]))
                behind = True
            state = self._fetch_canonical(decision, why="joining")
        if state is None:
            log.warning("training on our own state until the next round's lineage check")
            if behind:  # behind the swarm, on its lineage: the next round's check catches us up
                self._adopted(publish=False)
            self.swarm.announce_syncing(decision.canonical)  # still syncing (see above)
            return
        loop.adopt(state)
        self._adopted()

    def publish(self, round: int | None = None, *, boundary: Boundary | None = None) -> None:
        """Advertise and serve the loop's current global state (after ``round``, default the rounds
        it applied; at ``boundary``, default its step and data position now), with the round's mean
        beside it if this node stepped to it with one."""
        loop = self.loop
        snapshot = loop.snapshot(round, boundary)
        round = snapshot.round_id
        companions = []
        if self._round_mean is not None and self._round_mean.previous[0] + 1 == round:
            companions.append(round_mean_snapshot(snapshot, self._round_mean))
        self._round_mean = None
        self.swarm.publish(
            round=round,
            param_hash=snapshot.state_id,
            tokens_per_s=loop.tokens_per_s(),
            snapshot=snapshot,
            companions=companions,
        )
        self._published = (round, snapshot.state_id)

    def publish_landed(self, round: int, boundary: Boundary) -> None:
        """Overlap: round ``round`` was applied on the averaging thread (the loop saw it land at a
        step boundary, ``DiLoCo.landed``); advertise and serve it now, not a phase later, so the
        swarm's lineage check sees every member of the round on its new params at once, and a node
        that sees that lineage can fetch it (or its mean) right away.

        ``boundary``: the step and data position of the round's end, which the loop kept when it
        handed the round over: every member serves the same ones, while each is mid-phase."""
        if self._published is None or self._published[0] < round:
            self.publish(round, boundary=boundary)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What one round carries into the next, for the checkpoint: the codec's error-feedback
        residual (a copy). Without it a resumed node's next round encodes another vector than an
        uninterrupted node's, and the runs part from there."""
        if self.error_feedback is None:
            return {}
        return {"error_feedback": self.error_feedback.residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (after :meth:`start`; not after adopting the swarm's state,
        whose residual would be of other params). A residual of another size (another codec or
        streams setting) is dropped with a warning: it only delays what error feedback adds."""
        residual = state.get("error_feedback")
        if residual is None or self.error_feedback is None:
            return
        if residual.shape != self.error_feedback.residual.shape:
            log.warning("the checkpoint's error-feedback residual (%d numbers) does not fit this node's (%d); "
                        "starting from zero", residual.numel(), self.error_feedback.num_elements)  # fmt: skip
            return
        self.error_feedback.residual.copy_(residual)

    def serve_stragglers(self) -> int:
        """At the end of a run, serve our last state while a node is behind it (``protocol/swarm/
        participation.py``); how many nodes were behind."""
        return serve_stragglers(self.swarm)

    def stop(self) -> None:
        """Leave the swarm (a tombstone, so rounds stop waiting for us) and close every connection."""
        try:
            self.swarm.leave()
        finally:
            self.swarm.close()

    @property
    def catching_up(self) -> bool:
        """Whether we adopted the swarm's state mid-phase and end our phase when its round forms
        (meanwhile the swarm's view is read every ``view_refresh``, to see that moment sooner)."""
        return self._catching_up

    @catching_up.setter
    def catching_up(self, value: bool) -> None:
        if value != self._catching_up:
            self.swarm.watch_closely(value)
        self._catching_up = value

    # --- the Averager ---

    def average(self, vector: torch.Tensor, *, round_index: int, weight: float) -> AveragingOutcome:
        """The round's outcome (:meth:`_average`) with its metrics: codec error, state-sync bytes and
        failures since the previous round."""
        self.catching_up = False  # we take part in a round (with overlap, in the background)
        outcome = self._average(vector, round_index=round_index, weight=weight)
        failures = Counter(outcome.failures_by_kind)
        if self._state_sync_failures:
            failures["state_sync"] += self._state_sync_failures
        codec_error = None
        if self.last_result is not None and self.last_result.kind == "averaged":
            # The residual is what the codec failed to deliver of this round's Δ (plus the carry);
            # the lossless codec "none" runs without one.
            codec_error = 0.0
            if self.error_feedback is not None:  # (with streams: stream 0's shard, a sample of the rest)
                delta_norm = float(torch.linalg.vector_norm(vector[: self.error_feedback.num_elements]))
                codec_error = self.error_feedback.norm() / delta_norm if delta_norm > 0 else 0.0
        result = self.last_result
        allreduce = None if result is None else result.allreduce
        group = None if result is None else result.group
        outcome = dataclasses.replace(
            outcome,
            failures_by_kind=dict(failures),
            codec_error=codec_error,
            bytes_recv_state_sync=self._bytes_state_sync,
            seconds_forming=None if result is None else result.seconds_forming,
            seconds_allreduce=None if allreduce is None else allreduce.seconds,
            streams=None if allreduce is None or group is None else group.num_streams,
        )
        self._bytes_state_sync = self._state_sync_failures = 0
        self._stepped_alone = outcome.fell_back
        return outcome

    def _average(self, vector: torch.Tensor, *, round_index: int, weight: float) -> AveragingOutcome:
        loop = self.loop
        previous = (round_index - 1, loop.lineage()[1])
        self._round_mean = None
        try:
            result = self.swarm.run_round(
                vector.to("cpu", torch.float32).contiguous(),
                round=previous[0],
                param_hash=previous[1],
                num_tokens=int(weight),
                tokens_per_s=loop.tokens_per_s(),
                error_feedback=self.error_feedback,
            )
        except TimeoutError as error:  # the swarm's loop missed its own deadline: survive the round
            log.warning("round %d did not finish in time (%s); stepping on our own Δ", round_index, error)
            result = RoundResult(kind="failed", round=round_index, reason=f"timeout: {error}")
            failure_kind = "timeout"
        else:
            failure_kind = "round_failed" if result.kind == "failed" else result.kind  # missed, resync
        self.last_result = result
        if self.on_round is not None:
            self.on_round(result)
        if result.kind == "averaged":
            assert result.allreduce is not None and result.group is not None
            outcome = result.allreduce
            if outcome.fell_back:
                log.warning(
                    "round %d fell back to our own Δ: %s", round_index, "; ".join(outcome.failures[:3])
                )
            if not outcome.fell_back:
                # With overlap too: the round steps θ_global from `previous` (the averaging thread
                # starts only after the round before was applied), just a phase later.
                codec = self.swarm.codec
                self._round_mean = RoundMean(
                    previous=previous,
                    mean=outcome.averaged,
                    encoded=outcome.payloads,
                    codec=codec.name,
                    block_size=codec.block_size,
                )
            contributors = {peer for part in outcome.contributors for peer in part}
            kinds = {"peer": len(outcome.failures)} if outcome.failures else {}
            if outcome.fell_back:
                kinds["fell_back"] = 1
            return AveragingOutcome(
                averaged=outcome.averaged,
                num_peers=1 if outcome.fell_back else max(len(contributors), 1),
                bytes_sent=outcome.bytes_sent,
                bytes_recv=outcome.bytes_recv,
                bytes_by_phase={
                    **{f"sent_{phase}": n for phase, n in outcome.bytes_sent_by_phase.items()},
                    **{f"recv_{phase}": n for phase, n in outcome.bytes_recv_by_phase.items()},
                },
                fell_back=outcome.fell_back,
                failures=tuple(outcome.failures),
                members=result.group.member_ids,
                failures_by_kind=kinds,
            )
        if result.kind == "failed":
            log.warning("round %d: %s; stepping on our own Δ", round_index, result.reason)
            return _own_delta(vector, result.reason, failure_kind)
        decision = result.resync
        if result.kind == "missed":
            decision = self._wait_for_canonical_past(round_index - 1)
        if decision is not None and not decision.in_canonical:
            state = self._fetch_canonical(decision, why=f"round {round_index} {result.kind}")
            if state is not None:  # the loop loads it (Adopt)
                return AveragingOutcome(
                    averaged=vector,
                    num_peers=0,
                    adopted_state=state,
                    failures=(result.kind,),
                    failures_by_kind={failure_kind: 1},
                )
            return _own_delta(vector, result.kind, failure_kind)
        log.warning(
            "round %d %s but no canonical state to adopt; stepping on our own Δ", round_index, result.kind
        )
        return _own_delta(vector, result.kind, failure_kind)

    def after_round(
        self, decision: RoundDecision, members: tuple[str, ...], boundary: Boundary | None = None
    ) -> None:
        """After the loop acted on a round's decision (stepped, or adopted the swarm's state): take
        the round's data shard and serve the new state, unless it was served when it landed
        (``publish_landed``; ``boundary``: the round's end, with overlap)."""
        loop = self.loop
        if isinstance(decision, Adopt):
            self._adopted()
            return
        self.catching_up = False
        if members and self.swarm.peer_id in members:
            shard = assign_shard(members, self.swarm.peer_id)
            loop.reshard(shard.shard_index, shard.num_shards)
        if self._published != loop.lineage():
            self.publish(boundary=boundary)

    # --- adopting the canonical state ---

    def _wait_for_canonical_past(self, round: int) -> LineageDecision | None:
        """After a missed round: the lineage decision once the group published params newer than ``round``."""
        loop = self.loop
        budget = self.swarm.config.round_deadline + self.swarm.config.record_ttl
        deadline = time.monotonic() + budget.total_seconds()
        while time.monotonic() < deadline and not loop.stop_requested():  # SIGTERM ends the wait
            decision = self.swarm.lineage(round=round, param_hash=loop.lineage()[1])
            if not decision.in_canonical and decision.canonical.round > round:
                return decision
            time.sleep(self.swarm.config.view_refresh.total_seconds())
        return None

    def _fetch_canonical(self, decision: LineageDecision, *, why: str) -> AdoptedState | None:
        """Fetch the canonical state, checked against this node's model and corpus; None (logged) if
        no source delivered it in time.

        Every fetch is announced (``SwarmNode.fetch_state(announce=True)``): until we hold the state
        our record says which state we fetch and when we expect to hold it, so the leader of that
        lineage's next round waits for us (``RoundFormation._joiners_due``) and, with
        ``--round-seconds``, its members train on meanwhile (:meth:`lineage_peer_due`). Without
        this, a node whose catch-up takes longer than the swarm's round arrives one round late
        every round, forever.

        A failed fetch is survived, never fatal: the sources may be unreachable (a partition not
        healed yet), and the next round's lineage check tries again.
        """
        canonical = decision.canonical
        behind = canonical.round - self.loop.lineage()[0]
        if not self._stepped_alone and 0 < behind <= MAX_CATCH_UP_ROUNDS:
            caught_up = self._catch_up(decision, why=why)
            if caught_up is not None:
                return caught_up
        log.info("%s: adopting the swarm's state (round %d, param_hash %s) from %d source(s)",
                 why, canonical.round, canonical.param_hash[:12], len(decision.sync_sources))  # fmt: skip
        try:
            report = self.swarm.fetch_state(decision, announce=True)
        except (StateSyncError, ValueError, TimeoutError) as error:
            log.warning("could not fetch the swarm's state (%s): %s", why, error)
            self._state_sync_failures += 1
            return None
        return self._checked(report)

    def _catch_up(self, decision: LineageDecision, *, why: str) -> AdoptedState | None:
        """At most MAX_CATCH_UP_ROUNDS behind: step to the swarm's state with its rounds' means
        (``node/catch_up.py``); None (logged) if that cannot be done: fetch the whole state."""
        canonical = decision.canonical
        state, num_bytes, error = catch_up_with_means(self.swarm, self.loop, decision)
        self._bytes_state_sync += num_bytes
        if state is None:
            log.info("%s: cannot step to round %d with its means (%s)", why, canonical.round, error)
            return None
        log.info("%s: stepped to the swarm's state (round %d, param_hash %s) with its rounds' means "
                 "(%.1f MB fetched)", why, canonical.round, canonical.param_hash[:12], num_bytes / 1e6)  # fmt: skip
        self._round_mean = state.round_mean  # serve the last one on too
        self.num_caught_up += 1
        return state

    def _checked(self, report: FetchReport) -> AdoptedState:
        """The fetched snapshot checked against this node's model and corpus (ConfigError if it does
        not fit: another model or corpus, so this node cannot be part of this swarm)."""
        loop = self.loop
        self._bytes_state_sync += sum(report.bytes_by_source.values())
        try:
            return adopted_state(
                report.snapshot, num_elements=loop.num_elements, corpus_sha256=loop.corpus_sha256
            )
        except ValueError as error:
            raise ConfigError(f"cannot join run {self.swarm.config.run_name!r}: {error}") from None

    def lineage_peer_due(self) -> bool:
        """Whether a node is fetching our lineage's state: the loop then trains on past its phase's end
        (``Trainer._phase_due``), so the state is still the lineage's when the node holds it and it
        joins our next round (ARCHITECTURE.md, "Participation"; ``participation.peer_due``)."""
        return peer_due(self.swarm, max_ahead=timedelta(seconds=MAX_DUE_WAIT_SECONDS))

    def phase_should_end(self) -> bool:
        """Whether a node catching up should end its inner phase now (the view is read every
        ``view_refresh`` meanwhile): a peer of its lineage is ready for the next round (join it with
        the steps done so far; the mean weights members by tokens), or a peer is past the adopted
        round (the round's lineage check then catches us up at once, not a phase later)."""
        if not self.catching_up or self._loop is None:
            return False
        return rejoin_due(self.swarm.driver.view, self.swarm.peer_id, self._adopted_lineage)

    def _feedback_elements(self) -> int:
        """The numbers our own residual covers: the whole vector, or with streams stream 0's shard
        (each other stream keeps its shard's residual where it runs)."""
        num_streams = 1 + len(self.swarm.stream_addresses)
        return stream_bounds(self.loop.num_elements, num_streams)[1]

    def _adopted(self, *, publish: bool = True) -> None:
        """The trainer loaded the swarm's state: fresh error-feedback residuals, serve the new state
        (unless ``publish`` is False: an older state of the swarm's, which only catches us up)."""
        self.catching_up, self._stepped_alone = True, False
        self._adopted_lineage = self.loop.lineage()
        if self.error_feedback is not None:  # residuals of other params
            self.error_feedback = ErrorFeedback(self._feedback_elements())
            if self.streams is not None:
                self.streams.reset_error_feedback()
        self.num_adoptions += 1
        if publish:
            self.publish()


def _own_delta(vector: torch.Tensor, reason: str, failure_kind: str) -> AveragingOutcome:
    """The outcome of a round this node steps through on its own Δ (``failure_kind``: metrics.py)."""
    return AveragingOutcome(
        averaged=vector, num_peers=1, fell_back=True, failures=(reason,), failures_by_kind={failure_kind: 1}
    )
