"""SwarmNode: everything a training loop needs from the swarm, behind blocking calls.

    swarm = SwarmNode(SwarmConfig(run_name="demo", dht=DhtConfig(initial_peers=peers)))
    swarm.publish(round=0, param_hash=h, tokens_per_s=0.0, snapshot=None)
    decision = swarm.lineage(round=0, param_hash=h)      # join: are we on the swarm's params?
    if not decision.in_canonical:
        snapshot = swarm.fetch_state(decision)             # verified against the advertised hash
    ...                                                    # H inner steps
    result = swarm.run_round(delta, round=r - 1, param_hash=h, num_tokens=t, error_feedback=ef)
    ...                                                    # outer step; publish the new state
    swarm.leave(); swarm.close()

One round (``run_round``): the local peer publishes that it is ready for round ``r``, the driver
forms the round's group with the other ready peers of its lineage (``protocol/membership/rounds.py``),
and, once locked into a group, runs the compressed all-reduce with exactly that group
(``protocol/allreduce``). The outcome says which of four things happened: averaged (with the
all-reduce result), missed (a group formed without us), failed (too few peers), or resync (our
params are not the swarm's: fetch the canonical state).

Threads: a uvloop event loop on a daemon thread runs the gRPC server, the formation driver and
the all-reduce; hivemind's DHT runs in its own process; the caller's thread only blocks in these
methods, each bounded by a deadline.

Status: the node tracks its phase (starting, training, forming, all-reduce, syncing) as these
methods run, and answers ``dtnode status`` from it and its last view (``status.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, TypeVar

import torch
from hivemind.utils import get_dht_time

from protocol.allreduce.allreduce import AllReduceResult
from protocol.allreduce.pace import member_send_bytes
from protocol.allreduce.tiered import run_tiered
from protocol.allreduce.tiers import stage_round_ids
from protocol.auth import OPEN_SWARM_WARNING
from protocol.discovery.addresses import WILDCARD_HOSTS, join_host_port, parse_host_port
from protocol.discovery.dht_node import DhtCallTimeout, DhtNode, DhtNodeClosed
from protocol.discovery.registry import SwarmRegistry
from protocol.error_feedback import ErrorFeedback
from protocol.loop import BackgroundLoop
from protocol.membership.actions import StartAllReduce
from protocol.membership.lineage import Lineage, LineageDecision, decide_lineage
from protocol.membership.messages import GroupSpec
from protocol.membership.records import PeerRecord, SwarmView
from protocol.membership.transport import MAX_MESSAGE_BYTES, MembershipClient
from protocol.statesync.fetch import FetchReport, fetch_state_with_report
from protocol.statesync.progress import FetchEstimate
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.collect import collect_messages
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig, routable_host
from protocol.swarm.driver import RoundDriver, watch_swarm
from protocol.swarm.result import GroupAveraged, RoundResult, not_averaged
from protocol.swarm.server import NodeServer
from protocol.swarm.status import NodePhase, NodeStatus, PhaseState, build_status
from protocol.swarm.streams import StreamRunner, run_streamed, stream_group, to_allreduce_group, to_tier_plan

logger = logging.getLogger(__name__)

MARGIN = timedelta(seconds=10)
"""How much longer than a call's own deadline the caller waits before declaring the loop wedged."""

T = TypeVar("T")


