"""The calling side of the wire contract: push a contribution, push a replica, pull an average, pull
a slice of a tiered round's mean.

Each function streams one part to or from one peer and turns every way that can go wrong into an
outcome the caller can act on: a peer that is gone or stalled (walk on along the part's backup
chain), a part that moved to a backup (walk on), or a refusal that the next peer would repeat
(stay). Writes are bounded by the phase deadline; frozen peers are caught by gRPC keepalive, and
pulls by the owner's heartbeats (a pull with no message for `stall_timeout` is a stalled owner).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from datetime import timedelta
from typing import Protocol

import grpc
import grpc.aio
import torch

from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.contributions import ContributionSource
from protocol.allreduce.faults import FaultPlan, check_fault
from protocol.allreduce.group import GroupSpec
from protocol.allreduce.pace import SendPace
from protocol.allreduce.parts import chunk_message_num_bytes
from protocol.allreduce.reducer import ReducedPart
from protocol.allreduce.slices import PulledSlice, SliceKey
from protocol.auth.channels import SwarmAuth, open_channel
from protocol.codecs import Codec, CodecError, codec_from_spec, wire_bytes
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from protocol.gen.dtnode.v1 import allreduce_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Statuses after which asking the next member of the chain cannot help: the refusal is about us.
_REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,  # we lack the swarm key (or our clock is off): every member says so
}


class PushOutcome(enum.Enum):
    DELIVERED = "delivered"  # the target holds our contribution (or already decided without needing it)
    REFUSED = "refused"  # the target rejected it; another member would too; we are left out
    LATE = "late"  # the phase deadline passed mid-push; the target is alive, we are left out
    MOVED = "moved"  # the target handed the part to a backup: walk on
    FAILED = "failed"  # the target is gone or stalled: walk on


class PeerFailed(Exception):
    """A peer did not serve what we asked for; `moved` means it is alive but the part went to a backup."""

    def __init__(self, message: str, *, moved: bool = False) -> None:
        super().__init__(message)
        self.moved = moved


class CallingRound(Protocol):
    """The round a call belongs to, as the calls see it (`protocol.allreduce.round.RoundState` is one):
    whom to dial and with what limits, the headers we send, our contribution's chunks, and the byte
    counters the calls add to. The round imports these calls; they know it only through this."""

    group: GroupSpec
    config: AllReduceConfig
    client: PeerClient
    codec: Codec
    weight: float
    source: ContributionSource
    fault_plan: FaultPlan | None
    pace: SendPace | None
    bytes_sent: int
    bytes_recv: int

    @property
    def round_id(self) -> int: ...

    def round_ref(self) -> pb.RoundRef: ...

    def average_header(self, reduced: ReducedPart) -> pb.AverageHeader: ...

    def check_average_header(self, header: pb.AverageHeader, part_index: int) -> None: ...

    def count_contribution_bytes(self, *, sent: int = 0, received: int = 0) -> None: ...


def _remaining(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


async def _connected_stub(state: CallingRound, target: int, deadline: float) -> pb_grpc.AllReduceStub:
    """A stub for member `target`, once its connection is up or failed (see PeerClient.wait_connected)."""
    return await connected_stub(
        state.client, state.group.members[target].address, state.config.connect_timeout, deadline
    )


async def connected_stub(
    client: PeerClient, address: str, connect_timeout: timedelta, deadline: float
) -> pb_grpc.AllReduceStub:
    """A stub for `address`, once its connection is up or failed, waiting at most `connect_timeout`
    and never past `deadline` (see PeerClient.wait_connected)."""
    await client.wait_connected(address, min(connect_timeout.total_seconds(), _remaining(deadline)))
    return client.stub(address)


def _code_of(error: BaseException) -> grpc.StatusCode | None:
    return error.code() if isinstance(error, grpc.aio.AioRpcError) else None


async def _final_status(call: grpc.aio.Call, error: BaseException) -> tuple[grpc.StatusCode | None, str]:
    """The status of a call that raised: a write on a call the server already ended raises a non-RPC error."""
    code = _code_of(error)
    if code is not None:
        return code, error.details() or ""  # type: ignore[attr-defined]
    if call.done():
        return await call.code(), await call.details()
    return None, repr(error)


_SETTLED = (
    grpc.ChannelConnectivity.READY,
    grpc.ChannelConnectivity.TRANSIENT_FAILURE,
    grpc.ChannelConnectivity.SHUTDOWN,
)


class PeerClient:
    """One gRPC channel per peer address, with the explicit limits of AllReduceConfig.

    Channels live as long as the peer, so connections made in one round serve the next ones.
    """

    def __init__(self, options: list[tuple[str, int]], *, auth: SwarmAuth | None = None) -> None:
        self._options = options
        self._auth = auth  # a closed swarm: every call is signed (and TLS if auth.tls)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = open_channel(address, options=self._options, auth=self._auth)
        return self._channels[address]

    @property
    def addresses(self) -> frozenset[str]:
        """The peers (host:port) we have a channel to: every one we dialled since we started."""
        return frozenset(self._channels)

    def stub(self, address: str) -> pb_grpc.AllReduceStub:
        return pb_grpc.AllReduceStub(self.channel(address))

    def connect(self, addresses: list[str]) -> None:
        """Start connecting to every address that has no connection yet (returns at once)."""
        for address in addresses:
            self.channel(address).get_state(try_to_connect=True)

    async def wait_connected(self, address: str, timeout: float) -> None:
        """Return once the connection to `address` is up or its attempt failed, at most `timeout` s.

        A call started on a connection still being made waits for it anyway; waiting here first keeps
        a round's bulk data from starting while handshakes are in flight, and lets the call's own
        deadline and stall checks measure the transfer, not the handshake.
        """
        channel = self.channel(address)
        state = channel.get_state(try_to_connect=True)
        give_up = time.monotonic() + timeout
        while state not in _SETTLED and (time_left := give_up - time.monotonic()) > 0:
            try:
                async with asyncio.timeout(time_left):
                    await channel.wait_for_state_change(state)
            except TimeoutError:
                return  # still connecting: the call itself waits on, within its own deadline
            state = channel.get_state(try_to_connect=True)

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        await asyncio.gather(*(channel.close(grace=None) for channel in channels.values()))


class _Stalled(Exception):
    """The peer made no progress for the stall timeout."""


async def _write(call: grpc.aio.StreamStreamCall, message: object, deadline: float, stall: float) -> None:
    """One write; _Stalled if flow control blocks it for `stall` seconds, TimeoutError at the deadline."""
    if _remaining(deadline) <= 0:
        raise TimeoutError
    try:
        async with asyncio.timeout(min(stall, _remaining(deadline))):
            await call.write(message)
    except TimeoutError as error:
        if _remaining(deadline) <= 0:
            raise
        raise _Stalled(f"a write blocked for {stall:.1f}s") from error


async def _read_reply(call: grpc.aio.StreamStreamCall, deadline: float, stall: float) -> str:
    """The kind of the receiver's next reply, skipping heartbeats; its status is raised if it ended the call."""
    while True:
        if _remaining(deadline) <= 0:
            raise TimeoutError
        try:
            async with asyncio.timeout(min(stall, _remaining(deadline))):
                reply = await call.read()
        except TimeoutError as error:
            if _remaining(deadline) <= 0:
                raise
            raise _Stalled(f"no answer for {stall:.1f}s") from error
        if reply is grpc.aio.EOF:
            code, details = await call.code(), await call.details()
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
        kind = reply.WhichOneof("body")
        if kind != "still_working":
            return kind


