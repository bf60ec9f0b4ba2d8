"""Who trains together: the start barrier and serving the nodes still behind at the end of a run.

Both keep a run on one lineage at its two edges (ARCHITECTURE.md, "Participation"):

- *Start.* Nodes started together hold the same seeded init. Without a barrier the first one up runs
  rounds alone while the others start, and they then re-sync to its state instead of training their
  first rounds with it. ``await_start_peers`` holds a node's first inner step until N nodes of the
  run hold a lineage (bounded; a lone ``dtnode join`` uses N = 1 and starts at once).
- *End.* A node a round behind when the others reach ``--max-rounds`` would form its last round
  alone and end on a param_hash of its own. ``serve_stragglers`` keeps a finished node serving its
  last state (and that round's mean) while a live node of the run is behind it, so that node's
  lineage check catches it up to the swarm's last state instead.

Every wait is bounded and reads the DHT view only; nothing here knows of models.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta

from protocol.membership.lineage import LineageDecision
from protocol.membership.records import SwarmView
from protocol.swarm.config import SwarmConfig
from protocol.swarm.node import SwarmNode

log = logging.getLogger(__name__)

START_TIMEOUT = timedelta(minutes=10)
"""How long the start barrier waits for the other nodes before training with whoever is there."""


def await_start_peers(
    swarm: SwarmNode, num_nodes: int, timeout: timedelta, stop_requested: Callable[[], bool]
) -> SwarmView:
    """Wait until ``num_nodes`` nodes of the run (ourselves included) hold a lineage, at most
    ``timeout`` and only until ``stop_requested()``; returns the last view read (the live nodes the
    barrier passed on: the node settles its round-0 lineage and data shard from it)."""
    deadline = time.monotonic() + timeout.total_seconds()
    log.info("start barrier: waiting for %d node(s) of run %r", num_nodes, swarm.config.run_name)
    view = swarm.driver.view
    while not stop_requested():
        remaining = deadline - time.monotonic()
        view = swarm.wait_for_peers(num_nodes - 1, timedelta(seconds=max(min(remaining, 2.0), 0.0)))
        live = 1 + len([peer for peer in view if peer.peer_id != swarm.peer_id])
        if live >= num_nodes:
            log.info("start barrier: %d node(s) live, training", live)
            return view
        if remaining <= 0:
            log.warning("start barrier: only %d of %d node(s) live after %s; training with them",
                        live, num_nodes, timeout)  # fmt: skip
            return view
    return view


def missed_round_wait(config: SwarmConfig) -> timedelta:
    """How long a node that missed a round waits for the group that began without it to publish its
    new params, once that group is no longer seen running: the group's all-reduce drops a member
    that makes no progress for the stall timeout (a frozen one), then each member publishes within a
    heartbeat and a DHT store."""
    return config.allreduce.stall_timeout + config.heartbeat + config.dht_call_timeout


class MissedRoundWait:
    """When a node that missed a round stops waiting for the group that began it without us.

    The peer that told us the round began (``MissedRound.told_by``; a member of that group, or a
    node that missed it too) is in the group's all-reduce while its record, renewed every heartbeat,
    stays on our lineage and ready for the round: a member locked into a group keeps the readiness
    it published until the all-reduce ends and it publishes the round's params (a node that gave up
    on the round took its readiness back). So the wait is
    :func:`missed_round_wait` counted from the last view that showed that peer still in the round,
    and at most ``round_deadline`` (no all-reduce runs longer) plus that. A fixed
    ``missed_round_wait`` from the miss was shorter than a large model's all-reduce over home
    links (37 s against 160 s for 100 M numbers at 10 Mbit/s, issue 33's simulator): the node then
    stepped on its own Δ, which no chain of means leads back from, fetched the whole state (the
    group had not published yet, so the old one), arrived during the next round's all-reduce and
    missed that round too, round after round. A group that froze or died is no longer seen within
    a record TTL; one that published moves its record past our lineage: then the wait ends
    :func:`missed_round_wait` later, as before (issue 31: a missed node must not wait out a group
    that never publishes, or one smaller than the nodes it left behind)."""

    def __init__(
        self, config: SwarmConfig, *, lineage: tuple[int, str], told_by: str | None, now: float
    ) -> None:
        self._wait = missed_round_wait(config).total_seconds()
        self._latest = now + config.round_deadline.total_seconds()
        self._lineage = lineage
        self._told_by = told_by
        self._running_at = now  # when the group was last seen running (our clock)

    def over(self, view: SwarmView, now: float) -> bool:
        """Whether to stop waiting at ``now`` (our clock), given a fresh ``view``."""
        record = view.get(self._told_by) if self._told_by is not None else None
        if (
            record is not None
            and (record.round, record.param_hash) == self._lineage
            and record.ready_for_round == self._lineage[0] + 1
        ):
            self._running_at = max(self._running_at, min(now, self._latest))
        return now >= self._running_at + self._wait


def await_lineage_past(
    swarm: SwarmNode,
    *,
    round: int,
    param_hash: str,
    told_by: str | None,
    stop_requested: Callable[[], bool],
) -> LineageDecision | None:
    """After a missed round (a group of our lineage ``(round, param_hash)`` began it without us, as
    ``told_by`` said): the lineage decision once a lineage past ``round`` is canonical (adopt it), or
    None once :class:`MissedRoundWait` is over (or at ``stop_requested()``): the group froze or died
    before it published, or it is smaller than the nodes it left behind, whose lineage stays
    canonical. The caller then steps on its own Δ, so it records the round, and the next round's
    lineage check syncs it to whichever lineage is canonical by then. Waiting for the group as long
    as its ``round_deadline`` whatever it did stalled every node it left behind for minutes, each
    waiting for the others to move (issue 31, "No stall under faults")."""
    wait = MissedRoundWait(swarm.config, lineage=(round, param_hash), told_by=told_by, now=time.monotonic())
    while not stop_requested():
        decision = swarm.lineage(round=round, param_hash=param_hash)  # reads a fresh view
        if not decision.in_canonical and decision.canonical.round > round:
            return decision
        if wait.over(swarm.driver.view, time.monotonic()):
            log.info("no lineage past round %d became canonical within %s of the last sign of the "
                     "group that began our missed round", round, missed_round_wait(swarm.config))  # fmt: skip
            return None
        time.sleep(swarm.config.view_refresh.total_seconds())
    return None


def serve_stragglers(swarm: SwarmNode) -> int:
    """Keep serving our published state while a live node of the run (holding a lineage, or fetching
    one) is at a lower round, at most ``max_wait`` plus a join window; returns how many nodes were
    behind when the wait began."""
    record = swarm.driver.record
    if record is None or swarm.config.client_mode:  # a client serves nobody: nobody can dial it
        return 0
    config = swarm.config
    deadline = time.monotonic() + (config.rounds.max_wait + config.rounds.join_window).total_seconds()
    first: int | None = None
    while True:
        view = swarm.view_or_last("serving nodes behind us")
        behind = [
            peer.peer_id
            for peer in (*view.peers, *view.syncing)
            if peer.peer_id != swarm.peer_id and peer.round < record.round
        ]
        if first is None:
            first = len(behind)
            if behind:
                log.info(
                    "serving round %d to %d node(s) still behind it before leaving", record.round, len(behind)
                )
        if not behind or time.monotonic() >= deadline:
            if behind:
                log.warning("leaving with %d node(s) still behind round %d", len(behind), record.round)
            return first
        time.sleep(config.view_refresh.total_seconds())


class ReadySeen:
    """When this node first saw another node of its lineage ready for the next round (the DHT's
    clock): ``peer_due``'s one memory across its calls, a node's own (``SwarmSession``, the
    simulator's node). That node is forming the round and gathers for a join window from about
    then; a hold past it brings nobody into the round."""

    def __init__(self) -> None:
        self._seen: tuple[tuple[int, str], float] | None = None

    def since(self, lineage: tuple[int, str], now: float) -> float:
        """The first time a ready peer of ``lineage`` was seen (``now`` on the first call for it)."""
        if self._seen is None or self._seen[0] != lineage:
            self._seen = (lineage, now)
        return self._seen[1]


def peer_due(swarm: SwarmNode, *, max_ahead: timedelta, ready_seen: ReadySeen | None = None) -> bool:
    """Whether a peer is fetching our lineage's state to join it (a joiner, or a member catching
    up after a missed round), so that a node about to end its inner phase trains on for it.

    Two signals: our own state provider is sending, or sent within two view refreshes, a
    snapshot we keep (our state, the one before, the rounds' means beside them): seen at once,
    even while that transfer saturates our uplink and the DHT lags; or the view shows a
    ``syncing`` record naming our lineage whose estimate is at most ``max_ahead`` away and was
    renewed within a join window (a fetch that progresses renews it every ``view_refresh``).

    Once another node of our lineage is ready for the next round, only a fetch due within that
    node's join window holds us: it is forming the round and waits a join window for such a joiner
    (``RoundFormation._joiners_due``), and no longer. Training on past it would not bring the fetching
    node into the round, only leave us out of it: the nodes sending a slow fetch (the only ones that
    see their provider send) would miss the round the others formed, and fetch its state in turn,
    round after round. The window is counted from when we first saw such a node ready
    (``ready_seen``; without one, from now, which in a swarm where some node is always fetching,
    as at a thousand nodes, holds us until MAX_DUE_WAIT: the slow nodes, whose own H comes later,
    then miss the round the fast ones formed)."""
    config = swarm.config
    record = swarm.driver.record
    if record is None:
        return swarm.server.state_provider.served_lately(2 * config.view_refresh.total_seconds())
    view = swarm.driver.view
    now = swarm.driver.clock()  # the DHT's clock, which ready_at is on
    window = config.rounds.join_window.total_seconds()
    syncing = view.syncing_of(record.round, record.param_hash)  # by ready_at, once per view
    if any(
        peer_id != swarm.peer_id for peer_id in view.of_lineage(record.round, record.param_hash).ready_ids
    ):
        seen = now if ready_seen is None else ready_seen.since((record.round, record.param_hash), now)
        until = seen + window
        if until <= now:
            return False  # that node's window is over: the round forms without the fetching node
    elif swarm.server.state_provider.served_lately(2 * config.view_refresh.total_seconds()):
        return True
    else:
        until = now + max_ahead.total_seconds()
    return any(peer.peer_id != swarm.peer_id for peer in syncing.due(now - window, until))
