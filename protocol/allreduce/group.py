"""Who takes part in one all-reduce round, and which contiguous part of the vector each member owns.

A `GroupSpec` is handed to every member by the caller (agreeing on it is membership's job). Part k is
owned by member k; its size is proportional to member k's bandwidth weight, so a slow member reduces
and serves less (the "butterfly" all-reduce with uneven parts of Ryabinin et al. 2021, "Moshpit SGD",
arXiv:2103.03239, and hivemind's load balancing). Bounds come from the largest-remainder method, so
they are exact integers that sum to the vector's length and are identical on every machine.

If member k cannot be reached, part k moves along its backup chain: k+1, k+2, ... (mod N).

A *client* member (``--client-mode``: behind NAT, it accepts no connections) only dials others: it
pushes its contribution to every part's owner and pulls every part's average. So it owns no part
(its part is empty), is nobody's backup and holds no replica: the chains and the majorities that
commit a part are over the other members (the *servers*), of which a group needs at least one.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

_ONLY_CLIENTS = (
    "a group of client-mode members only cannot form: a part needs an owner that accepts connections"
)


@dataclass(frozen=True, kw_only=True)
class Member:
    """One peer of the group."""

    peer_id: str
    """Stable name of the peer (unique within the group)."""
    address: str
    """host:port of the peer's all-reduce gRPC server (a client's is never dialled)."""
    client: bool = False
    """The peer accepts no connections: it owns no part, backs up none and holds no replica."""

    def __post_init__(self) -> None:
        if not self.peer_id:
            raise ValueError("peer_id must be non-empty")
        if ":" not in self.address:
            raise ValueError(f"address must be host:port, got {self.address!r}")


def split_by_weight(num_elements: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Part bounds (len(weights) + 1 integers from 0 to num_elements), part sizes proportional to weights.

    Largest-remainder rounding: floor every ideal size, then give the leftover elements one each to the
    parts with the largest fractional remainders (ties go to the lower index).
    """
    if num_elements < 0:
        raise ValueError(f"num_elements must be >= 0, got {num_elements}")
    if not weights:
        raise ValueError("need at least one weight")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {list(weights)}")
    total = math.fsum(weights)
    if total <= 0:
        raise ValueError("at least one weight must be positive")
    ideal = [num_elements * w / total for w in weights]
    sizes = [math.floor(x) for x in ideal]
    leftover = num_elements - sum(sizes)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(ideal[i] - sizes[i]), i))
    for i in by_remainder[:leftover]:
        sizes[i] += 1
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return tuple(bounds)


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """The members of one round, in order, and the part each owns.

    Every member must be given an equal GroupSpec; its `digest` travels with every message so a peer
    with a different view of the group is refused instead of silently mixing vectors.
    """

    round_id: int
    """Round number; a peer's rounds must increase (older rounds are forgotten)."""
    members: tuple[Member, ...]
    """The members in order; member i owns part i."""
    part_bounds: tuple[int, ...]
    """len(members) + 1 non-decreasing integers; part i is elements [part_bounds[i], part_bounds[i + 1])."""

    def __post_init__(self) -> None:
        if self.round_id < 0:
            raise ValueError(f"round_id must be >= 0, got {self.round_id}")
        if not self.members:
            raise ValueError("a group needs at least one member")
        peer_ids = [m.peer_id for m in self.members]
        if len(set(peer_ids)) != len(peer_ids):
            raise ValueError(f"peer ids must be unique, got {peer_ids}")
        if len(self.part_bounds) != len(self.members) + 1 or self.part_bounds[0] != 0:
            raise ValueError("part_bounds must have len(members) + 1 entries starting at 0")
        if any(b > a for a, b in zip(self.part_bounds[1:], self.part_bounds[:-1], strict=True)):
            raise ValueError(f"part_bounds must be non-decreasing, got {self.part_bounds}")
        if self.num_servers == 0:
            raise ValueError(_ONLY_CLIENTS)
        owning_clients = [
            m.peer_id for i, m in enumerate(self.members) if m.client and self.part_num_elements(i)
        ]
        if owning_clients:
            raise ValueError(f"client-mode members own no part, but {owning_clients} do")

    @classmethod
    def build(
        cls,
        *,
        round_id: int,
        members: Sequence[Member],
        num_elements: int,
        bandwidths: Sequence[float] | None = None,
    ) -> GroupSpec:
        """Group whose part sizes are proportional to `bandwidths` (equal parts if None); clients own none."""
        weights = [1.0] * len(members) if bandwidths is None else list(bandwidths)
        if len(weights) != len(members):
            raise ValueError(f"got {len(weights)} bandwidths for {len(members)} members")
        if all(member.client for member in members):
            raise ValueError(_ONLY_CLIENTS)
        weights = [0.0 if member.client else weight for member, weight in zip(members, weights, strict=True)]
        return cls(
            round_id=round_id, members=tuple(members), part_bounds=split_by_weight(num_elements, weights)
        )

    @property
    def num_members(self) -> int:
        return len(self.members)

    @property
    def num_servers(self) -> int:
        """Members that accept connections (not clients): the ones that own, back up and vote."""
        return sum(1 for member in self.members if not member.client)

    @property
    def num_elements(self) -> int:
        return self.part_bounds[-1]

    def part_slice(self, part_index: int) -> slice:
        """Elements of the vector that make up part `part_index`."""
        return slice(self.part_bounds[part_index], self.part_bounds[part_index + 1])

    def part_num_elements(self, part_index: int) -> int:
        return self.part_bounds[part_index + 1] - self.part_bounds[part_index]

    def index_of(self, peer_id: str) -> int:
        """Position of a peer in the member list; ValueError if it is not a member."""
        for index, member in enumerate(self.members):
            if member.peer_id == peer_id:
                return index
        raise ValueError(f"peer {peer_id!r} is not a member of round {self.round_id}")

    def chain(self, part_index: int) -> tuple[int, ...]:
        """Members that may serve part `part_index`, in order: its owner, then each next member (mod N)
        that is not a client (a client cannot be dialled)."""
        n = self.num_members
        following = ((part_index + step) % n for step in range(1, n))
        return (part_index, *(i for i in following if not self.members[i].client))

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of a canonical JSON form of the spec (equal on every machine for an equal spec)."""
        canonical = json.dumps(
            {
                "round_id": self.round_id,
                # (a client is marked; a server's entry is as before clients existed)
                "members": [[m.peer_id, m.address, *(["client"] if m.client else [])] for m in self.members],
                "part_bounds": list(self.part_bounds),
            },
            separators=(",", ":"),
        )
        return hashlib.sha256(canonical.encode()).digest()