def _classify_push_error(code: grpc.StatusCode | None, details: str) -> tuple[PushOutcome, str]:
    if code in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.OK):
        return PushOutcome.DELIVERED, details
    if code in _REFUSALS:
        return PushOutcome.REFUSED, f"{code.name}: {details}"  # type: ignore[union-attr]
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return PushOutcome.LATE, details
    if code is grpc.StatusCode.ABORTED:
        return PushOutcome.MOVED, details
    return PushOutcome.FAILED, f"{code.name if code else 'error'}: {details}"


async def push_contribution(
    round_state: CallingRound, target: int, part_index: int, deadline: float
) -> tuple[PushOutcome, str]:
    """Stream our contribution to `part_index` to member `target`; return what happened and why.

    The call is a handshake: header; wait for the receiver's go-ahead (it heartbeats while it must
    wait); the chunks; wait for its receipt. A receiver silent or blocking a write for the stall
    timeout counts as stalled (FAILED); reaching the deadline means our contribution is LATE.
    """
    state = round_state
    stall = state.config.stall_timeout.total_seconds()
    stub = await _connected_stub(state, target, deadline)
    header = pb.ContributionHeader(
        round=state.round_ref(),
        part_index=part_index,
        codec=state.codec.spec(),
        num_elements=state.group.part_num_elements(part_index),
        weight=state.weight,
    )
    call = stub.PushContribution(timeout=_remaining(deadline) + 1.0)
    try:
        message = pb.ContributionMessage(header=header)
        await _write(call, message, deadline, stall)
        state.count_contribution_bytes(sent=message.ByteSize())
        answer = await _read_reply(call, deadline, stall)
        if answer == "already_decided":
            await call.done_writing()
            return PushOutcome.DELIVERED, "already decided"
        if answer != "send_chunks":
            call.cancel()
            return PushOutcome.FAILED, f"receiver answered our header with {answer}"
        offset = 0
        for chunk_index, size in enumerate(state.source.chunk_sizes(part_index)):
            payload = await state.source.payload(part_index, chunk_index)
            message = pb.ContributionMessage(
                chunk=pb.TensorChunk(offset=offset, num_elements=size, payload=payload)
            )
            if state.pace is not None:
                await state.pace.admit(len(payload), deadline)
            await _write(call, message, deadline, stall)
            state.count_contribution_bytes(sent=chunk_message_num_bytes(offset, size, len(payload)))
            offset += size
            check_fault(state.fault_plan, "push_chunk", state.group.round_id, chunk_index)
        await call.done_writing()
        answer = await _read_reply(call, deadline, stall)
    except TimeoutError:
        call.cancel()
        return PushOutcome.LATE, "the deadline passed while pushing"
    except _Stalled as error:
        call.cancel()
        return PushOutcome.FAILED, f"stalled: {error}"
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
        return _classify_push_error(*(await _final_status(call, error)))
    if answer != "receipt":
        return PushOutcome.FAILED, f"receiver answered our chunks with {answer}"
    return PushOutcome.DELIVERED, ""


