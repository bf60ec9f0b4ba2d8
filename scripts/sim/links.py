"""Simulated links: each node's access link (latency, bandwidth), who can reach whom, and when a
membership message arrives.

Model (the distributions are drawn in ``swarm.py`` and documented in ``settings.py``): every node
has one access link to a core that never congests, with a one-way latency and an uplink and a
downlink rate. A message from A to B takes ``latency(A) + latency(B)`` plus its wire size over A's
uplink, and A's uplink sends one message at a time (first in, first out): a leader that sends a
Begin to a thousand members waits for each, and a message not sent by the driver's deadline is
lost, as the daemon's send is cancelled at that deadline. The deadline is the driver's own
(``fan_out.send_timeout``): ``message_timeout`` (3 s) plus the time the sender's announced uplink
takes to move its backlog and the messages of the same event (a fan-out), sized as the driver
sizes them (``fan_out.wire_sizes``). The daemon's sends run concurrently and share the uplink;
with that deadline both orders get every message of a fan-out out in time. The size is the product's own encoding of the message
(``protocol.membership.wire.to_envelope``'s protobuf size), so a Begin that lists a thousand members
costs what it costs on the wire. Receivers' downlinks are not modelled for messages (they are small
next to the all-reduce, which ``allreduce_cost.py`` models both ways). A message to a node that is
down, frozen or on the other side of a partition is lost (the daemon's send fails at its deadline).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from protocol.membership.messages import Begin, Message
from protocol.membership.wire import to_envelope


@dataclass(frozen=True)
class LinkProfile:
    """One node's access link."""

    latency_s: float
    """One-way latency from the node to the core."""
    up_bytes_per_s: float
    down_bytes_per_s: float


class Network:
    """Reachability (partitions) and message timing over the nodes' access links."""

    def __init__(self, protocol_version: int) -> None:
        self.protocol_version = protocol_version
        self.profiles: dict[str, LinkProfile] = {}
        self.side_of: dict[str, int] = {}  # partition side; absent = 0
        self._uplink_free_at: dict[str, float] = {}
        self._sizes: dict[int, tuple[object, int]] = {}  # id(message or group) -> (it, wire bytes)
        self.num_messages = 0
        self.num_messages_expired = 0  # not sent by their deadline (fan_out.send_timeout)
        self.expired_by_round: Counter[int] = Counter()  # the same, by the round they are about
        self.bytes_sent: dict[str, int] = {}  # membership bytes per sender

    def add(self, peer_id: str, profile: LinkProfile) -> None:
        self.profiles[peer_id] = profile

    def reachable(self, a: str, b: str) -> bool:
        return self.side_of.get(a, 0) == self.side_of.get(b, 0)

    def latency(self, a: str, b: str) -> float:
        return self.profiles[a].latency_s + self.profiles[b].latency_s

    def wire_bytes(self, sender: str, message: Message) -> int:
        """The envelope's protobuf size (cached per message object: a leader sends one Proposal and
        one GroupSpec to everyone)."""
        key_object: object = message.group if isinstance(message, Begin) else message
        cached = self._sizes.get(id(key_object))
        if cached is not None and cached[0] is key_object:
            return cached[1]
        size = to_envelope(message, sender_id=sender, protocol_version=self.protocol_version).ByteSize()
        if len(self._sizes) > 4096:
            self._sizes.clear()
        self._sizes[id(key_object)] = (key_object, size)
        return size

    def backlog_bytes(self, sender: str, now: float) -> int:
        """Bytes still queued on ``sender``'s uplink at ``now`` (what its driver has in flight)."""
        waiting = self._uplink_free_at.get(sender, 0.0) - now
        return round(waiting * self.profiles[sender].up_bytes_per_s) if waiting > 0 else 0

    def send_time(
        self, sender: str, receiver: str, message: Message, now: float, deadline: float
    ) -> float | None:
        """When ``message`` arrives at ``receiver``, or None if it is not sent by ``deadline`` (the
        driver's send has ``message_timeout``): it queues behind the sender's earlier sends, and one
        cut at its deadline holds the uplink until then."""
        size = self.wire_bytes(sender, message)
        self.num_messages += 1
        start = max(now, self._uplink_free_at.get(sender, 0.0))
        if start >= deadline:
            self._expired(message)
            return None
        done = start + size / self.profiles[sender].up_bytes_per_s
        if done > deadline:
            self._expired(message)
            self._uplink_free_at[sender] = deadline
            self.bytes_sent[sender] = self.bytes_sent.get(sender, 0) + round(
                (deadline - start) * self.profiles[sender].up_bytes_per_s
            )
            return None
        self._uplink_free_at[sender] = done
        self.bytes_sent[sender] = self.bytes_sent.get(sender, 0) + size
        return done + self.latency(sender, receiver)

    def _expired(self, message: Message) -> None:
        self.num_messages_expired += 1
        self.expired_by_round[message.round] += 1

    def transfer_seconds(self, num_bytes: int, receiver: str, sources: list[str]) -> float:
        """A state fetch of ``num_bytes`` from ``sources`` in parallel (``protocol.statesync``): the
        receiver's downlink or the sources' uplinks together, whichever is slower, plus a round trip."""
        if not sources:
            raise ValueError("a transfer needs a source")
        rate = min(
            self.profiles[receiver].down_bytes_per_s,
            sum(self.profiles[source].up_bytes_per_s for source in sources),
        )
        return num_bytes / rate + 2 * max(self.latency(receiver, source) for source in sources)
