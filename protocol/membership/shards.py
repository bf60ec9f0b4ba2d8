"""Which data shard each live peer trains on: a deterministic function of the member list.

Rule: a member's ``shard_index`` is its position in the member order (``records.member_order``: by
rank, then peer id; the order of a round's ``GroupSpec``) and ``num_shards`` is the number of
members. Every peer that applies the rule to the same members gets the same, disjoint assignment,
with no message exchanged; with ranked members (``dtnode swarm``'s nodes) it is the same in every
run of the same command.

Two moments assign shards:

- *the start barrier* (``--start-peers N``): once N nodes of a fresh run (round 0, one lineage) are
  live, each orders the live records it sees (:func:`start_shards`) and reads its shard from the
  first inner step on. Nodes that see the same live set (the barrier waits for exactly the N it was
  told of) get the same disjoint assignment (:func:`start_lane`: unless a node past the barrier
  already reads another one, below);
- *every round*, with the round's group (below).

A node that begins reading after its round began holds none of the round's shards: it reads a
*spare lane* (``node/data/batches.py``: positions behind the round's, which no member reads in the
round) until the next round assigns it a shard. Each node's record says what it reads
(``PeerRecord.data_lane``: ``(index, count)``, a spare lane as ``index >= count``), so two nodes
never pick one spare lane knowingly:

- *a late joiner* (it adopted a running lineage's state mid-phase, at its join or after a missed
  round) takes the lowest spare lane that no live record of that lineage holds
  (:func:`spare_lane`);
- *a starter beyond the barrier's set*: a node whose barrier view does not give the live records'
  own start shards (they passed the barrier seeing another set of nodes, e.g. more than N nodes
  started and it was not among the ones they saw) takes a spare lane beside their shards
  (:func:`start_lane`): never a shard that another node reads, never another count of shards (the
  data position advances by ``count * batch_size`` per step on every node of the lineage).

Two nodes that choose at once (neither sees the other's record yet) may choose alike. Two late
joiners of one round on one spare lane part as soon as they see each other's records: the later
in the member order moves to a free spare lane of the same round (:func:`spare_lane_to_move_to`,
checked at every step boundary), so they share at most the batches read until then. Starters that
pass the barrier at the same moment on different views may take different shard counts for round
1: they read overlapping windows in round 1 only, since a round's end puts every member of its
group at one data position (below).

Data-layer contract (``node/data/batches.py``, :class:`node.data.batches.ShardedBatches`)
-------------------------------------------------------------------------
The loader keeps a *global* ``position`` in the epoch's window permutation, identical on every
peer of a lineage; in each inner step shard ``i`` of ``n`` reads the positions
``position + i + n * k`` and every peer advances ``position`` by ``n * batch_size``.
``reshard(shard_index, num_shards)`` keeps ``epoch`` and ``position`` and changes only how the
following blocks are divided, so nothing before ``position`` is re-read and no two peers of the
new assignment read the same window afterwards. For that to hold, all peers must reshard at the
same global position with the same member list. The daemon therefore:

1. reshards at outer-round boundaries only, with the member list of the round that just formed:
   ``assign_shard(group.member_ids, my_id)`` on the :class:`~protocol.membership.messages.GroupSpec`
   that every member holds identically (``rounds.py``), then calls
   ``loader.end_round(a.shard_index, a.num_shards, ...)`` before the next inner phase: every
   member moves to one position, its phase's start (the lineage's) advanced by the group's most
   batches (from the spec's ``num_tokens``) of the lineage's shard count, whatever count or number
   of steps it read the phase with (``node/data/batches.py``, "One agreed position at a round's end");
2. lets a peer that (re)joins in the middle of an inner phase copy its sync source's loader
   ``state_dict()`` (epoch and position; the served state carries no shard) with the global params,
   so it stays in lockstep; until the next boundary it reads a spare lane (above: no window a
   member reads in the round), and at the boundary it gets its own shard;
3. accepts that a member lost during an inner phase leaves its shard unread for that phase; the
   next boundary reassigns the data among the survivors.

Because ``position`` advances by ``num_shards * batch_size`` per step, peers that shared an
assignment and a number of steps during a phase still share ``position`` at its end, and ``end_round``
makes the group share it whatever they read: the data position is part of the lineage's state just
like the global params.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from protocol.membership.records import PeerRecord, check_peer_id, member_order


@dataclass(frozen=True)
class ShardAssignment:
    """Arguments for ``ShardedBatches.reshard``."""

    shard_index: int
    num_shards: int


def shard_assignments(member_ids: Iterable[str]) -> dict[str, ShardAssignment]:
    """Every member's shard: its position in ``member_ids`` (a group's ``member_ids``, already in the
    member order), of ``len(members)`` shards."""
    members = [check_peer_id(peer_id, "member id") for peer_id in member_ids]
    if not members:
        raise ValueError("need at least one member to assign shards")
    if len(set(members)) != len(members):
        raise ValueError(f"member ids must be distinct, got {members}")
    return {peer_id: ShardAssignment(index, len(members)) for index, peer_id in enumerate(members)}


def start_shards(records: Iterable[PeerRecord]) -> dict[str, ShardAssignment]:
    """The start barrier's shards: the live ``records`` (ourselves included) in the member order."""
    ordered = sorted(records, key=lambda record: member_order(record.rank, record.peer_id))
    return shard_assignments(record.peer_id for record in ordered)


