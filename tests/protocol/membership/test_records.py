"""Peer records: round trip, validation of hostile input, and the live view built from them."""

from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.membership.records import PeerRecord, SwarmView, check_token, newest_per_peer, parse_records
from tests.protocol.membership.fake_swarm import H0, PROTOCOL_VERSION, make_record

VERSION = 1


def _valid_dict(**changes: Any) -> dict[str, Any]:
    data = make_record("peer-A", round=4, ready=True, expires_at=100.0).to_dict()
    data.update(changes)
    return data


def test_round_trip_through_a_plain_dict() -> None:
    record = make_record("QmPeer123", round=7, ready=True, bandwidth=2.5e6, expires_at=123.5)
    data = record.to_dict()
    assert data == {
        "peer_id": "QmPeer123",
        "grpc_address": "10.0.0.1:5000",
        "protocol_version": 1,
        "round": 7,
        "param_hash": H0,
        "ready_for_round": 8,
        "tokens_per_s": 1000.0,
        "bandwidth_bytes_per_s": 2.5e6,
        "status": "active",
        "expires_at": 123.5,
    }
    assert PeerRecord.from_dict(data) == record
    assert PeerRecord.from_dict(data, expected_peer_id="QmPeer123") == record


def test_integers_are_accepted_for_rates_and_normalised_to_float() -> None:
    record = PeerRecord.from_dict(_valid_dict(tokens_per_s=5, bandwidth_bytes_per_s=7, expires_at=9))
    assert (record.tokens_per_s, record.bandwidth_bytes_per_s, record.expires_at) == (5.0, 7.0, 9.0)
    assert all(
        type(v) is float for v in (record.tokens_per_s, record.bandwidth_bytes_per_s, record.expires_at)
    )


def test_unknown_keys_are_ignored_for_forward_compatibility() -> None:
    assert PeerRecord.from_dict(_valid_dict(future_field=[1, 2])).peer_id == "peer-A"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("peer_id", ""),
        ("peer_id", "x" * 129),
        ("peer_id", "has space"),
        ("peer_id", "ünïcode"),
        ("peer_id", 12),
        ("peer_id", None),
        ("grpc_address", "no-port"),
        ("grpc_address", "host:0"),
        ("grpc_address", "host:65536"),
        ("grpc_address", ":5000"),
        ("grpc_address", "host:50a"),
        ("grpc_address", "h" * 300 + ":1"),
        ("protocol_version", -1),
        ("protocol_version", 1.0),
        ("protocol_version", True),
        ("protocol_version", 2**31),
        ("round", -1),
        ("round", "3"),
        ("round", 2**63),
        ("param_hash", H0.upper()),
        ("param_hash", H0[:-1]),
        ("param_hash", H0 + "0"),
        ("param_hash", H0[:-1] + "g"),
        ("param_hash", H0 + "\n"),
        ("param_hash", b"\x00" * 32),
        ("ready_for_round", 4),  # must be round + 1 = 5
        ("ready_for_round", 6),
        ("ready_for_round", 0),
        ("ready_for_round", "5"),
        ("tokens_per_s", -1.0),
        ("tokens_per_s", math.nan),
        ("tokens_per_s", math.inf),
        ("tokens_per_s", "fast"),
        ("tokens_per_s", False),
        ("tokens_per_s", 10**400),
        ("bandwidth_bytes_per_s", -0.5),
        ("bandwidth_bytes_per_s", -math.inf),
        ("status", "gone"),
        ("status", ["active"]),
        ("expires_at", math.nan),
        ("expires_at", -1.0),
        ("expires_at", None),
        ("ready_at", 5.0),  # an active record says nothing of a fetch
        ("ready_at", "soon"),
    ],
)
def test_each_malformed_field_is_a_value_error_that_names_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        PeerRecord.from_dict(_valid_dict(**{field: value}))


def test_malformed_containers_and_impersonation_are_rejected() -> None:
    with pytest.raises(ValueError, match="mapping"):
        PeerRecord.from_dict([("peer_id", "a")])
    with pytest.raises(ValueError, match="mapping"):
        PeerRecord.from_dict(None)
    data = _valid_dict()
    del data["round"]
    with pytest.raises(ValueError, match="round"):
        PeerRecord.from_dict(data)
    with pytest.raises(ValueError, match="subkey"):
        PeerRecord.from_dict(_valid_dict(), expected_peer_id="someone-else")


def test_ready_for_round_none_is_fine() -> None:
    assert PeerRecord.from_dict(_valid_dict(ready_for_round=None)).ready_for_round is None


_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=80)
    | st.binary(max_size=40)
    | st.sampled_from([H0, "active", "left", "10.0.0.1:5000", "peer-A"]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=10,
)
_FIELD_NAMES = [
    "peer_id",
    "grpc_address",
    "protocol_version",
    "round",
    "param_hash",
    "ready_for_round",
    "tokens_per_s",
    "bandwidth_bytes_per_s",
    "status",
    "expires_at",
]


