"""The messages peers exchange to form a round, and the group they agree on.

These are plain frozen dataclasses; the gRPC servicer translates them to and from protobuf and
fills in the *sender* from the authenticated connection (a message never names its own sender).
Every field is validated on construction, because messages come from untrusted peers: a
servicer that builds one from a decoded protobuf gets a ``ValueError`` for anything malformed.

Read each message as a sentence one peer says to another (round ``r`` is the outer round being
formed; its members hold global params ``(r - 1, param_hash)`` before it):

- ``JoinRequest``: "I am ready for round r with param_hash; if you lead it, include me."
- ``Proposal``: "I lead round r for the peers holding param_hash; will you join? (proposal_id)"
- ``Accept``:   "Yes to proposal_id; here is my address, my weight, my bandwidth, whether I am a
  client (I accept no connections: give me no part), and my rank (my place in the member order)."
- ``Reject``:   "No to proposal_id, because <reason>."
- ``Withdraw``: "I take back my Accept of proposal_id, because <reason>."
- ``Cancel``:   "Forget proposal_id: it will not begin with you, because <reason>."
- ``Begin``:    "Round r starts with exactly this group; run the all-reduce."
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from itertools import pairwise
from typing import Final

from protocol.membership.parts import part_boundaries
from protocol.membership.records import (
    MAX_ID_CHARS,
    check_address,
    check_int,
    check_param_hash,
    check_peer_id,
    check_rank,
    check_rate,
    check_token,
    member_order,
)

MAX_GROUP_SIZE: Final = 1024  # bounds the work a hostile message can cause


class Reason(StrEnum):
    """Why a peer said no, took an answer back, cancelled a proposal or gave up on a round."""

    WRONG_ROUND = "wrong_round"  # I am forming another round than the proposal's.
    LINEAGE_MISMATCH = "lineage_mismatch"  # My global params (round, param_hash) differ from yours.
    ALREADY_IN_GROUP = "already_in_group"  # I am locked into a group for this round already.
    SMALLER_LEADER = "smaller_leader"  # I lead this round with a smaller id; my proposal is on its way.
    NOT_AVAILABLE = "not_available"  # I am not forming this round (not ready, gave up, re-syncing).
    SWITCHED_LEADER = "switched_leader"  # I accepted the proposal of a leader with a smaller id.
    BEGIN_TIMEOUT = "begin_timeout"  # Your Begin did not come in time; I moved on.
    LEADER_GONE = "leader_gone"  # Your DHT record expired or became a tombstone; I moved on.
    NOT_BOUND = "not_bound"  # That Begin is for a proposal I did not accept or withdrew from.
    INVALID_GROUP = "invalid_group"  # Your Begin disagrees with what I accepted or breaks the rules.
    STEPPED_DOWN = "stepped_down"  # A leader with a smaller id is forming this round.
    TOO_FEW_ACCEPTED = "too_few_accepted"  # Fewer than min_peers accepted; I will propose again.
    ROUND_STARTED = "round_started"  # A group of this round and lineage began without you.
    STALE_PROPOSAL = "stale_proposal"  # That proposal is no longer current.
    TOO_FEW_PEERS = "too_few_peers"  # (RoundFailed) fewer than min_peers were ready by max_wait.
    MAX_WAIT = "max_wait"  # (MissedRound) max_wait passed without a group that includes me.
    STREAMS_MISMATCH = "streams_mismatch"  # You open a different number of all-reduce streams than I do.


MAX_STREAMS = 64
"""At most this many all-reduce streams per member (one per local rank of a large node)."""


def check_stream_addresses(value: object) -> tuple[str, ...]:
    """A tuple of at most ``MAX_STREAMS - 1`` ``host:port`` addresses (streams 1..S-1)."""
    if not isinstance(value, tuple) or len(value) > MAX_STREAMS - 1:
        raise ValueError(f"stream_addresses must be a tuple of at most {MAX_STREAMS - 1} addresses")
    for i, address in enumerate(value):
        check_address(address, f"stream_addresses[{i}]")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_round(value: object) -> int:
    return check_int("round", value, minimum=1)


def _check_id(name: str, value: object) -> str:
    return check_token(name, value, max_chars=MAX_ID_CHARS)


def _check_reason(value: object) -> Reason:
    if not isinstance(value, Reason):
        raise ValueError(f"reason must be a Reason, got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class GroupMember:
    """One member of a round's group, as the leader recorded it from the member's Accept."""

    peer_id: str
    grpc_address: str
    num_tokens: int
    """Tokens the member processed in the round's inner phase: its contribution's weight."""
    bandwidth_bytes_per_s: float
    stream_addresses: tuple[str, ...] = ()
    """Where the member's all-reduce streams 1..S-1 listen (stream 0 is ``grpc_address``)."""
    client: bool = False
    """The member accepts no connections (``--client-mode``): it owns no part and nobody dials it."""
    rank: int | None = None
    """The member's place in the member order, fixed by its run (``records.member_order``); None: unranked."""

    def __post_init__(self) -> None:
        check_peer_id(self.peer_id)
        check_address(self.grpc_address)
        check_int("num_tokens", self.num_tokens)
        object.__setattr__(
            self, "bandwidth_bytes_per_s", check_rate("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        )
        check_stream_addresses(self.stream_addresses)
        _check_bool("client", self.client)
        check_rank(self.rank)

    @property
    def order(self) -> tuple[bool, int, str]:
        """Where the member stands in a group (``records.member_order``)."""
        return member_order(self.rank, self.peer_id)

    @property
    def num_streams(self) -> int:
        return 1 + len(self.stream_addresses)

    def stream_address(self, stream: int) -> str:
        """Where stream ``stream`` (0-based) of this member listens."""
        return self.grpc_address if stream == 0 else self.stream_addresses[stream - 1]


@dataclass(frozen=True, kw_only=True)
class GroupSpec:
    """Everything the members of round ``round`` agree on; the leader sends it in ``Begin``.

    ``members`` are in the member order (``records.member_order``: by rank, then peer id; the
    all-reduce order, and the data shards' order); member ``i`` owns the vector elements ``[part_boundaries[i], part_boundaries[i + 1])`` (``parts.py``).
    """

    round: int
    group_id: str
    leader_id: str
    param_hash: str
    """The global params every member holds before the round: lineage ``(round - 1, param_hash)``."""
    vector_length: int
    members: tuple[GroupMember, ...]
    part_boundaries: tuple[int, ...]
    tier_group_size: int = 0
    """Run the all-reduce in groups of at most this many members if there are more members than
    that (``tiered``; ``protocol/allreduce/tiers.py``); 0: always one flat round. The leader's."""

    def __post_init__(self) -> None:
        _check_round(self.round)
        check_int("tier_group_size", self.tier_group_size, maximum=MAX_GROUP_SIZE)
        if self.tier_group_size == 1:
            raise ValueError("tier_group_size must be 0 (flat rounds) or at least 2")
        _check_id("group_id", self.group_id)
        check_peer_id(self.leader_id, "leader_id")
        check_param_hash(self.param_hash)
        check_int("vector_length", self.vector_length)
        if not isinstance(self.members, tuple) or not 1 <= len(self.members) <= MAX_GROUP_SIZE:
            raise ValueError(f"members must be a tuple of 1..{MAX_GROUP_SIZE} GroupMember")
        if not all(isinstance(member, GroupMember) for member in self.members):
            raise ValueError("members must all be GroupMember")
        ids = [member.peer_id for member in self.members]
        if len(set(ids)) != len(ids) or any(a.order >= b.order for a, b in pairwise(self.members)):
            order = [(member.rank, member.peer_id) for member in self.members]
            raise ValueError(f"members must be sorted by (rank, peer_id) without duplicates, got {order}")
        if self.leader_id not in ids:
            raise ValueError(f"leader {self.leader_id!r} is not a member")
        bounds = self.part_boundaries
        if not isinstance(bounds, tuple) or len(bounds) != len(ids) + 1:
            raise ValueError(f"part_boundaries must be a tuple of {len(ids) + 1} ints")
        for i, bound in enumerate(bounds):
            check_int(f"part_boundaries[{i}]", bound, maximum=self.vector_length)
        if bounds[0] != 0 or bounds[-1] != self.vector_length:
            raise ValueError(f"part_boundaries must run from 0 to {self.vector_length}, got {bounds}")
        if any(a > b for a, b in pairwise(bounds)):
            raise ValueError(f"part_boundaries must not decrease, got {bounds}")
        if all(member.client for member in self.members):
            raise ValueError("a round of client-mode members only cannot form: a part needs an owner")
        if self.members[ids.index(self.leader_id)].client:
            raise ValueError(f"leader {self.leader_id!r} is a client: a leader must accept connections")
        streams = {member.num_streams for member in self.members}
        if len(streams) != 1:
            raise ValueError(
                f"members must all open the same number of all-reduce streams, got {sorted(streams)}"
            )

    @property
    def num_streams(self) -> int:
        """How many all-reduce streams the round runs (each member opens this many)."""
        return self.members[0].num_streams

    @property
    def tiered(self) -> bool:
        """Whether the round's all-reduce runs in groups of ``tier_group_size`` (more members than that)."""
        return 0 < self.tier_group_size < len(self.members)

    @property
    def member_ids(self) -> tuple[str, ...]:
        return tuple(member.peer_id for member in self.members)

    @property
    def total_tokens(self) -> int:
        return sum(member.num_tokens for member in self.members)

    def index_of(self, peer_id: str) -> int:
        return self.member_ids.index(peer_id)

    def part(self, peer_id: str) -> tuple[int, int]:
        """``(start, end)`` of the elements ``peer_id`` owns."""
        index = self.index_of(peer_id)
        return self.part_boundaries[index], self.part_boundaries[index + 1]

    def problem_for(
        self, member: GroupMember, *, leader_id: str, param_hash: str, vector_length: int
    ) -> str | None:
        """Why ``member`` must refuse this group from ``leader_id``, or None if it is sound.

        ``member`` is the entry the member itself would write (what it sent in its Accept); the
        group must hold it unchanged, come from its leader, start from the member's params, fit
        its vector and have the parts ``parts.py`` gives for the members' bandwidths (so a leader
        cannot grab a larger part).
        """
        if self.leader_id != leader_id:
            return f"leader_id {self.leader_id!r} is not the sender {leader_id!r}"
        if self.param_hash != param_hash:
            return "param_hash differs from the member's"
        if self.vector_length != vector_length:
            return f"vector_length {self.vector_length} != the member's {vector_length}"
        if member.peer_id not in self.member_ids:
            return f"{member.peer_id!r} is not a member"
        if self.members[self.index_of(member.peer_id)] != member:
            return f"{member.peer_id!r}'s entry differs from its Accept"
        if not self.has_expected_parts():
            return "parts are not parts.part_boundaries of the members' bandwidths"
        return None

    def has_expected_parts(self) -> bool:
        """Whether the parts are what ``parts.part_boundaries`` gives for these members (worked out
        once per group object: it is frozen, and a process that holds one object for many members,
        as the swarm simulator does, would otherwise redo O(members) work per member)."""
        known = self.__dict__.get("_has_expected_parts")
        if known is None:
            bandwidths = [member.bandwidth_bytes_per_s for member in self.members]
            clients = [member.client for member in self.members]
            known = self.part_boundaries == part_boundaries(bandwidths, self.vector_length, clients)
            object.__setattr__(self, "_has_expected_parts", known)
        return bool(known)


@dataclass(frozen=True, kw_only=True)
class JoinRequest:
    round: int
    param_hash: str
    """The requester's global params before the round."""

    def __post_init__(self) -> None:
        _check_round(self.round)
        check_param_hash(self.param_hash)


@dataclass(frozen=True, kw_only=True)
class Proposal:
    round: int
    proposal_id: str
    param_hash: str
    """The leader's global params before the round; only peers holding the same may accept."""
    members: tuple[str, ...]
    """Peers invited so far, the leader included. Informational: only ``Begin`` fixes the group."""

    def __post_init__(self) -> None:
        _check_round(self.round)
        _check_id("proposal_id", self.proposal_id)
        check_param_hash(self.param_hash)
        if not isinstance(self.members, tuple) or not 1 <= len(self.members) <= MAX_GROUP_SIZE:
            raise ValueError(f"members must be a tuple of 1..{MAX_GROUP_SIZE} peer ids")
        for peer_id in self.members:
            check_peer_id(peer_id, "member id")


@dataclass(frozen=True, kw_only=True)
class Accept:
    round: int
    proposal_id: str
    grpc_address: str
    num_tokens: int
    """Tokens processed in this round's inner phase: the weight of this peer's contribution."""
    bandwidth_bytes_per_s: float
    stream_addresses: tuple[str, ...] = ()
    """Where our all-reduce streams 1..S-1 listen (stream 0 is ``grpc_address``)."""
    client: bool = False
    """We accept no connections (``--client-mode``): give us no part, never dial us."""
    rank: int | None = None
    """Our place in the member order, fixed by our run; None: unranked (order us by peer id)."""

    def __post_init__(self) -> None:
        _check_round(self.round)
        _check_id("proposal_id", self.proposal_id)
        check_address(self.grpc_address)
        check_int("num_tokens", self.num_tokens)
        object.__setattr__(
            self, "bandwidth_bytes_per_s", check_rate("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        )
        check_stream_addresses(self.stream_addresses)
        _check_bool("client", self.client)
        check_rank(self.rank)

    @property
    def num_streams(self) -> int:
        return 1 + len(self.stream_addresses)


@dataclass(frozen=True, kw_only=True)
class _ProposalNotice:
    """A notice about proposal ``proposal_id`` of round ``round``, with the reason for it.

    The subclasses differ only in who sends them and what they mean; equality and repr keep the
    subclass (dataclass ``__eq__`` compares classes), so a Reject never equals a Cancel.
    """

    round: int
    proposal_id: str
    reason: Reason

    def __post_init__(self) -> None:
        _check_round(self.round)
        _check_id("proposal_id", self.proposal_id)
        _check_reason(self.reason)


class Reject(_ProposalNotice):
    """Member to leader: I do not accept your proposal."""


class Withdraw(_ProposalNotice):
    """Member to leader: I take back my acceptance."""


class Cancel(_ProposalNotice):
    """Leader to member: my proposal is off (e.g. the round already started without you)."""


@dataclass(frozen=True, kw_only=True)
class Begin:
    group: GroupSpec

    def __post_init__(self) -> None:
        if not isinstance(self.group, GroupSpec):
            raise ValueError("Begin.group must be a GroupSpec")

    @property
    def round(self) -> int:
        return self.group.round


Message = JoinRequest | Proposal | Accept | Reject | Withdraw | Cancel | Begin
