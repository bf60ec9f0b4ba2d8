"""Peer records: what each peer stores in the DHT about itself, and the live swarm they describe.

Every peer periodically stores one :class:`PeerRecord` under the run's DHT key (subkey = its
peer id) with a TTL. A record is the peer's public state: where to reach it, which global params
it holds (``round``, ``param_hash``), whether it is ready for the next outer round, and how fast
it computes and communicates. A dead peer's record lingers until ``expires_at``; a peer that
leaves gracefully overwrites its record with a ``status="left"`` tombstone so the others drop it
at once. A node that is still fetching the swarm's state to join it publishes ``status="syncing"``:
``(round, param_hash)`` then name the state it fetches, not one it holds, and ``ready_at`` when it
expects to hold it. A syncing peer counts for no lineage and takes part in no round; a leader may
wait for it (``rounds.py``). A record with ``client=True`` is a node that accepts no connections
(``--client-mode``): it takes part in rounds but never leads one, owns no part, serves no state, and
nobody dials its ``grpc_address``, which is ``CLIENT_ADDRESS``: the client binds no port to name.

Records come from untrusted peers: :meth:`PeerRecord.from_dict` validates every field (types,
lengths, ranges, finiteness) and raises ``ValueError`` naming the field, never anything else.
Validation lives in ``__post_init__`` so a record built in code is held to the same rules.

Conventions (shared with ``node/train/trainer.py``): ``round`` counts the outer rounds a peer's global
params have been through; the next outer round is ``round + 1``, so ``ready_for_round`` is either
``None`` (training its inner steps) or exactly ``round + 1``.
"""

from __future__ import annotations

import heapq
import math
import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Final, Literal, TypeVar, cast

from protocol.discovery.addresses import split_host_port

PeerStatus = Literal["active", "left", "syncing"]

MAX_PEER_ID_CHARS: Final = 128
MAX_ADDRESS_CHARS: Final = 256
MAX_ID_CHARS: Final = 256  # proposal and group ids
PARAM_HASH_HEX_CHARS: Final = 64  # SHA-256, as ``node.diloco.tensor_hash`` prints it
MAX_COUNTER: Final = 2**63 - 1  # rounds, token counts: what a protobuf int64 holds
MAX_PROTOCOL_VERSION: Final = 2**31 - 1
STATUSES: Final = ("active", "left", "syncing")
CLIENT_ADDRESS: Final = "client.invalid:1"
"""The ``grpc_address`` of a client's record and messages: it listens on nothing, so it names no address
(the ``.invalid`` top-level domain never resolves, RFC 6761: a peer that dialled it anyway fails at once)."""

_PARAM_HASH_RE: Final = re.compile(r"[0-9a-f]{64}")
_OPTIONAL_FIELDS: Final = frozenset({"ready_at", "client", "rank", "identity", "data_lane", "step_seconds"})
MAX_RANK: Final = 2**31 - 1
MAX_IDENTITY_CHARS: Final = 128


# --- field validators: each takes an untrusted object and returns it typed, or raises ValueError ---


def check_int(name: str, value: object, *, minimum: int = 0, maximum: int = MAX_COUNTER) -> int:
    """An ``int`` (not a ``bool``) in ``[minimum, maximum]``."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return int(value)


def check_rate(name: str, value: object) -> float:
    """A finite, non-negative number (int or float, not bool), returned as ``float``."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int too large for a double
        raise ValueError(f"{name} is too large: {value}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {number}")
    return number


def check_token(name: str, value: object, *, max_chars: int) -> str:
    """A non-empty string of printable ASCII without whitespace, at most ``max_chars`` long.

    ASCII only so that every peer, in any language, sorts ids the same way (code point order).
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    if not 1 <= len(value) <= max_chars:
        raise ValueError(f"{name} must have 1..{max_chars} characters, got {len(value)}")
    # '!'..'~' only: printable ASCII is ' '..'~' (str.isprintable), less the space
    if not (value.isascii() and value.isprintable() and " " not in value):
        raise ValueError(f"{name} must be printable ASCII without spaces, got {value!r}")
    return value


def check_peer_id(value: object, name: str = "peer_id") -> str:
    return check_token(name, value, max_chars=MAX_PEER_ID_CHARS)


def check_rank(value: object, name: str = "rank") -> int | None:
    """None (unranked) or an int in ``[0, MAX_RANK]``."""
    return None if value is None else check_int(name, value, maximum=MAX_RANK)


def check_data_lane(value: object, name: str = "data_lane") -> tuple[int, int]:
    """``(index, count)`` (a list from the wire) with ``count >= 1`` and ``index >= 0``."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        raise ValueError(f"{name} must be [index, count], got {value!r}"[:200])
    index = check_int(f"{name} index", value[0], maximum=MAX_RANK)
    count = check_int(f"{name} count", value[1], minimum=1, maximum=MAX_RANK)
    return index, count


