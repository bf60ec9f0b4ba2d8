"""Drives round formation on the event loop: views, messages and ticks in; sends and publishes out.

:class:`~protocol.membership.rounds.RoundFormation` is a pure state machine; this is the loop
around it. While the local peer forms round ``r`` the driver feeds the formation

- every membership message the gRPC servicer receives (``on_message``, called on the loop),
- a fresh DHT view every ``view_refresh`` (read in a worker thread: hivemind's calls block),
- a ``tick`` at the formation's ``next_deadline``,

and executes what it asks for: ``Send`` as a fire-and-forget gRPC call with its own deadline (the
message timeout plus the time our announced uplink takes to send the bytes in flight with it: a
leader's fan-out of Begins to a thousand members takes seconds, ``protocol/membership/fan_out.py``;
to a client-mode peer, which nobody can dial: held in our ``Outbox`` until it collects it),
``Publish`` as a new DHT record through the registry's non-blocking heartbeat. The terminal
outcome ends :meth:`RoundDriver.form`. Between formations the last formation keeps answering
messages about its round (a late peer learns at once that the round started without it);
messages about any other round get the stateless answer of ``reply_without_formation``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from protocol.discovery.dht_node import DhtCallTimeout, DhtNodeClosed
from protocol.discovery.registry import SwarmRegistry
from protocol.membership.actions import (
    Action,
    GroupMemberLost,
    Outcome,
    Publish,
    Send,
    reply_without_formation,
)
from protocol.membership.fan_out import message_bytes, send_timeout, wire_sizes
from protocol.membership.messages import Accept, Begin, Cancel, Message, Reason
from protocol.membership.outbox import Outbox
from protocol.membership.records import PeerRecord, SwarmView
from protocol.membership.rounds import RoundFormation
from protocol.membership.transport import MembershipClient
from protocol.membership.wire import to_envelope
from protocol.swarm.config import SwarmConfig

logger = logging.getLogger(__name__)

MAX_REMEMBERED_PEERS = 256
"""Peers remembered as once seen, to knock on again after a partition (oldest forgotten first)."""
MAX_PENDING_SENDS = 1024
"""Membership messages in flight at once; more are dropped with a log line (their senders retry)."""


class RoundDriver:
    """Feeds one :class:`RoundFormation` at a time; lives on the node's event loop."""

    def __init__(
        self,
        *,
        config: SwarmConfig,
        peer_id: str,
        registry: SwarmRegistry,
        client: MembershipClient,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        # Messages for client-mode peers (nobody dials them) wait here as long as a proposal lives.
        rounds = config.rounds
        self.outbox = Outbox(hold=max(config.message_timeout, rounds.proposal_timeout, rounds.begin_timeout))
        self.clients: set[str] = set()  # peers in client mode (from views, Accepts, Begins): never dialled
        self.peer_id = peer_id
        self.registry = registry
        self.client = client
        self.clock = clock
        self.record: PeerRecord | None = None  # what we publish between rounds (ready_for_round None)
        self.view = SwarmView(now=clock(), peers=())
        self._formation: RoundFormation | None = None
        self._wake = asyncio.Event()
        self._addresses: dict[str, str] = {}  # peer id -> gRPC address, from views and Accepts
        self.last_seen: dict[str, float] = {}  # peer id -> when a view last listed it (bounded)
        self._sends: set[asyncio.Task[bool]] = set()
        self._bytes_in_flight = 0  # of those sends (fan_out.message_bytes): our uplink's queue
        # Sends to peers no view has listed yet (a leader whose record has not reached our DHT view
        # proposes to us): sent as soon as a view or a message gives the address, or dropped once
        # older than a proposal lives (the formation's own timeouts take over then).
        self._unaddressed: list[tuple[float, Send]] = []
        self.num_messages_in = 0
        self._warned_streams: set[str] = set()  # peers we told the user cannot share our rounds
        self.identity = ""  # what we train (SwarmNode.set_identity): views leave out other identities
        self._warned_foreign: set[str] = set()  # peers of another identity we told the user about
        self.num_messages_dropped = 0
        self.watch_closely = False
        """Read the view every ``view_refresh`` between rounds, not every 5 x: a node that adopted the
        swarm's state mid-phase ends its phase as soon as a peer is ready (set by the daemon)."""

    # --- records and views ---

    def publish(self, record: PeerRecord) -> None:
        """Make ``record`` ours (the heartbeat keeps storing it)."""
        self.record = record
        self.registry.publish(record)

    async def refresh_view(self) -> SwarmView:
        """Read the DHT (in a worker thread; bounded by the registry's call timeout)."""
        view = (await asyncio.to_thread(self.registry.fetch)).of_identity(self.identity)
        self._warn_foreign(view)
        self.view = view
        for record in view:
            self._addresses[record.peer_id] = record.grpc_address
            if record.client:
                self.clients.add(record.peer_id)
            else:
                self.clients.discard(record.peer_id)
            self.last_seen.pop(record.peer_id, None)
            self.last_seen[record.peer_id] = view.now  # re-inserted: the dict stays in last-seen order
        self._flush_unaddressed()
        for peer_id in view.left_peer_ids:  # said goodbye: no need to knock again
            self.last_seen.pop(peer_id, None)
        while len(self.last_seen) > MAX_REMEMBERED_PEERS:
            self.last_seen.pop(next(iter(self.last_seen)))
        return view

    def address_of(self, peer_id: str) -> str | None:
        """The peer's gRPC address, as the last view or message gave it."""
        return self._addresses.get(peer_id)

    # --- messages ---

    def on_message(self, sender: str, message: Message) -> None:
        """A membership message arrived (called by the gRPC servicer on the event loop)."""
        self.num_messages_in += 1
        if sender == self.peer_id:
            raise ValueError("a peer does not send round messages to itself")
        if any(record.peer_id == sender for record in self.view.foreign):
            logger.debug(
                "dropping a %s from %s: it trains another model or data", type(message).__name__, sender
            )
            return
        if isinstance(message, Cancel) and message.reason is Reason.STREAMS_MISMATCH:
            self._warn_streams(sender, "its leader opens another number of all-reduce streams")
        if isinstance(message, Accept):
            self._addresses[sender] = message.grpc_address
            if message.client:
                self.clients.add(sender)
        elif isinstance(message, Begin):
            for member in message.group.members:
                self._addresses.setdefault(member.peer_id, member.grpc_address)
                if member.client:
                    self.clients.add(member.peer_id)
        self._flush_unaddressed()
        formation = self._formation
        if formation is not None:
            actions = formation.on_message(sender, message, self.clock())
        else:
            actions = reply_without_formation(sender, message)
        self._execute(actions)
        self._wake.set()

    def _warn_foreign(self, view: SwarmView) -> None:
        """Once per peer: a peer that trains something else (another model, data or tokenizer,
        as its node's identity digest says) is never grouped, followed or fetched from."""
        for record in view.foreign:
            if (
                record.peer_id not in self._warned_foreign
                and len(self._warned_foreign) < MAX_REMEMBERED_PEERS
            ):
                self._warned_foreign.add(record.peer_id)
                logger.warning(
                    "peer %s (%s) trains another model or data than we do (identity %s, ours %s): it is "
                    "never grouped with us, nor do we take its state; every node of run %r needs the same "
                    "model, data and tokenizer",
                    record.peer_id, record.grpc_address, record.identity[:12], self.identity[:12],
                    self.config.run_name,
                )  # fmt: skip

    def _warn_streams(self, peer_id: str, why: str) -> None:
        """Once per peer: a peer that opens another number of streams never shares our rounds."""
        if peer_id not in self._warned_streams:
            self._warned_streams.add(peer_id)
            logger.warning(
                "peer %s cannot share rounds with us: %s; every peer of a swarm needs the same --swarm-streams",
                peer_id, why,
            )  # fmt: skip

    def _execute(self, actions: list[Action]) -> None:
        sends = [action for action in actions if isinstance(action, Send)]
        sizes = dict(zip(map(id, sends), wire_sizes([send.message for send in sends]), strict=True))
        # The sends of one event leave together (a leader's fan-out) and share our uplink with those
        # still in flight: each may take until all of them are out, plus the message timeout.
        timeout = self._send_timeout(sum(sizes.values()))
        for action in actions:
            if isinstance(action, Send):
                if isinstance(action.message, Cancel) and action.message.reason is Reason.STREAMS_MISMATCH:
                    self._warn_streams(action.to, "it opens another number of all-reduce streams than we do")
                self._send(action, sizes[id(action)], timeout)
            elif isinstance(action, Publish):
                assert self.record is not None, "publish a record before forming a round"
                self.registry.publish(
                    dataclasses.replace(self.record, ready_for_round=action.ready_for_round)
                )
            elif isinstance(action, GroupMemberLost):
                logger.info(
                    "round %d: member %s left our group (%s)", action.round, action.peer_id, action.reason
                )
            # Terminal outcomes are read from formation.outcome by form().

    def _send_timeout(self, num_bytes: int) -> timedelta:
        """A send's deadline once ``num_bytes`` more leave with it (``fan_out.send_timeout``)."""
        seconds = send_timeout(
            self.config.message_timeout.total_seconds(),
            self._bytes_in_flight + num_bytes,
            self.config.bandwidth_bytes_per_s,
        )
        return timedelta(seconds=seconds)

    def _send(self, send: Send, num_bytes: int | None = None, timeout: timedelta | None = None) -> None:
        if send.to in self.clients:
            # Nobody can dial it: it collects the message from us (Membership.Collect).
            envelope = to_envelope(
                send.message, sender_id=self.peer_id, protocol_version=self.client.protocol_version
            )
            self.outbox.put(send.to, envelope)
            return
        address = self._addresses.get(send.to)
        if address is None:
            if len(self._unaddressed) >= MAX_PENDING_SENDS:
                self.num_messages_dropped += 1
                logger.warning("no address for %s; dropped %s", send.to, type(send.message).__name__)
                return
            logger.info(
                "no address for %s yet; %s held until a view lists it", send.to, type(send.message).__name__
            )
            self._unaddressed.append((time.monotonic(), send))
            return
        if len(self._sends) >= MAX_PENDING_SENDS:
            self.num_messages_dropped += 1
            logger.warning("%d membership messages in flight; dropped one to %s", len(self._sends), send.to)
            return
        if num_bytes is None:
            num_bytes = message_bytes(send.message)
        if timeout is None:
            timeout = self._send_timeout(num_bytes)
        task = asyncio.create_task(self.client.send(address, send.message, timeout=timeout))
        self._sends.add(task)
        self._bytes_in_flight += num_bytes

        def done(task: asyncio.Task[bool]) -> None:
            self._sends.discard(task)
            self._bytes_in_flight -= num_bytes

        task.add_done_callback(done)

    def _flush_unaddressed(self) -> None:
        """Send the held messages whose address is known now; drop those past the message timeout."""
        if not self._unaddressed:
            return
        hold = max(self.config.message_timeout, self.config.rounds.proposal_timeout)  # a proposal's life
        oldest = time.monotonic() - hold.total_seconds()
        held, self._unaddressed = self._unaddressed, []
        for since, send in held:
            if since < oldest:
                self.num_messages_dropped += 1
                logger.info("no address for %s in time; dropped %s", send.to, type(send.message).__name__)
            elif send.to in self._addresses:
                self._send(send)
            else:
                self._unaddressed.append((since, send))

    # --- one formation ---

    async def form(
        self,
        local: PeerRecord,
        *,
        num_tokens: int,
        vector_length: int,
        stream_addresses: tuple[str, ...] = (),
    ) -> Outcome:
        """Form round ``local.round + 1``; returns its outcome by ``max_wait`` (plus a view read)."""
        self.record = dataclasses.replace(local, ready_for_round=None)
        now = self.clock()
        formation = RoundFormation(
            config=self.config.rounds,
            local=local,
            num_tokens=num_tokens,
            vector_length=vector_length,
            now=now,
            stream_addresses=stream_addresses,
        )
        self._formation = formation
        view = await self._read_view()
        self._execute(formation.start(view, self.clock()))
        refresh_every = self.config.view_refresh.total_seconds()
        next_refresh = time.monotonic() + refresh_every
        while formation.outcome is None:
            now = self.clock()
            deadline = formation.next_deadline()
            wait = refresh_every if deadline is None else min(max(deadline - now, 0.0), refresh_every)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=max(wait, 0.01))
            except TimeoutError:
                pass  # a deadline or a refresh is due
            if formation.outcome is not None:
                break
            if time.monotonic() >= next_refresh:
                next_refresh = time.monotonic() + refresh_every
                view = await self._read_view()
                self._execute(formation.on_view(view, self.clock()))
            if formation.outcome is None:
                self._execute(formation.tick(self.clock()))
        assert formation.outcome is not None
        return formation.outcome

    async def _read_view(self) -> SwarmView:
        """A fresh view, or the last one if the DHT does not answer in time (formation deadlines still run)."""
        try:
            return await self.refresh_view()
        except (DhtCallTimeout, DhtNodeClosed) as error:
            logger.warning(
                "DHT read failed (%s); using the view from %.1fs ago", error, self.clock() - self.view.now
            )
            return self.view

    async def close(self) -> None:
        for task in list(self._sends):
            task.cancel()
        await asyncio.gather(*self._sends, return_exceptions=True)