async def push_replica(
    round_state: CallingRound, target: int, reduced: ReducedPart, deadline: float, *, committed: bool = False
) -> None:
    """Hand member `target` a copy of our decided average; PeerFailed(moved=True) if it holds another version.

    With `committed`, send only the header telling `target`, which already holds the copy, that a
    majority holds it (the receiver answers ALREADY_EXISTS).
    """
    state = round_state
    stall = state.config.stall_timeout.total_seconds()
    stub = await _connected_stub(state, target, deadline)
    header = pb.ReplicaHeader(
        round=state.round_ref(), average=state.average_header(reduced), committed=committed
    )
    call = stub.PushReplica(timeout=_remaining(deadline) + 1.0)
    try:
        message = pb.ReplicaMessage(header=header)
        await _write(call, message, deadline, stall)
        state.bytes_sent += message.ByteSize()
        if committed:
            await call.done_writing()
        if (answer := await _read_reply(call, deadline, stall)) != "send_chunks":
            raise PeerFailed(f"replica receiver answered our header with {answer}")
        offset = 0
        for chunk_index, (size, payload) in enumerate(
            zip(reduced.chunk_sizes, reduced.payloads, strict=True)
        ):
            message = pb.ReplicaMessage(
                chunk=pb.TensorChunk(offset=offset, num_elements=size, payload=wire_bytes(payload))
            )
            if state.pace is not None:
                await state.pace.admit(len(payload), deadline)
            await _write(call, message, deadline, stall)
            state.bytes_sent += chunk_message_num_bytes(offset, size, len(payload))
            offset += size
            check_fault(state.fault_plan, "replica_chunk", state.group.round_id, chunk_index)
        await call.done_writing()
        if (answer := await _read_reply(call, deadline, stall)) != "receipt":
            raise PeerFailed(f"replica receiver answered our chunks with {answer}")
    except (TimeoutError, _Stalled) as error:
        call.cancel()
        raise PeerFailed(f"replica hand-off stalled or ran out of time: {error!r}") from error
    except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as error:
        code, details = await _final_status(call, error)
        if code in (grpc.StatusCode.OK, grpc.StatusCode.ALREADY_EXISTS):
            return
        raise PeerFailed(
            f"{code.name if code else 'error'}: {details}", moved=code is grpc.StatusCode.ABORTED
        ) from error
    except (PeerFailed, asyncio.CancelledError):
        call.cancel()
        raise


