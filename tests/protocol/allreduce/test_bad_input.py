"""Bad input: every malformed, mismatched or hostile request gets a clear status and one log line,
its contribution is left out, and the round it arrived in still completes with consistent results.

Each case opens round 1 on members p0 and p1 (p2 joins later, so p0's part stays open), sends one bad
request to p0 from a raw gRPC client, then lets p2 join and checks the round's outcome.
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


@dataclass(frozen=True)
class Target:
    """What a bad client knows: the group, the victim's address, and whom it impersonates."""

    group: GroupSpec
    address: str

    def ref(self, *, sender: int = 2, peer_id: str | None = None, round_id: int | None = None) -> pb.RoundRef:
        return pb.RoundRef(
            round_id=self.group.round_id if round_id is None else round_id,
            group_digest=self.group.digest,
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


def nan_chunk(target: Target) -> pb.ContributionMessage:
    payload = bytearray(CODEC.encode(torch.randn(4096)).numpy().tobytes())
    payload[:4] = struct.pack("<f", math.nan)
    return chunk(0, 4096, bytes(payload))


# (case name, expected status, whether the impersonated member p2 ends up excluded from part 0, request)
CASES: list[tuple[str, grpc.StatusCode, bool, Callable[[Target], Awaitable[grpc.StatusCode]]]] = [
    ("garbage bytes", grpc.StatusCode.INVALID_ARGUMENT, False, lambda t: push(t, [b"\x0a\xff\xff\xff\xff"])),
    ("chunk before header", grpc.StatusCode.INVALID_ARGUMENT, False, lambda t: push(t, [chunk(0, 10)])),
    (
        "wrong codec",
        grpc.StatusCode.INVALID_ARGUMENT,
        False,
        lambda t: push(t, [t.header(codec=pb.CodecSpec(kind=pb.CODEC_KIND_FP16))]),
    ),
    (
        "unknown codec",
        grpc.StatusCode.INVALID_ARGUMENT,
        False,
        lambda t: push(t, [t.header(codec=pb.CodecSpec(kind=pb.CODEC_KIND_UNSPECIFIED))]),
    ),
    ("wrong length", grpc.StatusCode.INVALID_ARGUMENT, False, lambda t: push(t, [t.header(num_elements=17)])),
    (
        "non-finite weight",
        grpc.StatusCode.INVALID_ARGUMENT,
        False,
        lambda t: push(t, [t.header(weight=math.inf)]),
    ),
    ("no such part", grpc.StatusCode.INVALID_ARGUMENT, False, lambda t: push(t, [t.header(part_index=9)])),
    (
        "unknown round",
        grpc.StatusCode.NOT_FOUND,
        False,
        lambda t: push(t, [t.header(round=t.ref(round_id=99))], timeout=2.0),
    ),
    (
        "expired round",
        grpc.StatusCode.FAILED_PRECONDITION,
        False,
        lambda t: push(t, [t.header(round=t.ref(round_id=0))]),
    ),
    (
        "other group",
        grpc.StatusCode.FAILED_PRECONDITION,
        False,
        lambda t: push(
            t,
            [
                t.header(
                    round=pb.RoundRef(round_id=1, group_digest=b"x" * 32, sender_index=2, sender_peer_id="p2")
                )
            ],
        ),
    ),
    (
        "sender outside group",
        grpc.StatusCode.PERMISSION_DENIED,
        False,
        lambda t: push(t, [t.header(round=t.ref(peer_id="mallory"))]),
    ),
    (
        "sender index out of range",
        grpc.StatusCode.PERMISSION_DENIED,
        False,
        lambda t: push(t, [t.header(round=t.ref(sender=7, peer_id="p7"))]),
    ),
    (
        "payload of wrong size",
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
        lambda t: push(t, [t.header(), chunk(0, 4096, b"\0" * 100)]),
    ),
    (
        "non-finite numbers",
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
        lambda t: push(t, [t.header(), nan_chunk(t)]),
    ),
    (
        "chunk at wrong offset",
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
        lambda t: push(t, [t.header(), chunk(8, 4096)]),
    ),
    (
        "truncated contribution",
        grpc.StatusCode.INVALID_ARGUMENT,
        True,
        lambda t: push(t, [t.header(), chunk(0, 4096)]),
    ),
    (
        "oversized message",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        True,
        lambda t: push(t, [t.header(), chunk(0, 4096, b"\0" * (2 << 20))]),
    ),
    (
        "pull from outside group",
        grpc.StatusCode.PERMISSION_DENIED,
        False,
        lambda t: pull(t, pb.PullAverageRequest(round=t.ref(peer_id="mallory"), part_index=0)),
    ),
    ("garbage pull", grpc.StatusCode.INVALID_ARGUMENT, False, lambda t: pull(t, b"\x0a\xff\xff\xff\xff")),
]


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
        while peers[0].registry.get(1) is None:
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


async def _warm_up(peers: list[AllReducePeer]) -> None:
    """Round 0, so that round 0 counts as expired while round 1 runs."""
    group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=10)
    await allreduce_all(peers, [torch.zeros(10)] * 3, group, CODEC)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("name", "expected", "excludes_sender", "request_"), CASES, ids=[c[0] for c in CASES]
)
def test_bad_request_is_refused_and_the_round_completes(
    name: str,
    expected: grpc.StatusCode,
    excludes_sender: bool,
    request_: Callable[[Target], Awaitable[grpc.StatusCode]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="protocol.allreduce.servicer")
    code, group, vectors, results = uvloop.run(round_with_bad_request(request_))
    assert code is expected, name
    rejections = [
        r for r in caplog.records if re.match(rf"rejected \w+ from \S+: {expected.name}:", r.getMessage())
    ]
    assert len(rejections) == 1, [r.getMessage() for r in caplog.records]

    for result in results:  # the honest members finish, agree, and average what was delivered
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, results[0].averaged)
        assert result.contributors == results[0].contributors
    contributors = results[0].contributors
    assert contributors[0] == (["p0", "p1"] if excludes_sender else ["p0", "p1", "p2"])
    assert contributors[1] == contributors[2] == ["p0", "p1", "p2"]
    exact = exact_mean(vectors, [1.0] * 3, group, contributors)
    assert (results[0].averaged - exact).abs().max() < 0.05  # int8 of N(0, 1) numbers
