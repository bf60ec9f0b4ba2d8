"""All-reduce between real gRPC peers on loopback (one process, one event loop, one server per peer)."""

from __future__ import annotations

import dataclasses
import threading
from datetime import timedelta

import pytest
import torch
import uvloop

from protocol.allreduce import AllReducePeer, AllReduceResult, GroupSpec, Member, SyncAllReducePeer
from protocol.codecs import get_codec
from protocol.error_feedback import ErrorFeedback
from tests.protocol.allreduce.support import FAST_CONFIG, allreduce_all, exact_mean, local_peers, members_of


def random_vectors(num_peers: int, num_elements: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_elements, generator=generator) * (i + 1) for i in range(num_peers)]


def uneven_group(peers: list[AllReducePeer], num_elements: int) -> GroupSpec:
    """Round 0 of `peers`, member i's part sized by bandwidth i + 1 (so no two parts are equal)."""
    bandwidths = [1.0 + i for i in range(len(peers))]
    return GroupSpec.build(
        round_id=0, members=members_of(peers), num_elements=num_elements, bandwidths=bandwidths
    )


def assert_all_identical(results: list[AllReduceResult]) -> None:
    for result in results:
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, results[0].averaged)
        assert result.contributors == results[0].contributors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_peers", [2, 3, 4])
def test_none_codec_equals_torch_mean_bit_for_bit(num_peers: int) -> None:
    vectors = random_vectors(num_peers, 50_021)

    async def scenario() -> list[AllReduceResult]:
        async with local_peers(num_peers) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=50_021)
            return await allreduce_all(peers, vectors, group, get_codec("none"))

    results = uvloop.run(scenario())
    assert_all_identical(results)
    assert torch.equal(results[0].averaged, torch.stack(vectors).mean(dim=0))
    everyone = [f"p{i}" for i in range(num_peers)]
    assert results[0].contributors == [everyone] * num_peers
    assert all(r.bytes_sent > 0 and r.bytes_recv > 0 for r in results)


@pytest.mark.timeout(60)
def test_weighted_mean_with_uneven_parts_matches_reference() -> None:
    vectors = random_vectors(4, 40_000, seed=1)
    weights = [1.0, 2.5, 0.125, 7.0]

    async def scenario() -> tuple[GroupSpec, list[AllReduceResult]]:
        async with local_peers(4) as peers:
            group = GroupSpec.build(
                round_id=5, members=members_of(peers), num_elements=40_000, bandwidths=[1.0, 3.0, 0.5, 2.0]
            )
            return group, await allreduce_all(peers, vectors, group, get_codec("none"), weights=weights)

    group, results = uvloop.run(scenario())
    assert_all_identical(results)
    assert abs(group.part_num_elements(1) - 6 * group.part_num_elements(2)) <= 6  # 6x the bandwidth
    assert torch.equal(results[0].averaged, exact_mean(vectors, weights, group, results[0].contributors))
    torch.testing.assert_close(
        results[0].averaged, sum(w * v for w, v in zip(weights, vectors, strict=True)) / sum(weights)
    )


def codec_error_bound(
    vectors: list[torch.Tensor], group: GroupSpec, codec_name: str, exact: torch.Tensor
) -> torch.Tensor:
    """Per element: the contributions' quantization (owners send theirs unquantized) plus the average's.

    Each codec block starts at a chunk boundary of its part, so the bound is evaluated chunk by chunk.
    """
    codec = get_codec(codec_name)
    chunk = FAST_CONFIG.chunk_num_elements
    bound = torch.zeros_like(exact)
    num_peers = len(vectors)
    for part in range(group.num_members):
        start, stop = group.part_bounds[part], group.part_bounds[part + 1]
        for offset in range(start, stop, chunk):
            piece = slice(offset, min(offset + chunk, stop))
            sent = sum(codec.error_bound(v[piece]) for i, v in enumerate(vectors) if i != part) / num_peers
            bound[piece] = sent + codec.error_bound(exact[piece].abs() + sent)  # type: ignore[operator]
    return bound * (1 + 1e-5) + 1e-6 * exact.abs().max()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec_name", ["fp16", "bf16", "int8", "int4"])