def member_order(rank: int | None, peer_id: str) -> tuple[bool, int, str]:
    """The swarm's member order (a group's all-reduce order, its parts, the data shards): ranked
    nodes first by rank, then unranked ones; ties by peer id (code point order). A rank is fixed by
    the run (``dtnode swarm`` numbers its nodes), a peer id is random unless its identity key is kept,
    so a run whose nodes are all ranked orders its groups the same way every time it runs."""
    return (rank is None, rank or 0, peer_id)


def check_param_hash(value: object, name: str = "param_hash") -> str:
    """A SHA-256 in lowercase hex (64 characters)."""
    if not isinstance(value, str) or _PARAM_HASH_RE.fullmatch(value) is None:
        shown = value[:80] if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{name} must be {PARAM_HASH_HEX_CHARS} lowercase hex characters, got {shown!r}")
    return value


def check_address(value: object, name: str = "grpc_address") -> str:
    """``host:port`` with a port in 1..65535 (``[::1]:port`` for IPv6)."""
    address = check_token(name, value, max_chars=MAX_ADDRESS_CHARS)
    host_port = split_host_port(address)
    if host_port is None or not host_port[0] or host_port[1] == 0:
        raise ValueError(f"{name} must be host:port with a port in 1..65535, got {address!r}")
    return address


# --- the record ---


