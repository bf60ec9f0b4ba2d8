"""GroupSpec: bandwidth-proportional parts, validation, digests, backup chains; FaultPlan parsing."""

from __future__ import annotations

import pytest

from protocol.allreduce import FaultPlan, GroupSpec, Member, split_by_weight


def members(n: int) -> list[Member]:
    return [Member(peer_id=f"p{i}", address=f"10.0.0.{i}:5000") for i in range(n)]


def test_parts_are_proportional_to_bandwidth() -> None:
    assert split_by_weight(100, [1, 1, 2]) == (0, 25, 50, 100)
    assert split_by_weight(10, [1, 1, 1]) == (0, 4, 7, 10)  # leftover to the lowest index on ties
    assert split_by_weight(7, [0, 1]) == (0, 0, 7)  # a member with no bandwidth owns nothing
    bounds = split_by_weight(1_000_003, [10.0, 1.0, 3.3, 0.7])
    sizes = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    assert sum(sizes) == 1_000_003 and bounds[0] == 0
    ideal = [1_000_003 * w / 15.0 for w in (10.0, 1.0, 3.3, 0.7)]
    assert all(abs(size - x) < 1 for size, x in zip(sizes, ideal, strict=True))


@pytest.mark.parametrize("weights", [[], [0, 0], [1, -1], [1, float("nan")]])
def test_bad_weights_are_refused(weights: list[float]) -> None:
    with pytest.raises(ValueError):
        split_by_weight(10, weights)


def test_group_validation() -> None:
    with pytest.raises(ValueError, match="unique"):
        GroupSpec.build(round_id=0, members=[members(1)[0], members(1)[0]], num_elements=4)
    with pytest.raises(ValueError, match="bandwidths"):
        GroupSpec.build(round_id=0, members=members(2), num_elements=4, bandwidths=[1.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        GroupSpec(round_id=0, members=tuple(members(2)), part_bounds=(0, 5, 4))
    with pytest.raises(ValueError, match="host:port"):
        Member(peer_id="x", address="nohost")


def test_digest_chain_and_lookup() -> None:
    group = GroupSpec.build(round_id=3, members=members(4), num_elements=10, bandwidths=[1, 2, 3, 4])
    same = GroupSpec.build(round_id=3, members=members(4), num_elements=10, bandwidths=[1, 2, 3, 4])
    other_round = GroupSpec.build(round_id=4, members=members(4), num_elements=10, bandwidths=[1, 2, 3, 4])
    assert group.digest == same.digest != other_round.digest
    assert group.chain(2) == (2, 3, 0, 1)
    assert group.index_of("p3") == 3
    assert group.part_slice(3) == slice(6, 10) and group.part_num_elements(0) == 1
    with pytest.raises(ValueError, match="not a member"):
        group.index_of("nobody")


def test_fault_plan_parsing() -> None:
    plan = FaultPlan.parse("push_chunk:2:1:stall")
    assert (plan.point, plan.round_id, plan.chunk_index, plan.action) == ("push_chunk", 2, 1, "stall")
    assert FaultPlan.parse("round_open:0") == FaultPlan(point="round_open", round_id=0)
    for bad in ["nowhere:0", "push_chunk", "push_chunk:x", "push_chunk:0:0:explode"]:
        with pytest.raises(ValueError):
            FaultPlan.parse(bad)
