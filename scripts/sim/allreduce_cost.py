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
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.allreduce.reducer import chunk_sizes
from protocol.allreduce.sparse import is_sparse
from protocol.codecs import Codec
from protocol.membership.messages import GroupSpec
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
