"""PartReducer as a plain state machine: member-order sums whatever the arrival order, exclusions,
poisoning, refusals."""

from __future__ import annotations

import itertools
import math
import random
import struct
from collections.abc import Callable

import grpc
import pytest
import torch

from protocol.allreduce.reducer import PartReducer, chunk_sizes
from protocol.codecs import get_codec
from protocol.errors import ProtocolError

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


def chunks_of(reducer: PartReducer, member: int, vector: torch.Tensor) -> list[Callable[[], None]]:
    """One callable per chunk of a member's stream, then one that ends the stream."""

    def sender(offset: int, size: int, payload: bytes) -> Callable[[], None]:
        return lambda: reducer.add_chunk(member, offset, size, payload)

    steps: list[Callable[[], None]] = []
    offset = 0
    for size in chunk_sizes(NUM_ELEMENTS, CHUNK):
        steps.append(
            sender(offset, size, reducer.codec.encode(vector[offset : offset + size]).numpy().tobytes())
        )
        offset += size
    steps.append(lambda: reducer.complete(member))
    return steps


def fold_available(reducer: PartReducer) -> None:
    jobs = reducer.plan_folds()
    reducer.run_folds(jobs)
    reducer.folds_done(jobs)


def decode_average(reducer: PartReducer) -> tuple[torch.Tensor, tuple[int, ...]]:
    reduced = reducer.encode_average(error_feedback=None, part_offset=0)
    pieces = [reducer.codec.decode(p, n) for p, n in zip(reduced.payloads, reduced.chunk_sizes, strict=True)]
    return torch.cat(pieces), reduced.contributor_indices


def make_reducer(codec: str = "none", num_members: int = 4) -> PartReducer:
    return PartReducer(
        part_index=1,
        producer_index=1,
        num_elements=NUM_ELEMENTS,
        num_members=num_members,
        codec=get_codec(codec),
        chunk_num_elements=CHUNK,
    )


@pytest.mark.parametrize("seed", range(6))
def test_sum_is_member_ordered_whatever_the_interleaving(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    vectors = {i: torch.randn(NUM_ELEMENTS, generator=generator) * 10.0**i for i in range(4)}
    weights = {0: 1.5, 1: 0.25, 2: 3.0, 3: 7.0}
    reducer = make_reducer()
    reducer.add_local(1, weights[1], vectors[1])
    streams = {m: chunks_of(reducer, m, vectors[m]) for m in (0, 2, 3)}
    for m in streams:
        reducer.begin(m, weights[m])
    rng = random.Random(seed)
    while streams:  # chunks of the three senders arrive interleaved at random, folding as we go
        member = rng.choice(sorted(streams))
        streams[member].pop(0)()
        if not streams[member]:
            del streams[member]
        fold_available(reducer)
    assert reducer.is_done()
    reducer.finalize()
    average, contributors = decode_average(reducer)
    assert contributors == (0, 1, 2, 3)
    assert torch.equal(average, naive_weighted_mean(vectors, weights))


def test_higher_members_wait_for_lower_ones_and_exclusion_unblocks_them() -> None:
    vectors = {i: torch.full((NUM_ELEMENTS,), float(i + 1)) for i in range(4)}
    reducer = make_reducer()
    reducer.add_local(1, 1.0, vectors[1])
    reducer.begin(2, 1.0)
    for step in chunks_of(reducer, 2, vectors[2]):
        step()
    assert reducer.plan_folds() == []  # member 0 has sent nothing: nobody may fold past it
    reducer.give_up_on(0, "unreachable")
    fold_available(reducer)
    reducer.begin(3, 1.0)  # member 3 starts but never gets anywhere
    reducer.finalize()  # the deadline: 3 has nothing summed, so it is simply left out
    fold_available(reducer)
    assert reducer.is_done() and not reducer.poisoned
    average, contributors = decode_average(reducer)
    assert contributors == (1, 2)
    assert torch.equal(average, naive_weighted_mean({1: vectors[1], 2: vectors[2]}, {1: 1.0, 2: 1.0}))
    assert set(reducer.exclusion_reasons()) == {0, 3}


def test_a_member_failing_after_being_partly_summed_poisons_the_part() -> None:
    reducer = make_reducer(num_members=3)
    reducer.add_local(1, 1.0, torch.ones(NUM_ELEMENTS))
    reducer.begin(0, 1.0)
    chunks_of(reducer, 0, torch.ones(NUM_ELEMENTS))[0]()
    fold_available(reducer)  # member 0's first chunk is now in the sum
    reducer.finalize()  # member 0 is partly summed: the deadline does not drop it
    assert not reducer.poisoned and reducer.status(0).value == "streaming"
    reducer.exclude(0, "its stream broke")
    assert "member 0" in reducer.poisoned
    with pytest.raises(ProtocolError) as caught:
        reducer.add_chunk(0, CHUNK, CHUNK, b"")
    assert caught.value.code is grpc.StatusCode.ABORTED


def test_refusals_carry_the_right_status() -> None:
    codec = get_codec("int8")
    reducer = make_reducer("int8")
    good = codec.encode(torch.randn(CHUNK)).numpy().tobytes()

    def status_of(action: Callable[[], None]) -> grpc.StatusCode:
        with pytest.raises(ProtocolError) as caught:
            action()
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


def test_every_order_of_completion_gives_the_same_bits() -> None:
    vectors = {i: torch.randn(NUM_ELEMENTS, generator=torch.Generator().manual_seed(i)) for i in range(3)}
    results = []
    for order in itertools.permutations(range(3)):
        reducer = make_reducer(num_members=3)
        for member in order:
            reducer.begin(member, 1.0)
            for step in chunks_of(reducer, member, vectors[member]):
                step()
            fold_available(reducer)
        reducer.finalize()
        results.append(decode_average(reducer)[0])
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], torch.stack([vectors[i] for i in range(3)]).mean(dim=0))
