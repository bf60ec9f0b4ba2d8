"""Stage C of the tiered all-reduce on the wire: a slice held by one peer, pulled by others (PullSlice).

Real peers on loopback. A pulled slice must decode to exactly the numbers its holder's bytes decode
to (each payload decoded here with the codec, as the reference), and every way a pull can fail must
end in PeerFailed within its deadline, the holder serving on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import grpc
import grpc.aio
import pytest
import torch

from protocol.allreduce.client import PeerFailed
from protocol.allreduce.slices import HeldSlice, SliceKey, SliceStore
from protocol.codecs import Codec, fp32_view, get_codec
from protocol.errors import ProtocolError
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from tests.protocol.allreduce.support import FAST_CONFIG, local_peers

CHUNK = FAST_CONFIG.chunk_num_elements  # 4096
NUM_ELEMENTS = 2 * CHUNK + 1808  # three chunks, the last one short
DIGEST = bytes(range(32))
KEY = SliceKey(round_id=3, plan_digest=DIGEST, slice_index=1)
LINGER = timedelta(seconds=30)


def _chunk_sizes(num_elements: int) -> list[int]:
    return [min(CHUNK, num_elements - start) for start in range(0, num_elements, CHUNK)]


def _held(codec: Codec, values: torch.Tensor, weight_sum: float = 3.0) -> HeldSlice:
    """The slice as a column would hold it: each chunk encoded once (fp32: views of the numbers)."""
    sizes, payloads, offset = [], [], 0
    for size in _chunk_sizes(values.numel()):
        part = values[offset : offset + size]
        payloads.append(fp32_view(part) if codec.name == "none" else codec.encode(part).numpy().tobytes())
        sizes.append(size)
        offset += size
    return HeldSlice(codec=codec, chunk_sizes=tuple(sizes), payloads=tuple(payloads), weight_sum=weight_sum)


def _reference(held: HeldSlice) -> torch.Tensor:
    """What the holder's bytes decode to: every payload decoded on its own, then put end to end."""
    return torch.cat(
        [
            held.codec.decode(payload, size)
            for size, payload in zip(held.chunk_sizes, held.payloads, strict=True)
        ]
    )


def _wire_bytes(held: HeldSlice, slice_index: int) -> int:
    """The header and chunk messages a pull of `held` receives, serialized here."""
    header = pb.AverageHeader(
        part_index=slice_index,
        codec=held.codec.spec(),
        num_elements=held.num_elements,
        weight_sum=held.weight_sum,
    )
    total, offset = pb.AverageMessage(header=header).ByteSize(), 0
    for size, payload in zip(held.chunk_sizes, held.payloads, strict=True):
        chunk = pb.TensorChunk(offset=offset, num_elements=size, payload=bytes(payload))
        total += pb.AverageMessage(chunk=chunk).ByteSize()
        offset += size
    return total


def _values(seed: int = 0) -> torch.Tensor:
    return torch.randn(NUM_ELEMENTS, generator=torch.Generator().manual_seed(seed))  # (E,)


def _in(seconds: float) -> float:
    return time.monotonic() + seconds


