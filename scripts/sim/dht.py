"""A simulated DHT: the run's peer records, visible after a delay, sometimes lost, split by partitions.

It stands where ``protocol.discovery.registry.SwarmRegistry`` and hivemind stand in the daemon and
keeps their contract: one record per peer (the one that expires last; a tombstone wins a tie, the
product's ``newest_per_peer``), a record gone once ``expires_at`` passes, and readers handed a
``SwarmView`` built by the product's ``SwarmView.build``. What it models instead of running:

- a store becomes visible ``delay`` seconds later (drawn per store) or is lost (probability
  ``loss``): the heartbeat's next store renews it, as in the daemon;
- a partition splits the DHT: each side keeps a copy of the records as they were at the split, and
  a store reaches only the storer's side; at the heal the copies merge by the newest-record rule;
- readers get the DHT as it was at the last ``epoch`` boundary (views are shared between the
  readers of one side within an epoch: building one is the costly part of a large swarm).
"""

from __future__ import annotations

import heapq
import itertools
import random

from protocol.membership.records import PeerRecord, SwarmView, newest_per_peer


class SimulatedDht:
    """The run key's records, per side of a partition (one side when there is none)."""

    def __init__(
        self,
        *,
        rng: random.Random,
        protocol_version: int,
        delay: tuple[float, float],
        loss: float,
        epoch: float,
    ) -> None:
        self.rng = rng
        self.protocol_version = protocol_version
        self.delay = delay
        self.loss = loss
        self.epoch = epoch
        self.sides: list[dict[str, PeerRecord]] = [{}]
        self.side_of: dict[str, int] = {}  # peer id -> side; absent = 0
        self._pending: list[tuple[float, int, PeerRecord]] = []  # (visible at, sequence, record)
        self._sequence = itertools.count()
        self._views: dict[int, tuple[int, SwarmView]] = {}  # side -> (epoch index, view)
        self.num_stores = 0
        self.num_lost = 0

    def store(self, record: PeerRecord, now: float) -> None:
        """Store ``record`` (its ``expires_at`` already set by the caller, as the registry does)."""
        self.num_stores += 1
        if self.rng.random() < self.loss:
            self.num_lost += 1
            return
        visible_at = now + self.rng.uniform(*self.delay)
        heapq.heappush(self._pending, (visible_at, next(self._sequence), record))

    def view(self, peer_id: str, now: float) -> SwarmView:
        """What ``peer_id`` reads at ``now``: its side's records as of the last epoch boundary."""
        epoch_index = int(now / self.epoch)
        side = self.side_of.get(peer_id, 0)
        cached = self._views.get(side)
        if cached is not None and cached[0] == epoch_index:
            return cached[1]
        at = epoch_index * self.epoch
        self._apply(at)
        view = SwarmView.build(self.sides[side].values(), now=at, protocol_version=self.protocol_version)
        self._views[side] = (epoch_index, view)
        return view

    def _apply(self, until: float) -> None:
        while self._pending and self._pending[0][0] <= until:
            _, _, record = heapq.heappop(self._pending)
            table = self.sides[self.side_of.get(record.peer_id, 0)]
            current = table.get(record.peer_id)
            table[record.peer_id] = (
                record if current is None else newest_per_peer((current, record))[record.peer_id]
            )
        self._forget_expired(until)

    def _forget_expired(self, now: float) -> None:
        """Drop expired records (the DHT forgets them too); only the table's size depends on this."""
        for table in self.sides:
            for peer_id in [p for p, record in table.items() if record.expires_at <= now]:
                del table[peer_id]

    # --- partitions ---

    def split(self, side_of: dict[str, int], num_sides: int, now: float) -> None:
        """Each side starts from a copy of the records as they are now; stores stay on their side."""
        self._apply(now)
        merged = self._merged()
        self.sides = [dict(merged) for _ in range(num_sides)]
        self.side_of = dict(side_of)
        self._views.clear()

    def heal(self, now: float) -> None:
        """The sides' records merge, the newest record of each peer winning."""
        self._apply(now)
        self.sides = [self._merged()]
        self.side_of = {}
        self._views.clear()

    def _merged(self) -> dict[str, PeerRecord]:
        return newest_per_peer(record for table in self.sides for record in table.values())