@dataclass(frozen=True, kw_only=True)
class PeerRecord:
    """One peer's public state, as stored in the DHT."""

    peer_id: str
    """The peer's DHT/p2p identity; the DHT subkey the record is stored under."""
    grpc_address: str
    """Where the peer's dtnode gRPC server listens (``host:port``)."""
    protocol_version: int
    """The membership/all-reduce protocol this peer speaks; peers of other versions are ignored."""
    round: int
    """Outer rounds the peer's global params have been through."""
    param_hash: str
    """SHA-256 (hex) of the peer's flat fp32 global params: equal hash ⇔ equal params."""
    ready_for_round: int | None
    """``round + 1`` once the peer finished its inner steps and waits to form that round, else None."""
    tokens_per_s: float
    """Recent training throughput; an estimate for planning (the round's weights come from Accept)."""
    bandwidth_bytes_per_s: float
    """Measured or configured uplink bandwidth; the all-reduce gives fast peers larger parts."""
    status: PeerStatus
    """``"active"``; ``"left"`` for the tombstone a peer writes when it leaves gracefully;
    ``"syncing"`` while it fetches the state ``(round, param_hash)`` to join the swarm."""
    expires_at: float
    """Clock time (seconds, the DHT's clock) after which the record is stale."""
    ready_at: float | None = None
    """Syncing only: the clock time (the DHT's) by which the peer expects to hold the state it
    fetches; None while it cannot tell yet. Optional in a stored record (absent = None)."""
    client: bool = False
    """The peer accepts no connections (``--client-mode``): never dial it, never fetch state from it,
    never follow it as a leader. Optional in a stored record (absent = False)."""
    rank: int | None = None
    """The peer's place in the member order, fixed by its run (:func:`member_order`); None: unranked,
    ordered by peer id after the ranked peers. Optional in a stored record (absent = None)."""
    identity: str = ""
    """An opaque digest of what the peer trains (its model and its data, as its node computes it):
    only peers of one identity share a lineage, a round or a state; peers of another are left out of
    the view (``SwarmView.of_identity``). Empty: unknown (a peer that has not said yet). Optional in a
    stored record (absent = "")."""

    data_lane: tuple[int, int] | None = None
    """``(index, count)``: the data the peer reads in its inner phase under way. ``index < count``:
    shard ``index`` of ``count``; ``index >= count``: spare lane ``index - count`` beside the round's
    ``count`` shards (it began reading after its round began; ``shards.py``). None: it has not said.
    Optional in a stored record (absent = None)."""
    step_seconds: float | None = None
    """How long one of the peer's training steps takes (seconds, the median of its last ones): an
    opaque pace that peers of one run compare; the protocol only carries it. None: not measured yet.
    Optional in a stored record (absent = None)."""

    def __post_init__(self) -> None:
        check_peer_id(self.peer_id)
        check_address(self.grpc_address)
        check_int("protocol_version", self.protocol_version, maximum=MAX_PROTOCOL_VERSION)
        check_int("round", self.round, maximum=MAX_COUNTER - 1)
        check_param_hash(self.param_hash)
        if self.ready_for_round is not None:
            check_int("ready_for_round", self.ready_for_round, minimum=1)
            if self.ready_for_round != self.round + 1:
                raise ValueError(
                    f"ready_for_round must be round + 1 = {self.round + 1} or None, got {self.ready_for_round}"
                )
        # Normalise ints to floats so equal records compare and serialise equally.
        object.__setattr__(self, "tokens_per_s", check_rate("tokens_per_s", self.tokens_per_s))
        object.__setattr__(
            self, "bandwidth_bytes_per_s", check_rate("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        )
        if not isinstance(self.status, str) or self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        object.__setattr__(self, "expires_at", check_rate("expires_at", self.expires_at))
        if self.status == "syncing" and self.ready_for_round is not None:
            raise ValueError("a syncing peer is ready for no round (ready_for_round must be None)")
        if self.ready_at is not None:
            if self.status != "syncing":
                raise ValueError(f"ready_at is for syncing records only, not {self.status!r} ones")
            object.__setattr__(self, "ready_at", check_rate("ready_at", self.ready_at))
        if not isinstance(self.client, bool):
            raise ValueError(f"client must be a bool, got {type(self.client).__name__}")
        check_rank(self.rank)
        if self.data_lane is not None:
            object.__setattr__(self, "data_lane", check_data_lane(self.data_lane))
        if self.identity != "":
            check_token("identity", self.identity, max_chars=MAX_IDENTITY_CHARS)
        if self.step_seconds is not None:
            object.__setattr__(self, "step_seconds", check_rate("step_seconds", self.step_seconds))

    def to_dict(self) -> dict[str, object]:
        """Plain JSON/msgpack-able dict for DHT storage (an optional field at its default is left out)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if not (f.name in _OPTIONAL_FIELDS and getattr(self, f.name) == f.default)
        }

    @classmethod
    def from_dict(cls, data: object, *, expected_peer_id: str | None = None) -> PeerRecord:
        """Parse an untrusted DHT value; ``ValueError`` on anything malformed.

        Unknown keys are ignored so a later minor version can add fields; a missing one is an
        error, except the optional ``ready_at`` and ``client``. ``expected_peer_id`` is the DHT subkey the value
        was stored under: a record that claims another peer's id is rejected, so a peer cannot
        speak for someone else.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"a peer record must be a mapping, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        missing = [name for name in names if name not in data and name not in _OPTIONAL_FIELDS]
        if missing:
            raise ValueError(f"peer record lacks field(s) {missing}")
        record = cls(**{name: data[name] for name in names if name in data})
        if expected_peer_id is not None and record.peer_id != expected_peer_id:
            raise ValueError(f"record of {record.peer_id!r} stored under subkey {expected_peer_id!r}")
        return record

    def is_live(self, now: float, protocol_version: int) -> bool:
        """Active, not expired, and speaking ``protocol_version``."""
        return self.status == "active" and self.expires_at > now and self.protocol_version == protocol_version


def newest_per_peer(records: Iterable[PeerRecord]) -> dict[str, PeerRecord]:
    """One record per peer: the one that expires last (= written last); a tombstone wins a tie."""
    newest: dict[str, PeerRecord] = {}
    for record in records:
        current = newest.get(record.peer_id)
        if current is None or (record.expires_at, record.status == "left") > (
            current.expires_at,
            current.status == "left",
        ):
            newest[record.peer_id] = record
    return newest


Derived = TypeVar("Derived")


@dataclass(frozen=True)
class SyncingPeers:
    """A view's syncing peers that fetch one ``(round, param_hash)`` and said by when they expect to
    hold it (``ready_at``), in that order."""

    records: tuple[PeerRecord, ...]
    ready_ats: tuple[float, ...]
    """Their ``ready_at``, ascending (for ``bisect``)."""

    def due(self, after: float, until: float) -> tuple[PeerRecord, ...]:
        """Those whose ``ready_at`` lies in ``(after, until]``."""
        return self.records[bisect_right(self.ready_ats, after) : bisect_right(self.ready_ats, until)]


@dataclass(frozen=True)
class LineagePeers:
    """The live peers of a view that hold one ``(round, param_hash)``, each tuple sorted by peer id."""

    records: tuple[PeerRecord, ...]
    ready_ids: tuple[str, ...]
    """Those ready for the next round (``ready_for_round == round + 1``)."""
    ready_server_ids: tuple[str, ...]
    """Those ready that accept connections (not ``client``)."""
    peer_ids: frozenset[str]
    ready_set: frozenset[str]
    """``ready_ids`` as a set."""
    fastest_steps: tuple[tuple[float, str], ...] = ()
    """The two shortest ``step_seconds`` its peers announce, with their peer ids, shortest first."""
    slowest_steps: tuple[tuple[float, str], ...] = ()
    """The two longest ``step_seconds`` its peers announce, with their peer ids, longest first."""

    def step_seconds_range(self, excluding: str) -> tuple[float, float] | None:
        """The shortest and the longest step time the peers other than ``excluding`` announce (None:
        none does)."""
        fastest = next((seconds for seconds, peer_id in self.fastest_steps if peer_id != excluding), None)
        slowest = next((seconds for seconds, peer_id in self.slowest_steps if peer_id != excluding), None)
        return None if fastest is None or slowest is None else (fastest, slowest)


NO_LINEAGE_PEERS: Final = LineagePeers(
    records=(), ready_ids=(), ready_server_ids=(), peer_ids=frozenset(), ready_set=frozenset()
)


def _records_by_lineage(view: SwarmView) -> dict[tuple[int, str], list[PeerRecord]]:
    by_lineage: dict[tuple[int, str], list[PeerRecord]] = {}
    for peer in view.peers:  # sorted by id, so each list is too
        key = (peer.round, peer.param_hash)
        if key in by_lineage:
            by_lineage[key].append(peer)
        else:
            by_lineage[key] = [peer]
    return by_lineage


def _lineage_peers(records: list[PeerRecord]) -> LineagePeers:
    announced = [(r.step_seconds, r.peer_id) for r in records if r.step_seconds is not None]
    ready_ids = tuple(
        record.peer_id for record in records if record.ready_for_round is not None
    )  # = round + 1
    ready_set = frozenset(ready_ids)
    return LineagePeers(
        records=tuple(records),
        ready_ids=ready_ids,
        ready_server_ids=tuple(
            record.peer_id for record in records if record.peer_id in ready_set and not record.client
        ),
        peer_ids=frozenset(record.peer_id for record in records),
        ready_set=ready_set,
        fastest_steps=tuple(heapq.nsmallest(2, announced)),
        slowest_steps=tuple(heapq.nlargest(2, announced)),
    )


def _syncing_by_lineage(view: SwarmView) -> dict[tuple[int, str], SyncingPeers]:
    by_lineage: dict[tuple[int, str], list[PeerRecord]] = {}
    for peer in view.syncing:
        if peer.ready_at is not None:
            by_lineage.setdefault((peer.round, peer.param_hash), []).append(peer)
    grouped = {}
    for key, records in by_lineage.items():
        records.sort(key=lambda record: (record.ready_at, record.peer_id))
        grouped[key] = SyncingPeers(
            records=tuple(records), ready_ats=tuple(r.ready_at or 0.0 for r in records)
        )
    return grouped


NO_SYNCING_PEERS: Final = SyncingPeers(records=(), ready_ats=())


def _lineage_sizes(view: SwarmView) -> dict[tuple[int, str], int]:
    return {key: len(records) for key, records in view.memo(_records_by_lineage).items()}


def _lineage_peers_memo(view: SwarmView) -> dict[tuple[int, str], LineagePeers]:
    return {}  # filled one lineage at a time by ``SwarmView.of_lineage``


@dataclass(frozen=True)
class SwarmView:
    """The live peers at clock time ``now``, sorted by peer id (the same order on every peer).

    Build it with :meth:`build` from whatever the DHT returned. A peer whose newest record is a
    tombstone, has expired, or speaks another protocol version is not in the view.
    """

    now: float
    peers: tuple[PeerRecord, ...]
    left_peer_ids: frozenset[str] = frozenset()
    """Peers whose newest record is an unexpired tombstone: they said goodbye."""
    syncing: tuple[PeerRecord, ...] = ()
    """Peers whose newest live record says they fetch the swarm's state to join it, by peer id.
    Not in ``peers``: they hold no lineage yet."""
    foreign: tuple[PeerRecord, ...] = ()
    """Live or syncing peers left out because they train something else (``of_identity``), by peer id."""
    _by_id: Mapping[str, PeerRecord] = field(init=False, repr=False, compare=False)
    _memo: dict[Callable[[SwarmView], object], object] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = [peer.peer_id for peer in self.peers]
        if ids != sorted(set(ids)):
            raise ValueError("SwarmView.peers must be sorted by peer_id without duplicates; use build()")
        object.__setattr__(self, "_by_id", {peer.peer_id: peer for peer in self.peers})
        object.__setattr__(self, "_memo", {})

    def memo(self, compute: Callable[[SwarmView], Derived]) -> Derived:
        """``compute(self)``, computed once per view and kept with it. A view never changes, and the
        membership code derives the same things from it on every event of a round (the lineage
        rule's counts, the ready peers of a lineage): over every peer, which at a thousand peers is
        most of a round's CPU. ``compute`` must be a pure function of the view, defined once (a
        module-level function: it is the key)."""
        memo = self._memo
        if compute not in memo:
            memo[compute] = compute(self)
        return cast(Derived, memo[compute])

    def syncing_of(self, round: int, param_hash: str) -> SyncingPeers:
        """The syncing peers fetching ``(round, param_hash)`` with a ``ready_at`` (sorted once per view)."""
        return self.memo(_syncing_by_lineage).get((round, param_hash), NO_SYNCING_PEERS)

    def lineage_sizes(self) -> Mapping[tuple[int, str], int]:
        """How many of the view's peers hold each ``(round, param_hash)`` (counted once per view)."""
        return self.memo(_lineage_sizes)

    def of_lineage(self, round: int, param_hash: str) -> LineagePeers:
        """The view's peers holding ``(round, param_hash)`` (gathered once per view and lineage)."""
        key = (round, param_hash)
        known = self.memo(_lineage_peers_memo)
        if key not in known:
            records = self.memo(_records_by_lineage).get(key)
            known[key] = NO_LINEAGE_PEERS if records is None else _lineage_peers(records)
        return known[key]

    @classmethod
    def build(cls, records: Iterable[PeerRecord], *, now: float, protocol_version: int) -> SwarmView:
        live: list[PeerRecord] = []  # is_live: active, unexpired, of our protocol version
        syncing: list[PeerRecord] = []
        left: list[str] = []
        for record in newest_per_peer(records).values():
            if record.expires_at <= now:
                continue
            if record.status == "left":
                left.append(record.peer_id)
            elif record.protocol_version == protocol_version:
                (live if record.status == "active" else syncing).append(record)
        by_id = attrgetter("peer_id")
        return cls(
            now=now,
            peers=tuple(sorted(live, key=by_id)),
            left_peer_ids=frozenset(left),
            syncing=tuple(sorted(syncing, key=by_id)),
        )

    def of_identity(self, identity: str) -> SwarmView:
        """The view of the peers that train what we train: a peer whose record names another
        ``identity`` moves to ``foreign``. An empty identity (ours or a peer's) is unknown and
        excludes nobody."""
        if not identity:
            return self

        def ours(record: PeerRecord) -> bool:
            return record.identity in ("", identity)

        foreign = [record for record in (*self.peers, *self.syncing) if not ours(record)]
        if not foreign:
            return self
        return SwarmView(
            now=self.now,
            peers=tuple(record for record in self.peers if ours(record)),
            left_peer_ids=self.left_peer_ids,
            syncing=tuple(record for record in self.syncing if ours(record)),
            foreign=(*self.foreign, *sorted(foreign, key=lambda record: record.peer_id)),
        )

    @property
    def peer_ids(self) -> tuple[str, ...]:
        return tuple(peer.peer_id for peer in self.peers)

    def get(self, peer_id: str) -> PeerRecord | None:
        return self._by_id.get(peer_id)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._by_id

    def __iter__(self) -> Iterator[PeerRecord]:
        return iter(self.peers)

    def __len__(self) -> int:
        return len(self.peers)

    def with_local(self, local: PeerRecord) -> tuple[PeerRecord, ...]:
        """The view's peers with ``local`` in place of (or added as) the local peer's record.

        A peer knows its own state better than the DHT's copy of it, which may lag.
        """
        others = [peer for peer in self.peers if peer.peer_id != local.peer_id]
        return tuple(sorted([*others, local], key=lambda record: record.peer_id))


def parse_records(values: Mapping[str, object]) -> tuple[list[PeerRecord], dict[str, str]]:
    """Parse DHT values keyed by subkey; return the good records and ``{subkey: error}`` for the rest."""
    records: list[PeerRecord] = []
    errors: dict[str, str] = {}
    for subkey, value in values.items():
        try:
            records.append(PeerRecord.from_dict(value, expected_peer_id=cast(str, subkey)))
        except ValueError as error:  # one hostile or corrupt record must not hide the others
            errors[str(subkey)] = str(error)
    return records, errors
