"""Round messages validate untrusted fields; a member can tell a sound group from a bad one."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from protocol.membership.messages import (
    Accept,
    Begin,
    Cancel,
    GroupMember,
    GroupSpec,
    JoinRequest,
    Proposal,
    Reason,
    Reject,
)
from tests.protocol.membership.fake_swarm import H0, fake_hash


def _member(peer_id: str, bandwidth: float = 1e6) -> GroupMember:
    return GroupMember(
        peer_id=peer_id, grpc_address="10.0.0.1:5000", num_tokens=10, bandwidth_bytes_per_s=bandwidth
    )


def _group(**changes: Any) -> GroupSpec:
    fields: dict[str, Any] = {
        "round": 3,
        "group_id": "a/3/1",
        "leader_id": "a",
        "param_hash": H0,
        "vector_length": 10,
        "members": (_member("a", 1e6), _member("b", 4e6)),
        "part_boundaries": (0, 2, 10),
    }
    fields.update(changes)
    return GroupSpec(**fields)


def test_a_sound_group() -> None:
    group = _group()
    assert group.member_ids == ("a", "b") and group.total_tokens == 20
    assert group.part("b") == (2, 10) and group.has_expected_parts()
    assert group.problem_for(_member("b", 4e6), leader_id="a", param_hash=H0, vector_length=10) is None
    assert Begin(group=group).round == 3


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"members": (_member("b"), _member("a"))}, "sorted"),
        ({"members": (_member("a"), _member("a"))}, "sorted"),
        ({"members": ()}, "members"),
        ({"members": [_member("a"), _member("b")]}, "members"),
        ({"leader_id": "z"}, "leader"),
        ({"part_boundaries": (0, 10)}, "part_boundaries"),
        ({"part_boundaries": (1, 2, 10)}, "part_boundaries"),
        ({"part_boundaries": (0, 8, 9)}, "part_boundaries"),
        ({"part_boundaries": (0, 9, 8)}, "part_boundaries"),
        ({"part_boundaries": (0, 11, 10)}, "part_boundaries"),
        ({"round": 0}, "round"),
        ({"group_id": ""}, "group_id"),
        ({"param_hash": "abc"}, "param_hash"),
    ],
)
def test_malformed_groups_are_value_errors(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _group(**changes)


@pytest.mark.parametrize(
    ("group", "member", "match"),
    [
        (_group(), _member("b", 4e6), None),
        (_group(leader_id="b"), _member("b", 4e6), "not the sender"),
        (_group(param_hash=fake_hash("other")), _member("b", 4e6), "param_hash"),
        (_group(vector_length=11, part_boundaries=(0, 2, 11)), _member("b", 4e6), "vector_length"),
        (_group(), _member("c", 4e6), "not a member"),
        (_group(), replace(_member("b", 4e6), num_tokens=11), "differs"),
        (_group(part_boundaries=(0, 5, 10)), _member("b", 4e6), "parts"),
    ],
)
def test_problem_for_each_way_a_begin_can_be_wrong(
    group: GroupSpec, member: GroupMember, match: str | None
) -> None:
    problem = group.problem_for(member, leader_id="a", param_hash=H0, vector_length=10)
    assert problem is None if match is None else match in (problem or "")


@pytest.mark.parametrize(
    "build",
    [
        lambda: JoinRequest(round=0, param_hash=H0),
        lambda: JoinRequest(round=1, param_hash=H0.upper()),
        lambda: Proposal(round=1, proposal_id="x" * 257, param_hash=H0, members=("a",)),
        lambda: Proposal(round=1, proposal_id="p", param_hash=H0, members=()),
        lambda: Proposal(round=1, proposal_id="p", param_hash=H0, members=("a b",)),
        lambda: Proposal(
            round=1, proposal_id="p", param_hash=H0, members=tuple(f"p{i}" for i in range(1025))
        ),
        lambda: Accept(round=1, proposal_id="p", grpc_address="x", num_tokens=1, bandwidth_bytes_per_s=1.0),
        lambda: Accept(
            round=1, proposal_id="p", grpc_address="h:1", num_tokens=-1, bandwidth_bytes_per_s=1.0
        ),
        lambda: Accept(
            round=1, proposal_id="p", grpc_address="h:1", num_tokens=1, bandwidth_bytes_per_s=math.nan
        ),
        lambda: Reject(round=1, proposal_id="p", reason="busy"),  # type: ignore[arg-type]
        lambda: Cancel(round=True, proposal_id="p", reason=Reason.STALE_PROPOSAL),
        lambda: Begin(group="not a group"),  # type: ignore[arg-type]
    ],
)
def test_hostile_message_fields_are_value_errors(build: Any) -> None:
    with pytest.raises(ValueError):
        build()
