"""Bad input: every malformed, mismatched or hostile request gets a clear status and one log line,
its contribution is left out, and the round it arrived in still completes with consistent results.

Each case opens round 1 on members p0 and p1 (p2 joins later, so p0's part stays open), waits until
p1's contribution to p0's part is in, sends one bad request to p0 from a raw gRPC client posing as p2,
then lets p2 join and checks the round's outcome. A refusal before anything of the impostor was
summed leaves p2 out of part 0 ("excluded"); a refusal after one of its chunks was summed cannot be
undone exactly, so p0 hands the part to its backup p1, which reduces it again from resent
contributions, the real p2's included ("moved").
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import timedelta

import grpc
import grpc.aio
import pytest
import torch
import uvloop

from protocol.allreduce import AllReduceConfig, AllReducePeer, AllReduceResult, GroupSpec
from protocol.allreduce.reducer import SenderStatus
from protocol.codecs import get_codec
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from tests.protocol.allreduce.support import allreduce_all, exact_mean, local_peers, members_of

NUM_ELEMENTS = 30_000
CODEC = get_codec("int8")
CONFIG = AllReduceConfig(
    chunk_num_elements=4096,
    max_message_bytes=1 << 20,
    stall_timeout=timedelta(seconds=3),
    heartbeat_interval=timedelta(milliseconds=500),
    max_early_wait=timedelta(seconds=10),
)
SERVICE = "/dtnode.v1.AllReduce/"
INVALID, DENIED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED


@dataclass(frozen=True)
class Target:
    """What a bad client knows: the group, the victim's address, and whom it impersonates."""

    group: GroupSpec
    address: str

    def ref(
        self,
        *,
        sender: int = 2,
        peer_id: str | None = None,
        round_id: int | None = None,
        digest: bytes | None = None,
    ) -> pb.RoundRef:
        return pb.RoundRef(
            round_id=self.group.round_id if round_id is None else round_id,
            group_digest=self.group.digest if digest is None else digest,
            sender_index=sender,
            sender_peer_id=peer_id if peer_id is not None else self.group.members[sender].peer_id,
        )

    def header(self, **changes: object) -> pb.ContributionMessage:
        fields: dict[str, object] = {
            "round": self.ref(),
            "part_index": 0,
            "codec": CODEC.spec(),
            "num_elements": self.group.part_num_elements(0),
            "weight": 1.0,
        }
        fields.update(changes)
        return pb.ContributionMessage(header=pb.ContributionHeader(**fields))  # type: ignore[arg-type]


def _serialize(message: object) -> bytes:
    """Raw bytes go out as they are (to send garbage); messages are serialized."""
    return message if isinstance(message, bytes) else message.SerializeToString()  # type: ignore[attr-defined]


def chunk(offset: int, num_elements: int, payload: bytes | None = None) -> pb.ContributionMessage:
    if payload is None:
        payload = CODEC.encode(torch.randn(num_elements)).numpy().tobytes()
    return pb.ContributionMessage(
        chunk=pb.TensorChunk(offset=offset, num_elements=num_elements, payload=payload)
    )


async def push(
    target: Target, messages: list[object], *, handshake: bool = True, timeout: float = 8.0
) -> grpc.StatusCode:
    """Send messages as a PushContribution (raw bytes allowed); wait for the go-ahead after the first."""
    async with grpc.aio.insecure_channel(target.address) as channel:
        serialize = _serialize
        call = channel.stream_stream(SERVICE + "PushContribution", request_serializer=serialize)(
            timeout=timeout
        )
        try:
            await call.write(messages[0])
            if handshake:
                reply = await call.read()
                assert reply is not grpc.aio.EOF, "the receiver ended the call without a status"
            for message in messages[1:]:
                await call.write(message)
            await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return await call.code()


async def pull(target: Target, request: object) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target.address) as channel:
        serialize = _serialize
        call = channel.unary_stream(SERVICE + "PullAverage", request_serializer=serialize)(
            request, timeout=8.0
        )
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return await call.code()


