"""The node's side of the swarm: DiLoCo rounds through agreed groups, joining, re-syncing, shards.

:class:`SwarmSession` is the loop's :class:`~node.outer.seam.SwarmSide`. It talks to the swarm only
through :class:`protocol.swarm.node.SwarmNode` (which owns every socket) and never calls the loop:
the outer round (``node/outer/round.py``) tells it what it needs as arguments (the lineage, the state
to serve, the model's identity) and acts on what it answers. Each round's answer is one
:class:`~node.outer.seam.RoundOutcome` whose decision the loop acts on:

========================  ===========================  ===========================================
swarm's answer            decision                     what follows
========================  ===========================  ===========================================
averaged                  Averaged(mean)               outer step; the group's agreed data position,
                                                       resharded among the group
averaged, fell back       FellBack(own Δ)              outer step on our own Δ; the next round's
failed (too few peers)                                 lineage check sends us to re-sync (with the
                                                       rounds' means from the state before the step)
missed (group without us) Adopt(state)                 the group's new state, stepped to with the
resync (wrong lineage)                                 rounds' means (``node/swarm/catch_up.py``) or
                                                       fetched whole, verified (``swarm_state``)
========================  ===========================  ===========================================

Adopting a state replaces the node's global params, outer momentum, round and step counters and
data position with the source's (``shards.py`` explains the data contract); the local inner steps
since the last round are discarded, since their Δ was computed against other params. A node whose
last round fell back stepped on its own Δ: no chain of means leads to its state, so it steps with the
rounds' means from the state it held before that step (its state provider keeps it beside the new
one), or, after a second round alone, fetches the whole state at once. Every fetch is announced,
and the lineage's members train on while it runs (ARCHITECTURE.md, "Participation").
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from datetime import timedelta

import torch

from node.config import ConfigError
from node.outer.seam import (
    MAX_DUE_WAIT,
    Adopt,
    AdoptedState,
    Averaged,
    FellBack,
    JoinAnswer,
    JoinRequest,
    Lineage,
    NextShard,
    RoundDecision,
    RoundOutcome,
    RoundRequest,
    RoundStats,
    StartAnswer,
    Stepped,
)
from node.swarm.catch_up import catch_up_with_means, max_catch_up_rounds, rejoin_due
from node.swarm.join import JOIN_TIMEOUT, Prefetch
from node.swarm.state import RoundMean, adopted_state, round_mean_snapshot, served_state
from protocol.allreduce.allreduce import AllReduceResult
from protocol.codecs import TopKCodec
from protocol.error_feedback import ErrorFeedback
from protocol.membership.lineage import LineageDecision, decide_lineage
from protocol.membership.messages import GroupSpec
from protocol.membership.shards import assign_shard, spare_lane, spare_lane_to_move_to, start_lane
from protocol.statesync.errors import StateSyncError
from protocol.statesync.fetch import FetchReport
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.node import SwarmNode
from protocol.swarm.participation import (
    START_TIMEOUT,
    ReadySeen,
    await_lineage_past,
    await_start_peers,
    peer_due,
    serve_stragglers,
)
from protocol.swarm.result import (
    GroupAveraged,
    LineageResync,
    RoundMissed,
    RoundNotFormed,
    RoundResult,
    result_name,
)
from protocol.swarm.streams import StreamRunner, stream_bounds

log = logging.getLogger(__name__)

ROUND_FORMING_POLL_S = 0.2
"""How often a node waiting for the swarm's round to be due reads the DHT (``await_round_forming``)."""


