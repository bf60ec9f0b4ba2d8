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
  told of) get the same disjoint assignment;
- *every round*, with the round's group (below).

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
   ``loader.reshard(a.shard_index, a.num_shards)`` before the next inner phase;
2. lets a peer that (re)joins in the middle of an inner phase copy its sync source's loader
   ``state_dict()`` (epoch, position *and* the source's shard) with the global params, so it
   stays in lockstep; until the next boundary it reads the same windows as its source (a bounded
   duplicate, never a gap in the others' shards), and at the boundary it gets its own shard;
3. accepts that a member lost during an inner phase leaves its shard unread for that phase; the
   next boundary reassigns the data among the survivors.

Because ``position`` advances by ``num_shards * batch_size`` per step, peers that shared an
assignment during a phase still share ``position`` at its end: the data position is part of the
lineage's state just like the global params.
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


def assign_shard(member_ids: Iterable[str], peer_id: str) -> ShardAssignment:
    """``peer_id``'s shard among ``member_ids`` (in the member order; it must contain ``peer_id``)."""
    assignments = shard_assignments(member_ids)
    if peer_id not in assignments:
        raise ValueError(f"{peer_id!r} is not among the members {sorted(assignments)}")
    return assignments[peer_id]