async def tell_finished(state: CallingRound, targets: list[int], timeout: timedelta) -> None:
    """Tell `targets` we returned from the round (RoundFinished), so they can forget it; best effort."""
    request = pb.RoundFinished(round=state.round_ref())

    async def tell(target: int) -> None:
        stub = state.client.stub(state.group.members[target].address)
        try:
            await stub.FinishRound(request, timeout=timeout.total_seconds())
        except grpc.aio.AioRpcError as error:
            logger.debug(
                "round %d: member %d did not take our RoundFinished: %s", state.round_id, target, error.code()
            )

    await asyncio.gather(*(tell(target) for target in targets))


async def pull_average(
    round_state: CallingRound,
    target: int,
    part_index: int,
    deadline: float,
    decode_chunk: Callable[[pb.AverageHeader, int, int, bytes], Awaitable[None]],
) -> pb.AverageHeader:
    """Pull the average of `part_index` from member `target`, calling
    decode_chunk(header, offset, size, payload) for each chunk.

    Raises PeerFailed if the target is gone, stalls, sends malformed data, or says the part moved.
    """
    state = round_state
    stub = await _connected_stub(state, target, deadline)
    request = pb.PullAverageRequest(round=state.round_ref(), part_index=part_index)
    call = stub.PullAverage(request, timeout=_remaining(deadline) + 1.0)
    state.bytes_sent += request.ByteSize()

    def count_received(num_bytes: int) -> None:
        state.bytes_recv += num_bytes

    def chunk_read(chunk_index: int) -> None:
        check_fault(state.fault_plan, "pull_chunk", state.group.round_id, chunk_index)

    return await _read_average(
        call,
        deadline,
        state.config.stall_timeout.total_seconds(),
        check_header=lambda header: state.check_average_header(header, part_index),
        decode_chunk=decode_chunk,
        count_received=count_received,
        chunk_read=chunk_read,
    )


async def _read_average(
    call: grpc.aio.UnaryStreamCall,
    deadline: float,
    stall_seconds: float,
    *,
    check_header: Callable[[pb.AverageHeader], None],
    decode_chunk: Callable[[pb.AverageHeader, int, int, bytes], Awaitable[None]],
    count_received: Callable[[int], None],
    chunk_read: Callable[[int], None] = lambda chunk_index: None,
) -> pb.AverageHeader:
    """Read a pull's answer: heartbeats, one header (`check_header` raises ValueError to refuse it),
    then its chunks in order, each handed to `decode_chunk(header, offset, size, payload)`; each
    message's wire bytes go to `count_received`. Returns the header once the stream held all its numbers.

    Raises PeerFailed if the peer is gone, sends nothing for `stall_seconds`, sends malformed data,
    ends the stream early, or refuses (`moved` for ABORTED); cancels the call unless it ended.
    """
    header: pb.AverageHeader | None = None
    received = 0
    chunk_index = 0
    try:
        while True:
            if _remaining(deadline) <= 0:
                raise PeerFailed("the deadline passed")
            try:
                async with asyncio.timeout(min(stall_seconds, _remaining(deadline))):
                    message = await call.read()
            except TimeoutError as error:
                if _remaining(deadline) <= 0:
                    raise PeerFailed("the deadline passed") from error
                raise PeerFailed(f"no message for {stall_seconds:.1f}s: stalled") from error
            if message is grpc.aio.EOF:
                break
            kind = message.WhichOneof("body")
            if kind != "chunk":
                count_received(message.ByteSize())
            if kind == "header":
                if header is not None:
                    raise PeerFailed("malformed average stream: a second header")
                header = message.header
                check_header(header)
            elif kind == "chunk":
                chunk = message.chunk
                payload = chunk.payload  # each read of a bytes field copies it
                count_received(chunk_message_num_bytes(chunk.offset, chunk.num_elements, len(payload)))
                if header is None or chunk.offset != received or chunk.num_elements <= 0:
                    raise PeerFailed("malformed average stream: chunk out of order or before the header")
                if received + chunk.num_elements > header.num_elements:
                    raise PeerFailed("malformed average stream: more numbers than the part holds")
                await decode_chunk(header, chunk.offset, chunk.num_elements, payload)
                received += chunk.num_elements
                chunk_read(chunk_index)
                chunk_index += 1
    except grpc.aio.AioRpcError as error:
        moved = error.code() is grpc.StatusCode.ABORTED
        raise PeerFailed(f"{error.code().name}: {error.details()}", moved=moved) from error
    except (CodecError, ValueError) as error:
        raise PeerFailed(f"bad average data: {error}") from error
    finally:
        if not call.done():
            call.cancel()
    if header is None or received != header.num_elements:
        raise PeerFailed(f"average stream ended early: {received} numbers")
    return header


