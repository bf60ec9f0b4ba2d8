"""The all-reduce, modelled from its byte formulas instead of run: bytes per member, then seconds.

The group is the product's ``GroupSpec`` as the leader's ``RoundFormation`` built it, so the parts
are the product's (``protocol.membership.parts``: proportional to the members' advertised uplinks).
Let ``e_k`` be part k's encoded size: the sum over its streamed chunks (``chunk_sizes``, the
``AllReduceConfig.chunk_num_elements`` grid) of the codec's ``encoded_num_bytes``, scales included;
``S = sum_k e_k`` and N the group's size. Member i (ARCHITECTURE.md, "The all-reduce"):

- dense codecs (none, fp16, bf16, int8, int4): phase 1 (reduce-scatter) it sends its slice of every
  other part, ``S - e_i``, and receives ``(N - 1) e_i``; phase 2 (all-gather) it serves its part's
  encoded mean to the N - 1 others (as replicas or pulls), ``(N - 1) e_i``, and receives the other
  means, ``S - e_i``. With equal parts that is ``2 (N - 1) / N x S`` each way
  (``scripts/bench/simulated_allreduce.py``, ``sends_per_payload``);
- sparse (topk): phase 1 as above; phase 2 the owner relays the N contributors' payloads of its part,
  ``(N - 1) N e_i`` sent, ``N (S - e_i)`` received (ARCHITECTURE.md, "Sparse contributions").

Protobuf headers and message framing are left out (a few dozen bytes a chunk). Seconds: each phase
lasts as long as its slowest member's transfer, ``max_i max(sent_i / up_i, received_i / down_i)``,
plus one round trip between the group's two farthest members; the phases run one after the other. The core never
congests; the access links are the bottleneck (the case of a swarm over the internet).

A tiered round (``GroupSpec.tiered``: more members than the leader's ``tier_group_size``) is the
product's ``TierPlan`` (``protocol/allreduce/tiers.py``) over the group: stage A is the formula above
for each of its groups (parts by bandwidth), stage B for each column (the slice, equal parts), and
stage C every member receives the ``S - 1`` slices it did not average, each as its column's encoded
bytes (a sparse codec's: int8, ``tiered.SPARSE_CARRIER``), from its group's member of that column,
who sends its slice to each of its group-mates. The stages run one after the other, each as long as its slowest group, column or member. A member's
peers in the round (``peers``): the others of its group and its column (``TierPlan.peers_of``); K - 1
in a flat round.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from protocol.allreduce.reducer import chunk_sizes
from protocol.allreduce.sparse import is_sparse
from protocol.allreduce.tiered import SPARSE_CARRIER
from protocol.codecs import Codec, get_codec
from protocol.membership.messages import GroupSpec
from protocol.membership.parts import part_boundaries
from protocol.swarm.streams import to_tier_plan
from scripts.sim.links import Network


@dataclass(frozen=True)
class MemberTraffic:
    """One member's bytes in one round, per phase."""

    sent_reduce_scatter: int
    recv_reduce_scatter: int
    sent_all_gather: int
    recv_all_gather: int

    @property
    def sent(self) -> int:
        return self.sent_reduce_scatter + self.sent_all_gather

    @property
    def received(self) -> int:
        return self.recv_reduce_scatter + self.recv_all_gather


def part_payload_bytes(codec: Codec, num_elements: int, chunk_num_elements: int) -> int:
    """One member's encoded slice of a part of ``num_elements`` numbers (``e_k`` above)."""
    return sum(codec.encoded_num_bytes(size) for size in chunk_sizes(num_elements, chunk_num_elements))


