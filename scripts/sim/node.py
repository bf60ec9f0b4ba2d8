"""One simulated daemon: the life of a ``dtnode join`` process, driving the product's own decisions.

A node trains an inner phase, forms the next round, runs (a model of) the all-reduce or learns that
it missed the round, re-syncs, and trains again, as ``node/swarm/session.py`` and
``protocol/swarm/node.py`` sequence it. Every decision is the product's, called as the daemon calls
it; the simulator only supplies time, the DHT, links and faults:

==========================================  ================================================
daemon                                      here
==========================================  ================================================
``RoundDriver.form`` (protocol/swarm/        one ``RoundFormation`` per round, built with the
driver.py): ``start``, ``on_view`` every     daemon's ``SwarmConfig.rounds``; views every
``view_refresh``, ``tick`` at                ``view_refresh``, a tick at ``next_deadline``, each
``next_deadline``, ``on_message``            message at its arrival; ``Send`` / ``Publish`` /
                                             outcomes executed as the driver executes them
``SwarmRegistry`` heartbeat and TTL          ``SimulatedDht`` stores every ``heartbeat`` with
                                             ``expires_at = now + record_ttl``; a tombstone on leave
``SwarmNode._await_group_published``         the same wait, on the simulated view
``await_lineage_past`` after a missed round  ``decide_lineage`` polled until ``MissedRoundWait``
``SwarmSession._fetch_canonical``            catch-up with the rounds' means when at most
                                             ``MAX_CATCH_UP_ROUNDS`` behind (after one round on our
                                             own Δ: from the params before it), else the whole
                                             state; announced (``syncing`` record)
``OuterRound._phase_due`` / ``peer_due``     ``peer_due`` itself, on a stand-in of ``SwarmNode``
``OuterRound._short_phase_due`` (uneven      ``ShortPhases`` itself (``node/outer/uneven.py``), on
speeds: a lagging node ends its phase short) the view's announced step times, every few steps
``SwarmSession.phase_should_end``            ``rejoin_due`` itself
``Prefetch`` (a fresh joiner)                ``decide_lineage`` on the view, then the fetch
==========================================  ================================================

Time a node spends training counts as compute; the rest of its wall time (forming, the all-reduce,
fetching, waiting) does not: ``compute utilization`` is their ratio.

Steps (rounds due by steps): a phase is H steps (the daemon's ``--inner-steps``) of ``phase_seconds /
speed / H`` seconds each, the step time every node announces in its records. The daemon asks the
uneven-speed rule at every step boundary, from a view refreshed every ``view_refresh``; a simulated
node asks it every ``k`` steps, the fewest that last a ``view_refresh`` (its view changes no sooner),
so it sees the round due up to a step later than the daemon would.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from node.outer.seam import MAX_DUE_WAIT
from node.outer.uneven import AwaitRound, EndShort, ShortPhases, uneven
from node.swarm.catch_up import MAX_CATCH_UP_ROUNDS, rejoin_due
from node.swarm.session import ROUND_FORMING_POLL_S
from protocol.codecs import Codec
from protocol.membership.actions import (
    Action,
    GroupMemberLost,
    MissedRound,
    Outcome,
    Publish,
    Resync,
    RoundFailed,
    Send,
    StartAllReduce,
    reply_without_formation,
)
from protocol.membership.fan_out import send_timeout, wire_sizes
from protocol.membership.lineage import Lineage, decide_lineage
from protocol.membership.messages import GroupSpec, Message
from protocol.membership.records import PeerRecord, SwarmView
from protocol.membership.rounds import RoundFormation
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig
from protocol.swarm.participation import MissedRoundWait, ReadySeen, peer_due
from scripts.sim.allreduce_cost import MemberTraffic, part_payload_bytes
from scripts.sim.dht import SimulatedDht, restamped
from scripts.sim.events import Event, EventQueue
from scripts.sim.groups import AllReduces, LineageTree, Origin, derived_hash
from scripts.sim.links import LinkProfile, Network
from scripts.sim.settings import SimSettings, daemon_node_config

INIT_HASH = derived_hash("the run's seeded init")
"""The round-0 params every node of the run starts from (``dtnode swarm`` seeds them alike)."""
STATE_BYTES_PER_NUMBER = 8
"""A whole state fetch: fp32 global params and fp32 outer momentum."""
MAX_SYNC_SOURCES = 4
"""Sources a fetch reads from in parallel (the first of the decision's, in its rendezvous order)."""
TOKENS_PER_PHASE = 1_000_000
"""Tokens an inner phase of ``phase_seconds`` trains at speed 1x (with a fixed H, what every node's
phase trains, whatever its speed)."""


class NodeState(StrEnum):
    OFF = "off"  # not started, crashed or left
    SYNCING = "syncing"  # fetching the swarm's state
    TRAINING = "training"
    FORMING = "forming"  # waiting for the last group's records, then RoundFormation
    ALLREDUCE = "allreduce"
    MISSED = "missed"  # a group began without us: waiting for its params to become canonical


class Recorder(Protocol):
    """Where a node reports what happened (``report.py``)."""

    def formed(
        self,
        peer_id: str,
        round: int,
        outcome: str,
        started: float,
        seconds: float,
        messages_in: int,
        bytes_out: int,
    ) -> None: ...

    def round_end(
        self, peer_id: str, round: int, how: str, compute_seconds: float, wall_seconds: float
    ) -> None: ...

    def averaged(self, peer_id: str, round: int, bytes_sent: int) -> None: ...

    def up(self, peer_id: str, now: float) -> None: ...

    def down(self, peer_id: str, now: float) -> None: ...

    def holds_state(self, peer_id: str, now: float) -> None: ...

    def error(self, peer_id: str, round: int, what: str) -> None: ...

    def host_seconds(self, peer_id: str, round: int, seconds: float) -> None: ...


@dataclass
class World:
    """What every node shares: time, the DHT, the links, the all-reduces and the product's settings."""

    queue: EventQueue
    dht: SimulatedDht
    network: Network
    allreduces: AllReduces
    lineages: LineageTree
    config: SwarmConfig
    settings: SimSettings
    codec: Codec
    recorder: Recorder
    nodes: dict[str, SimNode]
    record_ttl: float = field(init=False)
    heartbeat: float = field(init=False)
    view_refresh: float = field(init=False)
    message_timeout: float = field(init=False)
    inner_steps: int = field(init=False)
    """H: the daemon's inner steps per phase (rounds due by steps)."""

    def __post_init__(self) -> None:
        # The daemon's durations as seconds: read on every event.
        self.record_ttl = self.config.record_ttl.total_seconds()
        self.heartbeat = self.config.heartbeat.total_seconds()
        self.view_refresh = self.config.view_refresh.total_seconds()
        self.message_timeout = self.config.message_timeout.total_seconds()
        self.inner_steps = daemon_node_config(self.settings).inner.steps

    @property
    def vector_payload_bytes(self) -> int:
        """One round's mean as the codec's bytes (what a catch-up fetches per round)."""
        chunk = self.config.allreduce.chunk_num_elements
        return part_payload_bytes(self.codec, self.settings.num_params, chunk)


_NO_VIEW = SwarmView(now=0.0, peers=())


class _Provider:
    """The part of ``StateProvider`` that ``peer_due`` asks: did we serve a state lately."""

    def __init__(self, node: SimNode) -> None:
        self._node = node

    def served_lately(self, within: float) -> bool:
        return self._node.world.queue.now - within <= self._node.serving_until


class _Driver:
    """The part of ``RoundDriver`` that ``peer_due`` reads."""

    def __init__(self, node: SimNode) -> None:
        self._node = node
        self.view = _NO_VIEW

    @property
    def record(self) -> PeerRecord | None:
        return self._node.published

    def clock(self) -> float:
        return self._node.world.queue.now


class _Server:
    def __init__(self, node: SimNode) -> None:
        self.state_provider = _Provider(node)


class DaemonStandIn:
    """What ``protocol.swarm.participation.peer_due`` reads of a ``SwarmNode``, backed by a sim node."""

    def __init__(self, node: SimNode) -> None:
        self.peer_id = node.peer_id
        self.config = node.world.config
        self.server = _Server(node)
        self.driver = _Driver(node)


class Heartbeat:
    """A node's heartbeat (one per incarnation): it stores the node's record again every
    ``heartbeat``, as ``_after`` would run it (not after the incarnation ends; a frozen node's once
    it thaws). Of all events, heartbeats are the most (a thousand nodes storing one every two seconds
    each), so one object is the queue's event for every beat of an incarnation, scheduled again each
    time, instead of a new ``Event`` and callback per beat."""

    __slots__ = ("at", "incarnation", "node")
    cancelled = False

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self.incarnation = node.incarnation
        self.at = 0.0

    def action(self) -> None:
        node = self.node
        if node.incarnation != self.incarnation or not node.alive:
            return
        queue = node.queue
        now = queue.now
        if now < node.frozen_until:  # frozen: the thread is stopped until it thaws
            queue.schedule(self, node.frozen_until)
            return
        world = node.world
        if node.published is not None:
            world.dht.store(restamped(node.published, now + world.record_ttl), now)
        queue.schedule(self, now + world.heartbeat)


class SimNode:
    """One simulated daemon (see the module docstring)."""

    def __init__(
        self,
        world: World,
        *,
        peer_id: str,
        address: str,
        speed: float,
        profile: LinkProfile,
        heartbeat_offset: float,
    ) -> None:
        self.world = world
        self.queue = world.queue
        self.address = address
        self.heartbeat_offset = heartbeat_offset  # in [0, 1): when in the period its heartbeat falls
        self.peer_id = peer_id
        self.speed = speed
        self.profile = profile
        self.alive = False
        self.frozen_until = -math.inf
        self.incarnation = 0  # a crash or leave ends one; its pending events then do nothing
        self.state = NodeState.OFF
        self.lineage: Lineage | None = None  # the global params we hold
        self.stepped_alone = False  # our state came from our own Δ: no chain of means leads to it
        # The params we held before one round on our own Δ (the session's ``_chain_held``): a
        # catch-up steps from them with the rounds' means; None after a second round alone.
        self.chain_lineage: Lineage | None = None
        self.catching_up = False
        self.adopted = Lineage(0, INIT_HASH)
        self.published: PeerRecord | None = None
        self._own_record: PeerRecord | None = None  # _record()'s, for the lineage it names
        self.formation: RoundFormation | None = None
        self.last_group_members: frozenset[str] = frozenset()
        self.serving_until = -math.inf
        self.stand_in = DaemonStandIn(self)
        self.ready_seen = ReadySeen()  # peer_due's memory, as the session's
        # the phase and the round in progress
        self._phase_started = 0.0
        self._phase_end: Event | None = None
        self._extended_since: float | None = None
        self._compute = 0.0  # seconds trained since our last round ended
        self._round_started = 0.0  # when our last round ended (wall time of this round from here)
        self._form_started = 0.0
        self._messages_in = 0
        self._bytes_out_at_start = 0
        self._tick: Event | None = None
        self._handled: RoundFormation | None = None
        # Uneven speeds (rounds due by steps): the product's rule, this node's step time (what its
        # records announce), a wait for the swarm's round in progress, and the seconds of this phase
        # spent waiting (not training); whether the phase ended short.
        self.short_phases = ShortPhases()
        self.step_seconds = world.settings.phase_seconds / speed / world.inner_steps
        self._await_from = 0.0
        self._await_until = 0.0
        self._waited = 0.0
        self._ended_short = False
        self._missed_wait: MissedRoundWait | None = None
        self._published_deadline = 0.0
        self._num_tokens = 0

    # --- plumbing ---

    @property
    def now(self) -> float:
        return self.queue.now

    @property
    def config(self) -> SwarmConfig:
        return self.world.config

    def is_up(self) -> bool:
        return self.alive and self.now >= self.frozen_until

    def _after(self, delay: float, action: Callable[[], None]) -> Event:
        """Run ``action`` later, unless this incarnation ended; a frozen node runs it once it thaws."""
        return self.queue.after(delay, functools.partial(self._later, self.incarnation, action))

    def _later(self, incarnation: int, action: Callable[[], None]) -> None:
        """``_after``'s event (a partial, not a closure that names itself: that made a reference
        cycle per event, and the cyclic garbage collector's passes over them cost a fifth of a run)."""
        if self.incarnation != incarnation or not self.alive:
            return
        queue = self.queue
        if queue.now < self.frozen_until:
            queue.at(self.frozen_until, functools.partial(self._later, incarnation, action))
            return
        action()

    def _view(self) -> SwarmView:
        return self.world.dht.view(self.peer_id, self.now)

    def _record(self) -> PeerRecord:
        """Our active record of the params we hold, not ready, expiring a TTL from now. Built once per
        lineage, then restamped: the record ``PeerRecord(...)`` would make, without validating it
        again each time a node missed a round polls the lineage rule with it."""
        lineage = self.lineage
        assert lineage is not None
        built = self._own_record
        if built is None or (built.round, built.param_hash) != (lineage.round, lineage.param_hash):
            built = self._own_record = PeerRecord(
                peer_id=self.peer_id,
                grpc_address=self.address,
                protocol_version=PROTOCOL_VERSION,
                round=lineage.round,
                param_hash=lineage.param_hash,
                ready_for_round=None,
                tokens_per_s=TOKENS_PER_PHASE * self.speed / self.world.settings.phase_seconds,
                bandwidth_bytes_per_s=self.profile.up_bytes_per_s,
                status="active",
                expires_at=self.now + self.world.record_ttl,
                step_seconds=self.step_seconds,
            )
        return restamped(built, self.now + self.world.record_ttl)

    def publish(self, record: PeerRecord) -> None:
        """Our record from now on (the heartbeat keeps storing it), stored at once."""
        self.published = record
        self.world.dht.store(restamped(record, self.now + self.world.record_ttl), self.now)

    # --- lifecycle (faults.py and swarm.py call these) ---

    def start(self, lineage: Lineage | None, *, delay: float) -> None:
        """Start the daemon ``delay`` seconds from now: with ``lineage`` (an initial node, or one
        restarting from its checkpoint) or fresh (None: it fetches the swarm's state first)."""
        self.incarnation += 1
        self.alive = True
        self.frozen_until = -math.inf
        self.state = NodeState.SYNCING
        self.formation = None
        self._handled = None
        self.short_phases = ShortPhases()  # a new process: nothing measured yet
        self.lineage = lineage
        self.world.recorder.up(self.peer_id, self.now)
        if lineage is not None:
            self.publish(self._record())
        self.queue.schedule(Heartbeat(self), self.now + self.heartbeat_offset * self.world.heartbeat)
        self._after(delay, self._join)

    def crash(self) -> None:
        """Gone without a word: its record lingers until it expires."""
        self._stop()

    def leave(self) -> None:
        """Gone with a tombstone, which expires after every heartbeat's record."""
        if self.published is not None:
            tombstone = dataclasses.replace(
                self.published, status="left", ready_for_round=None, ready_at=None
            )
            self.world.dht.store(
                dataclasses.replace(tombstone, expires_at=self.now + 2 * self.world.record_ttl),
                self.now,
            )
        self._stop()

    def freeze(self, seconds: float) -> None:
        """Stopped (SIGSTOP-like): no heartbeat, no answer; its timers run once it thaws."""
        if not self.is_up():
            return
        self.frozen_until = self.now + seconds
        self.world.recorder.down(self.peer_id, self.now)
        incarnation = self.incarnation
        self.world.queue.at(self.frozen_until, lambda: self._thaw(incarnation))

    def _thaw(self, incarnation: int) -> None:
        if self.alive and self.incarnation == incarnation:
            self.world.recorder.up(self.peer_id, self.now)

    def _stop(self) -> None:
        if self.alive:
            self.world.recorder.down(self.peer_id, self.now)
        self.alive = False
        self.incarnation += 1
        self.state = NodeState.OFF
        self.formation = None
        # Nothing of this incarnation is read again: drop what holds a view (each a few hundred
        # records), else every node that ever left keeps the view of its last event, and a long run's
        # heap (and the collector's full passes over it) grows with its churn: 2 GB at 50 rounds.
        self._handled = None
        self._tick = None  # (its event, if still queued, does nothing after the incarnation ends)
        self.stand_in.driver.view = _NO_VIEW

    # --- joining (Prefetch, SwarmSession.join) ---

    def _join(self) -> None:
        view = self._view()
        others = [peer for peer in view if peer.peer_id != self.peer_id]
        if self.lineage is None and not others:
            self._after(self.world.view_refresh, self._join)  # wait to see the swarm
            return
        if self.lineage is None:
            # A fresh node's params are unknown until its model exists: it follows the swarm's lineage.
            local = dataclasses.replace(self._record_for(Lineage(0, INIT_HASH)), param_hash="0" * 64)
            decision = decide_lineage(view, local)
            if decision.canonical.round == 0:
                self._adopt(decision.canonical, catching_up=False)
                return
            self._fetch(decision.canonical, decision.sync_sources, why="join")
            return
        decision = decide_lineage(view, self._record(), defer=True)
        if decision.in_canonical or not decision.sync_sources:
            self.world.recorder.holds_state(self.peer_id, self.now)
            self._train()
            return
        self._fetch(decision.canonical, decision.sync_sources, why="restart")

    def _record_for(self, lineage: Lineage) -> PeerRecord:
        held, self.lineage = self.lineage, lineage
        try:
            return self._record()
        finally:
            self.lineage = held

    # --- the inner phase (OuterRound) ---

    def _train(self) -> None:
        self.state = NodeState.TRAINING
        self._phase_started = self.now
        self._extended_since = None
        self._waited, self._ended_short = 0.0, False
        full = self.world.settings.phase_seconds_at(self.speed)
        self._phase_end = self._after(full, self._phase_due)
        if self.catching_up:
            self._after(self.world.view_refresh, self._check_rejoin)
        if self.world.settings.round_seconds == 0:  # rounds due by steps: the uneven-speed rule
            self._after(self._check_every, self._step_boundary)

    @property
    def _check_every(self) -> float:
        """Seconds between two asks of the uneven-speed rule: the fewest whole steps that last a
        view_refresh (see the module docstring)."""
        return self.step_seconds * max(1, math.ceil(self.world.view_refresh / self.step_seconds - 1e-9))

    def _step_boundary(self) -> None:
        """OuterRound._short_phase_due at a step boundary: ``ShortPhases`` decides from our step time,
        the shortest and longest our lineage's peers announce, and whether one is ready (the round
        is due)."""
        if self.state is not NodeState.TRAINING or self.lineage is None:
            return
        trained = self.now - self._phase_started - self._waited
        done = round(trained / self.step_seconds)
        missing = self.world.inner_steps - done
        if missing < 1:
            return  # H steps: the phase's end (_phase_due) is due now
        peers = self._view().of_lineage(self.lineage.round, self.lineage.param_hash)
        announced = peers.step_seconds_range(self.peer_id)
        if uneven(self.step_seconds, announced, self.world.inner_steps):
            verdict = self.short_phases.at_step(
                elapsed=self.now - self._phase_started, done=done, missing=missing,
                forming=not peers.ready_set <= {self.peer_id}, step_seconds=self.step_seconds,
                peers=announced,
            )  # fmt: skip
            if isinstance(verdict, EndShort):
                self._end_short()
                return
            if isinstance(verdict, AwaitRound):  # the training pauses: its phase end moves on
                if self._phase_end is not None:
                    self._phase_end.cancel()
                self._await_from, self._await_until = self.now, self.now + verdict.seconds
                self._await_round()
                return
        self._after(self._check_every, self._step_boundary)

    def _await_round(self) -> None:
        """SwarmSession.await_round_forming: poll until a peer of our lineage is ready, or the wait's
        bound; then the rule says whether the phase ends (short) or training goes on."""
        if self.state is not NodeState.TRAINING or self.lineage is None:
            return
        forming = not self._view().of_lineage(self.lineage.round, self.lineage.param_hash).ready_set <= {
            self.peer_id
        }
        if not forming and self.now < self._await_until:
            self._after(min(ROUND_FORMING_POLL_S, self._await_until - self.now), self._await_round)
            return
        self._waited += self.now - self._await_from
        if self.short_phases.waited(formed=forming, elapsed=self.now - self._phase_started):
            self._end_short()
            return
        full = self.world.settings.phase_seconds_at(self.speed)
        left = full - (self.now - self._phase_started - self._waited)
        self._phase_end = self._after(max(left, 0.0), self._phase_due)
        self._after(self._check_every, self._step_boundary)

    def _end_short(self) -> None:
        """The rule ended the phase short of H: the steps trained go to the round."""
        if self._phase_end is not None:
            self._phase_end.cancel()
        self._ended_short = True
        self._end_phase()

    def _check_rejoin(self) -> None:
        """SwarmSession.phase_should_end: an adopter joins the swarm's round as soon as it forms."""
        if self.state is not NodeState.TRAINING or not self.catching_up:
            return
        if rejoin_due(self._view(), self.peer_id, (self.adopted.round, self.adopted.param_hash)):
            if self._phase_end is not None:
                self._phase_end.cancel()
            self._end_phase()
            return
        self._after(self.world.view_refresh, self._check_rejoin)

    def _phase_due(self) -> None:
        """H steps are done: end the phase, unless a node is fetching our lineage's state (then train
        on, at most MAX_DUE_WAIT), as ``OuterRound._phase_due`` does through ``peer_due``."""
        if self.state is not NodeState.TRAINING:
            return
        self.stand_in.driver.view = self._view()
        if peer_due(self.stand_in, max_ahead=MAX_DUE_WAIT, ready_seen=self.ready_seen):  # type: ignore[arg-type]
            if self._extended_since is None:
                self._extended_since = self.now
            if self.now - self._extended_since < MAX_DUE_WAIT.total_seconds():
                self._phase_end = self._after(self.world.view_refresh, self._phase_due)
                return
        self._end_phase()

    def _end_phase(self) -> None:
        trained = self.now - self._phase_started - self._waited
        self._compute += trained
        settings = self.world.settings
        tokens = TOKENS_PER_PHASE * self.speed * trained / settings.phase_seconds
        if settings.round_seconds == 0:  # H steps: no more tokens for a phase trained on (peer_due)
            tokens = min(tokens, TOKENS_PER_PHASE)
        self._num_tokens = max(1, round(tokens))
        self.catching_up = False
        self.state = NodeState.FORMING
        self._published_deadline = self.now + self.config.rounds.join_window.total_seconds()
        self._await_group_published()

    # --- the round (SwarmNode.run_round, RoundDriver.form) ---

    def _await_group_published(self) -> None:
        """Give the last group's other members time to publish their new params (bounded)."""
        assert self.lineage is not None
        # The members whose record is on an older round (SwarmNode's scan of the members, through
        # the view's index of its lineages: a group of a thousand, each asking every second).
        round, view = self.lineage.round, self._view()
        lagging = any(
            not view.of_lineage(*held).peer_ids.isdisjoint(self.last_group_members)
            for held in view.lineage_sizes()
            if held[0] < round
        )
        if lagging and self.now < self._published_deadline:
            self._after(self.world.view_refresh, self._await_group_published)
            return
        self._form()

    def _form(self) -> None:
        local = self._record()
        self.published = local
        self._form_started = self.now
        self._messages_in = 0
        self._bytes_out_at_start = self.world.network.bytes_sent.get(self.peer_id, 0)
        formation = RoundFormation(
            config=self.config.rounds,
            local=local,
            num_tokens=self._num_tokens,
            vector_length=self.world.settings.num_params,
            now=self.now,
        )
        self.formation = formation
        self._execute(formation, lambda: formation.start(self._view(), self.now))
        self._after(self.world.view_refresh, lambda: self._refresh(formation))

    def _refresh(self, formation: RoundFormation) -> None:
        """Every view_refresh while the round forms: a fresh view, then a tick (as the driver)."""
        if formation is not self.formation or formation.outcome is not None:
            return
        self._execute(formation, lambda: formation.on_view(self._view(), self.now))
        self._execute(formation, lambda: formation.tick(self.now))
        self._after(self.world.view_refresh, lambda: self._refresh(formation))

    def _on_deadline(self, formation: RoundFormation) -> None:
        self._tick = None
        if formation is self.formation and formation.outcome is None:
            self._execute(formation, lambda: formation.tick(self.now))

    def _execute(self, formation: RoundFormation, event: Callable[[], list[Action]]) -> None:
        """Feed one event to the formation and do what it asks (RoundDriver._execute)."""
        started = time.perf_counter()  # host CPU of the product's call, reported apart (not simulated)
        try:
            actions = event()
        except ValueError as error:  # the product refused (e.g. a proposal beyond MAX_GROUP_SIZE)
            self.world.recorder.error(self.peer_id, formation.round, str(error))
            if formation is self.formation and self._handled is not formation:
                self._handled = formation
                self._record_formed(formation, "error")
                self._own_delta(formation.round, "error")
            return
        self.world.recorder.host_seconds(self.peer_id, formation.round, time.perf_counter() - started)
        cut_at = self._send_deadline([action.message for action in actions if isinstance(action, Send)])
        for action in actions:
            if isinstance(action, Send):
                self._send(action.to, action.message, cut_at)
            elif isinstance(action, Publish):
                assert self.published is not None
                self.publish(dataclasses.replace(self.published, ready_for_round=action.ready_for_round))
            elif isinstance(action, GroupMemberLost):
                pass  # the all-reduce model drops silent members by itself (groups.py)
        if formation is not self.formation or self._handled is formation:
            return
        if formation.outcome is not None:
            self._handled = formation
            if self._tick is not None:
                self._tick.cancel()
                self._tick = None
            self._on_outcome(formation, formation.outcome)
            return
        deadline = formation.next_deadline()
        next_refresh = self.now + self.world.view_refresh
        if (
            deadline is not None
            and deadline < next_refresh
            and (self._tick is None or self._tick.at != deadline)
        ):
            if self._tick is not None:
                self._tick.cancel()
            self._tick = self._after(deadline - self.now, lambda: self._on_deadline(formation))

    def _send_deadline(self, messages: list[Message]) -> float:
        """When the driver cuts these sends of one event (``RoundDriver._execute``): the message
        timeout plus our uplink's time for its backlog and them (``fan_out.send_timeout``)."""
        queued = self.world.network.backlog_bytes(self.peer_id, self.now) + sum(wire_sizes(messages))
        return self.now + send_timeout(self.world.message_timeout, queued, self.profile.up_bytes_per_s)

    def _send(self, to: str, message: Message, deadline: float | None = None) -> None:
        network = self.world.network
        target = self.world.nodes.get(to)
        if deadline is None:
            deadline = self._send_deadline([message])
        arrival = network.send_time(self.peer_id, to, message, self.now, deadline)
        if arrival is None or target is None or not network.reachable(self.peer_id, to):
            return
        sender = self.peer_id

        def deliver() -> None:
            if target.is_up() and network.reachable(sender, to):
                target.on_message(sender, message)

        self.world.queue.at(arrival, deliver)

    def on_message(self, sender: str, message: Message) -> None:
        """A membership message (the servicer hands it to the driver)."""
        self._messages_in += 1
        formation = self.formation
        if formation is None:
            for action in reply_without_formation(sender, message):
                if isinstance(action, Send):
                    self._send(action.to, action.message)
            return
        self._execute(formation, lambda: formation.on_message(sender, message, self.now))

    def _record_formed(self, formation: RoundFormation, outcome: str) -> None:
        self.world.recorder.formed(
            self.peer_id,
            formation.round,
            outcome,
            self._form_started,
            self.now - self._form_started,
            self._messages_in,
            self.world.network.bytes_sent.get(self.peer_id, 0) - self._bytes_out_at_start,
        )

    def _on_outcome(self, formation: RoundFormation, outcome: Outcome) -> None:
        round = formation.round
        match outcome:
            case StartAllReduce(group=group):
                self._record_formed(formation, "group")
                self.state = NodeState.ALLREDUCE
                self.last_group_members = frozenset(group.member_ids) - {self.peer_id}
                self.world.allreduces.lock(self, group)
            case MissedRound(told_by=told_by):
                self._record_formed(formation, "missed")
                self.state = NodeState.MISSED
                assert self.lineage is not None
                self._missed_wait = MissedRoundWait(
                    self.config,
                    lineage=(self.lineage.round, self.lineage.param_hash),
                    told_by=told_by,
                    now=self.now,
                )
                self._await_lineage_past(round)
            case Resync(canonical=canonical, sources=sources):
                self._record_formed(formation, "resync")
                self._fetch(canonical, sources, why="resync")
            case RoundFailed():
                self._record_formed(formation, "failed")
                self._own_delta(round, "failed")

    def allreduce_done(self, group: GroupSpec, lineage: Lineage | None, traffic: MemberTraffic) -> None:
        incarnation = self.incarnation
        if not self.alive or self.state is not NodeState.ALLREDUCE:
            return

        def done() -> None:
            if self.incarnation != incarnation or self.state is not NodeState.ALLREDUCE:
                return
            if lineage is None:
                self._own_delta(group.round, "fell_back")
                return
            self.world.recorder.averaged(self.peer_id, group.round, traffic.sent)
            self.stepped_alone = False
            self._round_done(lineage, group.round, "averaged")

        if self.now < self.frozen_until:
            self.world.queue.at(self.frozen_until, done)
        else:
            done()

    # --- after the round ---

    def _await_lineage_past(self, round: int) -> None:
        """After a missed round: adopt the group's params once canonical, else our own Δ."""
        assert self.lineage is not None
        if self.state is not NodeState.MISSED:
            return
        view = self._view()
        decision = decide_lineage(view, self._record())
        if not decision.in_canonical and decision.canonical.round > self.lineage.round:
            self._fetch(decision.canonical, decision.sync_sources, why="missed")
        elif self._missed_wait is None or self._missed_wait.over(view, self.now):
            self._own_delta(round, "missed")
        else:
            self._after(self.world.view_refresh, lambda: self._await_lineage_past(round))

    def _own_delta(self, round: int, how: str) -> None:
        """The round steps on our own Δ: params nobody else holds."""
        assert self.lineage is not None
        new = Lineage(
            self.lineage.round + 1, derived_hash(self.lineage.param_hash, "alone", self.peer_id, round)
        )
        self.world.lineages.add(new, Origin(parent=self.lineage, averaged=False))
        self.chain_lineage = None if self.stepped_alone else self.lineage
        self.stepped_alone = True
        self._round_done(new, round, how)

    def _round_done(self, lineage: Lineage, round: int, how: str) -> None:
        self.world.recorder.round_end(self.peer_id, round, how, self._compute, self.now - self._round_started)
        self.short_phases.phase_ended(short=self._ended_short, averaged=how == "averaged")
        self._compute, self._round_started = 0.0, self.now
        self.lineage = lineage
        self.publish(self._record())  # published right after the outer step
        self._train()

    def _fetch(self, canonical: Lineage, sources: tuple[str, ...], *, why: str) -> None:
        """Fetch the canonical state (SwarmSession._fetch_canonical): the rounds' means if at most
        MAX_CATCH_UP_ROUNDS behind on a chain of means, else the whole state; announced."""
        network, nodes = self.world.network, self.world.nodes
        usable = list(
            itertools.islice(
                (
                    source
                    for source in sources
                    if source in nodes and nodes[source].is_up() and network.reachable(self.peer_id, source)
                ),
                MAX_SYNC_SOURCES,
            )
        )
        if not usable:  # the fetch fails (its sources are gone or cut off); a later check retries
            retry = self.world.message_timeout
            if self.lineage is None:
                self._after(retry, self._join)
            else:
                next_round = self.lineage.round + 1
                self._after(retry, lambda: self._own_delta(next_round, f"{why}_failed"))
            return
        held = self.chain_lineage if self.stepped_alone else self.lineage
        behind = canonical.round - held.round if held is not None else 0
        means = (
            held is not None
            and 0 < behind <= MAX_CATCH_UP_ROUNDS
            and self.world.lineages.means_lead_back(canonical, held)
        )
        num_bytes = (
            behind * self.world.vector_payload_bytes
            if means
            else STATE_BYTES_PER_NUMBER * self.world.settings.num_params
        )
        seconds = network.transfer_seconds(num_bytes, self.peer_id, usable)
        self.state = NodeState.SYNCING
        for source in usable:
            nodes[source].serving_until = max(nodes[source].serving_until, self.now + seconds)
        self.publish(
            dataclasses.replace(self._record_for(canonical), status="syncing", ready_at=self.now + seconds)
        )
        self._after(seconds, lambda: self._fetched(canonical, why))

    def _fetched(self, canonical: Lineage, why: str) -> None:
        if self.lineage is None:
            self._adopt(canonical, catching_up=True)
            return
        self._compute_adopt(canonical, why)

    def _compute_adopt(self, canonical: Lineage, why: str) -> None:
        """The loop loads the swarm's state (Adopt): this round ends for us, the next phase catches up."""
        self.world.recorder.round_end(
            self.peer_id, canonical.round, why, self._compute, self.now - self._round_started
        )
        self._compute, self._round_started = 0.0, self.now
        self._adopt(canonical, catching_up=True)

    def _adopt(self, canonical: Lineage, *, catching_up: bool) -> None:
        first = self.lineage is None
        self.lineage = canonical
        self.stepped_alone = False
        self.catching_up = catching_up
        self.adopted = canonical
        self.short_phases.reset()  # the swarm's pace is measured again from its next round
        self.publish(self._record())
        if first:
            self._round_started = self.now
            self.world.recorder.holds_state(self.peer_id, self.now)
        self._train()