@pytest.mark.timeout(30)
@pytest.mark.parametrize("codec_name", ["int8", "none"])
def test_a_pulled_slice_decodes_to_exactly_what_its_holder_decodes(codec_name: str) -> None:
    codec = get_codec(codec_name)
    held = _held(codec, _values())

    async def scenario() -> None:
        async with local_peers(2) as (holder, puller):
            holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=LINGER)
            out = torch.full((NUM_ELEMENTS,), float("nan"))
            pulled = await puller.pull_slice(
                holder.address, KEY, my_peer_id="p1", deadline=_in(10), out=out, codec=codec
            )
            assert torch.equal(out, _reference(held))
            assert pulled.num_elements == NUM_ELEMENTS and pulled.weight_sum == 3.0
            assert pulled.bytes_recv == _wire_bytes(held, KEY.slice_index) == holder.slices.bytes_sent
            request = pb.PullSliceRequest(round_id=3, plan_digest=DIGEST, slice_index=1, sender_peer_id="p1")
            assert pulled.bytes_sent == request.ByteSize() == holder.slices.bytes_recv

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_pull_that_comes_before_the_slice_waits_for_it_past_the_stall_timeout() -> None:
    """The holder heartbeats while its column still averages: a wait longer than the stall timeout
    (2 s) is not taken for a stalled holder."""
    held = _held(get_codec("int8"), _values(1))

    async def scenario() -> None:
        async with local_peers(2) as (holder, puller):
            out = torch.empty(NUM_ELEMENTS)
            pull = asyncio.ensure_future(
                puller.pull_slice(holder.address, KEY, my_peer_id="p1", deadline=_in(15), out=out)
            )
            await asyncio.sleep(FAST_CONFIG.stall_timeout.total_seconds() * 1.5)
            assert not pull.done()
            holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=LINGER)
            pulled = await pull
            assert torch.equal(out, _reference(held))
            heartbeat_bytes = pulled.bytes_recv - _wire_bytes(held, KEY.slice_index)
            heartbeat = pb.AverageMessage(still_working=pb.StillWorking()).ByteSize()
            assert heartbeat_bytes >= 2 * heartbeat and heartbeat_bytes % heartbeat == 0

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_member_not_among_the_pullers_is_refused_and_the_others_are_served() -> None:
    held = _held(get_codec("int8"), _values(2))

    async def scenario() -> None:
        async with local_peers(3) as (holder, allowed, other):
            holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=LINGER)
            with pytest.raises(PeerFailed, match="PERMISSION_DENIED"):
                await other.pull_slice(
                    holder.address, KEY, my_peer_id="p2", deadline=_in(10), out=torch.empty(NUM_ELEMENTS)
                )
            with pytest.raises(PeerFailed, match="PERMISSION_DENIED"):  # our channel, another's name
                await allowed.pull_slice(
                    holder.address, KEY, my_peer_id="p2", deadline=_in(10), out=torch.empty(NUM_ELEMENTS)
                )
            out = torch.empty(NUM_ELEMENTS)
            await allowed.pull_slice(holder.address, KEY, my_peer_id="p1", deadline=_in(10), out=out)
            assert torch.equal(out, _reference(held))

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_slice_never_held_fails_within_the_deadline_or_the_holders_wait() -> None:
    async def scenario() -> None:
        # Our deadline first: 1.5 s (the holder would wait 0.9 of the call's 2.5 s).
        async with local_peers(2) as (holder, puller):
            started = time.monotonic()
            with pytest.raises(PeerFailed, match="deadline"):
                await puller.pull_slice(
                    holder.address, KEY, my_peer_id="p1", deadline=_in(1.5), out=torch.empty(NUM_ELEMENTS)
                )
            assert 1.4 < time.monotonic() - started < 3.0
        # The holder's wait first (max_slice_wait 0.5 s): NOT_FOUND.
        async with local_peers(2, replace(FAST_CONFIG, max_slice_wait=timedelta(seconds=0.5))) as (
            holder,
            puller,
        ):
            started = time.monotonic()
            with pytest.raises(PeerFailed, match="NOT_FOUND"):
                await puller.pull_slice(
                    holder.address, KEY, my_peer_id="p1", deadline=_in(10), out=torch.empty(NUM_ELEMENTS)
                )
            assert time.monotonic() - started < 3.0

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_slice_whose_time_is_over_is_not_found_at_once() -> None:
    """Its linger passed, its round was dropped, or its holder gave it up: no pull waits for it."""
    held = _held(get_codec("int8"), _values(3))
    abandoned = replace(KEY, slice_index=2)
    old = replace(KEY, round_id=1)

    async def scenario() -> None:
        async with local_peers(2) as (holder, puller):
            holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=timedelta(seconds=0.3))
            holder.hold_slice(old, held, pullers=frozenset({"p1"}), linger=LINGER)
            holder.slices.drop_before(KEY.round_id)
            waiting = asyncio.ensure_future(
                puller.pull_slice(
                    holder.address, abandoned, my_peer_id="p1", deadline=_in(10), out=torch.empty(1)
                )
            )
            await asyncio.sleep(0.6)  # KEY's linger is over meanwhile
            holder.slices.abandon(abandoned)
            started = time.monotonic()
            with pytest.raises(PeerFailed, match="NOT_FOUND"):
                await waiting
            for key in (KEY, old):
                with pytest.raises(PeerFailed, match="NOT_FOUND"):
                    await puller.pull_slice(
                        holder.address, key, my_peer_id="p1", deadline=_in(10), out=torch.empty(NUM_ELEMENTS)
                    )
            assert time.monotonic() - started < 1.5  # (a wait would last 9 s)
            assert len(holder.slices) == 0

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_dead_holder_fails_the_pull_quickly() -> None:
    async def scenario() -> None:
        async with local_peers(3) as (holder, puller, gone):
            address = gone.address
            await gone.stop(timedelta(0))
            started = time.monotonic()
            with pytest.raises(PeerFailed):
                await puller.pull_slice(address, KEY, my_peer_id="p1", deadline=_in(10), out=torch.empty(1))
            assert time.monotonic() - started < 2.0
            # A holder that dies while a pull waits on it.
            waiting = asyncio.ensure_future(
                puller.pull_slice(holder.address, KEY, my_peer_id="p1", deadline=_in(10), out=torch.empty(1))
            )
            await asyncio.sleep(0.5)
            started = time.monotonic()
            await holder.stop(timedelta(0))
            with pytest.raises(PeerFailed):
                await waiting
            assert time.monotonic() - started < 2.0

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_slice_of_another_size_or_codec_is_refused_by_the_puller() -> None:
    held = _held(get_codec("int8"), _values(4))

    async def scenario() -> None:
        async with local_peers(2) as (holder, puller):
            holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=LINGER)
            with pytest.raises(PeerFailed, match="numbers"):
                await puller.pull_slice(
                    holder.address, KEY, my_peer_id="p1", deadline=_in(10), out=torch.empty(NUM_ELEMENTS - 1)
                )
            with pytest.raises(PeerFailed, match="encoded with"):
                await puller.pull_slice(
                    holder.address,
                    KEY,
                    my_peer_id="p1",
                    deadline=_in(10),
                    out=torch.empty(NUM_ELEMENTS),
                    codec=get_codec("fp16"),
                )

    asyncio.run(scenario())