def test_lossy_codecs_stay_within_their_bound_and_agree(codec_name: str) -> None:
    vectors = random_vectors(3, 30_011, seed=2)

    async def scenario() -> tuple[GroupSpec, list[AllReduceResult]]:
        async with local_peers(3) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=30_011)
            return group, await allreduce_all(peers, vectors, group, get_codec(codec_name))

    group, results = uvloop.run(scenario())
    assert_all_identical(results)
    exact = torch.stack(vectors).mean(dim=0)
    error = (results[0].averaged - exact).abs()
    assert torch.all(error <= codec_error_bound(vectors, group, codec_name, exact))
    assert error.max() > 0  # the codec really quantized


@pytest.mark.timeout(90)
def test_error_feedback_makes_the_average_error_shrink_over_rounds() -> None:
    """Same vectors every round: with feedback the running mean of results converges to the exact mean."""
    num_rounds, num_elements = 20, 8192
    vectors = random_vectors(3, num_elements, seed=3)
    exact = torch.stack(vectors).mean(dim=0)

    async def scenario(use_feedback: bool) -> list[float]:
        feedbacks = [ErrorFeedback(num_elements) if use_feedback else None for _ in range(3)]
        running = torch.zeros(num_elements)
        errors = []
        async with local_peers(3) as peers:
            for round_id in range(num_rounds):
                group = GroupSpec.build(
                    round_id=round_id, members=members_of(peers), num_elements=num_elements
                )
                results = await allreduce_all(peers, vectors, group, get_codec("int4"), feedbacks=feedbacks)
                assert_all_identical(results)
                running += results[0].averaged
                errors.append(float((running / (round_id + 1) - exact).abs().mean()))
        return errors

    with_feedback = uvloop.run(scenario(use_feedback=True))
    without_feedback = uvloop.run(scenario(use_feedback=False))
    assert with_feedback[-1] < with_feedback[0] / 5
    assert without_feedback[-1] > without_feedback[0] * 0.9  # the error does not shrink by itself


@pytest.mark.timeout(60)
def test_single_member_and_empty_part() -> None:
    vector = torch.randn(1000)

    async def scenario() -> tuple[AllReduceResult, list[AllReduceResult]]:
        async with local_peers(3) as peers:
            alone = GroupSpec.build(round_id=0, members=members_of(peers)[:1], num_elements=1000)
            single = (await allreduce_all(peers[:1], [vector], alone, get_codec("int8")))[0]
            group = GroupSpec.build(
                round_id=1, members=members_of(peers), num_elements=1000, bandwidths=[1.0, 0.0, 1.0]
            )
            return single, await allreduce_all(peers, [vector] * 3, group, get_codec("none"))

    single, results = uvloop.run(scenario())
    assert not single.fell_back and single.contributors == [["p0"]]
    assert torch.allclose(single.averaged, vector, atol=float(vector.abs().max()) / 100)
    assert_all_identical(results)
    assert results[0].contributors == [["p0", "p1", "p2"], [], ["p0", "p1", "p2"]]
    assert torch.equal(results[0].averaged, torch.stack([vector] * 3).mean(dim=0))


@pytest.mark.timeout(60)
def test_sync_facade_from_two_threads() -> None:
    vectors = random_vectors(2, 10_000, seed=4)
    with (
        SyncAllReducePeer(host="127.0.0.1", config=FAST_CONFIG) as first,
        SyncAllReducePeer(host="127.0.0.1", config=FAST_CONFIG) as second,
    ):
        members = [Member(peer_id="a", address=first.address), Member(peer_id="b", address=second.address)]
        group = GroupSpec.build(round_id=0, members=members, num_elements=10_000)
        results: dict[str, AllReduceResult] = {}

        def run(peer: SyncAllReducePeer, peer_id: str, vector: torch.Tensor) -> None:
            results[peer_id] = peer.allreduce(
                vector,
                group=group,
                my_peer_id=peer_id,
                weight=1.0,
                codec=get_codec("none"),
                error_feedback=None,
                deadline=timedelta(seconds=20),
            )

        threads = [
            threading.Thread(target=run, args=(first, "a", vectors[0])),
            threading.Thread(target=run, args=(second, "b", vectors[1])),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert first.port > 0 and second.port > 0
    assert torch.equal(results["a"].averaged, torch.stack(vectors).mean(dim=0))
    assert torch.equal(results["b"].averaged, results["a"].averaged)


@pytest.mark.timeout(30)
def test_bad_arguments_are_value_errors() -> None:
    async def scenario() -> None:
        async with local_peers(1) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=10)
            good: dict[str, object] = {
                "group": group,
                "my_peer_id": "p0",
                "weight": 1.0,
                "codec": get_codec("none"),
            }
            deadline = timedelta(seconds=5)
            cases: list[tuple[torch.Tensor, dict[str, object], str]] = [
                (torch.zeros(10, dtype=torch.float64), {}, "fp32"),
                (torch.zeros(11), {}, "group spec"),
                (torch.zeros(10), {"weight": 0.0}, "weight"),
                (torch.zeros(10), {"my_peer_id": "stranger"}, "not a member"),
            ]
            for vector, overrides, message in cases:
                kwargs = {**good, **overrides}
                with pytest.raises(ValueError, match=message):
                    await peers[0].allreduce(vector, error_feedback=None, deadline=deadline, **kwargs)  # type: ignore[arg-type]

    uvloop.run(scenario())


