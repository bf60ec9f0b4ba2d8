"""Robust aggregation ("clipped", "trimmed"): one malicious contribution cannot wreck the average.

Real rounds between gRPC peers on loopback, checked against references computed here with plain torch
(or plain Python per element) from the exact inputs; plus the reducer alone, fed in shuffled orders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import statistics
from datetime import timedelta

import pytest
import torch
import uvloop

from protocol.allreduce import AllReduceConfig, AllReduceResult, GroupSpec
from protocol.allreduce.reducer import PartReducer, ReducedPart
from protocol.allreduce.robust import AggregationRule
from protocol.codecs import get_codec
from tests.protocol.allreduce.support import FAST_CONFIG, allreduce_all, exact_mean, local_peers, members_of

NUM_PEERS = 5
NUM_ELEMENTS = 2_003
WEIGHTS = [1.0, 2.0, 1.5, 3.0, 0.5]
BAD = 3  # the malicious member (it also has the largest weight)
ATTACKS = ("scaled", "sign_flipped", "huge")


def make_vectors(attack: str, seed: int = 0) -> list[torch.Tensor]:
    """Honest members send noisy copies of one pseudo-gradient; member BAD sends an attack on it."""
    generator = torch.Generator().manual_seed(seed)
    signal = torch.randn(NUM_ELEMENTS, generator=generator)
    vectors = [signal + 0.3 * torch.randn(NUM_ELEMENTS, generator=generator) for _ in range(NUM_PEERS)]
    if attack == "scaled":
        vectors[BAD] = vectors[BAD] * 100
    elif attack == "sign_flipped":
        vectors[BAD] = -10 * vectors[BAD]
    else:
        vectors[BAD] = 1e6 * torch.randn(NUM_ELEMENTS, generator=generator)
    return vectors


def config_for(aggregation: str) -> AllReduceConfig:
    # Small chunks: every part spans several chunks (and a short last one).
    return dataclasses.replace(FAST_CONFIG, chunk_num_elements=128, aggregation=aggregation)  # type: ignore[arg-type]


def run_round(
    aggregation: str, vectors: list[torch.Tensor], codec_name: str = "none"
) -> tuple[GroupSpec, list[AllReduceResult]]:
    async def scenario() -> tuple[GroupSpec, list[AllReduceResult]]:
        async with local_peers(NUM_PEERS, config_for(aggregation)) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            return group, await allreduce_all(peers, vectors, group, get_codec(codec_name), weights=WEIGHTS)

    return uvloop.run(scenario())


def assert_all_identical(results: list[AllReduceResult]) -> None:
    for result in results:
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, results[0].averaged)
        assert result.contributors == [[f"p{i}" for i in range(NUM_PEERS)]] * NUM_PEERS


def reference_clipped(
    contributions: list[torch.Tensor], weights: list[float], clip_factor: float
) -> torch.Tensor:
    """sum(w_i s_i x_i) / sum(w_i), s_i = min(1, k median ||x|| / ||x_i||), summed in member order in fp32."""
    norms = [math.sqrt(float((x.double() ** 2).sum())) for x in contributions]
    threshold = clip_factor * statistics.median(norms)
    total = torch.zeros_like(contributions[0])
    weight_sum = torch.zeros(())
    for x, w, norm in zip(contributions, weights, norms, strict=True):
        total = total + x * (w * min(1.0, threshold / norm))
        weight_sum = weight_sum + w
    return total / weight_sum


def reference_trimmed(contributions: list[torch.Tensor], weights: list[float], trim: int) -> torch.Tensor:
    """Per element, in plain Python (float64): sort, drop `trim` per side, weighted mean of the rest."""
    columns = torch.stack(contributions).double().T.tolist()
    result = []
    for column in columns:
        kept = sorted(range(len(column)), key=lambda i: (column[i], i))[trim : len(column) - trim]
        result.append(sum(weights[i] * column[i] for i in kept) / sum(weights[i] for i in kept))
    return torch.tensor(result, dtype=torch.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", ATTACKS)
def test_clipped_equals_reference_bit_for_bit(attack: str) -> None:
    vectors = make_vectors(attack)
    group, results = run_round("clipped", vectors)
    assert_all_identical(results)
    expected = torch.empty(NUM_ELEMENTS)
    for part in range(NUM_PEERS):
        piece = group.part_slice(part)
        expected[piece] = reference_clipped([v[piece] for v in vectors], WEIGHTS, clip_factor=2.0)
    assert torch.equal(results[0].averaged, expected)
    # The owners of the parts report the clipped contribution, and only that one.
    adjustments = [note for result in results for note in result.adjustments]
    assert len(adjustments) == NUM_PEERS and all(f"p{BAD} norm" in note for note in adjustments)
    # The defence bounds the damage: closer to the honest mean than the plain mean (for a sign flip with
    # the largest weight, 3/8 of the total, the clipped vector still pulls: 1.1 |x| vs 4.1 |x| off).
    honest = torch.stack([v for i, v in enumerate(vectors) if i != BAD]).mean(0)
    plain = exact_mean(vectors, WEIGHTS, group, results[0].contributors)
    assert (results[0].averaged - honest).norm() < 0.5 * (plain - honest).norm()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("attack", ATTACKS)
def test_trimmed_equals_reference(attack: str) -> None:
    vectors = make_vectors(attack)
    _, results = run_round("trimmed", vectors)
    assert_all_identical(results)
    expected = reference_trimmed(vectors, WEIGHTS, trim=1)
    torch.testing.assert_close(results[0].averaged, expected, rtol=1e-5, atol=1e-5)
    honest = torch.stack([v for i, v in enumerate(vectors) if i != BAD]).mean(0)
    assert (results[0].averaged - honest).abs().max() < 1.5  # the attack's values never survive
    notes = [note for result in results for note in result.adjustments]
    assert any(f"p{BAD} trimmed at" in note for note in notes)


@pytest.mark.timeout(60)
def test_mean_is_unchanged_and_reports_nothing() -> None:
    vectors = make_vectors("scaled")
    group, results = run_round("mean", vectors)
    assert_all_identical(results)
    assert torch.equal(results[0].averaged, exact_mean(vectors, WEIGHTS, group, results[0].contributors))
    assert all(not result.adjustments for result in results)


@pytest.mark.timeout(60)
def test_clipped_with_a_lossy_codec_stays_within_its_bound() -> None:
    """fp16: the owner clips what it decoded (its own part in fp32), then the average is fp16 again."""
    vectors = make_vectors("scaled")
    group, results = run_round("clipped", vectors, codec_name="fp16")
    assert_all_identical(results)
    expected = torch.empty(NUM_ELEMENTS)
    for part in range(NUM_PEERS):
        piece = group.part_slice(part)
        decoded = [v[piece] if i == part else v[piece].half().float() for i, v in enumerate(vectors)]
        expected[piece] = reference_clipped(decoded, WEIGHTS, clip_factor=2.0)
    bound = expected.abs() * 2.0**-11 + 1e-6  # one fp16 rounding of the average (relative 2^-11)
    assert torch.all((results[0].averaged - expected).abs() <= bound)


# --- the reducer alone: the result depends on the contributors' bytes, never on arrival order ----------


def reduce_in_order(
    rule: AggregationRule, vectors: list[torch.Tensor], arrival: list[tuple[int, int]], chunk: int
) -> ReducedPart:
    """Feed the chunks (member, chunk index) in `arrival` order, folding whenever the reducer allows."""
    codec = get_codec("none")
    num_elements = vectors[0].numel()
    reducer = PartReducer(
        part_index=0,
        producer_index=0,
        num_elements=num_elements,
        num_members=len(vectors),
        codec=codec,
        chunk_num_elements=chunk,
        rule=rule,
    )
    num_chunks = math.ceil(num_elements / chunk)
    for member, chunk_index in arrival:
        if chunk_index == 0:
            reducer.begin(member, WEIGHTS[member])
        values = vectors[member][chunk_index * chunk : (chunk_index + 1) * chunk]
        reducer.add_chunk(member, chunk_index * chunk, values.numel(), codec.encode(values).numpy().tobytes())
        if chunk_index == num_chunks - 1:
            reducer.complete(member)
        jobs = reducer.plan_folds()
        assert not jobs or not rule.waits_for_all or reducer.all_arrived()
        reducer.run_folds(jobs)
        reducer.folds_done(jobs)
    reducer.finalize()
    jobs = reducer.plan_folds()
    reducer.run_folds(jobs)
    reducer.folds_done(jobs)
    assert reducer.is_done()
    return reducer.encode_average(error_feedback=None, part_offset=0)


@pytest.mark.parametrize("kind", ["clipped", "trimmed"])
def test_reducer_result_does_not_depend_on_arrival_order(kind: str) -> None:
    vectors = make_vectors("huge")
    rule = AggregationRule(kind=kind, clip_factor=1.5, trim_per_side=2)  # type: ignore[arg-type]
    chunk = 300
    num_chunks = math.ceil(NUM_ELEMENTS / chunk)
    in_order = [(member, index) for member in range(NUM_PEERS) for index in range(num_chunks)]
    first = reduce_in_order(rule, vectors, in_order, chunk)
    for seed in range(3):
        streams = {member: list(range(num_chunks)) for member in range(NUM_PEERS)}
        arrival = []
        shuffler = random.Random(seed)
        while streams:  # interleave the members' streams at random, each stream in order
            member = shuffler.choice(sorted(streams))
            arrival.append((member, streams[member].pop(0)))
            if not streams[member]:
                del streams[member]
        assert reduce_in_order(rule, vectors, arrival, chunk).payloads == first.payloads


def test_trimmed_keeps_one_value_when_too_few_contribute() -> None:
    """Three contributions with trim_per_side=2: one per side is dropped, the median is kept."""
    vectors = [torch.tensor([1.0, -5.0]), torch.tensor([2.0, 7.0]), torch.tensor([30.0, 0.0])]
    rule = AggregationRule(kind="trimmed", trim_per_side=2)
    reduced = reduce_in_order(rule, vectors, [(m, 0) for m in range(3)], chunk=2)
    decoded = get_codec("none").decode_into(b"".join(reduced.payloads), torch.empty(2))
    assert decoded.tolist() == [2.0, 0.0]


def test_robust_rules_refuse_chunks_off_the_grid() -> None:
    codec = get_codec("none")
    reducer = PartReducer(
        part_index=0,
        producer_index=0,
        num_elements=10,
        num_members=2,
        codec=codec,
        chunk_num_elements=4,
        rule=AggregationRule(kind="clipped"),
    )
    reducer.begin(1, 1.0)
    with pytest.raises(Exception, match="needs chunks of 4 numbers"):
        reducer.add_chunk(1, 0, 3, codec.encode(torch.zeros(3)).numpy().tobytes())


def test_bad_rules_are_value_errors() -> None:
    with pytest.raises(ValueError, match="aggregation"):
        AllReduceConfig(aggregation="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_factor"):
        AllReduceConfig(aggregation="clipped", clip_factor=0.0)
    with pytest.raises(ValueError, match="trim_per_side"):
        AllReduceConfig(aggregation="trimmed", trim_per_side=-1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aggregation", ["clipped", "trimmed"])
def test_a_dead_member_is_left_out_and_its_part_taken_over(aggregation: str) -> None:
    """Member 4 is down: member 0 reduces part 4 from resent contributions, with the same rule."""
    vectors = make_vectors("scaled")
    live = range(NUM_PEERS - 1)

    async def scenario() -> tuple[GroupSpec, list[AllReduceResult]]:
        async with local_peers(NUM_PEERS, config_for(aggregation)) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            await peers[-1].stop(timedelta(milliseconds=100))
            results = await asyncio.gather(
                *(
                    peers[i].allreduce(
                        vectors[i], group=group, my_peer_id=f"p{i}", weight=WEIGHTS[i],
                        codec=get_codec("none"), error_feedback=None, deadline=timedelta(seconds=20),
                    )
                    for i in live
                )
            )  # fmt: skip
            return group, list(results)

    group, results = uvloop.run(scenario())
    for result in results:
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, results[0].averaged)
    assert results[0].contributors == [[f"p{i}" for i in live]] * NUM_PEERS
    assert results[0].producers[-1] == "p0"
    expected = torch.empty(NUM_ELEMENTS)
    for part in range(NUM_PEERS):
        piece = group.part_slice(part)
        contributions = [vectors[i][piece] for i in live]
        weights = [WEIGHTS[i] for i in live]
        if aggregation == "clipped":
            expected[piece] = reference_clipped(contributions, weights, clip_factor=2.0)
        else:
            expected[piece] = reference_trimmed(contributions, weights, trim=1)
    if aggregation == "clipped":
        assert torch.equal(results[0].averaged, expected)
    else:
        torch.testing.assert_close(results[0].averaged, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("aggregation", ["mean", "clipped"])
def test_a_non_finite_contribution_is_rejected_everywhere(aggregation: str) -> None:
    """Member BAD's vector holds NaN and inf: every owner (BAD itself too) leaves it out."""
    vectors = make_vectors("scaled")
    vectors[BAD] = vectors[BAD].clone()
    vectors[BAD][::97] = math.nan
    vectors[BAD][5] = math.inf
    group, results = run_round(aggregation, vectors)
    honest = [i for i in range(NUM_PEERS) if i != BAD]
    for result in results:
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, results[0].averaged)
        assert result.contributors == [[f"p{i}" for i in honest]] * NUM_PEERS
    assert bool(torch.isfinite(results[0].averaged).all())
    if aggregation == "mean":
        assert torch.equal(results[0].averaged, exact_mean(vectors, WEIGHTS, group, results[0].contributors))
    else:
        expected = torch.empty(NUM_ELEMENTS)
        for part in range(NUM_PEERS):
            piece = group.part_slice(part)
            expected[piece] = reference_clipped(
                [vectors[i][piece] for i in honest], [WEIGHTS[i] for i in honest], clip_factor=2.0
            )
        assert torch.equal(results[0].averaged, expected)
