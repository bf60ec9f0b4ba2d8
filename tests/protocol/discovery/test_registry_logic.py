"""SwarmRegistry against an in-memory DHT with a fake clock: leases, tombstones, hostile records.

The fake keeps what a DHT keeps (per key/subkey, the value that expires last; nothing after it
expires), so these tests pin the registry's own logic deterministically; test_swarm.py checks the
same behaviour over real hivemind peers.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from datetime import timedelta
from typing import cast

import pytest

from protocol.discovery.dht_node import DhtCallTimeout, DhtEntry, DhtNode, DhtNodeClosed
from protocol.discovery.registry import SwarmRegistry, run_key
from tests.protocol.discovery.support import PROTOCOL_VERSION, make_record, poll

PERIOD = timedelta(milliseconds=20)
CALL_TIMEOUT = timedelta(milliseconds=200)
TTL = timedelta(seconds=10)


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class FakeDht:
    """A single-process DHT: values by (key, subkey), the later expiration wins, expired ones vanish."""

    def __init__(self, clock: FakeClock, peer_id: str = "peer-self") -> None:
        self.clock, self.peer_id = clock, peer_id
        self.values: dict[str, dict[object, DhtEntry]] = {}
        self.stores: list[tuple[str, float]] = []  # (status, expiration) of every accepted store
        self.store_gate = threading.Event()  # stores wait on it: a slow DHT
        self.store_gate.set()
        self.fail_stores = False
        self.closed = False
        self.lock = threading.Lock()

    def store(
        self, key: str, value: object, *, expiration_time: float, subkey: object = None, timeout: timedelta
    ) -> bool:
        if self.closed:
            raise DhtNodeClosed("fake node shut down")
        if not self.store_gate.wait(timeout.total_seconds()) or self.fail_stores:
            raise DhtCallTimeout("fake store timed out")
        with self.lock:
            current = self.values.setdefault(key, {}).get(subkey)
            if current is not None and current.expiration_time >= expiration_time:
                return False
            self.values[key][subkey] = DhtEntry(value, expiration_time)
            self.stores.append((cast(dict, value)["status"], expiration_time))
            return True

    def get(self, key: str, *, latest: bool, timeout: timedelta) -> DhtEntry | None:
        assert latest, "the registry must read with latest=True to see every subkey"
        with self.lock:
            live = {s: e for s, e in self.values.get(key, {}).items() if e.expiration_time > self.clock()}
        return DhtEntry(live, max(e.expiration_time for e in live.values())) if live else None


def make_registry(dht: FakeDht, clock: FakeClock, **overrides: object) -> SwarmRegistry:
    options: dict[str, object] = dict(period=PERIOD, ttl=TTL, call_timeout=CALL_TIMEOUT, clock=clock)
    options.update(overrides)
    return SwarmRegistry(
        cast(DhtNode, dht),
        run_name="unit",
        protocol_version=PROTOCOL_VERSION,
        **options,  # type: ignore[arg-type]
    )


@pytest.mark.timeout(10)
def test_ttl_must_cover_three_periods_and_two_call_timeouts() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    period, call = timedelta(seconds=1), timedelta(seconds=2)
    make_registry(dht, clock, period=period, call_timeout=call, ttl=timedelta(seconds=7)).close()  # 3 + 4
    with pytest.raises(ValueError, match="ttl"):
        make_registry(dht, clock, period=period, call_timeout=call, ttl=timedelta(seconds=6.9))
    with pytest.raises(ValueError, match="positive"):
        make_registry(dht, clock, period=timedelta(0))
    assert run_key("run-7") == "dtnode/run-7/peers"
    with pytest.raises(ValueError, match="run_name"):
        run_key("has space")


@pytest.mark.timeout(10)
def test_publish_returns_before_the_store_and_stamps_the_ttl() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    dht.store_gate.clear()  # the DHT hangs: a store ends at its 5 s timeout
    store_timeout = timedelta(seconds=5)
    registry = make_registry(dht, clock, call_timeout=store_timeout, ttl=timedelta(seconds=11))
    started = time.monotonic()
    done = registry.publish(make_record(dht.peer_id))
    # The training loop is not held up: publish returned with the store still hanging, long before
    # the store could have timed out (a publish that waited for it would take the whole 5 s).
    assert not done.done() and time.monotonic() - started < 0.5 * store_timeout.total_seconds()
    dht.store_gate.set()
    assert done.result(timeout=2) is True
    view = registry.fetch()
    assert view.peer_ids == (dht.peer_id,)
    assert view.peers[0].expires_at == clock.now + 11.0  # expiration = DHT clock now + ttl
    registry.close()


@pytest.mark.timeout(10)
def test_heartbeat_renews_with_increasing_expirations_even_if_the_clock_steps_back() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)
    registry.publish(make_record(dht.peer_id)).result(timeout=2)
    clock.now -= 5.0  # an NTP step backwards
    poll(lambda: len(dht.stores), lambda count: count >= 4, within=timedelta(seconds=2))
    registry.close()
    expirations = [expiration for _, expiration in dht.stores]
    assert len(expirations) >= 4
    assert all(later > earlier for earlier, later in itertools.pairwise(expirations))


@pytest.mark.timeout(10)
def test_records_published_faster_than_stored_are_coalesced() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock, period=timedelta(seconds=60), ttl=timedelta(seconds=181))
    registry.publish(make_record(dht.peer_id, round=0)).result(timeout=2)
    dht.store_gate.clear()
    middle = [registry.publish(make_record(dht.peer_id, round=r)) for r in (1, 2, 3)]
    dht.store_gate.set()
    assert all(future.result(timeout=2) for future in middle)
    view = registry.fetch()
    assert view.peers[0].round == 3
    assert len(dht.stores) <= 3  # round 0, then 1 (already taken by the thread), then 3 at most
    registry.close()


@pytest.mark.timeout(10)
def test_a_revised_record_goes_out_with_the_next_heartbeat_and_no_store_of_its_own() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock, period=timedelta(seconds=1), ttl=timedelta(seconds=11))
    registry.revise(lambda record: dataclasses.replace(record, tokens_per_s=1.0))  # nothing published: no-op
    registry.publish(make_record(dht.peer_id)).result(timeout=2)
    stores = len(dht.stores)
    registry.revise(lambda record: dataclasses.replace(record, tokens_per_s=2500.0))
    assert len(dht.stores) == stores  # no store of its own: the heartbeat carries it
    assert registry.fetch().peers[0].tokens_per_s == 1000.0
    poll(lambda: len(dht.stores), lambda count: count > stores, within=timedelta(seconds=4))
    (peer,) = registry.fetch().peers
    assert peer.tokens_per_s == 2500.0 and peer.round == 0  # the rest of the record as published
    registry.close()


@pytest.mark.timeout(10)
def test_leave_tombstone_outlives_the_last_heartbeat_and_hides_the_peer() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    other = make_registry(dht, clock)  # a reader
    registry = make_registry(dht, clock)
    registry.publish(make_record(dht.peer_id)).result(timeout=2)
    heartbeat_expiration = dht.stores[-1][1]
    clock.now -= 1.0  # the tombstone must still win
    assert registry.leave() is True
    status, tombstone_expiration = dht.stores[-1]
    assert status == "left" and tombstone_expiration > heartbeat_expiration
    view = other.fetch()
    assert dht.peer_id not in view and view.left_peer_ids == {dht.peer_id}
    with pytest.raises(RuntimeError, match="stopped"):
        registry.publish(make_record(dht.peer_id))
    other.close()


@pytest.mark.timeout(10)
def test_without_leave_the_record_lingers_until_it_expires() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)
    registry.publish(make_record(dht.peer_id)).result(timeout=2)
    registry.close()  # a crash, as far as the DHT can tell
    expires_at = dht.stores[-1][1]
    assert dht.peer_id in registry.fetch(now=expires_at - 0.01)
    clock.now = expires_at
    assert len(registry.fetch()) == 0


@pytest.mark.timeout(10)
def test_failed_stores_resolve_the_future_false_and_the_heartbeat_retries() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    dht.fail_stores = True
    registry = make_registry(dht, clock)
    assert registry.publish(make_record(dht.peer_id)).result(timeout=2) is False
    dht.fail_stores = False
    poll(lambda: len(dht.stores), lambda count: count >= 1, within=timedelta(seconds=2))
    assert dht.peer_id in registry.fetch()
    registry.close()


@pytest.mark.timeout(10)
def test_heartbeat_stops_when_its_node_shuts_down() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)
    registry.publish(make_record(dht.peer_id)).result(timeout=2)
    dht.closed = True
    with pytest.raises(RuntimeError, match="stopped"):
        poll(lambda: registry.publish(make_record(dht.peer_id)), lambda _: False, within=timedelta(seconds=2))
    assert registry.leave() is False  # the node is gone: no tombstone, the record will expire


@pytest.mark.timeout(10)
def test_publish_rejects_someone_elses_record() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)
    with pytest.raises(ValueError, match="not this node"):
        registry.publish(make_record("peer-other"))
    registry.close()


@pytest.mark.timeout(10)
def test_bad_records_are_skipped_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)
    registry.publish(make_record(dht.peer_id)).result(timeout=2)
    key, later = registry.key, clock.now + 100.0
    dht.values[key]["peer-evil"] = DhtEntry({"peer_id": "peer-evil", "round": -1}, later)
    dht.values[key]["peer-liar"] = DhtEntry(make_record(dht.peer_id).to_dict(), later)  # claims our id
    dht.values[key][7] = DhtEntry("not even a mapping", later)
    with caplog.at_level(logging.WARNING, logger="protocol.discovery.registry"):
        for _ in range(3):
            assert registry.fetch().peer_ids == (dht.peer_id,)
    skipped = [r.getMessage() for r in caplog.records if "skipping a bad peer record" in r.getMessage()]
    assert len(skipped) == 3, skipped  # one line per bad subkey, not one per fetch
    assert any("peer-evil" in line for line in skipped) and any("peer-liar" in line for line in skipped)
    registry.close()


@pytest.mark.timeout(10)
def test_a_plain_value_over_the_key_gives_an_empty_view_not_a_crash(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)

    def plain_get(key: str, *, latest: bool, timeout: timedelta) -> DhtEntry:
        return DhtEntry(["vandal"], clock.now + 100)

    dht.get = plain_get  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="protocol.discovery.registry"):
        assert len(registry.fetch()) == 0
    assert "instead of records by subkey" in caplog.text
    registry.close()


@pytest.mark.timeout(10)
def test_fetch_raises_when_the_dht_does_not_answer() -> None:
    clock = FakeClock()
    dht = FakeDht(clock)
    registry = make_registry(dht, clock)

    def silent_get(key: str, *, latest: bool, timeout: timedelta) -> DhtEntry:
        raise DhtCallTimeout("no answer")

    dht.get = silent_get  # type: ignore[method-assign]
    with pytest.raises(DhtCallTimeout):
        registry.fetch()  # an empty view would say that everyone left
    registry.close()
