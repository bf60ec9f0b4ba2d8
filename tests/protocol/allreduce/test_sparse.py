"""Rounds with a sparse codec (top-k, 2-bit or 4-bit values): every member ends with the token-weighted mean of the members'
decoded top-k payloads, bit for bit (nothing is re-encoded by an owner), also when a member dies
mid-round; a malformed sparse average is refused with INVALID_ARGUMENT and the round completes.

The reference is computed here with torch from the codec's encode/decode alone: each member's
payload for a part is its numbers (plus its error-feedback residual) encoded chunk by chunk from the
part's start, and the mean sums w_i * decode(payload_i) in member order in float32, then divides by
the float32 sum of the weights (protocol/allreduce/sparse.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from datetime import timedelta
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch
import uvloop

from protocol.allreduce import AllReduceConfig, GroupSpec
from protocol.allreduce.sparse import as_float32
from protocol.auth import SwarmKey
from protocol.auth.channels import SwarmAuth
from protocol.codecs import Codec, get_codec
from protocol.error_feedback import ErrorFeedback
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from protocol.swarm.config import SwarmConfig
from tests.protocol.allreduce.support import FAST_CONFIG, Workers, allreduce_all, local_peers, members_of

CODEC = get_codec("topk", block_size=512, density=0.05)  # several blocks per 4096-number chunk
CODEC4 = get_codec("topk4", block_size=512, density=0.05)  # the same, with 4-bit values
NUM_ELEMENTS = 30_001  # uneven parts, a short last chunk and a short last block
CHUNK = FAST_CONFIG.chunk_num_elements


def chunk_grid(group: GroupSpec) -> list[tuple[int, int]]:
    """[low, high) of every streamed chunk: each part cut from its start into chunks of CHUNK numbers."""
    return [
        (low, min(high, low + CHUNK))
        for part in range(group.num_members)
        for low, high in [(group.part_bounds[part], group.part_bounds[part + 1])]
        for low in range(low, high, CHUNK)
    ]


def decoded_payloads(
    codec: Codec, group: GroupSpec, vector: torch.Tensor, residual: torch.Tensor
) -> torch.Tensor:
    """What one member sends, decoded: top-k of vector + residual chunk by chunk; updates the residual."""
    decoded = torch.empty_like(vector)
    for low, high in chunk_grid(group):
        compensated = vector[low:high] + residual[low:high]
        decoded[low:high] = codec.decode(codec.encode(compensated), high - low)
        residual[low:high] = compensated - decoded[low:high]
    return decoded


def weighted_mean(decoded: list[torch.Tensor], weights: list[float], group: GroupSpec) -> torch.Tensor:
    """sum_i w_i x_i / sum_i w_i, chunk by chunk, in member order, in float32."""
    result = torch.empty_like(decoded[0])
    for low, high in chunk_grid(group):
        total = torch.zeros(high - low)
        weight_sum = torch.zeros(())
        for x, w in zip(decoded, weights, strict=True):
            total += x[low:high] * w
            weight_sum += w
        result[low:high] = total / weight_sum
    return result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("variant", ["new-tensor", "in-place", "swarm-key", "topk4"])
def test_every_member_holds_the_weighted_mean_of_the_decoded_payloads(variant: str) -> None:
    in_place = variant == "in-place"
    codec = CODEC4 if variant == "topk4" else CODEC
    auth = SwarmAuth(SwarmKey.generate()) if variant == "swarm-key" else None
    num_peers, num_rounds = 4, 2
    weights = [1.0, 2.0, 3.0, 5.0]
    feedbacks = [ErrorFeedback(NUM_ELEMENTS) for _ in range(num_peers)]
    residuals = [torch.zeros(NUM_ELEMENTS) for _ in range(num_peers)]  # the test's own feedback

    async def run() -> None:
        async with local_peers(
            num_peers, dataclasses.replace(FAST_CONFIG, keep_payloads=True), auth=auth
        ) as peers:
            for round_id in range(num_rounds):
                group = GroupSpec.build(
                    round_id=round_id,
                    members=members_of(peers),
                    num_elements=NUM_ELEMENTS,
                    bandwidths=[1.0, 2.0, 1.0, 3.0],
                )
                generators = [torch.Generator().manual_seed(10 * round_id + i) for i in range(num_peers)]
                vectors = [torch.randn(NUM_ELEMENTS, generator=g) for g in generators]
                decoded = [
                    decoded_payloads(codec, group, v, r) for v, r in zip(vectors, residuals, strict=True)
                ]
                expected = weighted_mean(decoded, weights, group)
                inputs = [v.clone() for v in vectors]
                results = await allreduce_all(
                    peers, inputs, group, codec, weights=weights, feedbacks=feedbacks, in_place=in_place
                )
                for result in results:
                    assert not result.fell_back, result.failures
                    assert result.contributors == [[f"p{i}" for i in range(num_peers)]] * num_peers
                    assert torch.equal(result.averaged, expected)
                    assert (
                        result.payloads is None
                    )  # bundles, not the codec's bytes: its mean is served as fp32
                    # Nothing dense crossed the wire: (N - 1)(1 + 1/N) payloads a member, plus framing.
                    payload_bytes = codec.encoded_num_bytes(NUM_ELEMENTS)
                    assert result.bytes_sent < 2 * num_peers * payload_bytes < 4 * NUM_ELEMENTS / 4
                for feedback, residual in zip(feedbacks, residuals, strict=True):
                    assert torch.equal(feedback.residual, residual)  # every part is a sender's residual

    uvloop.run(run())


@pytest.mark.timeout(60)
def test_clipped_rule_scales_each_payload_by_its_clip_factor() -> None:
    """With "clipped" the owner sends w_i * s_i per contributor; everyone sums with those weights."""
    config = AllReduceConfig(
        chunk_num_elements=CHUNK,
        max_message_bytes=1 << 20,
        stall_timeout=timedelta(seconds=2),
        heartbeat_interval=timedelta(milliseconds=400),
        aggregation="clipped",
        clip_factor=2.0,
    )
    weights = [1.0, 1.0, 2.0]
    vectors = [torch.randn(NUM_ELEMENTS, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    vectors[1] *= 100.0  # a hostile member

    async def run() -> tuple[GroupSpec, list[torch.Tensor], list[list[str]]]:
        async with local_peers(3, config) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            results = await allreduce_all(peers, vectors, group, CODEC, weights=weights)
            assert not any(r.fell_back for r in results)
            return group, [r.averaged for r in results], results[0].contributors

    group, averages, contributors = uvloop.run(run())
    assert contributors == [["p0", "p1", "p2"]] * 3
    decoded = [decoded_payloads(CODEC, group, v, torch.zeros(NUM_ELEMENTS)) for v in vectors]
    expected = torch.empty(NUM_ELEMENTS)
    for part in range(3):
        piece = group.part_slice(part)
        norms = [float(torch.linalg.vector_norm(x[piece].double())) for x in decoded]
        threshold = 2.0 * statistics.median(norms)
        applied = [as_float32(w * min(1.0, threshold / n)) for w, n in zip(weights, norms, strict=True)]
        for low, high in chunk_grid(group):
            if not group.part_bounds[part] <= low < group.part_bounds[part + 1]:
                continue
            total = torch.zeros(high - low)
            for x, v in zip(decoded, applied, strict=True):
                total += x[low:high] * v
            expected[low:high] = total / torch.tensor(sum(weights), dtype=torch.float32)
    for average in averages:
        assert torch.equal(average, expected)
    assert float(expected.abs().max()) < 10.0  # the x100 member was clipped


def test_trimmed_rule_is_refused_with_a_sparse_codec() -> None:
    config = AllReduceConfig(aggregation="trimmed")
    with pytest.raises(ValueError, match="trimmed"):  # a node fails at start, not in every round
        SwarmConfig(run_name="sparse", codec="topk", allreduce=config)
    SwarmConfig(run_name="sparse", codec="int8", allreduce=config)
    SwarmConfig(run_name="sparse", codec="topk", allreduce=AllReduceConfig(aggregation="clipped"))

    async def run() -> None:
        async with local_peers(2, config) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=100)
            with pytest.raises(ValueError, match="trimmed"):
                await peers[0].allreduce(
                    torch.zeros(100),
                    group=group,
                    my_peer_id="p0",
                    weight=1.0,
                    codec=CODEC,
                    error_feedback=None,
                    deadline=timedelta(seconds=5),
                )

    uvloop.run(run())


@pytest.mark.timeout(60)
def test_a_sum_that_would_overflow_is_never_committed_and_everyone_falls_back() -> None:
    """Finite contributions near float32's largest: no owner commits a sum it could not decode; every
    member returns on time with its own vector instead of raising."""
    vectors = [torch.full((NUM_ELEMENTS,), 1e38) for _ in range(3)]

    async def run() -> list[bool]:
        async with local_peers(3) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            results = await allreduce_all(peers, vectors, group, CODEC, deadline=timedelta(seconds=6))
            assert all("overflow" in " ".join(r.failures) for r in results)
            return [r.fell_back for r in results]

    assert uvloop.run(run()) == [True, True, True]


# --- a malformed sparse average, handed to a member as a replica by an impostor -------------------------


def _bundle(codec: Codec, num_elements: int, num_contributors: int) -> bytes:
    return b"".join(
        codec.encode(torch.randn(num_elements)).numpy().tobytes() for _ in range(num_contributors)
    )


def _with_nan_scale(codec: Codec, bundle: bytes) -> bytes:
    spoiled = bytearray(bundle)
    spoiled[-codec.encoded_num_bytes(CHUNK) : -codec.encoded_num_bytes(CHUNK) + 4] = (
        torch.tensor([float("nan")]).numpy().tobytes()
    )  # the last contributor's first scale
    return bytes(spoiled)


def _with_huge_scales(codec: Codec, bundle: bytes) -> bytes:
    """Every block's hi (and lo) near float32's largest: each payload is finite, their sum is not."""
    spoiled = bytearray(bundle)
    piece_bytes = codec.encoded_num_bytes(CHUNK)
    num_blocks = -(-CHUNK // codec.block_size)
    huge = torch.full((2 * num_blocks,), 3e38).numpy().tobytes()
    for start in range(0, len(spoiled), piece_bytes):
        spoiled[start : start + len(huge)] = huge
    return bytes(spoiled)


BAD_REPLICAS = {
    # (contributor weights, chunk payload) of a replica of part 2, produced by "p2", 3 contributors
    "weights-missing": ([], None),
    "weight-count": ([1.0, 1.0], None),
    "weight-nan": ([1.0, float("nan"), 1.0], None),
    "bundle-short": ([1.0, 1.0, 1.0], lambda codec: _bundle(codec, CHUNK, 2)),
    "bundle-nan": ([1.0, 1.0, 1.0], lambda codec: _with_nan_scale(codec, _bundle(codec, CHUNK, 3))),
    "bundle-overflow": ([1.0, 1.0, 1.0], lambda codec: _with_huge_scales(codec, _bundle(codec, CHUNK, 3))),
}


async def _push_bad_replica(address: str, group: GroupSpec, name: str, codec: Codec) -> grpc.StatusCode:
    weights, make_payload = BAD_REPLICAS[name]
    average = pb.AverageHeader(
        part_index=2,
        producer_index=2,
        contributor_indices=[0, 1, 2],
        codec=codec.spec(),
        num_elements=group.part_num_elements(2),
        weight_sum=3.0,
        contributor_weights=weights,
    )
    ref = pb.RoundRef(round_id=group.round_id, group_digest=group.digest, sender_index=2, sender_peer_id="p2")
    messages = [pb.ReplicaMessage(header=pb.ReplicaHeader(round=ref, average=average))]
    if make_payload is not None:
        chunk = pb.TensorChunk(offset=0, num_elements=CHUNK, payload=make_payload(codec))
        messages.append(pb.ReplicaMessage(chunk=chunk))
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream(
            "/dtnode.v1.AllReduce/PushReplica", request_serializer=pb.ReplicaMessage.SerializeToString
        )(timeout=10.0)
        try:
            await call.write(messages[0])
            await call.read()  # "send your chunks" (or the refusal)
            for message in messages[1:]:
                await call.write(message)
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return await call.code()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "codec"),
    [(name, CODEC) for name in BAD_REPLICAS]
    + [(name, CODEC4) for name in BAD_REPLICAS if name.startswith("bundle-")],
    ids=[*BAD_REPLICAS, *(f"{name}-topk4" for name in BAD_REPLICAS if name.startswith("bundle-"))],
)
def test_malformed_sparse_average_is_invalid_argument_and_the_round_completes(
    name: str, codec: Codec
) -> None:
    """p0 and p1 open the round; an impostor posing as p2 hands p0 a malformed sparse replica of part 2;
    then the real p2 joins and every member ends with the same reference mean."""
    config = AllReduceConfig(
        chunk_num_elements=CHUNK,
        max_message_bytes=1 << 20,
        stall_timeout=timedelta(seconds=3),
        heartbeat_interval=timedelta(milliseconds=500),
        max_early_wait=timedelta(seconds=10),
    )
    vectors = [torch.randn(NUM_ELEMENTS, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    async def run() -> tuple[grpc.StatusCode, GroupSpec, list[torch.Tensor]]:
        async with local_peers(3, config) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            deadline = timedelta(seconds=20)

            def start(i: int) -> asyncio.Future[object]:
                return asyncio.ensure_future(
                    peers[i].allreduce(
                        vectors[i], group=group, my_peer_id=f"p{i}", weight=1.0, codec=codec,
                        error_feedback=None, deadline=deadline,
                    )
                )  # fmt: skip

            first = [start(0), start(1)]
            while peers[0].registry.get(0) is None:  # p0 opened the round
                await asyncio.sleep(0.01)
            code = await _push_bad_replica(peers[0].address, group, name, codec)
            results = await asyncio.gather(*first, start(2))
            return code, group, [r.averaged for r in results if not r.fell_back]  # type: ignore[attr-defined]

    code, group, averages = uvloop.run(run())
    assert code is grpc.StatusCode.INVALID_ARGUMENT, name
    decoded = [decoded_payloads(codec, group, v, torch.zeros(NUM_ELEMENTS)) for v in vectors]
    expected = weighted_mean(decoded, [1.0, 1.0, 1.0], group)
    assert len(averages) == 3
    for average in averages:
        assert torch.equal(average, expected)


# --- a member killed mid-round (worker processes, deterministic fault points) ------------------------

NUM_WORKERS = 4
WORKER_ARGS = [
    "--elements", "200000",
    "--chunk-elements", "32768",  # two chunks per part
    "--codec", "topk",
    "--block-size", "1024",
    "--weighted",
    "--rounds", "2",
    "--deadline-seconds", "20",
    "--stall-seconds", "3",
    "--log-level", "INFO",
]  # fmt: skip


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("plan", "result"),
    [
        ("round_open:0", "new-tensor"),
        ("push_chunk:0:0", "new-tensor"),
        ("reduce_done:0", "new-tensor"),
        ("replica_chunk:0:0", "new-tensor"),
        ("serve_chunk:0:0", "new-tensor"),
        ("pull_chunk:0:0", "new-tensor"),
        ("push_chunk:0:0", "in-place"),
        ("serve_chunk:0:0", "in-place"),
        ("reduce_done:0:0:stall", "new-tensor"),  # frozen with its sockets open (SIGSTOP)
    ],
)
def test_survivors_agree_bit_for_bit_when_a_member_is_killed(tmp_path: Path, plan: str, result: str) -> None:
    """Member 1 (owner of part 1) is SIGKILLed (or frozen) at `plan`: the survivors finish both rounds,
    hold the same bits, and each holds the weighted mean of the decoded payloads of the contributors
    it reports (with `in-place`, written into its own vector)."""
    victim = 1
    in_place = ["--in-place"] if result == "in-place" else []
    workers = Workers(tmp_path, NUM_WORKERS, WORKER_ARGS + in_place, forked=True)
    workers.start({victim: ["--fault", plan]})
    try:
        survivors = [i for i in range(NUM_WORKERS) if i != victim]
        records = {i: workers.read_records(i, 2, timeout=90) for i in survivors}
    finally:
        workers.stop()
    for index, rounds in records.items():
        assert len(rounds) == 2, f"worker {index} stopped early:\n{workers.stderr(index)[-3000:]}"
    for round_id in range(2):
        by_survivor = [rounds[round_id] for rounds in records.values()]
        for record in by_survivor:
            assert record["fell_back"] is False, record["failures"]
            assert record["max_abs_error"] == 0.0, record
        assert len({r["sha256"] for r in by_survivor}) == 1, [r["failures"] for r in by_survivor]
        assert len({str(r["contributors"]) for r in by_survivor}) == 1
    # The next round runs without the dead member.
    assert all("peer-1" not in part for part in records[0][1]["contributors"])  # type: ignore[union-attr]
