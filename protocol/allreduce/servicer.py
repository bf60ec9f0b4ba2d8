"""The answering side of the wire contract: a thin grpc.aio servicer over RoundRegistry and RoundState.

It only translates: it reads messages, checks that they are well-formed and come from a member of the
round, hands them to the round's state, and turns every ProtocolError into a gRPC status plus exactly
one log line. A rejected contribution is excluded from its part; the round goes on without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

import grpc
import grpc.aio
from google.protobuf.message import Message as ProtoMessage

from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.faults import check_fault
from protocol.allreduce.parts import PartRole, chunk_message_num_bytes, remaining
from protocol.allreduce.reducer import ReducedPart
from protocol.allreduce.registry import RoundRegistry
from protocol.allreduce.round import RoundState
from protocol.allreduce.slices import PLAN_DIGEST_NUM_BYTES, SliceKey, SliceStore
from protocol.codecs import wire_bytes
from protocol.errors import ProtocolError, invalid
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from protocol.gen.dtnode.v1 import allreduce_pb2_grpc as pb_grpc
from protocol.lenient import Malformed, lenient

logger = logging.getLogger(__name__)

Message = TypeVar("Message")
Result = TypeVar("Result")

_ROUTINE_CODES = (grpc.StatusCode.ABORTED, grpc.StatusCode.ALREADY_EXISTS)


_Refusal = tuple[ProtocolError, int | None]
"""Why a pushed stream was refused, and how many bytes of its rest to drain before answering."""


def _detached(error: ProtocolError) -> ProtocolError:
    """The error without its traceback, which holds the frames of the code that raised it.

    A handler refuses a call from outside the code that raised, and gRPC keeps the abort's exception
    (with its traceback) alive for a while: the frames would keep their locals (a part's payloads, a
    reducer whose sum is a slice of the round's result) in memory long after the round is forgotten.
    """
    error.__traceback__ = None
    return error


def _member_of(state: RoundState, ref: pb.RoundRef) -> int:
    """The sender's member index in the round, if it speaks of our group and is who it says it is."""
    if ref.group_digest != state.group.digest:
        raise ProtocolError(grpc.StatusCode.FAILED_PRECONDITION, "your group spec differs from mine")
    sender = ref.sender_index
    if sender >= state.group.num_members or state.group.members[sender].peer_id != ref.sender_peer_id:
        raise ProtocolError(
            grpc.StatusCode.PERMISSION_DENIED,
            f"{ref.sender_peer_id!r} is not member {sender} of round {ref.round_id}",
        )
    return sender


def add_servicer_to_server(servicer: AllReduceServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated helper, but with lenient request deserializers."""
    service = pb.DESCRIPTOR.services_by_name["AllReduce"]
    handlers = {
        "PushContribution": grpc.stream_stream_rpc_method_handler(
            servicer.PushContribution,
            request_deserializer=lenient(pb.ContributionMessage),
            response_serializer=pb.ContributionReply.SerializeToString,
        ),
        "PushReplica": grpc.stream_stream_rpc_method_handler(
            servicer.PushReplica,
            request_deserializer=lenient(pb.ReplicaMessage),
            response_serializer=pb.ReplicaReply.SerializeToString,
        ),
        "PullAverage": grpc.unary_stream_rpc_method_handler(
            servicer.PullAverage,
            request_deserializer=lenient(pb.PullAverageRequest),
            response_serializer=pb.AverageMessage.SerializeToString,
        ),
        "FinishRound": grpc.unary_unary_rpc_method_handler(
            servicer.FinishRound,
            request_deserializer=lenient(pb.RoundFinished),
            response_serializer=pb.RoundFinishedReply.SerializeToString,
        ),
        "PullSlice": grpc.unary_stream_rpc_method_handler(
            servicer.PullSlice,
            request_deserializer=lenient(pb.PullSliceRequest),
            response_serializer=pb.AverageMessage.SerializeToString,
        ),
    }
    assert set(handlers) == {method.name for method in service.methods}, "servicer out of date with the proto"
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


class AllReduceServicer(pb_grpc.AllReduceServicer):
    """Serves PushContribution, PushReplica, PullAverage and FinishRound for every round in the registry,
    and PullSlice from the slices held in `slices` (a tiered round's stage C)."""

    def __init__(self, registry: RoundRegistry, config: AllReduceConfig, slices: SliceStore) -> None:
        self._registry = registry
        self._config = config
        self._slices = slices

    # --- shared helpers ------------------------------------------------------------------------------

    def _early_wait(self, context: grpc.aio.ServicerContext, limit_seconds: float | None = None) -> float:
        """How long a request may wait for its round to open (or its slice to be held, at most
        `limit_seconds`): answer NOT_FOUND before the caller gives up."""
        limit = self._config.max_early_wait.total_seconds() if limit_seconds is None else limit_seconds
        time_left = context.time_remaining()
        return limit if time_left is None else min(limit, 0.9 * time_left)

    async def _resolve(
        self, ref: pb.RoundRef, part_index: int, context: grpc.aio.ServicerContext
    ) -> tuple[RoundState, int]:
        """The round and the sender's member index, once the round is open here and the sender is in it."""
        state = await self._registry.wait_for_round(ref.round_id, self._early_wait(context))
        sender = _member_of(state, ref)
        if part_index >= state.group.num_members:
            raise invalid(f"part {part_index} does not exist (the group has {state.group.num_members})")
        self._registry.note_member_seen(ref.sender_peer_id, ref.round_id)
        return state, sender

    # --- after the round -------------------------------------------------------------------------------

    async def FinishRound(
        self, request: pb.RoundFinished, context: grpc.aio.ServicerContext
    ) -> pb.RoundFinishedReply:
        """A member returned from a round: the round is forgotten here once all have (RoundRegistry)."""
        try:
            if isinstance(request, Malformed):
                raise invalid(request.error)
            state = self._registry.get(request.round.round_id)
            if state is not None:  # (a round unknown here holds nothing to free)
                _member_of(state, request.round)
                self._registry.note_member_finished(request.round.sender_peer_id, request.round.round_id)
        except ProtocolError as error:
            await self._reject(context, "FinishRound", _detached(error))
        return pb.RoundFinishedReply()

    async def _read(self, context: grpc.aio.ServicerContext, message_type: type[Message]) -> Message | None:
        """The next request message, or None at the end of the stream; a silent sender is stalled."""
        stall = self._config.stall_timeout.total_seconds()
        try:
            async with asyncio.timeout(stall):
                message = await context.read()
        except TimeoutError as error:
            raise ProtocolError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no message for {stall:.1f}s") from error
        if message is grpc.aio.EOF:
            return None
        if isinstance(message, Malformed):
            raise invalid(message.error)
        assert isinstance(message, message_type)
        return message

    async def _heartbeating(
        self, context: grpc.aio.ServicerContext, awaitable: Awaitable[Result], heartbeat: ProtoMessage
    ) -> Result:
        """Await something that may take long (a round opening, a hand-off), writing `heartbeat` meanwhile."""
        task = asyncio.ensure_future(awaitable)
        interval = self._config.heartbeat_interval.total_seconds()
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval)
                if done:
                    return task.result()
                await self._write(context, heartbeat)
        finally:
            task.cancel()

    async def _refuse_stream(
        self,
        context: grpc.aio.ServicerContext,
        peer: str,
        rpc: str,
        error: ProtocolError,
        drain_bytes: int | None,
    ) -> None:
        """Refuse a client stream: drain it first (if chunks may still come), then answer with the status.

        `peer` is context.peer() from the start of the call (it reads empty once gRPC ended the call).
        """
        if drain_bytes is not None:
            try:
                await self._drain(context, drain_bytes)
            except asyncio.CancelledError:
                # gRPC itself ended the call: it refuses a message over max_message_bytes with
                # RESOURCE_EXHAUSTED, and we then see the stream end early.
                logger.warning(
                    "rejected %s from %s: RESOURCE_EXHAUSTED: gRPC ended the call (a message over %d bytes?); "
                    "we saw %s",
                    rpc,
                    peer,
                    self._config.max_message_bytes,
                    error,
                )
                raise
        await self._reject(context, rpc, error, peer)

    async def _reject(
        self, context: grpc.aio.ServicerContext, rpc: str, error: ProtocolError, peer: str | None = None
    ) -> None:
        # ABORTED / ALREADY_EXISTS are normal traffic (a commit tell is answered ALREADY_EXISTS in every
        # round; a pull of a part released here is retried elsewhere): DEBUG. The rest means a peer
        # misbehaved: WARNING.
        level = logging.DEBUG if error.code in _ROUTINE_CODES else logging.WARNING
        logger.log(level, "rejected %s from %s: %s", rpc, peer or context.peer(), error)
        await context.abort(error.code, error.message)

    async def _drain(self, context: grpc.aio.ServicerContext, max_bytes: int) -> None:
        """Read and drop the rest of a refused stream before ending the call.

        A grpc.aio client whose write fails because the server already ended the call reports
        INTERNAL instead of our status (grpc/grpc#36066), so we let the sender finish first; a sender
        that stalls or sends more than max_bytes gets the status anyway.
        """
        drained = 0
        try:
            while drained <= max_bytes and (message := await self._read(context, ProtoMessage)) is not None:
                drained += message.ByteSize()
        except ProtocolError:
            return  # the sender stalled: end the call anyway

    # --- phase 1: reduce-scatter ---------------------------------------------------------------------

    async def PushContribution(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        refusal = await self._take_contribution(context)
        if refusal is not None:
            await self._refuse_stream(context, peer, "PushContribution", *refusal)

    async def _take_contribution(self, context: grpc.aio.ServicerContext) -> _Refusal | None:
        """Receive one contribution into its part's reducer; return why it was refused, or None."""
        state: RoundState | None = None
        sender = part_index = -1
        opened = False
        try:
            first = await self._read(context, pb.ContributionMessage)
            if first is None or first.WhichOneof("body") != "header":
                raise invalid("a contribution must start with a header")
            header = first.header
            heartbeat = pb.ContributionReply(still_working=pb.StillWorking())
            round_state, sender = await self._heartbeating(
                context, self._resolve(header.round, header.part_index, context), heartbeat
            )
            state = round_state
            part_index = header.part_index
            round_state.count_contribution_bytes(received=first.ByteSize())
            if header.codec != round_state.codec.spec():
                raise invalid(f"codec {header.codec} is not the round's codec {round_state.codec.spec()}")
            if header.num_elements != round_state.group.part_num_elements(part_index):
                raise invalid(
                    f"part {part_index} has {round_state.group.part_num_elements(part_index)} numbers, "
                    f"you announced {header.num_elements}"
                )
            reducer = await self._heartbeating(
                context, round_state.open_contribution(part_index, sender, header.weight), heartbeat
            )
            if reducer is None:
                await self._write(context, pb.ContributionReply(already_decided=pb.AlreadyDecided()))
                return None
            opened = True
            await self._write(context, pb.ContributionReply(send_chunks=pb.SendChunks()))
            while (message := await self._read(context, pb.ContributionMessage)) is not None:
                if message.WhichOneof("body") != "chunk":
                    raise invalid("after the header a contribution holds only chunks")
                chunk = message.chunk
                payload = chunk.payload  # each read of a bytes field copies it
                round_state.count_contribution_bytes(
                    received=chunk_message_num_bytes(chunk.offset, chunk.num_elements, len(payload))
                )
                reducer.add_chunk(sender, chunk.offset, chunk.num_elements, payload)
                round_state.pulse.notify()  # the reducer may fold it now
                await round_state.hold_back(reducer, sender)
            reducer.complete(sender)
            round_state.pulse.notify()
            reply = pb.ContributionReply(
                receipt=pb.ContributionReceipt(num_elements_received=header.num_elements)
            )
            num_bytes = await self._write(context, reply)  # not `+= await`: other tasks add meanwhile
            round_state.count_contribution_bytes(sent=num_bytes)
        except ProtocolError as error:
            drain_bytes = None
            if state is not None and opened:
                state.contribution_failed(part_index, sender, str(error), vanished=False)
                drain_bytes = 2 * state.source.num_payload_bytes(part_index)
            return _detached(error), drain_bytes
        except asyncio.CancelledError:
            # The sender went away mid-stream (killed, or its connection dropped).
            if state is not None and opened:
                state.contribution_failed(part_index, sender, "its stream broke", vanished=True)
                logger.warning("contribution to part %d from member %d broke off", part_index, sender)
            raise
        return None

    # --- between the phases: the replica hand-off ----------------------------------------------------

    async def PushReplica(self, request_iterator: object, context: grpc.aio.ServicerContext) -> None:
        peer = context.peer()
        refusal = await self._take_replica(context)
        if refusal is not None:
            await self._refuse_stream(context, peer, "PushReplica", *refusal)

    async def _take_replica(self, context: grpc.aio.ServicerContext) -> _Refusal | None:
        """Receive a producer's decided average (or its commit); return why it was refused, or None."""
        state: RoundState | None = None
        part_index = -1
        opened = False
        try:
            first = await self._read(context, pb.ReplicaMessage)
            if first is None or first.WhichOneof("body") != "header":
                raise invalid("a replica must start with a header")
            header = first.header
            round_state, sender = await self._heartbeating(
                context,
                self._resolve(header.round, header.average.part_index, context),
                pb.ReplicaReply(still_working=pb.StillWorking()),
            )
            state = round_state
            part_index = header.average.part_index
            round_state.bytes_recv += first.ByteSize()
            round_state.open_replica(header.average, sender, committed=header.committed)
            opened = True
            await self._write(context, pb.ReplicaReply(send_chunks=pb.SendChunks()))
            while (message := await self._read(context, pb.ReplicaMessage)) is not None:
                if message.WhichOneof("body") != "chunk":
                    raise invalid("after the header a replica holds only chunks")
                chunk = message.chunk
                payload = chunk.payload  # each read of a bytes field copies it
                round_state.bytes_recv += chunk_message_num_bytes(
                    chunk.offset, chunk.num_elements, len(payload)
                )
                await round_state.add_replica_chunk(part_index, chunk.offset, chunk.num_elements, payload)
            round_state.complete_replica(part_index)
            await self._write(context, pb.ReplicaReply(receipt=pb.ReplicaReceipt()))
        except ProtocolError as error:
            drain_bytes = None
            if state is not None and opened:
                state.fail_replica(part_index)
                # (a sparse average holds every member's payload of the part)
                drain_bytes = (
                    state.group.num_members if state.sparse else 2
                ) * state.source.num_payload_bytes(part_index)
            return _detached(error), drain_bytes
        except asyncio.CancelledError:
            if state is not None and opened:
                state.fail_replica(part_index)
                logger.warning("replica of part %d broke off", part_index)
            raise
        return None

    # --- phase 2: all-gather -------------------------------------------------------------------------

    async def PullAverage(self, request: pb.PullAverageRequest, context: grpc.aio.ServicerContext) -> None:
        refusal = await self._serve_average(request, context)
        if refusal is not None:
            await self._reject(context, "PullAverage", refusal)

    async def _serve_average(
        self, request: pb.PullAverageRequest, context: grpc.aio.ServicerContext
    ) -> ProtocolError | None:
        """Stream a part's average to a member; return why we refused, or None."""
        try:
            if isinstance(request, Malformed):
                raise invalid(request.error)
            state, requester = await self._heartbeating(
                context,
                self._resolve(request.round, request.part_index, context),
                pb.AverageMessage(still_working=pb.StillWorking()),
            )
            state.bytes_recv += request.ByteSize()
            reduced = await self._wait_decided(state, request.part_index, requester, context)
            if requester in state.parts[request.part_index].told_committed:
                raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS, "you hold the replica of this part")
            num_bytes = await self._write(context, pb.AverageMessage(header=state.average_header(reduced)))
            state.bytes_sent += num_bytes
            offset = 0
            for chunk_index, (size, payload) in enumerate(
                zip(reduced.chunk_sizes, reduced.payloads, strict=True)
            ):
                chunk = pb.TensorChunk(offset=offset, num_elements=size, payload=wire_bytes(payload))
                if state.pace is not None:
                    await state.pace.admit(len(payload), state.all_gather_deadline)
                await self._write(context, pb.AverageMessage(chunk=chunk))
                state.bytes_sent += chunk_message_num_bytes(offset, size, len(payload))
                offset += size
                check_fault(state.fault_plan, "serve_chunk", state.round_id, chunk_index)
        except ProtocolError as error:
            return _detached(error)
        state.note_holder(request.part_index, requester)
        return None

    # --- a tiered round's stage C: the slices of its mean -------------------------------------------

    async def PullSlice(self, request: pb.PullSliceRequest, context: grpc.aio.ServicerContext) -> None:
        refusal = await self._serve_slice(request, context)
        if refusal is not None:
            await self._reject(context, "PullSlice", refusal)

    async def _serve_slice(
        self, request: pb.PullSliceRequest, context: grpc.aio.ServicerContext
    ) -> ProtocolError | None:
        """Stream a held slice to a member allowed to pull it, once held; return why we refused, or None."""
        slices = self._slices
        try:
            if isinstance(request, Malformed):
                raise invalid(request.error)
            slices.bytes_recv += request.ByteSize()
            if len(request.plan_digest) != PLAN_DIGEST_NUM_BYTES:
                raise invalid(
                    f"a plan digest is {PLAN_DIGEST_NUM_BYTES} bytes, got {len(request.plan_digest)}"
                )
            if not request.sender_peer_id:
                raise invalid("a pull must name its sender_peer_id")
            key = SliceKey(
                round_id=request.round_id, plan_digest=request.plan_digest, slice_index=request.slice_index
            )
            wait = self._early_wait(context, self._config.max_slice_wait.total_seconds())
            held = await self._heartbeating(
                context,
                slices.wait(key, request.sender_peer_id, wait),
                pb.AverageMessage(still_working=pb.StillWorking()),
            )
            header = pb.AverageHeader(
                part_index=key.slice_index,
                codec=held.codec.spec(),
                num_elements=held.num_elements,
                weight_sum=held.weight_sum,
            )
            num_bytes = await self._write(context, pb.AverageMessage(header=header))
            slices.count_served(key, num_bytes)
            offset = 0
            for size, payload in zip(held.chunk_sizes, held.payloads, strict=True):
                chunk = pb.TensorChunk(offset=offset, num_elements=size, payload=wire_bytes(payload))
                await self._write(context, pb.AverageMessage(chunk=chunk))
                slices.count_served(key, chunk_message_num_bytes(offset, size, len(payload)))
                offset += size
        except ProtocolError as error:
            return _detached(error)
        return None

    async def _wait_decided(
        self, state: RoundState, part_index: int, requester: int, context: grpc.aio.ServicerContext
    ) -> ReducedPart:
        """The part's decided average once it exists, heartbeating meanwhile; we take the part over if
        we neither own nor hold it (the puller found every earlier member of its chain gone)."""
        part = state.parts[part_index]
        if part.role is PartRole.IDLE:
            state.take_over(part_index, "a member could not get it from earlier chain members")

        def settled() -> bool:
            # A replica we hold but were never told is committed must not be served. We serve our
            # own version only once every voter knows it is committed (or failed to hear it): were
            # we to die mid-serve before that, the voters would hold bytes nobody may use, and the
            # members we had begun serving would have to fall back. A voter waits here too; it gets
            # the bytes with the commit.
            if part.role is PartRole.MOVED or state.stranded(part_index):
                return True  # (we no longer wait for a stranded replica's commit notice: send the puller on)
            return part.servable and not part.telling

        heartbeat = self._config.heartbeat_interval.total_seconds()
        while not await state.pulse.wait_for(settled, min(heartbeat, remaining(state.all_gather_deadline))):
            if remaining(state.all_gather_deadline) <= 0:
                raise ProtocolError(grpc.StatusCode.UNAVAILABLE, "part not decided before the deadline")
            num_bytes = await self._write(context, pb.AverageMessage(still_working=pb.StillWorking()))
            state.bytes_sent += num_bytes
        # (A replica decoded into our result as it arrived holds no bytes to serve, unless fp32.)
        if not part.servable or part.decided is None or (part.in_result and not part.decided.payloads):
            if state.settle_stranded(part_index):  # (from now on we refuse its late commit notice)
                reason = "is held here in a version that was never committed (its producer is gone)"
            elif part.released or part.in_result:
                reason = "was released here"
            else:
                reason = "moved to a backup"
            raise ProtocolError(grpc.StatusCode.ABORTED, f"part {part_index} {reason}")
        return part.decided

    async def _write(self, context: grpc.aio.ServicerContext, message: ProtoMessage) -> int:
        """Write one response; a caller that stops reading for the stall timeout is dropped."""
        stall = self._config.stall_timeout.total_seconds()
        try:
            async with asyncio.timeout(stall):
                await context.write(message)
        except TimeoutError as error:
            raise ProtocolError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"you stopped reading for {stall:.1f}s"
            ) from error
        return message.ByteSize()