class SwarmNode:
    """A node's swarm side: DHT peer, gRPC server, round formation, all-reduce and state sync."""

    def __init__(self, config: SwarmConfig, *, start_timeout: timedelta = timedelta(seconds=60)) -> None:
        self.config = config
        self.codec = config.wire_codec()
        if config.auth is None:
            logger.warning(OPEN_SWARM_WARNING)
        else:
            logger.info(
                "closed swarm: key fingerprint %s, gRPC %s",
                config.auth.key.fingerprint,
                "mutual TLS" if config.auth.tls else "plaintext with signed calls",
            )
        # DhtStartupError (clear message) if it cannot start or join
        self.dht = DhtNode(config.dht, swarm_key=None if config.auth is None else config.auth.key)
        self._loop: BackgroundLoop | None = None
        self.registry: SwarmRegistry | None = None
        # Read by status() on the loop as soon as the server runs, so set before it starts.
        self.grpc_address = ""  # the advertised address, known once the server is bound
        self.rounds_formed = 0
        self._last_group: GroupSpec | None = None  # the group of our last round
        self._last_group_members: tuple[str, ...] = ()  # the other members of our last round
        self._phase = PhaseState(NodePhase.STARTING, 0, time.monotonic())
        self._round_vector = ""  # what part of our state the round under way carries (run_round)
        self._pace_lifted_round = 0  # rounds up to this one are sent at full rate (lift_pace)
        self.streams: StreamRunner | None = None  # streams 1..S-1 of our rounds (attach_streams)
        self.stream_addresses: tuple[str, ...] = ()
        self.rank: int | None = None  # our place in the member order (set_identity)
        self.data_lane: tuple[int, int] | None = None  # what we read now, our records say (set_data_lane)
        self.step_seconds: float | None = None  # how long our steps take, our records say (advertise_rate)
        try:
            self.peer_id = self.dht.peer_id
            self.registry = SwarmRegistry(
                self.dht,
                run_name=config.run_name,
                protocol_version=PROTOCOL_VERSION,
                period=config.heartbeat,
                ttl=config.record_ttl,
                call_timeout=config.dht_call_timeout,
            )
            self._loop = BackgroundLoop(name="swarm-loop")
            client = MembershipClient(
                sender_id=self.peer_id,
                protocol_version=PROTOCOL_VERSION,
                options=[
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ],
                auth=config.auth,
            )
            self.driver = RoundDriver(
                config=config, peer_id=self.peer_id, registry=self.registry, client=client, clock=get_dht_time
            )
            outbox = self.driver.outbox  # what client-mode peers collect from us (Membership.Collect)
            self.server = self._loop.run(
                NodeServer.start(config, self.driver.on_message, status=self.status, outbox=outbox),
                start_timeout,
            )
        except BaseException:
            self._shutdown()
            raise
        self._watch = self._loop.submit(watch_swarm(self.driver, self.dht.reconnect))
        if config.client_mode:  # nobody dials us: we fetch what our peers hold for us
            self._collect = self._loop.submit(collect_messages(self.driver, client))
        self.grpc_address = self.server.address  # a client's: CLIENT_ADDRESS (it binds nothing)
        if not config.client_mode and config.announce_host is None and config.listen_host in WILDCARD_HOSTS:
            # Bound to every interface: advertise one others can reach, as the DHT sees it.
            host = routable_host(self.dht.visible_multiaddrs())
            if host is not None:
                self.grpc_address = f"{host}:{self.server.port}"

    def attach_streams(self, runner: StreamRunner) -> None:
        """Run our rounds on ``1 + len(runner.addresses)`` streams: shard 0 here, the others on
        ``runner`` (``protocol/swarm/streams.py``). Peers that open another number are left out."""
        addresses = tuple(runner.addresses)
        if self.config.announce_host is None and self.config.listen_host in WILDCARD_HOSTS:
            # Bound to every interface: advertise the host others reach our node server on.
            host, _ = parse_host_port(self.grpc_address, flag="grpc_address")
            ports = (parse_host_port(address, flag="stream address")[1] for address in addresses)
            addresses = tuple(join_host_port(host, port) for port in ports)
        self.streams, self.stream_addresses = runner, addresses
        logger.info(
            "all-reduce on %d streams: %s", 1 + len(addresses), ", ".join((self.grpc_address, *addresses))
        )

    # --- identity ---

    def set_identity(self, identity: str, *, rank: int | None) -> None:
        """Say what we train (an opaque digest the node computes from its model and data) and our
        place in the member order (``records.member_order``), before our first record: from then on
        our records carry both, and peers whose records name another identity are left out of every
        view (a WARNING once per peer), so we never share a lineage, a round or a state with them."""
        self.rank = rank
        self.driver.identity = identity

    def set_data_lane(self, lane: tuple[int, int], *, store_now: bool = False) -> None:
        """Say which data we read in our inner phase under way (``PeerRecord.data_lane``): our records
        carry it from the next :meth:`publish` on, or (``store_now``) from now, in the record that names
        the state we hold: others choose their spare lane or start shard by it. Never blocks on the
        network."""
        self.data_lane = lane
        record = self.driver.record
        if store_now and record is not None and record.status == "active":
            self.driver.publish(dataclasses.replace(record, data_lane=lane))

    def multiaddrs(self) -> list[str]:
        """What others pass to ``dtnode join --peers`` (each ends in ``/p2p/<peer id>``)."""
        return self.dht.visible_multiaddrs()

    # --- state ---

    def publish(
        self,
        *,
        round: int,
        param_hash: str,
        tokens_per_s: float,
        snapshot: Snapshot | None,
        companions: Sequence[Snapshot] = (),
    ) -> None:
        """Advertise our global params ``(round, param_hash)`` and serve ``snapshot`` to joiners, with
        ``companions`` beside it (other snapshots, fetched by their own state id).

        Never blocks on the network: the record goes out with the next heartbeat.
        """
        if snapshot is not None:
            if snapshot.state_id != param_hash or snapshot.round_id != round:
                raise ValueError("the snapshot must be of the published (round, param_hash)")
            self.server.state_provider.publish(snapshot, companions=companions)
        record = self._local_record(round=round, param_hash=param_hash, tokens_per_s=tokens_per_s)
        self.driver.record = record
        assert self.registry is not None
        self.registry.publish(record)
        if self._phase.phase is NodePhase.STARTING:
            self.set_phase(NodePhase.TRAINING)

    def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
        """Our training throughput now, and (if given) how long one of our steps takes, in our record
        from the next heartbeat on (no DHT call of its own): peers and ``dtnode status`` see it
        during a phase, not only from the round's end. ``step_seconds`` is opaque here: a number
        peers of one run compare (``PeerRecord.step_seconds``); later records keep it."""
        if step_seconds is not None:
            self.step_seconds = step_seconds
        if self.registry is not None:
            self.registry.revise(
                lambda record: dataclasses.replace(
                    record, tokens_per_s=tokens_per_s, step_seconds=self.step_seconds
                )
            )

    def watch_closely(self, on: bool) -> None:
        """Between rounds, read the swarm's view every ``view_refresh`` (on) or every 5 x (off): a node
        that must end its inner phase as soon as a peer is ready for the next round sees it sooner."""
        self.driver.watch_closely = on  # one bool, read by the watch task on the loop

    def set_phase(self, phase: NodePhase, *, round: int = 0) -> PhaseState:
        """Say what the node does now (``status.py``); returns the new state.

        The node's own methods keep this current (``run_round``, ``fetch_state``, ``publish``); a
        caller sets it only for what they cannot see. ``round``: the round formed or fetched.
        """
        state = PhaseState(phase, round, time.monotonic())
        self._phase = state  # one reference swap: readers on the loop see the old or the new state
        return state

    def _end_phase(self, state: PhaseState, then: PhaseState) -> None:
        """Leave ``state`` for ``then``, unless another phase was set meanwhile (that one stays)."""
        if self._phase is state:
            self._phase = then

    def status(self) -> NodeStatus:
        """The node's view of the swarm for ``dtnode status``: from memory, never blocking (runs on
        the loop, which owns the view; the phase is swapped in from the caller's thread)."""
        config = self.config
        return build_status(
            run_name=config.run_name,
            protocol_version=PROTOCOL_VERSION,
            peer_id=self.peer_id,
            grpc_address=self.grpc_address,
            local=self.driver.record,
            phase=self._phase,
            group=self._last_group,
            rounds_formed=self.rounds_formed,
            view=self.driver.view,
            last_seen=self.driver.last_seen,
            record_ttl=config.record_ttl,
            now=get_dht_time(),
            monotonic_now=time.monotonic(),
            round_vector=self._round_vector,
        )

    def view(self) -> SwarmView:
        """The live peers of the run, read now (DhtCallTimeout if the DHT does not answer in time)."""
        return self._run(self.driver.refresh_view(), self.config.dht_call_timeout)

    def view_or_last(self, why: str) -> SwarmView:
        """A fresh view, or the last one if the DHT does not answer in time (one log line)."""
        try:
            return self.view()
        except (DhtCallTimeout, DhtNodeClosed, TimeoutError) as error:
            logger.info("DHT read failed (%s); %s on the last view", error, why)
            return self.driver.view

    def lineage(self, *, round: int, param_hash: str, defer: bool = False) -> LineageDecision:
        """Whether ``(round, param_hash)`` is the swarm's canonical lineage, judged on a fresh view
        (``defer``: a fresh joiner's, which follows the others' lineage; ``decide_lineage``)."""
        local = self._local_record(round=round, param_hash=param_hash)
        return decide_lineage(self.view_or_last("judging the lineage").peers, local, defer=defer)

    def _await_group_published(self, round: int) -> None:
        """Before forming the next round, give the last round's other members (bounded by the join
        window) time to publish their new params: a lagging DHT record would otherwise look like a
        larger lineage still on the old params, and send us back to them."""
        members = self._last_group_members
        if not members:
            return
        deadline = time.monotonic() + self.config.rounds.join_window.total_seconds()
        while time.monotonic() < deadline:
            view = self.view_or_last("waiting for the last group's records")
            lagging = [m for m in members if (record := view.get(m)) is not None and record.round < round]
            if not lagging:
                return
            time.sleep(self.config.view_refresh.total_seconds())

    def wait_for_peers(self, num_peers: int, timeout: timedelta, *, or_foreign: bool = False) -> SwarmView:
        """Poll the view until it lists ``num_peers`` peers besides us, or ``timeout`` passes (or,
        with ``or_foreign``, a peer of another identity shows up: ``SwarmView.foreign``)."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            view = self.view_or_last("waiting for peers")  # a slow DHT read is one empty poll, not fatal
            if (
                len([p for p in view if p.peer_id != self.peer_id]) >= num_peers
                or (or_foreign and view.foreign)
                or time.monotonic() >= deadline
            ):
                return view
            time.sleep(min(self.config.view_refresh.total_seconds(), max(deadline - time.monotonic(), 0.0)))

    def announce_syncing(self, target: Lineage, *, ready_at: float | None = None) -> None:
        """Say that we fetch the state ``target`` to join the swarm and expect to hold it at
        ``ready_at`` (the DHT's clock; None: cannot tell yet). Until we publish the state we hold,
        no lineage counts us and no round takes us; a leader of ``target``'s next round waits for
        us if we expect to hold it within its join window. Never blocks on the network."""
        record = self._local_record(round=target.round, param_hash=target.param_hash)
        self.driver.publish(dataclasses.replace(record, status="syncing", ready_at=ready_at))

    def fetch_state(
        self, decision: LineageDecision, *, state_id: str | None = None, announce: bool = False
    ) -> FetchReport:
        """Fetch the canonical state from ``decision.sync_sources`` in parallel, verified against its
        hash; or, with ``state_id``, the snapshot of that id they serve beside it (a companion).

        ``announce`` (a joiner): say so first, then when we expect to hold the state, from the
        fetch's progress (``announce_syncing``)."""
        addresses = [
            record.grpc_address for pid in decision.sync_sources if (record := self.driver.view.get(pid))
        ]
        if not addresses:
            raise ValueError("no sync source is in the view any more")
        on_progress = None
        if announce:
            # Until the fetch's progress gives an estimate (within a view_refresh or two), say "soon":
            # a leader waits for a syncing peer only with an estimate, and a short fetch (a round's
            # mean) may be over before its first one. A stalled fetch renews nothing and goes stale.
            soon = get_dht_time() + 2 * self.config.view_refresh.total_seconds()
            self.announce_syncing(decision.canonical, ready_at=soon)
            on_progress = FetchEstimate(
                lambda ready_at: self.announce_syncing(decision.canonical, ready_at=ready_at),
                every=self.config.view_refresh,
                clock=get_dht_time,
            )
        deadline = self.config.sync_deadline
        coroutine = fetch_state_with_report(
            addresses,
            expected_state_id=state_id or decision.canonical.param_hash,
            deadline=deadline,
            auth=self.config.auth,
            on_progress=on_progress,
        )
        before = self._phase
        syncing = self.set_phase(NodePhase.SYNCING, round=decision.canonical.round)
        try:
            return self._run(coroutine, deadline)
        finally:
            self._end_phase(syncing, before)

    # --- rounds ---

    @contextlib.contextmanager
    def _round_phase(self, round: int, vector_name: str) -> Iterator[None]:
        """FORMING round ``round`` (ALLREDUCE once its group runs) of ``vector_name``, then back to
        TRAINING."""
        self._round_vector = vector_name
        forming = self.set_phase(NodePhase.FORMING, round=round)
        try:
            yield
        finally:
            self._round_vector = ""
            # Back to training, unless a phase this round did not set (a fetch) replaced ours meanwhile.
            if self._phase is forming or self._phase.phase is NodePhase.ALLREDUCE:
                self.set_phase(NodePhase.TRAINING)

    def run_round(
        self,
        vector: torch.Tensor,
        *,
        round: int,
        param_hash: str,
        num_tokens: int,
        tokens_per_s: float,
        error_feedback: ErrorFeedback | None,
        vector_name: str = "",
        send_window: timedelta | None = None,
    ) -> RoundResult:
        """Form round ``round + 1`` with the ready peers of lineage ``(round, param_hash)`` and average
        ``vector`` (fp32, flat) with them, weighted by ``num_tokens``. ``vector_name``: what part of
        the node's state ``vector`` is, as the caller names it (``dtnode status`` says it); "" the whole.
        ``send_window``: spread what we send in the all-reduce over about this long (its bytes for the
        group formed, ``member_send_bytes``, over the window: the round's send rate, ``pace.py``),
        unless the round's deadlines need it faster or :meth:`lift_pace` lifts it; None: full rate.
        A round on several streams is not paced.

        Returns within ``max_wait + round_deadline`` (plus a DHT read).
        """
        with self._round_phase(round + 1, vector_name):
            registry = self.server.allreduce.registry
            if stage_round_ids(round + 1)[0] <= registry.highest_opened:
                # We moved to a lineage whose rounds are numbered lower (we adopted an older state):
                # forget our old rounds before a group can lock us in. Rewound only once locked, a
                # member's first push of the new round (sent as soon as its leader began) found the
                # round "expired" here, was left out, and we waited for it until the reduce-scatter
                # deadline (half the round deadline: 150 s by default; issue 31, item 6).
                self._run(_call(self.server.allreduce.rewind), timedelta(seconds=5))
            self._await_group_published(round)
            local = self._local_record(round=round, param_hash=param_hash, tokens_per_s=tokens_per_s)
            started = time.monotonic()
            formation_budget = self.config.rounds.max_wait + 2 * self.config.dht_call_timeout
            outcome = self._run(
                self.driver.form(
                    local,
                    num_tokens=max(num_tokens, 1),
                    vector_length=vector.numel(),
                    stream_addresses=self.stream_addresses,
                ),
                formation_budget,
            )
            seconds_forming = time.monotonic() - started
            next_round = round + 1
            if not isinstance(outcome, StartAllReduce):
                return not_averaged(
                    outcome, self.driver.view, local, round=next_round, seconds_forming=seconds_forming
                )
            group = outcome.group
            self.rounds_formed += 1
            self._last_group = group
            if self._phase.phase is NodePhase.FORMING:
                self.set_phase(NodePhase.ALLREDUCE, round=group.round)
            self._last_group_members = tuple(m for m in group.member_ids if m != self.peer_id)
            logger.info(
                "round %d: group %s of %d (%s), formed in %.2fs",
                group.round, group.group_id, len(group.members), ", ".join(m.peer_id[-6:] for m in group.members),
                seconds_forming,
            )  # fmt: skip
            weight = float(group.members[group.index_of(self.peer_id)].num_tokens)
            if group.tiered and group.num_streams == 1:
                result = self._run(self._tiered(vector, group, error_feedback), self.config.round_deadline)
            elif group.num_streams == 1:
                result = self._run(
                    self._allreduce(vector, group, weight, error_feedback, send_window),
                    self.config.round_deadline,
                )
            else:
                result = self._run_streams(vector, group, weight, error_feedback)
            return GroupAveraged(
                round=next_round,
                group=group,
                allreduce=result,
                seconds_forming=seconds_forming,
            )

    async def _allreduce(
        self,
        vector: torch.Tensor,
        group: GroupSpec,
        weight: float,
        error_feedback: ErrorFeedback | None,
        send_window: timedelta | None,
    ) -> AllReduceResult:
        """The all-reduce of ``group`` (one stream), paced over ``send_window`` unless its pace was
        lifted already. Decided here, on the loop: a lift asked before this point is seen here, one
        asked after reaches the round's pace (``lift_paces`` runs on the loop after the round opened)."""
        lifted = self._pace_lifted_round >= group.round
        return await self.server.allreduce.allreduce(
            vector,
            group=to_allreduce_group(group),
            my_peer_id=self.peer_id,
            weight=weight,
            codec=self.codec,
            error_feedback=error_feedback,
            deadline=self.config.round_deadline,
            send_rate=None if lifted else self._send_rate(group, send_window),
        )

    async def _tiered(
        self, vector: torch.Tensor, group: GroupSpec, error_feedback: ErrorFeedback | None
    ) -> AllReduceResult:
        """The all-reduce of ``group`` tiered in groups of ``group.tier_group_size`` (not paced)."""
        plan = to_tier_plan(group)
        logger.info(
            "round %d: tiered all-reduce, %d groups of <= %d, %d slices", group.round, plan.num_groups,
            group.tier_group_size, plan.num_slices,
        )  # fmt: skip
        result = await run_tiered(
            self.server.allreduce, vector, plan=plan, my_peer_id=self.peer_id,
            weights=[float(m.num_tokens) for m in group.members], codec=self.codec,
            error_feedback=error_feedback, deadline=self.config.round_deadline,
            bandwidths=[m.bandwidth_bytes_per_s for m in group.members],
        )  # fmt: skip
        return result.as_allreduce_result(plan.num_slices)

    def _send_rate(self, group: GroupSpec, window: timedelta | None) -> float | None:
        """The send rate that spreads our bytes in ``group``'s all-reduce over ``window`` (None: none)."""
        if window is None:
            return None
        allreduce_group = to_allreduce_group(group)
        num_bytes = member_send_bytes(
            allreduce_group,
            allreduce_group.index_of(self.peer_id),
            self.codec,
            self.config.allreduce.chunk_num_elements,
        )
        rate = max(num_bytes, 1) / max(window.total_seconds(), 1e-3)
        logger.info(
            "round %d: pacing %.2f MB over %.1fs (%.2f MB/s)", group.round, num_bytes / 1e6,
            window.total_seconds(), rate / 1e6,
        )  # fmt: skip
        return rate

    def lift_pace(self, round: int) -> None:
        """Send round ``round`` at full rate from now on, whether its all-reduce runs already or not
        yet (from any thread; returns at once): the caller now waits on it."""
        self._pace_lifted_round = max(self._pace_lifted_round, round)
        logger.info("round %d: sending the rest at full rate (pace lifted)", round)
        if self._loop is not None:
            self._loop.submit(_call(self.server.allreduce.lift_paces))

    def _run_streams(
        self, vector: torch.Tensor, group: GroupSpec, weight: float, error_feedback: ErrorFeedback | None
    ) -> AllReduceResult:
        """Shard 0 on our server while the runner runs shards 1..S-1; the round's combined result."""
        assert self.streams is not None and self._loop is not None  # a group of S > 1 has our S
        loop, deadline = self._loop, self.config.round_deadline

        def ours(shard: torch.Tensor) -> Future[AllReduceResult]:
            return loop.submit(
                self.server.allreduce.allreduce(
                    shard,
                    group=stream_group(group, 0),
                    my_peer_id=self.peer_id,
                    weight=weight,
                    codec=self.codec,
                    error_feedback=error_feedback,
                    deadline=deadline,
                )
            )

        return run_streamed(
            vector, group, ours, self.streams, my_peer_id=self.peer_id, weight=weight, codec=self.codec,
            deadline=deadline, wait=deadline + MARGIN, error_feedback_decay=self.config.error_feedback_decay,
        )  # fmt: skip

    # --- leaving ---

    def leave(self) -> None:
        """Tell the swarm we are gone (a tombstone in the DHT), so rounds stop counting on us at once."""
        if self.registry is not None:
            self.registry.leave()

    def close(self) -> None:
        """Stop serving and shut everything down (call ``leave`` first for a graceful exit)."""
        self._shutdown()

    def __enter__(self) -> SwarmNode:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.leave()
        self.close()

    # --- internals ---

    def _local_record(self, *, round: int, param_hash: str, tokens_per_s: float | None = None) -> PeerRecord:
        base = self.driver.record
        rate = tokens_per_s if tokens_per_s is not None else (base.tokens_per_s if base else 0.0)
        return PeerRecord(
            peer_id=self.peer_id,
            grpc_address=self.grpc_address,
            protocol_version=PROTOCOL_VERSION,
            round=round,
            param_hash=param_hash,
            ready_for_round=None,
            tokens_per_s=rate,
            bandwidth_bytes_per_s=self.config.bandwidth_bytes_per_s,
            status="active",
            expires_at=get_dht_time() + self.config.record_ttl.total_seconds(),
            client=self.config.client_mode,
            rank=self.rank,
            identity=self.driver.identity,
            data_lane=self.data_lane,
            step_seconds=self.step_seconds,
        )

    def _run(self, coroutine: Coroutine[Any, Any, T], deadline: timedelta) -> T:
        if self._loop is None:
            raise RuntimeError("the swarm node is closed")
        return self._loop.run(coroutine, deadline + MARGIN)

    def _shutdown(self) -> None:
        if self.registry is not None:
            self.registry.close()
        if self._loop is not None:
            loop, self._loop = self._loop, None
            try:
                if hasattr(self, "_watch"):
                    self._watch.cancel()
                if hasattr(self, "_collect"):
                    self._collect.cancel()
                if hasattr(self, "server"):
                    loop.run(self.server.stop(timedelta(seconds=2)), MARGIN)
                if hasattr(self, "driver"):
                    loop.run(self.driver.close(), MARGIN)
                    loop.run(self.driver.client.close(), MARGIN)
            finally:
                loop.close()
        self.dht.shutdown()


async def _call(function: Callable[[], None]) -> None:
    """Run ``function`` on the event loop (the all-reduce registry is the loop's alone)."""
    function()