class SwarmSession:
    """The swarm side of a node; see the module docstring.

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
        # --fragments: each fragment's own residual (its rounds average its own vector); empty without.
        self.fragment_feedback: list[ErrorFeedback] = []
        self.streams: StreamRunner | None = None  # all-reduce streams 1..S-1 (--swarm-streams)
        self.last_result: RoundResult | None = None
        self.num_adoptions = 0
        self._catching_up = False  # adopted mid-phase: end our phase when the swarm's round forms
        self._watch_rounds = False  # the loop asks whether the round forms (round_forming): watch closely
        self._adopted_lineage: Lineage = (0, "")
        self._join: JoinRequest | None = None  # the model's identity and tools (join)
        self._ready_seen = ReadySeen()  # when a ready peer of our lineage was first seen (peer_due)
        # The global state this node holds: the one it last served, or an older state of the
        # swarm's it stepped to at start; a catch-up with the rounds' means starts from it.
        # Its (params, momentum) are put together when a catch-up needs them (``_held_state``).
        self._held: tuple[Lineage, Callable[[], Stepped]] | None = None
        # Between two rounds (e.g. while joining): state fetched and fetches failed, reported with
        # the next round's outcome (node/ops/metrics.py).
        self._bytes_state_sync = 0
        self._state_sync_failures = 0
        # The last round's mean Δ̄ and the (round, param_hash) it stepped from: served beside the
        # new state (round_mean_snapshot) until the next publish.
        self._round_mean: RoundMean | None = None
        # The round mean's snapshot built beside a state before it is published (prepare_publish):
        # (the state, the mean, the mean's snapshot).
        self._prepared: tuple[Snapshot, RoundMean, Snapshot] | None = None
        self.num_caught_up = 0  # missed rounds stepped through with the swarm's mean
        # Our last round stepped on our own Δ (it fell back): no member's chain of means leads to our
        # state, so a catch-up cannot start from it. It starts from the state we held before that
        # step (``_chain_held``) while we keep it, else the whole state is fetched at once.
        self._stepped_alone = False
        # The state we held on the swarm's chain of means before one round on our own Δ: the state
        # provider keeps it beside our own-Δ state, so holding it costs no copy. A second round on
        # our own Δ drops it (the provider does too).
        self._chain_held: tuple[Lineage, Callable[[], Stepped]] | None = None
        self._held_alone = False  # ``_held`` came from a round on our own Δ
        self._stepping_alone = False  # the same, for the round being averaged
        # Rounds our state went through alone (solo, fell back, stepped on our own Δ) since the last
        # one we shared with a group: what adopting another state would discard (a WARNING says so).
        self._rounds_alone: list[int] = []
        self._data_lane: tuple[int, int] | None = None  # what our records say we read (_say_lane)
        self._group: GroupSpec | None = None  # the last round's group, if one formed with us

    # --- lifecycle ---

    @property
    def identity(self) -> JoinRequest:
        assert self._join is not None, "join() the swarm first"
        return self._join

    @property
    def _max_catch_up_rounds(self) -> int:
        """How many rounds behind we step to the swarm's state with their means (2, or 2F)."""
        return max_catch_up_rounds(len(self.identity.fragment_sizes))

    def join(self, request: JoinRequest) -> JoinAnswer:
        """Announce the node; a joiner whose own state is not the swarm's gets the swarm's to adopt.
        The loop then loads and serves what this answers, and calls :meth:`await_start_peers`."""
        self._join = request
        self.swarm.set_identity(request.identity, rank=request.rank)  # before our first record
        held = request.held
        self._held = ((held.round_id, held.state_id), self._held_state(held))
        self.streams = None
        if request.open_streams is not None:
            self.streams = request.open_streams()
            self.swarm.attach_streams(self.streams)
        if self.swarm.codec.name != "none":
            self._new_feedback()
        if not self.joining:
            return JoinAnswer()
        # A joiner serves the state it holds only once it is the swarm's: a record of any other would
        # count for a lineage the swarm could be sent back to (several joiners on one seeded init).
        ahead = self.prefetch.result() if self.prefetch is not None else None
        view = self.swarm.wait_for_peers(1, self.join_timeout, or_foreign=True)
        if view.foreign and not [p for p in view if p.peer_id != self.swarm.peer_id]:
            # Every node we found trains something else: joining them is a mistake, not a new swarm.
            theirs = ", ".join(sorted({record.identity[:12] for record in view.foreign}))
            raise ConfigError(
                f"cannot join run {self.swarm.config.run_name!r}: its node(s) train another corpus or model than "
                f"ours (identity {theirs}, ours {request.identity[:12]}): the same model, data (or data_id) and "
                "tokenizer are needed"
            )
        if len([p for p in view if p.peer_id != self.swarm.peer_id]) == 0:
            log.warning("joined the DHT but saw no peer of run %r within %s; training alone until one appears",
                        self.swarm.config.run_name, self.join_timeout)  # fmt: skip
            return JoinAnswer()
        ours = self._held[0]
        # A fresh node follows the swarm's lineage, even where its own init would win the tie-break.
        decision = self.swarm.lineage(round=ours[0], param_hash=ours[1], defer=ours[0] == 0)
        if decision.in_canonical:
            return JoinAnswer()
        if ours[0] == 0 and decision.canonical.round == 0:
            _warn_other_init(ours[1], decision.canonical.param_hash, "the swarm's")
        state, behind = None, None
        if ahead is not None and ahead[0].canonical == decision.canonical:
            state = self._checked(ahead[1])
        else:
            if (
                ahead is not None
                and 0 < decision.canonical.round - ahead[0].canonical.round <= self._max_catch_up_rounds
            ):
                # The swarm finished a round while we fetched: from the state we have, its mean
                # (its wire bytes) may take us the rest of the way (_catch_up).
                behind = self._checked(ahead[1])
                self._held = (behind.lineage, _held_stepped(behind))
            state = self._fetch_canonical(decision, why="joining", ours=self._held[0])
        if state is None:
            log.warning("training on our own state until the next round's lineage check")
            self.swarm.announce_syncing(decision.canonical)  # still syncing (see above)
            if behind is not None:  # behind the swarm, on its lineage: the next round's check catches us up
                self._adopted(behind)
                return JoinAnswer(behind, serve=False)
            return JoinAnswer(serve=False)  # our own state, not the swarm's: not served (see above)
        self._adopted(state)
        return JoinAnswer(state, spare_lane=self._spare_lane(state))

    def await_start_peers(self) -> StartAnswer:
        """The start barrier (``protocol/swarm/participation.py``): wait until ``start_peers`` nodes
        of the run are live (after the loop served its state: each counts the others' records).

        A fresh run (every node the barrier saw at round 0) then settles two things before the first
        inner step, from the live records the barrier passed on, so every node that saw the same
        nodes settles them alike: the lineage (nodes started on different inits take the one the
        lineage rule names, with a WARNING: nothing was trained yet), and the data shards (the nodes
        in the member order: by rank, then peer id; ``protocol/membership/shards.py``), unless nodes
        past the barrier already read another assignment (they saw other nodes): then a spare lane
        beside their shards. A node that joins a run past round 0 reads a spare lane until its first
        round (as at any join: :meth:`_spare_lane`)."""
        if self.start_peers <= 1:
            return StartAnswer()
        view = await_start_peers(
            self.swarm, self.start_peers, self.start_timeout, self.identity.stop_requested
        )
        record = self.swarm.driver.record
        if record is None or record.status != "active" or self.identity.stop_requested():
            return StartAnswer()  # (a joiner still fetching the swarm's state serves nothing yet)
        records = view.with_local(record)
        if record.round != 0 or any(peer.round != 0 for peer in records) or len(records) < 2:
            return StartAnswer()
        decision = decide_lineage(records, record)
        adopt = None
        if not decision.in_canonical:
            _warn_other_init(record.param_hash, decision.canonical.param_hash, "the start barrier's nodes'")
            adopt = self._fetch_canonical(decision, why="start barrier", ours=None)
            if adopt is None:  # (logged) the first round's lineage check sends us to re-sync
                return StartAnswer()
            self._adopted(adopt)
        shard, lane = start_lane(records, self.swarm.peer_id)
        if lane is None:
            log.info("start barrier: %d node(s) on one lineage; reading data shard %d of %d from the first step",
                     len(records), shard.shard_index, shard.num_shards)  # fmt: skip
            self._say_lane((shard.shard_index, shard.num_shards), store_now=True)
        else:
            log.info("start barrier: the nodes past it read %d data shard(s) without us; reading spare lane %d "
                     "beside them from the first step", shard.num_shards, lane)  # fmt: skip
            self._say_lane((shard.num_shards + lane, shard.num_shards), store_now=True)
        return StartAnswer(adopt=adopt, shard=(shard.shard_index, shard.num_shards), spare_lane=lane)

    def prepare_publish(self, snapshot: Snapshot) -> None:
        """Build the round mean's snapshot that :meth:`publish` serves beside ``snapshot`` (a copy of Δ̄,
        fp32 or the codec's bytes, and its hashes) here, on the averaging thread with overlap, not in publish."""
        round_mean = self._round_mean
        if round_mean is not None and round_mean.previous[0] + 1 == snapshot.round_id:
            self._prepared = (snapshot, round_mean, round_mean_snapshot(snapshot, round_mean))

    def publish(self, snapshot: Snapshot, *, tokens_per_s: float) -> None:
        """Advertise and serve ``snapshot``, the loop's global state now, with the round's mean beside
        it if this node stepped to it with one (the one :meth:`prepare_publish` built, if of these)."""
        round = snapshot.round_id
        companions = []
        round_mean, prepared, self._prepared = self._round_mean, self._prepared, None
        if round_mean is not None and round_mean.previous[0] + 1 == round:
            if prepared is not None and prepared[0] is snapshot and prepared[1] is round_mean:
                companions.append(prepared[2])
            else:
                companions.append(round_mean_snapshot(snapshot, round_mean))
        self._round_mean = None
        self.swarm.publish(
            round=round,
            param_hash=snapshot.state_id,
            tokens_per_s=tokens_per_s,
            snapshot=snapshot,
            companions=companions,
        )
        before, self._held = self._held, ((round, snapshot.state_id), self._held_state(snapshot))
        if before is not None and before[0] == self._held[0]:
            return  # the same state served again
        if self._stepped_alone and not self._held_alone and before is not None and before[0][0] < round:
            self._chain_held = before  # our first round on our own Δ: the state we held before it
        else:
            self._chain_held = None  # on the chain again, or a second round alone (no longer kept)
        self._held_alone = self._stepped_alone

    def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
        """This node's throughput in the phase under way and its step time (``PeerRecord.step_seconds``:
        peers compare it, ``node/outer/uneven.py``), in its record from the next heartbeat on."""
        self.swarm.advertise_rate(tokens_per_s, step_seconds=step_seconds)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """What one round carries into the next, for the checkpoint: the codec's error-feedback
        residual (a copy). Without it a resumed node's next round encodes another vector than an
        uninterrupted node's, and the runs part from there."""
        if self.fragment_feedback:  # one residual per fragment
            return {f"error_feedback.{f}": ef.residual.clone() for f, ef in enumerate(self.fragment_feedback)}
        if self.error_feedback is None:
            return {}
        return {"error_feedback": self.error_feedback.residual.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`state_dict` (after :meth:`join`; not after adopting the swarm's state,
        whose residual would be of other params). A residual of another size (another codec or
        streams setting) is dropped with a warning: it only delays what error feedback adds."""
        feedbacks = {f"error_feedback.{f}": ef for f, ef in enumerate(self.fragment_feedback)}
        if self.error_feedback is not None:
            feedbacks["error_feedback"] = self.error_feedback
        for key, feedback in feedbacks.items():
            residual = state.get(key)
            if residual is None:
                continue
            if residual.shape != feedback.residual.shape:
                log.warning("the checkpoint's error-feedback residual %s (%d numbers) does not fit this node's (%d); "
                            "starting from zero", key, residual.numel(), feedback.num_elements)  # fmt: skip
                continue
            feedback.residual.copy_(residual)

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
            self.swarm.watch_closely(value or self._watch_rounds)
        self._catching_up = value

    # --- the round ---

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        """The round's outcome (:meth:`_average`) with its metrics: codec error, state-sync bytes and
        failures since the previous round."""
        self.catching_up = False  # we take part in a round (with overlap, in the background)
        feedback = self._feedback(request)
        decision, stats = self._average(vector, request, feedback)
        failures = Counter(stats.failures_by_kind)
        if self._state_sync_failures:
            failures["state_sync"] += self._state_sync_failures
        codec_error = None
        result = self.last_result
        if isinstance(result, GroupAveraged):
            # The residual is what the codec failed to deliver of this round's Δ (plus the carry);
            # the lossless codec "none" runs without one.
            codec_error = 0.0
            if feedback is not None:  # (with streams: stream 0's shard, a sample of the rest)
                delta_norm = float(torch.linalg.vector_norm(vector[: feedback.num_elements]))
                codec_error = feedback.norm() / delta_norm if delta_norm > 0 else 0.0
        stats = dataclasses.replace(
            stats,
            failures_by_kind=dict(failures),
            codec_error=codec_error,
            bytes_recv_state_sync=self._bytes_state_sync,
            seconds_forming=None if result is None else result.seconds_forming,
            seconds_allreduce=result.allreduce.seconds if isinstance(result, GroupAveraged) else None,
            streams=result.group.num_streams if isinstance(result, GroupAveraged) else None,
        )
        self._bytes_state_sync = self._state_sync_failures = 0
        self._stepped_alone = self._stepping_alone
        # Our own count of whose Δ is in the round (RoundStats.num_peers): shared, adopted, or alone.
        if stats.num_peers >= 2:
            self._rounds_alone = []
        elif stats.num_peers == 1:
            self._rounds_alone.append(request.round_index)
        return RoundOutcome(decision, stats)

    def lift_pace(self, round_index: int) -> None:
        """Paced round ``round_index`` sends the rest at full rate (``SwarmSide.lift_pace``)."""
        self.swarm.lift_pace(round_index)

    def _feedback(self, request: RoundRequest) -> ErrorFeedback | None:
        """The error-feedback residual of the vector this round averages: its fragment's, or the whole's."""
        if request.fragment is not None and self.fragment_feedback:
            return self.fragment_feedback[request.fragment]
        return self.error_feedback

    def _average(
        self, vector: torch.Tensor, request: RoundRequest, feedback: ErrorFeedback | None
    ) -> tuple[RoundDecision, RoundStats]:
        round_index, previous = request.round_index, request.lineage
        self._round_mean = self._prepared = None
        self._group = None
        self._stepping_alone = False  # this round steps on our own Δ (_own_delta; _stepped_alone after it)
        result: RoundResult
        try:
            result = self.swarm.run_round(
                vector.to("cpu", torch.float32).contiguous(),
                round=previous[0],
                param_hash=previous[1],
                num_tokens=int(request.weight),
                tokens_per_s=request.tokens_per_s,
                error_feedback=feedback,
                vector_name=f"fragment {request.fragment}" if request.fragment is not None else "",
                send_window=request.send_window,
            )
        except TimeoutError as error:  # the swarm's loop missed its own deadline: survive the round
            log.warning("round %d did not finish in time (%s); stepping on our own Δ", round_index, error)
            result = RoundNotFormed(round=round_index, reason=f"timeout: {error}")
            failure_kind = "timeout"
        else:
            failure_kind = {"failed": "round_failed"}.get(result_name(result), result_name(result))
        self.last_result = result
        if self.on_round is not None:
            self.on_round(result)
        match result:
            case GroupAveraged(group=group, allreduce=outcome):
                self._group = group  # what the members agreed on: the data's next position (after_step)
                return self._averaged(vector, request, group.member_ids, outcome)
            case RoundNotFormed(reason=reason):
                log.warning("round %d: %s; stepping on our own Δ", round_index, reason)
                return self._own_delta(vector, reason, failure_kind)
            case LineageResync(decision=lineage):
                return self._resync(vector, round_index, lineage, why="resync", failure_kind=failure_kind)
            case RoundMissed(told_by=told_by):
                lineage_past = self._wait_for_canonical_past(previous, told_by)
                return self._resync(
                    vector, round_index, lineage_past, why="missed", failure_kind=failure_kind
                )

    def _averaged(
        self,
        vector: torch.Tensor,
        request: RoundRequest,
        members: tuple[str, ...],
        outcome: AllReduceResult,
    ) -> tuple[RoundDecision, RoundStats]:
        """A group ran its all-reduce: its mean, or our own Δ if it fell back."""
        round_index = request.round_index
        if outcome.fell_back:
            log.warning("round %d fell back to our own Δ: %s", round_index, "; ".join(outcome.failures[:3]))
        else:
            # With overlap too: the round steps θ_global from the request's lineage (the averaging
            # thread starts only after the round before was applied), just a phase later. With
            # --fragments: the round's fragment's mean, served with its fragment named.
            codec = self.swarm.codec
            self._round_mean = RoundMean(
                previous=request.lineage,
                mean=outcome.averaged,
                encoded=outcome.payloads,
                codec=codec.name,
                block_size=codec.block_size,
                kept_per_block=codec.spec().kept_per_block,
                fragment=request.fragment,
            )
        contributors = {peer for part in outcome.contributors for peer in part}
        kinds = {"peer": len(outcome.failures)} if outcome.failures else {}
        if outcome.fell_back:
            kinds["fell_back"] = 1
        codec = self.swarm.codec
        stats = RoundStats(
            num_peers=1 if outcome.fell_back else max(len(contributors), 1),
            members=members,
            density=codec.density if isinstance(codec, TopKCodec) else 1.0,
            bytes_sent=outcome.bytes_sent,
            bytes_recv=outcome.bytes_recv,
            bytes_by_phase={
                **{f"sent_{phase}": n for phase, n in outcome.bytes_sent_by_phase.items()},
                **{f"recv_{phase}": n for phase, n in outcome.bytes_recv_by_phase.items()},
            },
            failures=tuple(outcome.failures),
            failures_by_kind=kinds,
        )
        if outcome.fell_back:
            self._stepping_alone = True
            return FellBack(outcome.averaged, "; ".join(outcome.failures[:3]) or "fell back"), stats
        if len(members) == 1:  # a group of one: our own Δ is the mean (reported as solo, RoundApplied.kind)
            log.info("round %d: solo (no other node of our lineage was ready)", round_index)
        return Averaged(outcome.averaged), stats

    def _resync(
        self,
        vector: torch.Tensor,
        round_index: int,
        decision: LineageDecision | None,
        *,
        why: str,
        failure_kind: str,
    ) -> tuple[RoundDecision, RoundStats]:
        """We missed the round or are off the lineage: the swarm's state to adopt, else our own Δ."""
        if decision is not None and not decision.in_canonical:
            state = self._fetch_canonical(decision, why=f"round {round_index} {why}", ours=None)
            if state is not None:  # the loop loads it (Adopt)
                stats = RoundStats(num_peers=0, failures=(why,), failures_by_kind={failure_kind: 1})
                return Adopt(state), stats
            return self._own_delta(vector, why, failure_kind)
        log.warning("round %d %s but no canonical state to adopt; stepping on our own Δ", round_index, why)
        return self._own_delta(vector, why, failure_kind)

    def after_step(self, members: tuple[str, ...]) -> NextShard | None:
        """The loop stepped through a round (Averaged or FellBack): the data shard (index, count) to
        train on next, if the round's group assigned one, and what the group agreed on about the
        phase it read (``NextShard``: every member moves to one data position from it)."""
        self.catching_up = False
        if not members or self.swarm.peer_id not in members:
            return None
        shard = assign_shard(members, self.swarm.peer_id)
        self._say_lane((shard.shard_index, shard.num_shards))  # in the record the loop serves next
        group = self._group if self._group is not None and self._group.member_ids == members else None
        return NextShard(
            shard_index=shard.shard_index,
            num_shards=shard.num_shards,
            # A run's first phase was read as the start barrier assigned it, from each node's view.
            phase_shards=len(members) if group is not None and group.round == 1 else None,
            phase_tokens=max((member.num_tokens for member in group.members), default=0) if group else 0,
        )

    # --- adopting the canonical state ---

    def _wait_for_canonical_past(self, ours: Lineage, told_by: str | None) -> LineageDecision | None:
        """After a missed round: the lineage decision once the group published params newer than ours,
        None (we step on our own Δ) if none is canonical within the wait (``missed_round_wait`` after
        the peer that told us the round began is last seen in it); a SIGTERM ends the wait
        (``participation.await_lineage_past``)."""
        return await_lineage_past(
            self.swarm,
            round=ours[0],
            param_hash=ours[1],
            told_by=told_by,
            stop_requested=self.identity.stop_requested,
        )

    def _fetch_canonical(
        self, decision: LineageDecision, *, why: str, ours: Lineage | None
    ) -> AdoptedState | None:
        """Fetch the canonical state, checked against this node's model and corpus; None (logged) if
        no source delivered it in time. ``ours``: the lineage of the state we hold (None: the one
        we last served).

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
        held = self._chain_held if self._stepped_alone else self._held
        if held is not None and 0 < canonical.round - held[0][0] <= self._max_catch_up_rounds:
            caught_up = self._catch_up(decision, held, why=why)
            if caught_up is not None:
                if self._stepped_alone:
                    self._warn_discarded(canonical.round, canonical.param_hash)
                return caught_up
        log.info("%s: adopting the swarm's state (round %d, param_hash %s) from %d source(s)",
                 why, canonical.round, canonical.param_hash[:12], len(decision.sync_sources))  # fmt: skip
        try:
            report = self.swarm.fetch_state(decision, announce=True)
        except (StateSyncError, ValueError, TimeoutError) as error:
            log.warning("could not fetch the swarm's state (%s): %s", why, error)
            self._state_sync_failures += 1
            return None
        state = self._checked(report)
        self._warn_discarded(canonical.round, canonical.param_hash)
        return state

    def _warn_discarded(self, round: int, param_hash: str) -> None:
        """Adopting the state ``(round, param_hash)`` discards trained rounds of ours: say which."""
        held = self._held[0] if self._held is not None else (0, "")
        alone = self._rounds_alone
        ahead = list(range(round + 1, held[0] + 1))  # rounds we hold past the swarm's state
        if not alone and not ahead:
            return
        lost = sorted({*alone, *ahead})
        log.warning("adopting the swarm's state (round %d, param_hash %s) in place of ours (round %d, param_hash "
                    "%s) discards %d round(s) of ours the swarm's state does not hold (round(s) %s: %s) and the "
                    "inner steps since", round, param_hash[:12], held[0], held[1][:12], len(lost),
                    _spans(lost), "stepped without the swarm" if alone else "the swarm's lineage outnumbers ours")  # fmt: skip

    def _held_state(self, snapshot: Snapshot) -> Callable[[], Stepped]:
        """The (global params, outer momentum) a served snapshot holds, put together when asked
        (served in fragments: ``served_state`` makes whole copies, which only a catch-up needs)."""
        assemble = self.identity.fragment_assemble if self._join is not None else None
        return lambda: served_state(snapshot, assemble)

    def _catch_up(
        self, decision: LineageDecision, held: tuple[Lineage, Callable[[], Stepped]], *, why: str
    ) -> AdoptedState | None:
        """At most ``max_catch_up_rounds`` behind: step from ``held`` to the swarm's state with its rounds'
        means (``node/swarm/catch_up.py``); None (logged) if that cannot be done: fetch the whole state."""
        canonical, identity = decision.canonical, self.identity
        state, num_bytes, error = catch_up_with_means(
            self.swarm, decision, ours=held[0], held=held[1](), stepper=identity.stepper,
            num_elements=identity.num_elements, corpus_sha256=identity.corpus_sha256,
            fragment_sizes=identity.fragment_sizes, fragment_stepper=identity.fragment_stepper,
        )  # fmt: skip
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
        identity = self.identity
        self._bytes_state_sync += sum(report.bytes_by_source.values())
        try:
            return adopted_state(
                report.snapshot, num_elements=identity.num_elements, corpus_sha256=identity.corpus_sha256,
                assemble=identity.fragment_assemble,
            )  # fmt: skip
        except ValueError as error:
            raise ConfigError(f"cannot join run {self.swarm.config.run_name!r}: {error}") from None

    def lineage_peer_due(self) -> bool:
        """Whether a node is fetching our lineage's state: the loop then trains on past its phase's end
        (``OuterRound``), so the state is still the lineage's when the node holds it and it joins our
        next round (ARCHITECTURE.md, "Participation"; ``participation.peer_due``)."""
        return peer_due(self.swarm, max_ahead=MAX_DUE_WAIT, ready_seen=self._ready_seen)

    def phase_should_end(self) -> bool:
        """Whether a node catching up should end its inner phase now (the view is read every
        ``view_refresh`` meanwhile): a peer of its lineage is ready for the next round (join it with
        the steps done so far; the mean weights members by tokens), or a peer is past the adopted
        round (the round's lineage check then catches us up at once, not a phase later)."""
        if not self.catching_up or self._join is None:
            return False
        return rejoin_due(self.swarm.driver.view, self.swarm.peer_id, self._adopted_lineage)

    def round_forming(self) -> bool:
        """Whether a peer of the lineage we hold is ready for its next round: the swarm's round is due
        (the loop of a node slower than its swarm then ends its phase short of H, ``OuterRound``).
        From the view in memory, nothing blocks; from the first call on, the view is read every
        ``view_refresh`` between rounds (not every 5 x), so a slow node sees the moment sooner."""
        if not self._watch_rounds:
            self._watch_rounds = True
            self.swarm.watch_closely(True)
        held = self._held
        if held is None:
            return False
        # The view's index of its lineages (built once per view): asked at every step boundary.
        ready = self.swarm.driver.view.of_lineage(*held[0]).ready_set
        return not ready <= {self.swarm.peer_id}

    def step_seconds_range(self) -> tuple[float, float] | None:
        """The shortest and the longest step time the live peers of the lineage we hold announce, from
        the view in memory (None: none does, or we hold none): the loop tells from them whether the
        swarm's speeds are uneven (``node/outer/uneven.py``)."""
        held = self._held
        if held is None:
            return None
        # Gathered once per view and lineage (asked at every step boundary).
        return self.swarm.driver.view.of_lineage(*held[0]).step_seconds_range(self.swarm.peer_id)

    def await_round_forming(self, seconds: float) -> bool:
        """Wait until :meth:`round_forming`, at most ``seconds`` (or a stop request), reading the DHT
        every ``ROUND_FORMING_POLL_S``: the loop of a slower node, ready before the swarm's round is
        due, waits here rather than in the round's formation, where its readiness would tell the
        swarm's other nodes that the round is due. Returns whether the round forms."""
        deadline = time.monotonic() + seconds
        while not self.round_forming():
            if time.monotonic() >= deadline or self.identity.stop_requested():
                return False
            self.swarm.view_or_last("waiting for the swarm's round")
            time.sleep(min(ROUND_FORMING_POLL_S, max(deadline - time.monotonic(), 0.0)))
        return True

    def _new_feedback(self) -> None:
        """Fresh error-feedback residuals: one per fragment with ``--fragments``, else the whole vector's."""
        decay = self.swarm.config.error_feedback_decay
        sizes = self.identity.fragment_sizes
        if sizes:
            self.fragment_feedback = [ErrorFeedback(size, decay=decay) for size in sizes]
        else:
            self.error_feedback = ErrorFeedback(self._feedback_elements(), decay=decay)

    def _feedback_elements(self) -> int:
        """The numbers our own residual covers: the whole vector, or with streams stream 0's shard
        (each other stream keeps its shard's residual where it runs)."""
        num_streams = 1 + len(self.swarm.stream_addresses)
        return stream_bounds(self.identity.num_elements, num_streams)[1]

    def after_adopt(self, state: AdoptedState) -> int | None:
        """The loop loaded ``state``, the swarm's (a round's Adopt): the spare data lane to read until
        our next round."""
        self._adopted(state)
        return self._spare_lane(state)

    def moved_spare_lane(self) -> int | None:
        """At a step boundary, on a spare data lane: the one to move to if a node earlier in the member
        order reads ours too (we chose at once: ``shards.spare_lane_to_move_to``), said at once;
        else None. From the view in memory: nothing blocks."""
        lane, held = self._data_lane, self._held
        if lane is None or lane[0] < lane[1] or held is None:
            return None
        moved = spare_lane_to_move_to(
            self.swarm.driver.view.peers, lineage=held[0], peer_id=self.swarm.peer_id, rank=self.identity.rank,
            lane=lane,
        )  # fmt: skip
        if moved is None:
            return None
        log.info("another node reads our spare data lane %d too: moving to spare lane %d",
                 lane[0] - lane[1], moved)  # fmt: skip
        self._say_lane((lane[1] + moved, lane[1]), store_now=True)
        return moved

    def _say_lane(self, lane: tuple[int, int], *, store_now: bool = False) -> None:
        """Our records say we read ``lane`` (``PeerRecord.data_lane``): from the next publish, or now."""
        self._data_lane = lane
        self.swarm.set_data_lane(lane, store_now=store_now)

    def _spare_lane(self, state: AdoptedState) -> int:
        """We adopted ``state`` while its lineage's members are in their phase: the spare data lane
        no live member of that lineage reads (``protocol/membership/shards.py``), said in the record
        the loop serves next (the lineage's, from a fresh view: other joiners' lanes are in it)."""
        view = self.swarm.view_or_last("choosing a spare data lane")
        lane = spare_lane(view.peers, lineage=state.lineage, peer_id=self.swarm.peer_id)
        count = int(state.metadata.get("data", {}).get("num_shards", 1))
        self._say_lane((count + lane, count))
        log.info("reading spare data lane %d beside the round's %d shard(s) until our next round", lane, count)  # fmt: skip
        return lane

    def _adopted(self, state: AdoptedState) -> None:
        """The loop loads ``state``, the swarm's: fresh error-feedback residuals (ours are of other
        params); end our phase as soon as the swarm's next round forms."""
        self.catching_up, self._stepped_alone = True, False
        self._rounds_alone = []
        self._adopted_lineage = state.lineage
        self._held = (state.lineage, _held_stepped(state))
        self._chain_held, self._held_alone = None, False
        if self.error_feedback is not None or self.fragment_feedback:  # residuals of other params
            self._new_feedback()
            if self.streams is not None:
                self.streams.reset_error_feedback()
        self.num_adoptions += 1

    def _own_delta(
        self, vector: torch.Tensor, reason: str, failure_kind: str
    ) -> tuple[RoundDecision, RoundStats]:
        """A round this node steps through on its own Δ (``failure_kind``: metrics.py): no member's
        chain of means leads to the state that gives, so a later catch-up starts from the state
        before it (``_chain_held``), or fetches the whole state."""
        self._stepping_alone = True
        return FellBack(vector, reason), RoundStats(failures=(reason,), failures_by_kind={failure_kind: 1})


def _spans(rounds: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``."""
    spans: list[list[int]] = []
    for r in rounds:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _warn_other_init(ours: str, theirs: str, whose: str) -> None:
    """A fresh node's round-0 params are not the swarm's: another seed or init of the same model."""
    log.warning("our round-0 params (param_hash %s) differ from %s (%s): another seed or init of the same "
                "model and data; taking theirs before the first inner step (nothing trained is lost)",
                ours[:12], whose, theirs[:12])  # fmt: skip


def _held_stepped(state: AdoptedState) -> Callable[[], Stepped]:
    """The (global params, outer momentum) of a state the loop loads, as ``SwarmSession._held`` keeps them."""
    stepped = (state.global_params, state.outer_momentum)
    return lambda: stepped