async def _raw_pull(address: str, request: bytes) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_stream("/dtnode.v1.AllReduce/PullSlice", request_serializer=lambda raw: raw)(
            request, timeout=5
        )
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            return error.code()
        return await call.code()


def _request(**changes: object) -> bytes:
    fields: dict[str, object] = {
        "round_id": 3,
        "plan_digest": DIGEST,
        "slice_index": 1,
        "sender_peer_id": "p1",
    }
    return pb.PullSliceRequest(**{**fields, **changes}).SerializeToString()  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_a_malformed_request_is_invalid_argument_and_the_holder_serves_on() -> None:
    held = _held(get_codec("int8"), _values(5))

    async def scenario() -> None:
        async with local_peers(2) as (holder, puller):
            holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=LINGER)
            for request in (b"\xff\xff\xff", _request(plan_digest=bytes(5)), _request(sender_peer_id="")):
                assert await _raw_pull(holder.address, request) == grpc.StatusCode.INVALID_ARGUMENT
            assert await _raw_pull(holder.address, _request()) == grpc.StatusCode.OK
            out = torch.empty(NUM_ELEMENTS)
            await puller.pull_slice(holder.address, KEY, my_peer_id="p1", deadline=_in(10), out=out)
            assert torch.equal(out, _reference(held))

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_chunk_too_large_for_a_message_is_refused_when_held() -> None:
    codec = get_codec("none")
    values = torch.zeros(FAST_CONFIG.max_message_bytes // 4)  # one chunk of a whole message's bytes
    held = HeldSlice(
        codec=codec, chunk_sizes=(values.numel(),), payloads=(fp32_view(values),), weight_sum=1.0
    )

    async def scenario() -> None:
        async with local_peers(1) as (holder,):
            with pytest.raises(ValueError, match="does not fit a message"):
                holder.hold_slice(KEY, held, pullers=frozenset({"p1"}), linger=LINGER)

    asyncio.run(scenario())


# --- the store alone, on a clock of our own ---------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _keys(num_keys: int) -> Iterator[SliceKey]:
    return (SliceKey(round_id=r, plan_digest=DIGEST, slice_index=0) for r in range(num_keys))


async def _refusal(
    store: SliceStore, key: SliceKey, peer_id: str = "p1", timeout: float = 5.0
) -> grpc.StatusCode:
    started = time.monotonic()
    with pytest.raises(ProtocolError) as raised:
        await store.wait(key, peer_id, timeout)
    assert time.monotonic() - started < 1.0, "answered at once, not after waiting"
    return raised.value.code


@pytest.mark.timeout(10)
def test_the_store_holds_at_most_max_held_slices_and_drops_the_oldest() -> None:
    held = _held(get_codec("int8"), _values(6))

    async def scenario() -> None:
        store = SliceStore(max_held=2, max_waiting=4, clock=_Clock())
        first, second, third = _keys(3)
        for key in (first, second, third):
            store.hold(key, held, pullers=frozenset({"p1"}), until=1e9)
        assert len(store) == 2 and first not in store and second in store and third in store
        assert await _refusal(store, first) == grpc.StatusCode.NOT_FOUND
        assert await store.wait(third, "p1", 1.0) is held

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_the_store_drops_a_slice_once_its_time_is_over() -> None:
    held = _held(get_codec("int8"), _values(7))

    async def scenario() -> None:
        clock = _Clock()
        store = SliceStore(max_held=4, max_waiting=4, clock=clock)
        early, late = _keys(2)
        store.hold(early, held, pullers=frozenset({"p1"}), until=clock.now + 10)
        store.hold(late, held, pullers=frozenset({"p1"}), until=clock.now + 20)
        clock.now += 10
        assert await _refusal(store, early) == grpc.StatusCode.NOT_FOUND
        assert await store.wait(late, "p1", 1.0) is held
        assert await _refusal(store, late, "p2") == grpc.StatusCode.PERMISSION_DENIED
        store.drop_before(2)
        assert len(store) == 0 and await _refusal(store, late) == grpc.StatusCode.NOT_FOUND
        with pytest.raises(ValueError, match="over here"):
            store.hold(late, held, pullers=frozenset({"p1"}), until=clock.now + 20)

    asyncio.run(scenario())


@pytest.mark.timeout(10)
def test_the_store_bounds_its_waiting_pulls() -> None:
    held = _held(get_codec("int8"), _values(8))

    async def scenario() -> None:
        store = SliceStore(max_held=4, max_waiting=1, clock=_Clock())
        key, other = _keys(2)
        waiting = asyncio.ensure_future(store.wait(key, "p1", 5.0))
        await asyncio.sleep(0.05)
        assert await _refusal(store, other) == grpc.StatusCode.RESOURCE_EXHAUSTED
        store.hold(key, held, pullers=frozenset({"p1"}), until=1e9)
        assert await waiting is held
        with pytest.raises(ValueError, match="already held"):
            store.hold(key, held, pullers=frozenset({"p1"}), until=1e9)
        waiting = asyncio.ensure_future(store.wait(other, "p1", 5.0))
        await asyncio.sleep(0.05)
        store.close()  # (its peer stops: no pull waits on)
        with pytest.raises(ProtocolError, match="stopping"):
            await asyncio.wait_for(waiting, 1.0)

    asyncio.run(scenario())


def test_a_held_slice_must_be_its_codecs_bytes() -> None:
    codec = get_codec("int8")
    good = _held(codec, _values(9))
    with pytest.raises(ValueError, match="bytes, got"):
        replace(good, payloads=(good.payloads[0][:-1], *good.payloads[1:]))
    with pytest.raises(ValueError, match="chunk sizes"):
        replace(good, chunk_sizes=good.chunk_sizes[:-1])
    with pytest.raises(ValueError, match="weight_sum"):
        replace(good, weight_sum=float("nan"))
