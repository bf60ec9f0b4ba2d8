"""Shard assignment, and the data-layer contract with ``node.data.batches.ShardedBatches`` it relies on."""

from __future__ import annotations

import numpy as np
import pytest

from node.data.batches import ShardedBatches
from protocol.membership.records import PeerRecord
from protocol.membership.shards import (
    ShardAssignment,
    assign_shard,
    shard_assignments,
    spare_lane,
    spare_lane_to_move_to,
    start_lane,
    start_shards,
)

SEQ_LEN = 4
BATCH_SIZE = 2


def test_position_in_the_member_order() -> None:
    """A group's member_ids are already in the member order: a member's shard is its position there."""
    assignments = shard_assignments(["peer-c", "peer-a", "peer-b"])
    assert assignments == {
        "peer-c": ShardAssignment(0, 3),
        "peer-a": ShardAssignment(1, 3),
        "peer-b": ShardAssignment(2, 3),
    }
    assert assign_shard(("peer-b", "peer-c", "peer-a"), "peer-c") == ShardAssignment(1, 3)
    assert assign_shard(["solo"], "solo") == ShardAssignment(0, 1)


def _record(
    peer_id: str,
    rank: int | None,
    *,
    lane: tuple[int, int] | None = None,
    round: int = 0,
    param_hash: str = "0" * 64,
) -> PeerRecord:
    return PeerRecord(
        peer_id=peer_id, grpc_address="127.0.0.1:1", protocol_version=1, round=round, param_hash=param_hash,
        ready_for_round=None, tokens_per_s=0.0, bandwidth_bytes_per_s=1.0, status="active", expires_at=1.0,
        rank=rank, data_lane=lane,
    )  # fmt: skip


def test_start_shards_order_ranked_nodes_by_rank_then_the_others_by_id() -> None:
    records = [_record("peer-a", None), _record("peer-z", 0), _record("peer-b", 1), _record("peer-0", None)]
    assert start_shards(records) == {
        "peer-z": ShardAssignment(0, 4),
        "peer-b": ShardAssignment(1, 4),
        "peer-0": ShardAssignment(2, 4),
        "peer-a": ShardAssignment(3, 4),
    }


def test_bad_member_lists() -> None:
    with pytest.raises(ValueError, match="at least one"):
        shard_assignments([])
    with pytest.raises(ValueError, match="distinct"):
        shard_assignments(["a", "b", "a"])
    with pytest.raises(ValueError, match="not among"):
        assign_shard(["a", "b"], "c")
    with pytest.raises(ValueError, match="member id"):
        shard_assignments(["a", "has space"])


def _loaders(tokens: np.ndarray, member_ids: list[str]) -> dict[str, ShardedBatches]:
    loaders = {}
    for peer_id, assignment in shard_assignments(member_ids).items():
        loaders[peer_id] = ShardedBatches(
            tokens,
            seq_len=SEQ_LEN,
            batch_size=BATCH_SIZE,
            seed=3,
            shard_index=assignment.shard_index,
            num_shards=assignment.num_shards,
        )
    return loaders


