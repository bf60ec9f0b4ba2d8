"""The plan of a tiered (two-level) all-reduce: with whom a member averages at each stage.

A flat round makes every member talk to every other one. A tiered round bounds that by ``group_size``
(G): the K members are dealt into M = ceil(K / G) groups of at most G, and the vector into S slices,
S the fewest servers any group has:

    stage A (group)   each group averages the whole vector with a flat round; every member of group g
                      then holds the group's mean m_g;
    stage B (column)  column i is the i-th server of every group (i < S); it averages slice i of the
                      group means with a flat round, each weighted by its group's weight, so every
                      member of column i holds the same bytes of slice i of the whole swarm's mean;
    stage C (gather)  every member pulls each slice it did not average itself from the i-th server
                      of its own group (of another group if that one is gone), as those bytes.

A member talks to its group (G − 1 peers) and its column (M − 1), so at most 2(G − 1) peers while
K <= G², whatever the swarm's size beyond that is bounded by the same square root. Every member
decodes the same bytes of every slice, so survivors end bit-identical, as after a flat round.

The plan is pure and deterministic: every member computes the same one from the same member list (in
the order membership agreed on), and its ``digest`` names it on the wire. Servers are dealt before
clients (a client accepts no connections: it can be no column's member), round-robin over the
groups, so the groups' sizes and server counts differ by at most one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from protocol.allreduce.group import GroupSpec, Member, split_by_weight


def stage_round_ids(round_id: int) -> tuple[int, int]:
    """The flat rounds' ids of tiered round ``round_id``: its group stage's, then its column stage's
    (a peer's round ids only increase, and each tiered round holds two flat ones)."""
    return 2 * round_id, 2 * round_id + 1


@dataclass(frozen=True, kw_only=True)
class TierPlan:
    """Groups, slices and columns of one tiered round over ``members``."""

    round_id: int
    """The tiered round's number (its stages' flat rounds: ``stage_round_ids``)."""
    members: tuple[Member, ...]
    """Every member of the round, in the order membership agreed on."""
    group_size: int
    """G: the most members a group may have."""
    num_elements: int
    """Length of the averaged vector."""

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2, got {self.group_size}")
        if not self.members:
            raise ValueError("a round needs at least one member")
        if len({m.peer_id for m in self.members}) != len(self.members):
            raise ValueError("peer ids must be unique")
        if self.num_servers == 0:
            raise ValueError("a round of client-mode members only cannot form: a part needs an owner")
        if self.num_elements < 0:
            raise ValueError(f"num_elements must be >= 0, got {self.num_elements}")

    @property
    def num_servers(self) -> int:
        return sum(1 for member in self.members if not member.client)

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """Per group, its members' indices into ``members``: servers first, each group's in order."""
        num_groups = min(math.ceil(len(self.members) / self.group_size), self.num_servers)
        dealt = [i for i, m in enumerate(self.members) if not m.client]
        dealt += [i for i, m in enumerate(self.members) if m.client]
        return tuple(tuple(dealt[g::num_groups]) for g in range(num_groups))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @cached_property
    def num_slices(self) -> int:
        """S: the fewest servers of any group (each group has a server for every slice)."""
        return min(sum(1 for i in group if not self.members[i].client) for group in self.groups)

    @cached_property
    def slice_bounds(self) -> tuple[int, ...]:
        """S + 1 offsets: slice i is elements [slice_bounds[i], slice_bounds[i + 1])."""
        return split_by_weight(self.num_elements, [1.0] * self.num_slices)

    def slice_of(self, index: int) -> slice:
        return slice(self.slice_bounds[index], self.slice_bounds[index + 1])

    @cached_property
    def _places(self) -> dict[int, tuple[int, int]]:
        """Member index -> (its group, its position in the group)."""
        return {i: (g, position) for g, group in enumerate(self.groups) for position, i in enumerate(group)}

    def index_of(self, peer_id: str) -> int:
        """Position of a peer in ``members``; ValueError if it is not a member."""
        for index, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return index
        raise ValueError(f"peer {peer_id!r} is not a member of tiered round {self.round_id}")

    def group_of(self, member_index: int) -> int:
        return self._places[member_index][0]

    def position_of(self, member_index: int) -> int:
        """The member's place in its group: the slice it averages in stage B if < ``num_slices``."""
        return self._places[member_index][1]

    def column(self, slice_index: int) -> tuple[int, ...]:
        """Members (indices) of stage B for slice ``slice_index``: the i-th of every group."""
        return tuple(group[slice_index] for group in self.groups)

    def holders(self, member_index: int, slice_index: int) -> tuple[int, ...]:
        """Whom the member pulls slice ``slice_index`` from in stage C, in order: its own group's
        column member, then the next groups' (mod M)."""
        g, m = self.group_of(member_index), self.num_groups
        return tuple(self.groups[(g + step) % m][slice_index] for step in range(m))

    def group_spec(self, group_index: int, bandwidths: Sequence[float] | None = None) -> GroupSpec:
        """Stage A's flat round of group ``group_index`` (``bandwidths``: per member of the group)."""
        return GroupSpec.build(
            round_id=stage_round_ids(self.round_id)[0],
            members=[self.members[i] for i in self.groups[group_index]],
            num_elements=self.num_elements,
            bandwidths=bandwidths,
        )

    def column_spec(self, slice_index: int) -> GroupSpec:
        """Stage B's flat round of slice ``slice_index`` (equal parts: all columns alike)."""
        return GroupSpec.build(
            round_id=stage_round_ids(self.round_id)[1],
            members=[self.members[i] for i in self.column(slice_index)],
            num_elements=self.slice_bounds[slice_index + 1] - self.slice_bounds[slice_index],
        )

    def peers_of(self, member_index: int) -> frozenset[int]:
        """The members a member exchanges with when nobody fails: its group and its column."""
        peers = set(self.groups[self.group_of(member_index)])
        position = self.position_of(member_index)
        if position < self.num_slices:
            peers.update(self.column(position))
        return frozenset(peers - {member_index})

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of a canonical form of the plan: what stage C's pulls name it by."""
        canonical = json.dumps(
            {
                "round_id": self.round_id,
                "members": [[m.peer_id, m.address, *(["client"] if m.client else [])] for m in self.members],
                "group_size": self.group_size,
                "num_elements": self.num_elements,
            },
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).digest()
