"""A deterministic in-memory swarm for round-formation tests: fake clock, fake DHT, fake network.

Nothing here is random unless the test makes it so: messages are delivered in (time, send order),
peers are processed in peer-id order, and the test decides every delay, drop, death and stale view.
"""

from __future__ import annotations

import hashlib
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field, replace

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
from protocol.membership.messages import Message
from protocol.membership.records import PeerRecord, SwarmView
from protocol.membership.rounds import RoundConfig, RoundFormation

PROTOCOL_VERSION = 1
FOREVER = 1e9


def fake_hash(label: str) -> str:
    return hashlib.sha256(label.encode()).hexdigest()


H0 = fake_hash("initial params")


def make_record(
    peer_id: str,
    *,
    round: int = 0,
    param_hash: str = H0,
    ready: bool = False,
    bandwidth: float = 1e6,
    expires_at: float = FOREVER,
    port: int = 5000,
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id,
        grpc_address=f"10.0.0.1:{port}",
        protocol_version=PROTOCOL_VERSION,
        round=round,
        param_hash=param_hash,
        ready_for_round=round + 1 if ready else None,
        tokens_per_s=1000.0,
        bandwidth_bytes_per_s=bandwidth,
        status="active",
        expires_at=expires_at,
    )


DelayFn = Callable[[str, str, Message, float], float]  # (sender, to, message, now) -> seconds
DropFn = Callable[[str, str, Message, float], bool]


@dataclass(order=True)
class Envelope:
    deliver_at: float
    seq: int
    sender: str = field(compare=False)
    to: str = field(compare=False)
    message: Message = field(compare=False)


class FakeNetwork:
    """Delivers each message after ``delay(...)`` seconds unless ``drop(...)`` says otherwise."""

    def __init__(self, delay: DelayFn | None = None, drop: DropFn | None = None) -> None:
        self.delay: DelayFn = delay or (lambda sender, to, message, now: 0.1)
        self.drop: DropFn = drop or (lambda sender, to, message, now: False)
        self._queue: list[Envelope] = []
        self._seq = 0
        self.sent: list[tuple[float, str, str, Message]] = []

    def send(self, now: float, sender: str, to: str, message: Message) -> None:
        self.sent.append((now, sender, to, message))
        if self.drop(sender, to, message, now):
            return
        self._seq += 1
        heapq.heappush(
            self._queue, Envelope(now + self.delay(sender, to, message, now), self._seq, sender, to, message)
        )

    def next_time(self) -> float | None:
        return self._queue[0].deliver_at if self._queue else None

    def pop_due(self, now: float) -> list[Envelope]:
        due = []
        while self._queue and self._queue[0].deliver_at <= now:
            due.append(heapq.heappop(self._queue))
        return due


ViewFn = Callable[[str, PeerRecord, float], PeerRecord | None]  # (observer, record, now) -> shown record