async def finish(target: Target, request: object) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(target.address) as channel:
        call = channel.unary_unary(SERVICE + "FinishRound", request_serializer=_serialize)
        try:
            await call(request, timeout=8.0)
        except grpc.aio.AioRpcError as error:
            return error.code()
        return grpc.StatusCode.OK


def nan_chunk(offset: int = 0) -> pb.ContributionMessage:
    payload = bytearray(CODEC.encode(torch.randn(4096)).numpy().tobytes())
    payload[:4] = struct.pack("<f", math.nan)
    return chunk(offset, 4096, bytes(payload))


KEPT, EXCLUDED, MOVED = "kept", "excluded", "moved"
OVERSIZED = b"\0" * (2 << 20)

# (case name, expected status, what becomes of part 0 and p2's place in it, the bad request)
CASES: list[tuple[str, grpc.StatusCode, str, Callable[[Target], Awaitable[grpc.StatusCode]]]] = [
    ("garbage bytes", INVALID, KEPT, lambda t: push(t, [b"\x0a\xff\xff\xff\xff"])),
    ("chunk before header", INVALID, KEPT, lambda t: push(t, [chunk(0, 10)])),
    ("wrong codec", INVALID, KEPT, lambda t: push(t, [t.header(codec=pb.CodecSpec(kind=pb.CODEC_KIND_FP16))])),
    ("unknown codec", INVALID, KEPT, lambda t: push(t, [t.header(codec=pb.CodecSpec(kind=pb.CODEC_KIND_UNSPECIFIED))])),
    ("wrong length", INVALID, KEPT, lambda t: push(t, [t.header(num_elements=17)])),
    ("non-finite weight", INVALID, KEPT, lambda t: push(t, [t.header(weight=math.inf)])),
    ("no such part", INVALID, KEPT, lambda t: push(t, [t.header(part_index=9)])),
    ("unknown round", grpc.StatusCode.NOT_FOUND, KEPT, lambda t: push(t, [t.header(round=t.ref(round_id=99))], timeout=2.0)),
    ("expired round", grpc.StatusCode.FAILED_PRECONDITION, KEPT, lambda t: push(t, [t.header(round=t.ref(round_id=0))])),
    ("other group", grpc.StatusCode.FAILED_PRECONDITION, KEPT, lambda t: push(t, [t.header(round=t.ref(digest=b"x" * 32))])),
    ("sender outside group", DENIED, KEPT, lambda t: push(t, [t.header(round=t.ref(peer_id="mallory"))])),
    ("sender index out of range", DENIED, KEPT, lambda t: push(t, [t.header(round=t.ref(sender=7, peer_id="p7"))])),
    ("payload of wrong size", INVALID, EXCLUDED, lambda t: push(t, [t.header(), chunk(0, 4096, b"\0" * 100)])),
    ("non-finite numbers", INVALID, EXCLUDED, lambda t: push(t, [t.header(), nan_chunk()])),
    ("chunk at wrong offset", INVALID, EXCLUDED, lambda t: push(t, [t.header(), chunk(8, 4096)])),
    ("truncated contribution", INVALID, EXCLUDED, lambda t: push(t, [t.header()])),
    ("oversized message", grpc.StatusCode.RESOURCE_EXHAUSTED, EXCLUDED, lambda t: push(t, [t.header(), chunk(0, 4096, OVERSIZED)])),
    ("truncated after a summed chunk", INVALID, MOVED, lambda t: push(t, [t.header(), chunk(0, 4096)])),
    ("non-finite after a summed chunk", INVALID, MOVED, lambda t: push(t, [t.header(), chunk(0, 4096), nan_chunk(4096)])),
    ("pull from outside group", DENIED, KEPT, lambda t: pull(t, pb.PullAverageRequest(round=t.ref(peer_id="mallory")))),
    ("garbage pull", INVALID, KEPT, lambda t: pull(t, b"\x0a\xff\xff\xff\xff")),
    ("finished from outside group", DENIED, KEPT, lambda t: finish(t, pb.RoundFinished(round=t.ref(peer_id="mallory")))),
    ("finished in other group", grpc.StatusCode.FAILED_PRECONDITION, KEPT, lambda t: finish(t, pb.RoundFinished(round=t.ref(digest=b"x" * 32)))),
    ("garbage finished", INVALID, KEPT, lambda t: finish(t, b"\x0a\xff\xff\xff\xff")),
]  # fmt: skip


