"""A simulated DHT: the run's peer records, visible after a delay, sometimes lost, split by partitions.

It stands where ``protocol.discovery.registry.SwarmRegistry`` and hivemind stand in the daemon and
keeps their contract: one record per peer (the one that expires last; a tombstone wins a tie, the
product's ``newest_per_peer``), a record gone once ``expires_at`` passes, and readers handed a
``SwarmView`` built by the product's ``SwarmView.build``. What it models instead of running:

- a store becomes visible ``delay`` seconds later (drawn per store) or is lost (probability
  ``loss``): the heartbeat's next store renews it, as in the daemon;
- a partition splits the DHT: each side keeps a copy of the records as they were at the split, and
  a store reaches only the storer's side; at the heal the copies merge by the newest-record rule;
- readers get the DHT as it was at the last ``epoch`` boundary.

A side's ``SwarmView`` is built (by ``SwarmView.build``) only when what it says changed: a record
appeared, expired, or changed in anything but its ``expires_at``; else the readers of a later epoch get
the same view, as the same object. A heartbeat that renews a record changes only its expiry, which
nothing reads from a view (``build`` alone tests it, to leave out the expired: the expiry heap below
removes a record when it expires and marks the view stale). That keeps every decision the same as
with a view built at every epoch, and a view's index of its lineages (``SwarmView.memo``) computed
once for all the epochs it lasts: a thousand nodes renew a record every two seconds each, and
rebuilding the view for each of them was most of a large run's CPU.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random

from protocol.membership.records import PeerRecord, SwarmView, newest_per_peer


def restamped(record: PeerRecord, expires_at: float) -> PeerRecord:
    """``record`` with a new ``expires_at`` (a heartbeat's store), as ``dataclasses.replace`` makes it
    but without validating again the fields that did not change: a thousand nodes store one every
    two seconds, and the validation would be most of the run's CPU. ``expires_at`` is the clock plus
    the TTL: a finite float >= 0, as ``PeerRecord`` requires. (A copy of the fields' dict with one
    item set: half the time of a dict display merging it.)"""
    fields = record.__dict__.copy()
    fields["expires_at"] = float(expires_at)
    copy = _new(PeerRecord)
    _set(copy, "__dict__", fields)
    return copy


_new = object.__new__
_set = object.__setattr__


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
        # (expires_at, sequence, side, peer id): one entry per record in a table, at or before its expiry
        self._expiries: list[tuple[float, int, int, str]] = []
        self._sequence = itertools.count()
        self._views: list[SwarmView | None] = [None]  # per side; None: what it says changed
        self._applied_until = -math.inf
        self.num_stores = 0
        self.num_lost = 0
        self.num_views_built = 0

    def store(self, record: PeerRecord, now: float) -> None:
        """Store ``record`` (its ``expires_at`` already set by the caller, as the registry does)."""
        self.num_stores += 1
        if self.rng.random() < self.loss:
            self.num_lost += 1
            return
        low, high = self.delay
        visible_at = now + low + (high - low) * self.rng.random()  # random.uniform(low, high), inlined
        heapq.heappush(self._pending, (visible_at, next(self._sequence), record))

    def view(self, peer_id: str, now: float) -> SwarmView:
        """What ``peer_id`` reads at ``now``: its side's records as of the last epoch boundary."""
        at = int(now / self.epoch) * self.epoch
        if at > self._applied_until:
            self._apply(at)
        side = self.side_of.get(peer_id, 0)
        view = self._views[side]
        if view is None:
            view = SwarmView.build(self.sides[side].values(), now=at, protocol_version=self.protocol_version)
            self._views[side] = view
            self.num_views_built += 1
        return view

    def _apply(self, until: float) -> None:
        """The stores visible by ``until``, then the records expired by then."""
        self._applied_until = until
        pending = self._pending
        while pending and pending[0][0] <= until:
            _, _, record = heapq.heappop(pending)
            side = self.side_of.get(record.peer_id, 0)
            table = self.sides[side]
            current = table.get(record.peer_id)
            if current is None or record.expires_at > current.expires_at:
                newest = record  # the later expiration wins (hivemind's rule for a subkey)
            else:  # a tie or an older store: the product's rule (a tombstone wins a tie)
                newest = newest_per_peer((current, record))[record.peer_id]
                if newest is current:
                    continue
            if current is None:  # (a renewed record's entry in the expiry heap moves when it comes up)
                heapq.heappush(
                    self._expiries, (newest.expires_at, next(self._sequence), side, record.peer_id)
                )
            if current is None or not _same_but_expiry(current, newest):
                self._views[side] = None
            table[record.peer_id] = newest
        expiries = self._expiries
        while expiries and expiries[0][0] <= until:
            _, _, side, peer_id = heapq.heappop(expiries)
            kept = self.sides[side].get(peer_id)
            if kept is None:
                continue
            if kept.expires_at <= until:  # not renewed since: gone
                del self.sides[side][peer_id]
                self._views[side] = None
            else:  # renewed: come up again when the renewal expires
                heapq.heappush(expiries, (kept.expires_at, next(self._sequence), side, peer_id))

    # --- partitions ---

    def split(self, side_of: dict[str, int], num_sides: int, now: float) -> None:
        """Each side starts from a copy of the records as they are now; stores stay on their side."""
        self._apply(now)
        merged = self._merged()
        self._reset([dict(merged) for _ in range(num_sides)], dict(side_of))

    def heal(self, now: float) -> None:
        """The sides' records merge, the newest record of each peer winning."""
        self._apply(now)
        self._reset([self._merged()], {})

    def _merged(self) -> dict[str, PeerRecord]:
        return newest_per_peer(record for table in self.sides for record in table.values())

    def _reset(self, sides: list[dict[str, PeerRecord]], side_of: dict[str, int]) -> None:
        self.sides, self.side_of = sides, side_of
        self._views = [None] * len(sides)
        self._expiries = [
            (record.expires_at, next(self._sequence), side, peer_id)
            for side, table in enumerate(sides)
            for peer_id, record in table.items()
        ]
        heapq.heapify(self._expiries)


def _same_but_expiry(a: PeerRecord, b: PeerRecord) -> bool:
    """Whether two records of a peer say the same, but for how long (a heartbeat's renewal)."""
    fields = b.__dict__.copy()
    fields["expires_at"] = a.expires_at
    return a.__dict__ == fields