async def watch_swarm(driver: RoundDriver, reconnect: Callable[[Sequence[str]], int]) -> None:
    """Every ``view_refresh`` x 5 (x 2 while some are lost, x 1 while ``driver.watch_closely``): read
    the view, knock on peers we lost.

    A partition makes each side drop the other from its DHT routing table; without a knock,
    the two halves of the DHT would never merge again after the partition heals. The bootstrap
    peers and every peer seen in the last ``record_ttl`` x 10 are knocked on while absent. A
    bootstrap peer that never published a record (a ``dtnode bootstrap`` node: DHT only) is never in
    the view, so it is not counted lost: it is knocked on quietly, once a ``record_ttl``.
    """
    tick = driver.config.view_refresh.total_seconds()
    bootstrap = [address.rpartition("/p2p/")[2] for address in driver.config.dht.initial_peers]
    lost: list[str] = []
    last_read = time.monotonic()
    knocked_recordless = last_read  # they answered our start-up moments ago
    while True:
        # While peers are missing, knock sooner: a healed partition should merge well within a round.
        await asyncio.sleep(tick)
        period = tick if driver.watch_closely else (2 if lost else 5) * tick
        if time.monotonic() - last_read < period - tick / 2:
            continue
        last_read = time.monotonic()
        lost = []
        try:
            view = await driver.refresh_view()
            forget_before = view.now - 10 * driver.config.record_ttl.total_seconds()
            lost = [
                peer_id
                for peer_id, seen in driver.last_seen.items()
                if peer_id not in view and seen >= forget_before and peer_id != driver.peer_id
            ]
            absent = [peer_id for peer_id in bootstrap if peer_id not in view and peer_id not in lost]
            lost += [peer_id for peer_id in absent if peer_id in driver.last_seen]
            if lost:
                answered = await asyncio.to_thread(reconnect, lost[-64:])
                if answered:
                    logger.info("reconnected to %d of %d lost peer(s)", answered, len(lost[-64:]))
            recordless = [peer_id for peer_id in absent if peer_id not in driver.last_seen]
            if (
                recordless
                and time.monotonic() - knocked_recordless >= driver.config.record_ttl.total_seconds()
            ):
                knocked_recordless = time.monotonic()
                answered = await asyncio.to_thread(reconnect, recordless[-64:])
                logger.debug(
                    "knocked on %d of %d bootstrap peer(s) without a record", answered, len(recordless)
                )
        except (DhtCallTimeout, DhtNodeClosed, TimeoutError) as error:
            logger.debug("swarm watch: %s", error)