@settings(max_examples=400, deadline=None)
@given(
    st.dictionaries(st.sampled_from(_FIELD_NAMES) | st.text(max_size=10), _JSONISH, max_size=14) | _JSONISH
)
def test_random_values_only_ever_raise_value_error(data: object) -> None:
    try:
        record = PeerRecord.from_dict(data)
    except ValueError:
        return
    assert PeerRecord.from_dict(record.to_dict()) == record  # whatever parses is a valid record


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(_FIELD_NAMES), _JSONISH)
def test_one_hostile_field_in_an_otherwise_valid_record(field: str, value: object) -> None:
    try:
        record = PeerRecord.from_dict(_valid_dict(**{field: value}))
    except ValueError as error:
        assert field in str(error) or "ready_for_round" in str(error)
        return
    assert getattr(record, field) == value


def test_a_syncing_record_names_the_state_it_fetches_and_when_it_expects_to_hold_it() -> None:
    record = replace(make_record("joiner", round=4, expires_at=100.0), status="syncing", ready_at=42.5)
    data = record.to_dict()
    assert data["status"] == "syncing" and data["ready_at"] == 42.5
    assert PeerRecord.from_dict(data) == record
    assert "ready_at" not in make_record("peer").to_dict()  # optional: absent means None
    unknown = replace(record, ready_at=None)
    assert PeerRecord.from_dict(unknown.to_dict()) == unknown
    for value in (math.nan, math.inf, -1.0, True):
        with pytest.raises(ValueError, match="ready_at"):
            PeerRecord.from_dict({**data, "ready_at": value})
    with pytest.raises(ValueError, match="ready for no round"):
        PeerRecord.from_dict({**data, "ready_for_round": 5})


def test_syncing_peers_are_listed_apart_and_count_for_no_lineage() -> None:
    """A joiner still fetching holds no params: it must not swell a lineage (two fresh joiners on the
    same seeded init would otherwise outnumber a one-node swarm and send it back to round 0)."""
    member = make_record("m", round=3, param_hash=H0, expires_at=50.0)
    joiners = [
        replace(make_record(peer, expires_at=50.0), status="syncing", ready_at=20.0) for peer in ("j1", "j2")
    ]
    stale = replace(make_record("j0", expires_at=5.0), status="syncing")
    other_version = replace(joiners[0], peer_id="j3", protocol_version=VERSION + 1)
    view = SwarmView.build([member, *joiners, stale, other_version], now=10.0, protocol_version=VERSION)
    assert view.peer_ids == ("m",)
    assert [peer.peer_id for peer in view.syncing] == ["j1", "j2"]
    # Once a joiner holds the state its newer active record replaces the syncing one.
    adopted = replace(make_record("j1", round=3, expires_at=60.0))
    view = SwarmView.build([member, *joiners, adopted], now=10.0, protocol_version=VERSION)
    assert view.peer_ids == ("j1", "m") and [peer.peer_id for peer in view.syncing] == ["j2"]


def test_rank_and_identity_round_trip_and_are_optional() -> None:
    record = replace(make_record("p", expires_at=9.0), rank=0, identity="ab" * 32)
    data = record.to_dict()
    assert (data["rank"], data["identity"]) == (0, "ab" * 32) and PeerRecord.from_dict(data) == record
    plain = make_record("p", expires_at=9.0).to_dict()
    assert "rank" not in plain and "identity" not in plain  # absent: unranked, identity unknown
    for field, value in (("rank", -1), ("rank", True), ("identity", "has space"), ("identity", 7)):
        with pytest.raises(ValueError, match=field):
            PeerRecord.from_dict({**plain, field: value})


def test_the_data_lane_round_trips_as_a_list_and_is_optional() -> None:
    record = replace(make_record("p", expires_at=9.0), data_lane=(3, 2))  # spare lane 1 beside 2 shards
    data = record.to_dict()
    assert data["data_lane"] == (3, 2)
    wire = {**data, "data_lane": [3, 2]}  # msgpack and JSON give a list back
    assert PeerRecord.from_dict(wire) == record and PeerRecord.from_dict(wire).data_lane == (3, 2)
    plain = make_record("p", expires_at=9.0).to_dict()
    assert "data_lane" not in plain and PeerRecord.from_dict(plain).data_lane is None
    for value in ([0, 0], [-1, 2], [1], [1, 2, 3], "0,1", [True, 2], [0.5, 2]):
        with pytest.raises(ValueError, match="data_lane"):
            PeerRecord.from_dict({**plain, "data_lane": value})