def start_lane(records: Iterable[PeerRecord], peer_id: str) -> tuple[ShardAssignment, int | None]:
    """The start barrier's data for ``peer_id``, from the live round-0 ``records`` it passed on (ours
    included): ``(shard, None)``, its shard of :func:`start_shards`, when every other record that
    says what it reads (``data_lane``) reads its shard of that same assignment; else ``(ShardAssignment
    (0, count), lane)``: spare lane ``lane`` beside the ``count`` shards that those nodes read (the
    first of them in the member order says ``count``), the lowest spare lane none of them holds."""
    records = list(records)
    ours = start_shards(records)
    said = sorted(
        (record for record in records if record.peer_id != peer_id and record.data_lane is not None),
        key=lambda record: member_order(record.rank, record.peer_id),
    )
    if all(record.data_lane == _lane(ours[record.peer_id]) for record in said):
        return ours[peer_id], None
    lane = said[0].data_lane
    assert lane is not None
    count = lane[1]
    return ShardAssignment(0, count), _lowest_free_spare(said, count)


def spare_lane(records: Iterable[PeerRecord], *, lineage: tuple[int, str], peer_id: str) -> int:
    """The spare lane ``peer_id`` reads after adopting ``lineage``'s state (round, param_hash) mid-phase:
    the lowest that no live record of that lineage holds (``data_lane``), ours left out."""
    held = [
        record
        for record in records
        if record.peer_id != peer_id and (record.round, record.param_hash) == tuple(lineage)
    ]
    return _lowest_free_spare(held, None)


def spare_lane_to_move_to(
    records: Iterable[PeerRecord],
    *,
    lineage: tuple[int, str],
    peer_id: str,
    rank: int | None,
    lane: tuple[int, int],
) -> int | None:
    """We read spare lane ``lane`` (``(index, count)``, ``index >= count``) on ``lineage``: the spare
    lane to move to if a live record of the lineage earlier in the member order holds it too (two
    nodes chose at once, neither seeing the other's record), the lowest that none holds; else None.
    The earlier node keeps it, so of any two that chose alike exactly one moves, once each sees the
    other's record."""
    ours = member_order(rank, peer_id)
    held = [
        record
        for record in records
        if record.peer_id != peer_id and (record.round, record.param_hash) == tuple(lineage)
    ]
    if not any(
        record.data_lane == lane and member_order(record.rank, record.peer_id) < ours for record in held
    ):
        return None
    return _lowest_free_spare(held, None)


def _lowest_free_spare(records: Iterable[PeerRecord], count: int | None) -> int:
    """The lowest spare lane no record holds (of ``count`` shards; None: of any count)."""
    held = {
        index - lane_count
        for record in records
        if record.data_lane is not None
        for index, lane_count in (record.data_lane,)
        if index >= lane_count and (count is None or lane_count == count)
    }
    return next(lane for lane in range(len(held) + 1) if lane not in held)


def _lane(shard: ShardAssignment) -> tuple[int, int]:
    return shard.shard_index, shard.num_shards


def assign_shard(member_ids: Iterable[str], peer_id: str) -> ShardAssignment:
    """``peer_id``'s shard among ``member_ids`` (in the member order; it must contain ``peer_id``)."""
    assignments = shard_assignments(member_ids)
    if peer_id not in assignments:
        raise ValueError(f"{peer_id!r} is not among the members {sorted(assignments)}")
    return assignments[peer_id]
