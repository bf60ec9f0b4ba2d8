"""One all-reduce round as seen by one member: the role it plays for each part, and how parts get decided.

For every part this member is in one role:

    IDLE               it neither reduces nor holds the part (it only pulls it)
    REDUCING           it owns the part, or took it over as a backup, and collects contributions
    RECEIVING_REPLICA  the part's producer is handing it a copy of the decided average
    DECIDED            it holds the part's final encoded average and serves exactly those bytes
    MOVED              it reduced the part but a backup took it over first; it refers pullers on

`RoundState` is built in three layers, one file each:

    round_core.py  `RoundCore`: what the member knows about the round (group, deadlines, parts,
                   failures, bytes), the headers it sends, and the round's lifetime
    deciding.py    `PartDecider`: how a part gets decided (fold the contributions, encode the average
                   once, replicate it to a strict majority, commit) or taken over, and why that keeps
                   survivors bit-identical
    round.py       `RoundState`: what the servicer asks of the round: contributions pushed to us, and
                   replicas of decided parts handed to us (accepting one is our vote for it)
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from protocol.allreduce.deciding import PartDecider
from protocol.allreduce.parts import PartRole, ReplicaBuffer, remaining, result_views
from protocol.allreduce.reducer import PartReducer
from protocol.codecs import CodecError, fp32_view
from protocol.errors import ProtocolError, invalid
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb


class RoundState(PartDecider):
    """One member's round: what it knows (`RoundCore`), how it decides parts (`PartDecider`), and what
    the servicer asks of it (here); the servicer and the member's tasks share it."""

    async def open_contribution(self, part_index: int, member: int, weight: float) -> PartReducer | None:
        """A member starts pushing its contribution; returns the reducer, or None if already decided."""
        part = self.parts[part_index]
        while True:
            if part.role is PartRole.DECIDED:
                return None
            if part.role is PartRole.MOVED:
                raise ProtocolError(grpc.StatusCode.ABORTED, f"part {part_index} moved to a backup")
            if part.role is PartRole.REDUCING:
                assert part.reducer is not None
                part.reducer.begin(member, weight)
                self.pulse.notify()
                return part.reducer
            if part.role is PartRole.IDLE:
                self.take_over(part_index, f"member {member} pushed it to us")
                continue
            # A replica hand-off is under way: it decides whether we serve the owner's bytes or reduce.
            if not await self.pulse.wait_for(
                lambda: part.role is not PartRole.RECEIVING_REPLICA, remaining(self.all_gather_deadline)
            ):
                raise ProtocolError(grpc.StatusCode.UNAVAILABLE, "replica hand-off did not finish in time")

    def contribution_failed(self, part_index: int, member: int, reason: str, *, vanished: bool) -> None:
        """A push ended badly: leave the member out of the part; if its stream broke, it is gone."""
        reducer = self.parts[part_index].reducer
        if reducer is not None:
            reducer.exclude(member, reason)
        if vanished:
            self.mark_failed(member, reason)
        self.pulse.notify()

    def open_replica(self, header: pb.AverageHeader, sender: int, *, committed: bool) -> None:
        """The producer of a part starts handing us its decided average, or says it is committed.

        Accepting a replica is our vote for the sender's version of the part, so we accept one only
        while we have voted for none (IDLE), or our own version is dead (MOVED: we gave it up before it
        was committed, and only we could commit it); a member reducing the part votes for its own.
        """
        part_index = header.part_index
        try:
            self.check_average_header(header, part_index)
        except ValueError as error:
            raise invalid(str(error)) from error
        if header.producer_index != sender:
            raise invalid(f"member {sender} sent a replica produced by member {header.producer_index}")
        part = self.parts[part_index]
        holds_senders = (
            part.role is PartRole.DECIDED
            and part.decided is not None
            and part.decided.producer_index == sender
        )
        if committed:
            if not holds_senders:
                raise ProtocolError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"no replica of yours for part {part_index} here"
                )
            part.committed = True
            self.pulse.notify()
        if holds_senders:
            raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS, f"already hold your part {part_index}")
        if part.role not in (PartRole.IDLE, PartRole.MOVED):
            raise ProtocolError(grpc.StatusCode.ABORTED, f"part {part_index} is {part.role.value} here")
        # We decode the replica into our result as it arrives instead of keeping a copy (a part less
        # at the end of the round) where we need no bytes to serve it later. With two members nobody
        # but its producer and us could ever want this part, and the producer holds it. With the fp32
        # codec the numbers in our result are the bytes, which we serve from there. A version never
        # committed is overwritten by the part we do get, or our result is not used (we fall back);
        # in place, our numbers there are spent (should we have to reduce the part again, we are
        # left out unless our contribution is cached; see `spend`).
        decode_on_arrival = self.group.num_members <= 2 or self.codec.payload_is_fp32
        keep = self.output is None or not decode_on_arrival
        part.role, part.replica = PartRole.RECEIVING_REPLICA, ReplicaBuffer(header=header, keep=keep)
        self.pulse.notify()

    async def add_replica_chunk(
        self, part_index: int, offset: int, num_elements: int, payload: bytes
    ) -> None:
        replica = self.parts[part_index].replica
        if replica is None:
            raise ProtocolError(grpc.StatusCode.ABORTED, f"round {self.round_id} was forgotten here")
        replica.add_chunk(offset, num_elements, payload, self.codec)
        if not replica.keep:
            if self.output is None:
                raise ProtocolError(grpc.StatusCode.ABORTED, f"round {self.round_id} is over here")
            self.spend(part_index)
            start = self.group.part_bounds[part_index] + offset
            target = self.output[start : start + num_elements]
            # (fp32 codec: what we keep is where it is decoded to, not a second copy)
            self.keep_payload(
                start, num_elements, fp32_view(target) if self.codec.payload_is_fp32 else payload
            )
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, self.codec.decode_into, payload, target
                )
            except CodecError as error:
                raise invalid(str(error)) from error

    def complete_replica(self, part_index: int) -> None:
        part = self.parts[part_index]
        if part.replica is None:
            raise ProtocolError(grpc.StatusCode.ABORTED, f"round {self.round_id} was forgotten here")
        decided = part.replica.complete()  # raises if truncated: then fail_replica, and nothing is in_result
        if not part.replica.keep and self.codec.payload_is_fp32 and self.output is not None:
            # The numbers are in our result, which are the fp32 bytes: we can serve them from there.
            views = result_views(self.output, self.group.part_bounds[part_index], decided.chunk_sizes)
            decided = dataclasses.replace(decided, payloads=views)
        part.in_result, part.decided = not part.replica.keep, decided
        part.role, part.replica = PartRole.DECIDED, None
        self.pulse.notify()

    def fail_replica(self, part_index: int) -> None:
        """The hand-off broke: forget the partial copy; we may have to take the part over later.

        Unless we already produced a version of the part and gave it up: a producer reduces a part at
        most once (a second version under our index could pass for the first at its replica holders).
        """
        part = self.parts[part_index]
        if part.role is PartRole.RECEIVING_REPLICA:
            part.role = PartRole.MOVED if part.gave_up else PartRole.IDLE
            part.replica, part.in_result = None, False
            self.pulse.notify()