async def round_with_bad_request(
    request: Callable[[Target], Awaitable[grpc.StatusCode]],
) -> tuple[grpc.StatusCode, GroupSpec, list[torch.Tensor], list[AllReduceResult]]:
    vectors = [torch.randn(NUM_ELEMENTS, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    async with local_peers(3, CONFIG) as peers:
        await _warm_up(peers)
        group = GroupSpec.build(round_id=1, members=members_of(peers), num_elements=NUM_ELEMENTS)
        early = [
            asyncio.ensure_future(
                peers[i].allreduce(
                    vectors[i],
                    group=group,
                    my_peer_id=f"p{i}",
                    weight=1.0,
                    codec=CODEC,
                    error_feedback=None,
                    deadline=timedelta(seconds=25),
                )
            )
            for i in (0, 1)
        ]
        while not p1_delivered(peers[0]):
            await asyncio.sleep(0.01)
        code = await request(Target(group=group, address=peers[0].address))
        late = peers[2].allreduce(
            vectors[2],
            group=group,
            my_peer_id="p2",
            weight=1.0,
            codec=CODEC,
            error_feedback=None,
            deadline=timedelta(seconds=25),
        )
        results = await asyncio.gather(*early, late)
    return code, group, vectors, list(results)


def p1_delivered(owner: AllReducePeer) -> bool:
    """Whether p1's whole contribution to part 0 reached its owner p0 (so an impostor's chunk can be summed)."""
    state = owner.registry.get(1)
    reducer = state.parts[0].reducer if state is not None else None
    return reducer is not None and reducer.status(1) is SenderStatus.COMPLETE


async def _warm_up(peers: list[AllReducePeer]) -> None:
    """Round 0, so that round 0 counts as expired while round 1 runs."""
    group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=10)
    await allreduce_all(peers, [torch.zeros(10)] * 3, group, CODEC)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("name", "expected", "outcome", "request_"), CASES, ids=[c[0] for c in CASES])
def test_bad_request_is_refused_and_the_round_completes(
    name: str,
    expected: grpc.StatusCode,
    outcome: str,
    request_: Callable[[Target], Awaitable[grpc.StatusCode]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="protocol.allreduce.servicer")
    code, group, vectors, results = uvloop.run(round_with_bad_request(request_))
    assert code is expected, name
    pattern = rf"rejected \w+ from \S+: {expected.name}:"
    rejections = [r for r in caplog.records if re.match(pattern, r.getMessage())]
    assert len(rejections) == 1, [r.getMessage() for r in caplog.records]

    for result in results:  # the honest members finish, agree, and average what was delivered
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, results[0].averaged)
        assert result.contributors == results[0].contributors
    contributors, producers = results[0].contributors, results[0].producers
    everyone = ["p0", "p1", "p2"]
    if outcome == MOVED and producers[0] == "p1":
        # The summed chunk poisoned p0's sum: the backup p1 reduced part 0 anew; the honest p2,
        # started only after the bad request, is in it if its resend beat p1's deadline (timing).
        assert contributors[0] in (everyone, ["p0", "p1"]), contributors[0]
    elif outcome == MOVED:
        # The owner had not summed the impostor's first chunk yet (it sums in member order, after
        # its own and p1's): the bad chunk only excluded the sender, as a bad first chunk does.
        assert producers[0] == "p0" and contributors[0] == ["p0", "p1"], (producers, contributors)
    else:
        assert contributors[0] == (["p0", "p1"] if outcome == EXCLUDED else everyone)
        assert producers[0] == "p0"
    assert contributors[1] == contributors[2] == everyone
    exact = exact_mean(vectors, [1.0] * 3, group, contributors)
    assert (results[0].averaged - exact).abs().max() < 0.05  # int8 of N(0, 1) numbers