def _windows(loader: ShardedBatches, num_steps: int) -> list[int]:
    """Window ids this loader reads in the next steps (the stream is 0, 1, 2, ... so x[:, 0] // T is the window)."""
    return [int(w) for _ in range(num_steps) for w in (loader.next_batch()[0][:, 0] // SEQ_LEN)]


def test_membership_change_at_a_round_boundary_keeps_shards_disjoint() -> None:
    """Phase 1 with {a, b, c}; c leaves; phase 2 with {a, b}; d re-syncs from b mid-phase 2; phase 3 with all three."""
    num_windows = 600
    tokens = np.arange(num_windows * SEQ_LEN + 1, dtype=np.uint16)
    inner_steps = 5
    loaders = _loaders(tokens, ["a", "b", "c"])

    phase1 = {peer_id: _windows(loader, inner_steps) for peer_id, loader in loaders.items()}
    all1 = [w for ws in phase1.values() for w in ws]
    assert len(all1) == len(set(all1)) == 3 * inner_steps * BATCH_SIZE

    # Boundary: the round's group is {a, b}; each reshards from the group's member list.
    del loaders["c"]
    for peer_id, loader in loaders.items():
        assignment = assign_shard(["b", "a"], peer_id)
        loader.reshard(assignment.shard_index, assignment.num_shards)
    assert loaders["a"].position == loaders["b"].position  # one global position
    phase2_first = {peer_id: _windows(loader, 2) for peer_id, loader in loaders.items()}

    # d joins mid-phase: it copies b's loader state (position and b's shard) with the params.
    d = ShardedBatches(tokens, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=3)
    d.load_state_dict(loaders["b"].state_dict())
    loaders["d"] = d
    phase2_rest = {peer_id: _windows(loader, inner_steps - 2) for peer_id, loader in loaders.items()}
    assert phase2_rest["d"] == phase2_rest["b"]  # a bounded duplicate of its source, never a gap
    all2 = phase2_first["a"] + phase2_first["b"] + phase2_rest["a"] + phase2_rest["b"]
    assert len(all2) == len(set(all2)) and not set(all2) & set(all1)
    assert len({loader.position for loader in loaders.values()}) == 1  # still in lockstep

    # Next boundary: the group is {a, b, d}; everyone reshards and reads disjoint windows again.
    for peer_id, loader in loaders.items():
        assignment = assign_shard(["a", "b", "d"], peer_id)
        loader.reshard(assignment.shard_index, assignment.num_shards)
    phase3 = {peer_id: _windows(loader, inner_steps) for peer_id, loader in loaders.items()}
    all3 = [w for ws in phase3.values() for w in ws]
    assert len(all3) == len(set(all3)) == 3 * inner_steps * BATCH_SIZE
    assert not set(all3) & (set(all1) | set(all2))


def test_start_lane_takes_the_views_shard_unless_nodes_past_the_barrier_read_another() -> None:
    # Nobody said yet, or everyone said what our view gives them: our shard of the view.
    view = [_record("peer-a", None), _record("peer-b", None), _record("peer-c", None)]
    assert start_lane(view, "peer-a") == (ShardAssignment(0, 3), None)
    agreed = [
        _record("peer-a", None),
        _record("peer-b", None, lane=(1, 3)),
        _record("peer-c", None, lane=(2, 3)),
    ]
    assert start_lane(agreed, "peer-a") == (ShardAssignment(0, 3), None)
    # --start-peers 2: peer-b and peer-c passed the barrier seeing each other only and read shards 0
    # and 1 of 2; peer-a, seeing all three, would take shard 0 of 3 (position 0, which peer-b reads,
    # and a position that moves by 3 batches a step, theirs by 2): it reads spare lane 0 beside them.
    past = [
        _record("peer-a", None),
        _record("peer-b", None, lane=(0, 2)),
        _record("peer-c", None, lane=(1, 2)),
    ]
    assert start_lane(past, "peer-a") == (ShardAssignment(0, 2), 0)
    # A fourth starter after that: the next spare lane.
    later = [*past[1:], _record("peer-a", None, lane=(2, 2)), _record("peer-0", None)]
    assert start_lane(later, "peer-0") == (ShardAssignment(0, 2), 1)
    # One node past the barrier saw another set: whatever else we see, we take none of its count's shards.
    partial = [_record("peer-a", None), _record("peer-b", None, lane=(1, 2)), _record("peer-c", None)]
    assert start_lane(partial, "peer-c") == (ShardAssignment(0, 2), 0)


def test_spare_lane_is_the_lowest_no_live_node_of_the_lineage_holds() -> None:
    lineage = (4, "4" * 64)
    members = [
        _record("peer-a", None, lane=(0, 2), round=4, param_hash="4" * 64),
        _record("peer-b", None, lane=(1, 2), round=4, param_hash="4" * 64),
    ]
    assert spare_lane(members, lineage=lineage, peer_id="peer-j") == 0
    joiners = [
        _record("peer-j0", None, lane=(2, 2), round=4, param_hash="4" * 64),  # spare lane 0
        _record("peer-j2", None, lane=(4, 2), round=4, param_hash="4" * 64),  # spare lane 2
        _record("peer-x", None, lane=(3, 2), round=3, param_hash="3" * 64),  # another lineage's lane 1
        _record("peer-j", None, lane=(3, 2), round=4, param_hash="4" * 64),  # our own, stale record
    ]
    assert spare_lane([*members, *joiners], lineage=lineage, peer_id="peer-j") == 1


def test_of_two_nodes_on_one_spare_lane_the_later_in_the_member_order_moves() -> None:
    lineage, hash_4 = (4, "4" * 64), "4" * 64
    view = [
        _record("peer-a", None, lane=(0, 2), round=4, param_hash=hash_4),
        _record("peer-b", None, lane=(1, 2), round=4, param_hash=hash_4),
        _record("peer-j", None, lane=(2, 2), round=4, param_hash=hash_4),  # spare lane 0
        _record("peer-k", None, lane=(3, 2), round=4, param_hash=hash_4),  # spare lane 1
    ]
    # peer-x took spare lane 0 too and orders after peer-j: it moves to the lowest free, lane 2.
    assert spare_lane_to_move_to(view, lineage=lineage, peer_id="peer-x", rank=None, lane=(2, 2)) == 2
    # peer-j orders before peer-x: it keeps its lane (peer-x's record in its view changes nothing).
    with_x = [*view, _record("peer-x", None, lane=(2, 2), round=4, param_hash=hash_4)]
    assert spare_lane_to_move_to(with_x, lineage=lineage, peer_id="peer-j", rank=None, lane=(2, 2)) is None
    # A ranked node orders before every unranked one; a lane of another lineage is no conflict.
    assert spare_lane_to_move_to(view, lineage=lineage, peer_id="peer-z", rank=0, lane=(2, 2)) is None
    other = [_record("peer-j", None, lane=(2, 2), round=3, param_hash="3" * 64)]
    assert spare_lane_to_move_to(other, lineage=lineage, peer_id="peer-x", rank=None, lane=(2, 2)) is None


def test_spare_lanes_and_shards_read_disjoint_windows_of_a_round() -> None:
    """The contract with the data layer: shards 0..n-1 and spare lanes 0.. of one round, in lockstep."""
    tokens = np.arange(200 * SEQ_LEN + 1, dtype=np.uint16)
    loaders = []
    for index in range(5):  # 2 shards and spare lanes 0, 1, 2
        loader = ShardedBatches(tokens, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=3, num_shards=2)
        loader.skip(7)  # a round starting at position 28
        if index < 2:
            loader.reshard(index, 2)
        else:
            loader.read_spare(index - 2, steps=5)
        loaders.append(loader)
    windows = [
        [int(w) for _ in range(5) for w in loader.next_batch()[0][:, 0] // SEQ_LEN] for loader in loaders
    ]
    assert sum(len(w) for w in windows) == len(set().union(*map(set, windows))) == 5 * 5 * BATCH_SIZE
    assert len({loader.position for loader in loaders}) == 1
