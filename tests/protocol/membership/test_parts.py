"""All-reduce parts: exact sums, proportional to bandwidth within one element, deterministic."""

from __future__ import annotations

import math
from fractions import Fraction
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.membership.parts import part_boundaries, part_sizes


def _greedy_reference(bandwidths: list[float], vector_length: int) -> tuple[int, ...]:
    """Hand out elements one at a time to the member furthest below its ideal share (ties: lower index).

    An independent formulation of largest-remainder rounding, valid when no member's ideal share
    is below one element (so no minimum needs enforcing).
    """
    total = sum(Fraction(b) for b in bandwidths)
    ideal = [vector_length * Fraction(b) / total for b in bandwidths]
    sizes = [0] * len(bandwidths)
    for _ in range(vector_length):
        deficits = [ideal[i] - sizes[i] for i in range(len(sizes))]
        best = max(range(len(sizes)), key=lambda i: (deficits[i], -i))
        sizes[best] += 1
    return tuple(sizes)


def test_hand_computed_examples() -> None:
    assert part_sizes([1.0, 1.0, 1.0], 10) == (4, 3, 3)  # remainders tie: lower index first
    assert part_sizes([3.0, 1.0], 8) == (6, 2)
    assert part_sizes([1.0, 3.0, 2.0], 600) == (100, 300, 200)
    assert part_sizes([5.0], 7) == (7,)
    assert part_boundaries([1.0, 3.0, 2.0], 600) == (0, 100, 400, 600)
    assert part_sizes([2.0, 1.0], 0) == (0, 0)


def test_minimum_one_element_each_by_water_filling() -> None:
    # Ideal shares 998.004 / 0.998 / 0.998: the slow two are raised to one element each.
    assert part_sizes([1000.0, 1.0, 1.0], 1000) == (998, 1, 1)
    assert part_sizes([0.0, 10.0, 0.0], 5) == (1, 3, 1)  # zero bandwidth still owns one
    assert part_sizes([0.0, 0.0, 0.0], 7) == (3, 2, 2)  # no bandwidth known: equal shares


def test_fewer_elements_than_members_go_to_the_fastest() -> None:
    assert part_sizes([1.0, 5.0, 3.0, 5.0], 2) == (0, 1, 0, 1)
    assert part_boundaries([1.0, 5.0, 3.0, 5.0], 2) == (0, 0, 1, 1, 2)


@pytest.mark.parametrize("bad", [[], [1.0, -1.0], [math.nan], [math.inf, 1.0], ["fast"]])
def test_bad_bandwidths(bad: list) -> None:
    with pytest.raises(ValueError):
        part_sizes(bad, 10)


def test_bad_length() -> None:
    with pytest.raises(ValueError, match="vector_length"):
        part_sizes([1.0], -1)


_BANDWIDTHS = st.lists(
    st.floats(min_value=0.0, max_value=1e12, allow_nan=False, allow_infinity=False)
    | st.sampled_from([0.0, 1.0, 1e6, 2.5e6, 1e-300]),
    min_size=1,
    max_size=40,
)


@settings(max_examples=500, deadline=None)
@given(_BANDWIDTHS, st.integers(min_value=0, max_value=10**9))
def test_properties(bandwidths: list[float], vector_length: int) -> None:
    sizes = part_sizes(bandwidths, vector_length)
    num_members = len(bandwidths)
    assert len(sizes) == num_members and sum(sizes) == vector_length
    assert all(size >= 0 for size in sizes)
    if vector_length >= num_members:
        assert all(size >= 1 for size in sizes)
    # A faster member never owns less than a slower one (equal bandwidth: the lower index first).
    for i in range(num_members):
        for j in range(num_members):
            if bandwidths[i] > bandwidths[j] or (bandwidths[i] == bandwidths[j] and i < j):
                assert sizes[i] >= sizes[j]
    total = sum(Fraction(b) for b in bandwidths)
    if total > 0 and all(vector_length * Fraction(b) / total >= 1 for b in bandwidths):
        # No minimum kicked in: within one element of the exact proportional share.
        assert all(
            abs(size - vector_length * Fraction(b) / total) < 1
            for size, b in zip(sizes, bandwidths, strict=True)
        )
    bounds = part_boundaries(bandwidths, vector_length)
    assert bounds[0] == 0 and bounds[-1] == vector_length
    assert tuple(b - a for a, b in pairwise(bounds)) == sizes
    assert part_sizes(list(bandwidths), vector_length) == sizes  # deterministic


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=1000).map(float), min_size=1, max_size=8),
    st.integers(min_value=0, max_value=500),
)
def test_matches_the_greedy_reference(bandwidths: list[float], vector_length: int) -> None:
    total = sum(bandwidths)
    if not all(vector_length * b / total >= 1 for b in bandwidths):
        return  # the reference does not enforce the one-element minimum
    assert part_sizes(bandwidths, vector_length) == _greedy_reference(bandwidths, vector_length)


def _fraction_reference(bandwidths: list[float], vector_length: int) -> tuple[int, ...]:
    """The algorithm of the module docstring in ``Fraction`` arithmetic, step by step (how parts.py
    computed it before its shares became ratios of integers)."""
    weights = [Fraction(b) for b in bandwidths]
    num_members = len(weights)
    if vector_length < num_members:
        fastest_first = sorted(range(num_members), key=lambda i: (-weights[i], i))
        return tuple(1 if i in fastest_first[:vector_length] else 0 for i in range(num_members))
    fixed: set[int] = set()
    while True:
        free = [i for i in range(num_members) if i not in fixed]
        remaining = vector_length - len(fixed)
        total = sum((weights[i] for i in free), Fraction(0))
        ideal = {i: remaining * weights[i] / total if total else Fraction(remaining, len(free)) for i in free}
        below_one = {i for i in free if ideal[i] < 1}
        if not below_one:
            break
        fixed |= below_one
    sizes = [1 if i in fixed else math.floor(ideal[i]) for i in range(num_members)]
    leftover = remaining - sum(sizes[i] for i in free)
    for i in sorted(free, key=lambda i: (-(ideal[i] - sizes[i]), i))[:leftover]:
        sizes[i] += 1
    return tuple(sizes)


@settings(max_examples=400, deadline=None)
@given(
    bandwidths=st.lists(
        st.one_of(
            st.floats(min_value=0.0, max_value=1e10, allow_nan=False),
            st.sampled_from([0.0, 1e-300, 5e-324, 0.1, 1.25e6, 1e9]),
        ),
        min_size=1,
        max_size=40,
    ),
    vector_length=st.one_of(st.integers(0, 60), st.integers(10**6, 10**9)),
)
def test_integer_shares_are_the_fraction_algorithm(bandwidths: list[float], vector_length: int) -> None:
    assert part_sizes(bandwidths, vector_length) == _fraction_reference(bandwidths, vector_length)