async def pull_slice(
    client: PeerClient,
    config: AllReduceConfig,
    address: str,
    key: SliceKey,
    *,
    my_peer_id: str,
    codec: Codec | None,
    deadline: float,
    out: torch.Tensor,
    executor: Executor | None = None,
) -> PulledSlice:
    """Pull slice `key` of a tiered round's mean from the member at `address` (PullSlice) and decode
    it into `out`, the slice's (E,) fp32 numbers, chunk by chunk (on `executor`, if given). The
    slice must be encoded with `codec` (None: with whichever codec the holder names).

    `deadline` is a time.monotonic() one. Raises PeerFailed if the member is gone, sends nothing for
    the stall timeout (it heartbeats while the slice is not held yet), refuses (not held there, not
    for us), or sends a slice of another size or codec or malformed data; `out` then holds whatever
    arrived before (pull again, from another holder, into the same tensor).
    """
    if out.dtype != torch.float32 or out.dim() != 1 or not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError(f"out must be a contiguous 1-D fp32 CPU tensor, got {out.dtype} {tuple(out.shape)}")
    stub = await connected_stub(client, address, config.connect_timeout, deadline)
    request = pb.PullSliceRequest(
        round_id=key.round_id,
        plan_digest=key.plan_digest,
        slice_index=key.slice_index,
        sender_peer_id=my_peer_id,
    )
    call = stub.PullSlice(request, timeout=_remaining(deadline) + 1.0)
    bytes_recv = 0
    decoder: Codec | None = None  # the header's codec, once it came
    chunks: list[tuple[int, int, bytes]] = []

    def check_header(header: pb.AverageHeader) -> None:
        if header.part_index != key.slice_index:
            raise ValueError(f"got slice {header.part_index}, asked for {key.slice_index}")
        nonlocal decoder
        if codec is not None and header.codec != codec.spec():
            raise ValueError(f"slice encoded with {header.codec}, not {codec.spec()}")
        decoder = codec_from_spec(header.codec)  # (raises CodecError, a ValueError, if malformed)
        if header.num_elements != out.numel():
            raise ValueError(f"slice has {header.num_elements} numbers, expected {out.numel()}")
        if not (math.isfinite(header.weight_sum) and header.weight_sum >= 0):
            raise ValueError(f"bad weight sum {header.weight_sum}")

    def count_received(num_bytes: int) -> None:
        nonlocal bytes_recv
        bytes_recv += num_bytes

    async def decode_chunk(header: pb.AverageHeader, offset: int, size: int, payload: bytes) -> None:
        assert decoder is not None  # (_read_average checks the header before any chunk)
        chunks.append((offset, size, payload))
        into = out[offset : offset + size]
        if executor is None:
            decoder.decode_into(payload, into)
        else:
            await asyncio.get_running_loop().run_in_executor(executor, decoder.decode_into, payload, into)

    header = await _read_average(
        call,
        deadline,
        config.stall_timeout.total_seconds(),
        check_header=check_header,
        decode_chunk=decode_chunk,
        count_received=count_received,
    )
    return PulledSlice(
        num_elements=header.num_elements,
        weight_sum=header.weight_sum,
        bytes_sent=request.ByteSize(),
        bytes_recv=bytes_recv,
        codec=decoder,
        chunks=tuple(chunks),
    )
