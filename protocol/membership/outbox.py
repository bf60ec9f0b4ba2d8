"""Membership messages for peers nobody can dial, held until they collect them.

A node in client mode (``--client-mode``, e.g. behind NAT with no port forwarded) accepts no
connections, so a leader cannot ``Deliver`` its Proposal, Begin or Cancel to it. Instead the
sender keeps each such message here, under the receiver's peer id, and the client fetches it with
a ``Membership.Collect`` call it opens itself (a long poll: the call waits until a message is here
or its wait is over). So a message reaches a client one round trip after it was sent, over a
connection the client made.

A message is held at most ``hold`` (a proposal's life: after that the formation's own timeouts
have moved on), at most ``max_per_peer`` per receiver (the oldest go first) and for at most
``max_peers`` receivers (past that, the receiver whose messages have waited longest since it last
collected loses them): a peer that claims to be a client and never collects costs bounded memory. Everything runs on the node's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Final

from protocol.gen.dtnode.v1 import membership_pb2 as pb

MAX_PER_PEER: Final = 64
MAX_PEERS: Final = 256
MAX_WAIT: Final = timedelta(seconds=30)
"""The longest a Collect call is kept open (``CollectRequest.wait_ms`` is capped at this)."""


class Outbox:
    """Envelopes waiting for their receivers to collect them (see the module docstring)."""

    def __init__(
        self,
        *,
        hold: timedelta,
        max_per_peer: int = MAX_PER_PEER,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if hold <= timedelta(0) or max_per_peer < 1 or max_peers < 1:
            raise ValueError("hold, max_per_peer and max_peers must be positive")
        self.hold = hold
        self.max_per_peer = max_per_peer
        self.max_peers = max_peers
        self.clock = clock
        # receiver -> (time put, envelope), oldest first; receivers in the order their queues began
        self._held: OrderedDict[str, deque[tuple[float, pb.MembershipEnvelope]]] = OrderedDict()
        self._arrived: dict[str, asyncio.Event] = {}
        self.num_dropped = 0
        """Envelopes dropped unread: too old, too many for one receiver, or too many receivers."""

    def put(self, receiver_id: str, envelope: pb.MembershipEnvelope) -> None:
        """Hold ``envelope`` for ``receiver_id`` and wake a Collect call of it that waits."""
        queue = self._held.get(receiver_id)
        if queue is None:
            while len(self._held) >= self.max_peers:
                _, evicted = self._held.popitem(last=False)
                self.num_dropped += len(evicted)
            queue = self._held[receiver_id] = deque()
        if len(queue) >= self.max_per_peer:
            queue.popleft()
            self.num_dropped += 1
        queue.append((self.clock(), envelope))
        event = self._arrived.get(receiver_id)
        if event is not None:
            event.set()

    def num_held(self, receiver_id: str) -> int:
        self._expire(receiver_id)
        return len(self._held.get(receiver_id, ()))

    async def take(self, receiver_id: str, wait: timedelta) -> list[pb.MembershipEnvelope]:
        """Every envelope held for ``receiver_id``, oldest first; if there is none, wait up to
        ``wait`` (at most ``MAX_WAIT``) for one. Empty if the wait passed first."""
        self._expire(receiver_id)
        if not self._held.get(receiver_id):
            event = self._arrived.setdefault(receiver_id, asyncio.Event())
            event.clear()
            with contextlib.suppress(TimeoutError):  # nothing came: an empty answer
                async with asyncio.timeout(min(wait, MAX_WAIT).total_seconds()):
                    await event.wait()
            if self._arrived.get(receiver_id) is event and not event.is_set():
                del self._arrived[receiver_id]
            self._expire(receiver_id)
        queue = self._held.pop(receiver_id, None)
        return [] if queue is None else [envelope for _, envelope in queue]

    def _expire(self, receiver_id: str) -> None:
        queue = self._held.get(receiver_id)
        if queue is None:
            return
        oldest = self.clock() - self.hold.total_seconds()
        while queue and queue[0][0] < oldest:
            queue.popleft()
            self.num_dropped += 1
        if not queue:
            del self._held[receiver_id]
