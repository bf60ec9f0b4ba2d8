"""``peer_due``: when a node about to end its inner phase trains on for a node fetching its lineage's
state. It reads a real ``SwarmView`` of ``PeerRecord``s; the node around it is a stand-in holding
what the function reads (its config, its state provider's last send, its record and view, the clock)."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from protocol.membership.records import PeerRecord, SwarmView
from protocol.swarm.participation import ReadySeen, peer_due
from tests.protocol.membership.fake_swarm import PROTOCOL_VERSION, make_record

NOW = 1000.0
MAX_AHEAD = timedelta(minutes=2)


def node(*peers: PeerRecord, serving: bool, me: str = "me") -> Any:
    records = [make_record(me, round=3), *peers]
    view = SwarmView.build(records, now=NOW, protocol_version=PROTOCOL_VERSION)
    return SimpleNamespace(
        peer_id=me,
        config=SimpleNamespace(
            view_refresh=timedelta(seconds=1), rounds=SimpleNamespace(join_window=timedelta(seconds=15))
        ),
        server=SimpleNamespace(state_provider=SimpleNamespace(served_lately=lambda within: serving)),
        driver=SimpleNamespace(record=records[0], view=view, clock=lambda: NOW),
    )


def syncing(peer_id: str, *, ready_at: float) -> PeerRecord:
    """A joiner fetching our lineage's state (round 3, H0), expecting to hold it at ``ready_at``."""
    return dataclasses.replace(make_record(peer_id, round=3), status="syncing", ready_at=ready_at)


def test_a_node_sending_its_state_to_a_joiner_trains_on_while_no_peer_is_ready() -> None:
    assert peer_due(node(make_record("peer", round=3), serving=True), max_ahead=MAX_AHEAD)


def test_a_joiner_due_soon_holds_every_node_of_its_lineage() -> None:
    joiner = syncing("joiner", ready_at=NOW + 30)
    assert peer_due(node(make_record("peer", round=3), joiner, serving=False), max_ahead=MAX_AHEAD)
    far = syncing("joiner", ready_at=NOW + 600)  # past max_ahead: nobody waits for it
    assert not peer_due(node(make_record("peer", round=3), far, serving=False), max_ahead=MAX_AHEAD)


def test_a_node_sending_its_state_joins_the_round_once_a_peer_of_its_lineage_is_ready() -> None:
    """The nodes a joiner fetches from see it at once (their provider sends); the others only through
    its syncing record, which a fetch longer than MAX_DUE_WAIT does not make due. Before, the senders
    trained on up to MAX_DUE_WAIT while the others formed the round without them: they missed it and
    fetched its state in turn (in the simulator, 250 of 688 missed or re-synced formations). Once a
    peer of our lineage is ready, the round is forming: we train on only for a fetch due within the
    join window, which that peer's formation waits for too, else we end the phase and join it."""
    ready = make_record("peer", round=3, ready=True)
    assert not peer_due(node(ready, serving=True), max_ahead=MAX_AHEAD)
    assert not peer_due(node(ready, syncing("joiner", ready_at=NOW + 30), serving=True), max_ahead=MAX_AHEAD)
    assert peer_due(node(ready, syncing("joiner", ready_at=NOW + 10), serving=True), max_ahead=MAX_AHEAD)
    assert peer_due(node(ready, syncing("joiner", ready_at=NOW + 10), serving=False), max_ahead=MAX_AHEAD)
    other_lineage = make_record("other", round=2, param_hash="f" * 64, ready=True)  # not forming our round
    assert peer_due(node(other_lineage, serving=True), max_ahead=MAX_AHEAD)


def node_at(now: float, *peers: PeerRecord) -> Any:
    """``node`` with its clock (the DHT's) at ``now``."""
    stand_in = node(*peers, serving=False)
    stand_in.driver.clock = lambda: now
    return stand_in


def test_once_a_peer_is_ready_a_stream_of_fetches_holds_us_only_until_its_join_window_ends() -> None:
    """At a thousand nodes some node is always fetching the lineage's state, each due a few seconds
    later than the last. Counted from now, "a fetch due within a join window" then held a node past
    its H for every step until MAX_DUE_WAIT, long after the ready peer's formation closed: slow nodes,
    whose H comes later, missed the round (issue 33's simulator, fixed H: 0.75 of live nodes). With
    ``ReadySeen`` the window is the ready peer's, counted from when we first saw it ready."""
    ready = make_record("peer", round=3, ready=True)
    seen = ReadySeen()
    for offset in (
        0.0,
        5.0,
        9.0,
        10.0,
    ):  # a fetch due 5 s ahead at every step: held while it is due in the window
        stand_in = node_at(NOW + offset, ready, syncing("joiner", ready_at=NOW + offset + 5))
        assert peer_due(stand_in, max_ahead=MAX_AHEAD, ready_seen=seen)
    for offset in (15.0, 16.0, 60.0):  # the ready peer's window is over: we join its round
        stand_in = node_at(NOW + offset, ready, syncing("joiner", ready_at=NOW + offset + 5))
        assert not peer_due(stand_in, max_ahead=MAX_AHEAD, ready_seen=seen)
        assert peer_due(stand_in, max_ahead=MAX_AHEAD)  # counted from now, as before: held on
    # A fetch due after the ready peer's window ends does not hold us even inside it.
    late = node_at(NOW + 10, ready, syncing("joiner", ready_at=NOW + 18))
    assert not peer_due(late, max_ahead=MAX_AHEAD, ready_seen=seen)
    # The next round's lineage starts a new window.
    next_ready = make_record("peer", round=4, param_hash="e" * 64, ready=True)
    me = dataclasses.replace(make_record("me", round=4, param_hash="e" * 64))
    stand_in = node_at(NOW + 100, next_ready, dataclasses.replace(syncing("joiner", ready_at=NOW + 105), round=4,
                                                                   param_hash="e" * 64))  # fmt: skip
    stand_in.driver.record = me
    stand_in.driver.view = SwarmView.build(
        [me, next_ready, dataclasses.replace(syncing("joiner", ready_at=NOW + 105), round=4, param_hash="e" * 64)],
        now=NOW + 100, protocol_version=PROTOCOL_VERSION,
    )  # fmt: skip
    assert peer_due(stand_in, max_ahead=MAX_AHEAD, ready_seen=seen)