class FakeSwarm:
    """Peers' round-formation machines wired to a fake DHT and network under one fake clock."""

    def __init__(
        self,
        config: RoundConfig,
        records: list[PeerRecord],
        *,
        network: FakeNetwork | None = None,
        vector_length: int = 1000,
        view_of: ViewFn | None = None,
    ) -> None:
        self.config = config
        self.network = network or FakeNetwork()
        self.vector_length = vector_length
        self.view_of: ViewFn = view_of or (lambda observer, record, now: record)
        self.now = 0.0
        self.dht: dict[str, PeerRecord] = {record.peer_id: record for record in records}
        self.machines: dict[str, RoundFormation] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.outcome_times: dict[str, float] = {}
        self.actions: dict[str, list[tuple[float, Action]]] = {}
        self.dead: set[str] = set()
        self._last_views: dict[str, SwarmView] = {}

    # --- test controls ---

    def make_ready(self, peer_id: str, *, num_tokens: int = 1000) -> None:
        machine = RoundFormation(
            config=self.config,
            local=self.dht[peer_id],
            num_tokens=num_tokens,
            vector_length=self.vector_length,
            now=self.now,
        )
        self.machines[peer_id] = machine
        self.outcomes.pop(peer_id, None)
        view = self.view_for(peer_id)
        self._last_views[peer_id] = view
        self._route(peer_id, machine.start(view, self.now))

    def kill(self, peer_id: str) -> None:
        """The peer stops: no more messages in or out; its record lingers until it expires."""
        self.dead.add(peer_id)
        self.machines.pop(peer_id, None)

    def set_record(self, record: PeerRecord) -> None:
        self.dht[record.peer_id] = record

    def view_for(self, observer: str) -> SwarmView:
        shown = [self.view_of(observer, record, self.now) for record in self.dht.values()]
        return SwarmView.build(
            [record for record in shown if record is not None],
            now=self.now,
            protocol_version=PROTOCOL_VERSION,
        )

    # --- the event loop ---

    def run_until(self, end: float, *, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            self._push_views()
            times = [self.network.next_time()]
            times += [machine.next_deadline() for machine in self.machines.values()]
            times += [record.expires_at for record in self.dht.values() if record.expires_at > self.now]
            pending = [t for t in times if t is not None]
            if not pending or min(pending) > end:
                self.now = max(self.now, end)
                self._push_views()
                return
            self.now = max(self.now, min(pending))
            self._step()
        raise AssertionError(f"no quiescence after {max_steps} steps at t={self.now}")

    def _step(self) -> None:
        for envelope in self.network.pop_due(self.now):
            if envelope.to in self.dead:  # what a peer sent before it died is still delivered
                continue
            machine = self.machines.get(envelope.to)
            if machine is None:  # not forming any round: the daemon answers for it
                self._route(envelope.to, reply_without_formation(envelope.sender, envelope.message))
            else:
                self._route(envelope.to, machine.on_message(envelope.sender, envelope.message, self.now))
        for peer_id in sorted(self.machines):
            machine = self.machines[peer_id]
            deadline = machine.next_deadline()
            if deadline is not None and deadline <= self.now:
                self._route(peer_id, machine.tick(self.now))
        self._push_views()

    def _push_views(self) -> None:
        for peer_id in sorted(self.machines):
            view = self.view_for(peer_id)
            last = self._last_views.get(peer_id)
            if last is None or (last.peers, last.syncing) != (view.peers, view.syncing):
                self._last_views[peer_id] = view
                self._route(peer_id, self.machines[peer_id].on_view(view, self.now))

    def _route(self, peer_id: str, actions: list[Action]) -> None:
        log = self.actions.setdefault(peer_id, [])
        for action in actions:
            log.append((self.now, action))
            if isinstance(action, Send):
                self.network.send(self.now, peer_id, action.to, action.message)
            elif isinstance(action, Publish):
                self.dht[peer_id] = replace(self.dht[peer_id], ready_for_round=action.ready_for_round)
            elif isinstance(action, StartAllReduce | MissedRound | RoundFailed | Resync):
                assert peer_id not in self.outcomes, f"{peer_id} got a second outcome {action}"
                self.outcomes[peer_id] = action
                self.outcome_times[peer_id] = self.now
            else:
                assert isinstance(action, GroupMemberLost)

    # --- reading results ---

    def groups(self) -> dict[str, StartAllReduce]:
        return {p: o for p, o in self.outcomes.items() if isinstance(o, StartAllReduce)}

    def sent_by(self, peer_id: str) -> list[Action]:
        return [action for _, action in self.actions.get(peer_id, [])]

    def finish_round(self, peer_ids: list[str], new_hash: str) -> None:
        """What the daemon does after the all-reduce: publish the new params, not ready."""
        for peer_id in peer_ids:
            record = self.dht[peer_id]
            self.dht[peer_id] = replace(
                record, round=record.round + 1, param_hash=new_hash, ready_for_round=None
            )
            self.machines.pop(peer_id, None)