def member_traffic(group: GroupSpec, codec: Codec, chunk_num_elements: int) -> list[MemberTraffic]:
    """Every member's bytes, in the group's member order (see the module docstring)."""
    bounds = group.part_boundaries
    payloads = [
        part_payload_bytes(codec, high - low, chunk_num_elements)
        for low, high in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    total, num_members = sum(payloads), len(payloads)
    sparse = is_sparse(codec)
    traffic = []
    for own in payloads:
        others = total - own
        relayed = num_members if sparse else 1  # payloads per part in phase 2
        traffic.append(
            MemberTraffic(
                sent_reduce_scatter=others,
                recv_reduce_scatter=(num_members - 1) * own,
                sent_all_gather=(num_members - 1) * relayed * own,
                recv_all_gather=relayed * others,
            )
        )
    return traffic


def allreduce_seconds(group: GroupSpec, traffic: list[MemberTraffic], network: Network) -> float:
    """How long the group's all-reduce lasts over the members' access links (module docstring)."""
    ids = group.member_ids
    profiles = [network.profiles[peer_id] for peer_id in ids]
    round_trip = 2 * 2 * max(profile.latency_s for profile in profiles)  # the two farthest members
    phase_1 = max(
        max(t.sent_reduce_scatter / p.up_bytes_per_s, t.recv_reduce_scatter / p.down_bytes_per_s)
        for t, p in zip(traffic, profiles, strict=True)
    )
    phase_2 = max(
        max(t.sent_all_gather / p.up_bytes_per_s, t.recv_all_gather / p.down_bytes_per_s)
        for t, p in zip(traffic, profiles, strict=True)
    )
    return phase_1 + phase_2 + 2 * round_trip


@dataclass(frozen=True)
class RoundCost:
    """A group's all-reduce: every member's bytes (member order), how long it lasts, whom each talks to."""

    traffic: list[MemberTraffic]
    seconds: float
    peers: list[int]
    """Per member, how many others it exchanges with in the round."""


def _subgroup(group: GroupSpec, indices: list[int], num_elements: int, *, by_bandwidth: bool) -> GroupSpec:
    """``group``'s members ``indices`` as a flat group over ``num_elements`` numbers (a stage's round)."""
    members = tuple(group.members[i] for i in indices)
    bandwidths = [m.bandwidth_bytes_per_s if by_bandwidth else 1.0 for m in members]
    return replace(
        group,
        leader_id=members[0].peer_id,
        vector_length=num_elements,
        members=members,
        part_boundaries=part_boundaries(bandwidths, num_elements, [m.client for m in members]),
        tier_group_size=0,
    )


def round_cost(group: GroupSpec, codec: Codec, chunk_num_elements: int, network: Network) -> RoundCost:
    """The all-reduce of ``group``, flat or tiered (see the module docstring)."""
    if not group.tiered:
        traffic = member_traffic(group, codec, chunk_num_elements)
        peers = [len(group.members) - 1] * len(group.members)
        return RoundCost(traffic, allreduce_seconds(group, traffic, network), peers)
    plan = to_tier_plan(group)
    sent = [[0, 0] for _ in group.members]  # per member: (first phase, second phase) of stages A and B
    received = [[0, 0] for _ in group.members]
    stage_seconds = [0.0, 0.0, 0.0]

    def add(indices: list[int], stage_group: GroupSpec, stage: int) -> None:
        traffic = member_traffic(stage_group, codec, chunk_num_elements)
        stage_seconds[stage] = max(stage_seconds[stage], allreduce_seconds(stage_group, traffic, network))
        for i, t in zip(indices, traffic, strict=True):
            sent[i][0] += t.sent_reduce_scatter
            sent[i][1] += t.sent_all_gather
            received[i][0] += t.recv_reduce_scatter
            received[i][1] += t.recv_all_gather

    for members in plan.groups:
        add(list(members), _subgroup(group, list(members), group.vector_length, by_bandwidth=True), 0)
    slice_bytes = []
    for i in range(plan.num_slices):
        column = list(plan.column(i))
        length = plan.slice_bounds[i + 1] - plan.slice_bounds[i]
        add(column, _subgroup(group, column, length, by_bandwidth=False), 1)
        served_as = get_codec(SPARSE_CARRIER) if is_sparse(codec) else codec  # (tiered._held)
        slice_bytes.append(part_payload_bytes(served_as, length, chunk_num_elements))
    pulled = [0] * len(group.members)  # stage C
    served = [0] * len(group.members)
    for members in plan.groups:
        for position, holder in enumerate(members[: plan.num_slices]):
            for mate in members:
                if mate != holder:
                    pulled[mate] += slice_bytes[position]
                    served[holder] += slice_bytes[position]
    profiles = [network.profiles[m.peer_id] for m in group.members]
    stage_seconds[2] = max(
        max(served[i] / p.up_bytes_per_s, pulled[i] / p.down_bytes_per_s) for i, p in enumerate(profiles)
    ) + 2 * 2 * max(p.latency_s for p in profiles)
    traffic = [
        MemberTraffic(
            sent_reduce_scatter=sent[i][0],
            recv_reduce_scatter=received[i][0],
            sent_all_gather=sent[i][1] + served[i],
            recv_all_gather=received[i][1] + pulled[i],
        )
        for i in range(len(group.members))
    ]
    peers = [len(plan.peers_of(i)) for i in range(len(group.members))]
    return RoundCost(traffic, sum(stage_seconds), peers)
