"""How a round's all-reduce vector is cut into one contiguous part per member.

In the reduce-scatter/all-gather all-reduce (hivemind's butterfly all-reduce, Ryabinin et al.,
2021, "Moshpit SGD"), member ``i`` owns part ``i``: it receives everybody's slice of that part,
averages it and sends the mean back. A member's traffic grows with its part, so parts are
proportional to the members' bandwidths: a fast uplink owns more of the vector.

Algorithm (exact rational arithmetic, so every peer computes the same parts; the shares are
ratios of integers, ``_exact_weights``):

1. Ideal share of member ``i``: ``L * b_i / sum(b)`` (equal shares if every bandwidth is 0).
2. Every member must own at least one element when ``L >= n``: members whose ideal share is below
   one are fixed at one element and the rest of the vector is shared among the others by the same
   rule; repeat until no share is below one (water filling; the fastest member is never fixed).
3. Round the remaining shares by the largest-remainder method (Hamilton): floor every share, then
   hand the leftover elements one each to the largest fractional parts, ties to the lower index.

So the sizes sum to ``L`` exactly, every size is within one element of its (water-filled) ideal
share, a member never owns less than a member with lower bandwidth, and with ``L < n`` the ``L``
fastest members own one element each and the others none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import accumulate

from protocol.membership.records import check_int, check_rate


def _exact_weights(bandwidths: Sequence[float]) -> list[int]:
    """The bandwidths as integers on one scale, exactly: each float is ``numerator / 2**k``
    (``float.as_integer_ratio``), so over the largest denominator they are integers in the same
    ratios. Every share below is then a ratio of integers: the same rationals as with ``Fraction``,
    without a gcd per addition (a leader's and every member's check of a thousand-member group)."""
    if (
        not all(type(b) is float for b in bandwidths)
        or not 0.0 <= min(bandwidths) <= max(bandwidths) < math.inf
    ):
        bandwidths = [check_rate(f"bandwidths[{i}]", b) for i, b in enumerate(bandwidths)]  # says which
    ratios = [b.as_integer_ratio() for b in bandwidths]
    shift = max(den for _, den in ratios).bit_length()  # denominators are powers of two
    return [num << (shift - den.bit_length()) for num, den in ratios]


def part_sizes(bandwidths: Sequence[float], vector_length: int) -> tuple[int, ...]:
    """Number of vector elements member ``i`` owns, for members with these bandwidths."""
    if len(bandwidths) == 0:
        raise ValueError("need at least one member")
    check_int("vector_length", vector_length)
    weights = _exact_weights(bandwidths)  # exact: no rounding differences between peers or platforms
    num_members = len(weights)

    if vector_length < num_members:
        # Not enough elements for everyone: one each to the fastest (ties to the lower index).
        fastest_first = sorted(range(num_members), key=lambda i: (-weights[i], i))
        sizes = [0] * num_members
        for i in fastest_first[:vector_length]:
            sizes[i] = 1
        return tuple(sizes)

    # The free members' ideal shares are scaled[k] / total: ratios of integers, compared exactly.
    free = list(range(num_members))
    while True:
        remaining = vector_length - (num_members - len(free))
        free_weights = [weights[i] for i in free]
        total = sum(free_weights)
        if total == 0:  # every bandwidth is 0: equal shares
            free_weights, total = [1] * len(free), len(free)
        scaled = [remaining * weight for weight in free_weights]
        still_free = [i for i, share in zip(free, scaled, strict=True) if share >= total]
        if len(still_free) == len(free):
            break
        # remaining >= len(free), so the fastest free member's share is >= 1: `free` never empties.
        free = still_free  # the others are fixed at one element

    sizes = [1] * num_members
    floors = [share // total for share in scaled]
    for i, floor in zip(free, floors, strict=True):
        sizes[i] = floor
    leftover = remaining - sum(floors)
    assert 0 <= leftover < len(free)
    # Share k's fractional part is (scaled[k] mod total) / total: largest first, ties to the lower index.
    by_remainder = sorted(range(len(free)), key=lambda k: (-(scaled[k] % total), free[k]))
    for k in by_remainder[:leftover]:
        sizes[free[k]] += 1
    assert sum(sizes) == vector_length
    return tuple(sizes)


def part_boundaries(
    bandwidths: Sequence[float], vector_length: int, clients: Sequence[bool] = ()
) -> tuple[int, ...]:
    """``(0, end_0, end_1, ..., vector_length)``: member ``i`` owns ``[bounds[i], bounds[i + 1])``.

    ``clients[i]`` (empty: nobody): member ``i`` accepts no connections (``--client-mode``), so it
    owns nothing and the others' parts are sized among themselves as if it were not there.
    """
    if not any(clients):
        return (0, *accumulate(part_sizes(bandwidths, vector_length)))
    if len(clients) != len(bandwidths):
        raise ValueError(f"got {len(clients)} client flags for {len(bandwidths)} members")
    servers = [i for i, client in enumerate(clients) if not client]
    if not servers:
        raise ValueError(
            "a round of client-mode members only cannot form: a part needs an owner that accepts connections"
        )
    server_sizes = iter(part_sizes([bandwidths[i] for i in servers], vector_length))
    sizes = [0 if client else next(server_sizes) for client in clients]
    return (0, *accumulate(sizes))