def test_a_view_of_one_identity_leaves_the_others_out() -> None:
    """Peers that train something else (another identity digest) are set apart, active or syncing;
    a peer that has not said (empty identity) is kept, and an empty identity of ours keeps everyone."""
    ours, theirs = "a" * 64, "b" * 64
    records = [
        replace(make_record("same", expires_at=50.0), identity=ours),
        replace(make_record("other", expires_at=50.0), identity=theirs),
        make_record("unknown", expires_at=50.0),
        replace(make_record("fetching", expires_at=50.0), status="syncing", identity=theirs),
    ]
    view = SwarmView.build(records, now=10.0, protocol_version=VERSION)
    mine = view.of_identity(ours)
    assert mine.peer_ids == ("same", "unknown") and mine.syncing == ()
    assert [record.peer_id for record in mine.foreign] == ["fetching", "other"]
    assert view.of_identity("") is view


def test_view_keeps_live_compatible_active_peers_sorted() -> None:
    records = [
        make_record("c", expires_at=50.0),
        make_record("a", expires_at=50.0),
        make_record("expired", expires_at=10.0),
        make_record("at-now", expires_at=20.0),  # expiring exactly now: stale
        replace(make_record("other-version", expires_at=50.0), protocol_version=2),
        replace(make_record("gone", expires_at=50.0), status="left"),
        make_record("b", expires_at=50.0),
    ]
    view = SwarmView.build(records, now=20.0, protocol_version=VERSION)
    assert view.peer_ids == ("a", "b", "c")
    assert "a" in view and "gone" not in view and view.get("expired") is None
    assert view.left_peer_ids == frozenset({"gone"})
    assert len(view) == 3 and [r.peer_id for r in view] == ["a", "b", "c"]


def test_newest_record_per_peer_wins_and_a_tombstone_wins_a_tie() -> None:
    old = make_record("a", expires_at=30.0)
    tombstone = replace(make_record("a", expires_at=40.0), status="left")
    rejoined = make_record("a", round=1, expires_at=50.0)
    assert newest_per_peer([old, tombstone]) == {"a": tombstone}
    assert newest_per_peer([rejoined, tombstone, old]) == {"a": rejoined}
    same_time = replace(old, status="left")
    assert newest_per_peer([old, same_time])["a"].status == "left"
    assert newest_per_peer([same_time, old])["a"].status == "left"
    assert SwarmView.build([old, tombstone], now=0.0, protocol_version=VERSION).peer_ids == ()


def test_view_with_local_replaces_the_dht_copy() -> None:
    view = SwarmView.build([make_record("a"), make_record("b")], now=0.0, protocol_version=VERSION)
    local = make_record("b", ready=True)
    assert view.with_local(local) == (make_record("a"), local)
    assert [r.peer_id for r in view.with_local(make_record("0"))] == ["0", "a", "b"]
    with pytest.raises(ValueError, match="sorted"):
        SwarmView(now=0.0, peers=(make_record("b"), make_record("a")))


def test_parse_records_keeps_the_good_and_reports_the_bad() -> None:
    good = make_record("a").to_dict()
    records, errors = parse_records({"a": good, "b": {"peer_id": "b"}, "c": good, "d": "garbage"})
    assert records == [make_record("a")]
    assert sorted(errors) == ["b", "c", "d"]
    assert "subkey" in errors["c"] and "mapping" in errors["d"]


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=20))
def test_a_token_is_printable_ascii_without_spaces_char_by_char(value: str) -> None:
    """The reference: every character between '!' and '~' (what the C-level test must equal)."""
    expected = all("!" <= char <= "~" for char in value)
    try:
        check_token("name", value, max_chars=20)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == expected


def test_a_views_syncing_peers_due_in_a_window_are_the_scan_of_its_syncing_records() -> None:
    """``syncing_of(...).due(after, until)`` against a pass over ``view.syncing``."""
    rng = random.Random(5)
    hashes = [H0, "b" * 64]
    for _ in range(200):
        records = []
        for index in rng.sample(range(40), rng.randrange(0, 15)):
            record = make_record(f"p{index:02d}", round=rng.choice((1, 2)), param_hash=rng.choice(hashes))
            if rng.random() < 0.7:
                ready_at = rng.choice([None, float(rng.randrange(0, 20))])
                record = replace(record, status="syncing", ready_at=ready_at)
            records.append(record)
        view = SwarmView.build(records, now=0.0, protocol_version=PROTOCOL_VERSION)
        round, param_hash = rng.choice((1, 2)), rng.choice(hashes)
        after, until = sorted((float(rng.randrange(-2, 22)), float(rng.randrange(-2, 22))))
        scan = {
            peer.peer_id
            for peer in view.syncing
            if (peer.round, peer.param_hash) == (round, param_hash)
            and peer.ready_at is not None
            and after < peer.ready_at <= until
        }
        assert {peer.peer_id for peer in view.syncing_of(round, param_hash).due(after, until)} == scan