def decoded(codec_name: str, result: AllReduceResult) -> torch.Tensor:
    """The result rebuilt from its kept payloads alone."""
    assert result.payloads is not None
    codec = get_codec(codec_name)
    out = torch.full_like(result.averaged, float("nan"))
    for chunk in result.payloads:
        codec.decode_into(chunk.payload, out[chunk.offset : chunk.offset + chunk.num_elements])
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("codec_name", "num_peers"),
    [("int8", 2), ("int8", 3), ("int4", 4), ("none", 3), ("fp16", 2)],  # (topk keeps none: test_sparse.py)
)
def test_kept_payloads_rebuild_the_result_bit_for_bit_on_every_member(
    codec_name: str, num_peers: int
) -> None:
    vectors = random_vectors(num_peers, 30_011, seed=4)
    config = dataclasses.replace(FAST_CONFIG, keep_payloads=True)

    async def scenario() -> list[AllReduceResult]:
        async with local_peers(num_peers, config) as peers:
            group = uneven_group(peers, 30_011)
            return await allreduce_all(peers, vectors, group, get_codec(codec_name))

    results = uvloop.run(scenario())
    assert_all_identical(results)
    for result in results:
        assert result.payloads == results[0].payloads  # the same bytes everywhere
        assert torch.equal(decoded(codec_name, result).view(torch.int32), result.averaged.view(torch.int32))
    codec = get_codec(codec_name)
    assert sum(len(c.payload) for c in results[0].payloads or ()) == sum(
        codec.encoded_num_bytes(c.num_elements) for c in results[0].payloads or ()
    )

    async def without() -> list[AllReduceResult]:  # off by default: nothing kept
        async with local_peers(2) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=1000)
            return await allreduce_all(peers, [v[:1000] for v in vectors[:2]], group, get_codec(codec_name))

    assert all(result.payloads is None for result in uvloop.run(without()))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("codec_name", "num_peers"), [("none", 2), ("none", 4), ("int8", 3), ("fp16", 2)])
def test_in_place_writes_the_same_average_into_each_vector(codec_name: str, num_peers: int) -> None:
    """In place, each member's vector becomes its result, bit for bit what a copying round returns; with
    two members the replica is decoded straight into the vector, with more it is kept until committed."""
    vectors = random_vectors(num_peers, 40_009, seed=7)
    config = dataclasses.replace(FAST_CONFIG, keep_payloads=True)

    async def scenario(inputs: list[torch.Tensor], in_place: bool) -> list[AllReduceResult]:
        async with local_peers(num_peers, config) as peers:
            group = uneven_group(peers, 40_009)
            return await allreduce_all(peers, inputs, group, get_codec(codec_name), in_place=in_place)

    copied = uvloop.run(scenario(vectors, in_place=False))
    inputs = [vector.clone() for vector in vectors]
    written = uvloop.run(scenario(inputs, in_place=True))
    assert_all_identical(written)
    for result, vector in zip(written, inputs, strict=True):
        assert result.averaged.data_ptr() == vector.data_ptr()  # no second vector
        assert torch.equal(result.averaged.view(torch.int32), copied[0].averaged.view(torch.int32))
        assert result.payloads == copied[0].payloads
        assert torch.equal(decoded(codec_name, result).view(torch.int32), result.averaged.view(torch.int32))
    if codec_name == "none":
        assert torch.equal(written[0].averaged, torch.stack(vectors).mean(dim=0))
    with pytest.raises(ValueError, match="contiguous"):

        async def strided() -> None:
            async with local_peers(1) as peers:
                group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=100)
                await allreduce_all(
                    peers, [torch.zeros(200)[::2]], group, get_codec(codec_name), in_place=True
                )

        uvloop.run(strided())
