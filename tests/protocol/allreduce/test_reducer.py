"""PartReducer as a plain state machine: member-order sums regardless of arrival, exclusions, refusals."""

from __future__ import annotations

import itertools
import math
import struct

import grpc
import pytest
import torch

from protocol.allreduce.errors import ProtocolError
from protocol.allreduce.reducer import PartReducer, chunk_sizes
from protocol.codecs import get_codec

NUM_ELEMENTS = 1000
CHUNK = 300


def naive_weighted_mean(vectors: dict[int, torch.Tensor], weights: dict[int, float]) -> torch.Tensor:
    """sum(w_i * x_i) / sum(w_i) in float32, members in ascending order: the reference."""
    total = torch.zeros(NUM_ELEMENTS)
    weight_sum = torch.zeros(())
    for member in sorted(vectors):
        total = total + vectors[member] * weights[member]
        weight_sum = weight_sum + weights[member]
    return total / weight_sum


def stream(reducer: PartReducer, member: int, vector: torch.Tensor, weight: float) -> None:
    reducer.begin(member, weight)
    offset = 0
    for size in chunk_sizes(NUM_ELEMENTS, CHUNK):
        payload = reducer.codec.encode(vector[offset : offset + size]).numpy().tobytes()
        reducer.add_chunk(member, offset, size, payload)
        offset += size
    reducer.complete(member)


def fold_all(reducer: PartReducer) -> None:
    while (member := reducer.next_foldable()) is not None:
        reducer.fold(member)


def decode_average(reducer: PartReducer) -> tuple[torch.Tensor, tuple[int, ...]]:
    reduced = reducer.encode_average(chunk_num_elements=CHUNK, error_feedback=None, part_offset=0)
    decoded = torch.cat(
        [reducer.codec.decode(p, n) for p, n in zip(reduced.payloads, reduced.chunk_sizes, strict=True)]
    )
    return decoded, reduced.contributor_indices


def make_reducer(codec: str = "none", num_members: int = 4) -> PartReducer:
    return PartReducer(
        part_index=1,
        producer_index=1,
        num_elements=NUM_ELEMENTS,
        num_members=num_members,
        codec=get_codec(codec),
    )


def test_sum_is_member_ordered_whatever_the_arrival_order() -> None:
    generator = torch.Generator().manual_seed(0)
    vectors = {i: torch.randn(NUM_ELEMENTS, generator=generator) * 10.0**i for i in range(4)}
    weights = {0: 1.5, 1: 0.25, 2: 3.0, 3: 7.0}
    reference = naive_weighted_mean(vectors, weights)
    for order in itertools.permutations([0, 2, 3]):
        reducer = make_reducer()
        reducer.add_local(1, weights[1], vectors[1])
        for member in order:
            stream(reducer, member, vectors[member], weights[member])
            fold_all(reducer)  # folds whatever prefix is ready, as the round does
        assert reducer.all_resolved()
        reducer.finalize()
        fold_all(reducer)
        average, contributors = decode_average(reducer)
        assert contributors == (0, 1, 2, 3)
        assert torch.equal(average, reference), order


def test_folding_waits_for_lower_members_and_exclusions_unblock_it() -> None:
    vectors = {i: torch.full((NUM_ELEMENTS,), float(i)) for i in range(4)}
    reducer = make_reducer()
    reducer.add_local(1, 1.0, vectors[1])
    stream(reducer, 2, vectors[2], 1.0)
    assert reducer.next_foldable() is None  # member 0 has not delivered yet
    reducer.give_up_on(0, "unreachable")
    assert reducer.next_foldable() == 1
    reducer.begin(3, 1.0)
    reducer.add_chunk(3, 0, CHUNK, get_codec("none").encode(vectors[3][:CHUNK]).numpy().tobytes())
    reducer.give_up_on(3, "unreachable")  # already streaming: giving up does not exclude it
    fold_all(reducer)
    assert not reducer.all_resolved()
    reducer.finalize()  # the deadline: member 3 never finished
    fold_all(reducer)
    average, contributors = decode_average(reducer)
    assert contributors == (1, 2)
    assert torch.equal(average, naive_weighted_mean({1: vectors[1], 2: vectors[2]}, {1: 1.0, 2: 1.0}))
    assert set(reducer.exclusion_reasons()) == {0, 3}


def test_refusals_carry_the_right_status() -> None:
    codec = get_codec("int8")
    reducer = make_reducer("int8")
    good = codec.encode(torch.randn(CHUNK)).numpy().tobytes()

    def status_of(action: object) -> grpc.StatusCode:
        with pytest.raises(ProtocolError) as caught:
            action()  # type: ignore[operator]
        return caught.value.code

    assert status_of(lambda: reducer.begin(0, math.nan)) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: reducer.begin(0, -1.0)) is grpc.StatusCode.INVALID_ARGUMENT
    reducer.begin(0, 1.0)
    assert status_of(lambda: reducer.begin(0, 1.0)) is grpc.StatusCode.ALREADY_EXISTS
    assert status_of(lambda: reducer.add_chunk(0, 5, CHUNK, good)) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: reducer.add_chunk(0, 0, CHUNK, good[:-1])) is grpc.StatusCode.INVALID_ARGUMENT
    nan_scale = struct.pack("<f", math.nan) + good[4:]
    assert status_of(lambda: reducer.add_chunk(0, 0, CHUNK, nan_scale)) is grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(lambda: reducer.add_chunk(0, 900, CHUNK, good)) is grpc.StatusCode.INVALID_ARGUMENT
    reducer.add_chunk(0, 0, CHUNK, good)
    assert status_of(lambda: reducer.complete(0)) is grpc.StatusCode.INVALID_ARGUMENT  # truncated
    reducer.finalize()
    assert status_of(lambda: reducer.begin(2, 1.0)) is grpc.StatusCode.FAILED_PRECONDITION
