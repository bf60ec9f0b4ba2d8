"""The swarm registry: each peer's :class:`PeerRecord` in the DHT, kept alive by a heartbeat.

Layout. All records of one run live under a single DHT key, ``dtnode/<run name>/peers``, one
*subkey* per peer (its DHT peer id), each with its own expiration. Reading the key with
``latest=True`` returns every live subkey: the DHT asks all peers near the key and merges what
they hold (a plain ``get`` stops at the first copy it finds, which may be a cache holding only
some subkeys).

Liveness is leases, not connections (the Kademlia way: a value lives until it expires):

- **Publish.** ``publish(record)`` hands the record to a background thread and returns at once
  (the caller is a training loop). The thread stores it with ``expires_at = now + ttl`` and
  re-stores the latest record every ``period`` (the *heartbeat*). The lease survives two lost
  heartbeats because ``ttl >= 3·period + 2·call_timeout`` (checked at construction).
  ``revise(change)`` edits the latest record for the next heartbeat without a store of its own (the
  throughput, which changes at every step).
- **Leave.** ``leave()`` stops the heartbeat and stores a ``status="left"`` *tombstone* whose
  expiration is later than every heartbeat's. The DHT keeps, per subkey, the value that expires
  last, and ``latest=True`` readers merge on the same rule, so the tombstone replaces the record
  everywhere at once and readers drop the peer immediately instead of after its TTL.
- **Crash.** A peer that dies without leaving stops heartbeating; its last record *lingers* until
  it expires, up to ``ttl`` later. Round formation must tolerate a listed peer that does not
  answer (it does: a silent peer is dropped by its own deadline).

Clock. ``PeerRecord.expires_at`` is on the DHT's clock, ``hivemind.utils.get_dht_time()`` (wall
time, seconds), the same clock the DHT uses to drop expired values. ``publish`` overwrites the
caller's ``expires_at``, and ``fetch`` sets each record's ``expires_at`` to the expiration the DHT
holds for it, which is the one that decides when it disappears.

Records come from untrusted peers: ``fetch`` validates each with ``parse_records``, logs a bad
one once (per subkey and error), and skips it; one hostile record never hides the others.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from typing import Final

from hivemind.utils import get_dht_time

from protocol.discovery.dht_node import DhtCallTimeout, DhtEntry, DhtNode, DhtNodeClosed
from protocol.membership.records import PeerRecord, SwarmView, check_token, parse_records

logger = logging.getLogger(__name__)

# Bad records are reported once per (subkey, error); a hostile peer writing ever new subkeys must not
# grow this without bound, so the memory is forgotten (and bad records reported again) past this size.
_MAX_REPORTED_ERRORS: Final = 4096
# Expirations a publisher writes strictly increase by at least this much, even if the clock steps back.
_EXPIRATION_STEP_S: Final = 1e-3


def run_key(run_name: str) -> str:
    """The DHT key holding the peer records of run ``run_name``."""
    return f"dtnode/{check_token('run_name', run_name, max_chars=128)}/peers"


class SwarmRegistry:
    """Publishes this peer's record under the run key and reads everyone's; see the module docstring.

    ``period`` is the heartbeat period, ``ttl`` the lease of each stored record, ``call_timeout``
    the deadline of each DHT store and get (keep it at least the node's ``rpc_timeout``, after
    which hivemind gives up on one unresponsive peer), and ``clock`` the DHT clock (injectable).
    """

    def __init__(
        self,
        node: DhtNode,
        *,
        run_name: str,
        protocol_version: int,
        period: timedelta = timedelta(seconds=5),
        ttl: timedelta = timedelta(seconds=30),
        call_timeout: timedelta = timedelta(seconds=5),
        clock: Callable[[], float] = get_dht_time,
    ) -> None:
        if period <= timedelta(0) or call_timeout <= timedelta(0):
            raise ValueError(f"period and call_timeout must be positive, got {period} and {call_timeout}")
        if ttl < 3 * period + 2 * call_timeout:
            raise ValueError(
                f"ttl={ttl} is too short for period={period} and call_timeout={call_timeout}: a record must "
                f"outlive two lost heartbeats, so ttl >= 3 * period + 2 * call_timeout = {3 * period + 2 * call_timeout}"
            )
        self.node = node
        self.key = run_key(run_name)
        self.protocol_version = protocol_version
        self.period, self.ttl, self.call_timeout = period, ttl, call_timeout
        self._clock = clock

        self._changed = threading.Condition()  # guards the heartbeat's fields below
        self._latest: PeerRecord | None = None  # the record the heartbeat re-publishes
        self._unstored = False  # _latest changed since the last store started
        self._waiters: list[Future[bool]] = []  # publish() futures the next store resolves
        self._last_expiration = 0.0  # the latest expiration this peer has written
        self._stopping = False
        self._reported_errors: set[tuple[str, str]] = set()  # (subkey, error) of bad records logged
        self._reported_lock = threading.Lock()
        self._heartbeat = threading.Thread(
            target=self._heartbeat_loop, name=f"heartbeat {self.key}", daemon=True
        )
        self._heartbeat.start()

    # --- writing ---

    def publish(self, record: PeerRecord) -> Future[bool]:
        """Make ``record`` this peer's record; returns at once.

        The heartbeat thread stores it as soon as it is free (its ``expires_at`` replaced by
        ``now + ttl``), then keeps re-storing it every ``period``. Records published faster than
        the DHT stores them are coalesced: only the latest is stored. The returned future becomes
        True once that store (or a later one) was accepted, False if it failed or the registry
        stopped first; the heartbeat retries either way.
        """
        if record.peer_id != self.node.peer_id:
            raise ValueError(f"record.peer_id {record.peer_id!r} is not this node's id {self.node.peer_id!r}")
        if record.protocol_version != self.protocol_version:
            raise ValueError(
                f"record speaks protocol {record.protocol_version}, registry {self.protocol_version}"
            )
        if record.status == "left":
            raise ValueError("publish an active or syncing record; leave() writes the tombstone")
        done: Future[bool] = Future()
        with self._changed:
            if self._stopping:
                raise RuntimeError("the registry stopped (leave(), close(), or its DHT node shut down)")
            self._latest, self._unstored = record, True
            self._waiters.append(done)
            self._changed.notify()
        return done

    def revise(self, change: Callable[[PeerRecord], PeerRecord]) -> None:
        """Make ``change(record)`` this peer's record from the next heartbeat on, with no store of its
        own: for a figure that moves all the time (the throughput during a phase), which can wait for
        the next beat. Does nothing before the first :meth:`publish` or once stopped."""
        with self._changed:
            if self._latest is not None and not self._stopping:
                self._latest = change(self._latest)

    def leave(self, timeout: timedelta | None = None) -> bool:
        """Stop the heartbeat and write a tombstone so that other peers drop this one at once.

        Blocks for at most ``timeout`` (default: two ``call_timeout``; half of it may go to an
        in-flight heartbeat, the rest is the tombstone's deadline). Returns whether the tombstone
        was stored; if not, the peer's record lingers until it expires, as after a crash.
        """
        budget = timeout or 2 * self.call_timeout
        deadline = time.monotonic() + budget.total_seconds()
        # Waiting for an in-flight heartbeat is a courtesy, not a need: the tombstone expires later.
        self._stop(join_timeout=budget / 2)
        with self._changed:
            record = self._latest
        if record is None:
            return True  # nothing was ever published, so there is nothing to retract
        tombstone = dataclasses.replace(record, status="left", ready_for_round=None, ready_at=None)
        remaining = timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
        try:
            stored = self._store(tombstone, timeout=remaining)
        except DhtNodeClosed:
            stored = False
        if not stored:
            logger.warning(
                "could not store our 'left' tombstone under %s; peers drop us after the TTL", self.key
            )
        return stored

    def close(self) -> None:
        """Stop the heartbeat without a tombstone: the record lingers until it expires."""
        self._stop()

    def __enter__(self) -> SwarmRegistry:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.leave()

    # --- reading ---

    def fetch(self, now: float | None = None) -> SwarmView:
        """The live peers of the run at DHT-clock time ``now`` (default: the clock's now).

        Raises :class:`DhtCallTimeout` if the DHT does not answer within ``call_timeout``: an
        empty view would wrongly say everyone left.
        """
        entry = self.node.get(self.key, latest=True, timeout=self.call_timeout)
        now = self._clock() if now is None else now
        values = self._values_by_subkey(entry)
        records, errors = parse_records(values)
        for subkey, error in errors.items():
            self._report(subkey, error)
        return SwarmView.build(records, now=now, protocol_version=self.protocol_version)

    def _values_by_subkey(self, entry: DhtEntry | None) -> dict[str, object]:
        """``{subkey: record dict}`` with ``expires_at`` set to the expiration the DHT holds."""
        if entry is None:
            return {}
        if not isinstance(entry.value, dict):
            # Someone stored a plain value over the whole key; it hides every record until it expires.
            self._report("<whole key>", f"a {type(entry.value).__name__} instead of records by subkey")
            return {}
        values: dict[str, object] = {}
        for subkey, item in entry.value.items():
            value = item.value if isinstance(item, DhtEntry) else item
            if isinstance(value, Mapping) and isinstance(item, DhtEntry):
                value = {**value, "expires_at": item.expiration_time}
            values[subkey if isinstance(subkey, str) else repr(subkey)] = value
        return values

    def _report(self, subkey: str, error: str) -> None:
        with self._reported_lock:
            if (subkey, error) in self._reported_errors:
                return
            if len(self._reported_errors) >= _MAX_REPORTED_ERRORS:
                self._reported_errors.clear()
            self._reported_errors.add((subkey, error))
        logger.warning("skipping a bad peer record under %s, subkey %s: %s", self.key, subkey[:140], error)

    # --- the heartbeat ---

    def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic()
        while True:
            with self._changed:
                while (
                    not self._stopping
                    and not self._unstored
                    and (self._latest is None or time.monotonic() < next_beat)
                ):
                    self._changed.wait(None if self._latest is None else next_beat - time.monotonic())
                if self._stopping:
                    return
                record, waiters = self._latest, self._waiters
                self._unstored, self._waiters = False, []
            assert record is not None  # the wait loop only exits with a record or when stopping
            # Beats are spaced from their starts, so a slow store does not push the next one later.
            next_beat = time.monotonic() + self.period.total_seconds()
            try:
                stored = self._store(record, timeout=self.call_timeout)
            except DhtNodeClosed:
                logger.warning("the DHT node shut down under the heartbeat of %s; it stops", self.key)
                with self._changed:
                    self._stopping = True
                    waiters += self._waiters
                    self._waiters = []
                stored = False
            for waiter in waiters:
                waiter.set_result(stored)

    def _store(self, record: PeerRecord, *, timeout: timedelta) -> bool:
        """Store ``record`` with a fresh expiration; False (logged) if the DHT refused or timed out.

        Raises :class:`DhtNodeClosed` if the node was shut down.
        """
        with self._changed:
            expires_at = max(
                self._clock() + self.ttl.total_seconds(), self._last_expiration + _EXPIRATION_STEP_S
            )
            self._last_expiration = expires_at
        stamped = dataclasses.replace(record, expires_at=expires_at)
        try:
            stored = self.node.store(
                self.key,
                stamped.to_dict(),
                expiration_time=expires_at,
                subkey=record.peer_id,
                timeout=timeout,
            )
        except DhtCallTimeout as error:
            logger.warning("storing our %s record under %s failed: %s", record.status, self.key, error)
            return False
        if not stored:
            logger.warning(
                "no DHT peer accepted our %s record under %s (peers of a closed swarm refuse records "
                "not signed with their swarm key: check --swarm-key-file)",
                record.status,
                self.key,
            )
        return stored

    def _stop(self, join_timeout: timedelta | None = None) -> None:
        with self._changed:
            self._stopping = True
            waiters, self._waiters = self._waiters, []
            self._changed.notify()
        # The thread may be inside one store, which ends by call_timeout.
        join_timeout = join_timeout or self.call_timeout + timedelta(seconds=1)
        self._heartbeat.join(join_timeout.total_seconds())
        if self._heartbeat.is_alive():
            logger.info("the heartbeat of %s is still inside a store after %s", self.key, join_timeout)
        for waiter in waiters:
            waiter.set_result(False)
