"""Per-part bookkeeping of a round: the role a member plays for a part, replicas being received,
and the `Pulse` that wakes everyone waiting for a part to change."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from protocol.allreduce.group import GroupSpec
from protocol.allreduce.reducer import PartReducer, ReducedPart
from protocol.allreduce.sparse import SummedContributions, check_weights, is_sparse
from protocol.codecs import Codec, CodecError, fp32_view
from protocol.errors import invalid
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb


class PartRole(enum.Enum):
    """What this member does for one part (see round.py for the life cycle)."""

    IDLE = "idle"
    REDUCING = "reducing"
    RECEIVING_REPLICA = "receiving_replica"
    DECIDED = "decided"
    MOVED = "moved"


def check_average_header(header: pb.AverageHeader, part_index: int, group: GroupSpec, codec: Codec) -> None:
    """Raise ValueError unless an average header fits this group, codec and part."""
    contributors = list(header.contributor_indices)
    if header.part_index != part_index:
        raise ValueError(f"average is for part {header.part_index}, expected {part_index}")
    if header.codec != codec.spec():
        raise ValueError("average uses a different codec than the round")
    if header.num_elements != group.part_num_elements(part_index):
        raise ValueError(f"average has {header.num_elements} numbers, the part has a different size")
    if header.producer_index >= group.num_members:
        raise ValueError(f"producer {header.producer_index} is not a member")
    if not contributors or contributors != sorted(set(contributors)) or contributors[-1] >= group.num_members:
        raise ValueError(f"bad contributor list {contributors}")
    if not (math.isfinite(header.weight_sum) and header.weight_sum > 0):
        raise ValueError(f"bad weight sum {header.weight_sum}")
    check_weights(header.contributor_weights, len(contributors), sparse=is_sparse(codec))


@dataclass
class ReplicaBuffer:
    """A decided average arriving from its producer, chunk by chunk."""

    header: pb.AverageHeader
    keep: bool = True
    """False: the receiver decodes each chunk into its result and we keep no bytes (see open_replica)."""
    chunk_sizes: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    num_received: int = 0

    def add_chunk(
        self, offset: int, num_elements: int, payload: bytes, codec: Codec | SummedContributions
    ) -> None:
        """Validate and keep (if `keep`) the next chunk (raises ProtocolError); `codec` decodes the
        average's chunks (`sparse.average_codec`)."""
        if offset != self.num_received or num_elements <= 0:
            raise invalid(f"replica chunk at {offset} after {self.num_received} numbers")
        if offset + num_elements > self.header.num_elements:
            raise invalid("replica has more numbers than the part")
        try:
            codec.validate(payload, num_elements)
        except CodecError as error:
            raise invalid(str(error)) from error
        if self.keep:
            self.payloads.append(payload)
        self.chunk_sizes.append(num_elements)
        self.num_received += num_elements

    def complete(self) -> ReducedPart:
        """The whole average, once every number arrived (raises ProtocolError if truncated)."""
        if self.num_received != self.header.num_elements:
            raise invalid(f"truncated replica: {self.num_received} of {self.header.num_elements} numbers")
        return ReducedPart(
            part_index=self.header.part_index,
            producer_index=self.header.producer_index,
            contributor_indices=tuple(self.header.contributor_indices),
            weight_sum=self.header.weight_sum,
            chunk_sizes=tuple(self.chunk_sizes),
            payloads=tuple(self.payloads),
            contributor_weights=tuple(self.header.contributor_weights),
        )


@dataclass
class PartState:
    """This member's view of one part in one round."""

    role: PartRole = PartRole.IDLE
    reducer: PartReducer | None = None
    decided: ReducedPart | None = None
    replica: ReplicaBuffer | None = None
    # A strict majority holds `decided` and a voter took its producer's commit notice: it may be served
    # and used.
    committed: bool = False
    # We acted on `decided` not being committed (sent a puller on, walked on past it, or, as its
    # producer, had no voter take our commit notice): it never will be here, and a late commit notice
    # is refused (RoundState.settle_stranded).
    never_committed: bool = False
    gave_up: bool = False  # we reduced the part but moved it before our version was committed
    told_committed: set[int] = field(default_factory=set)  # replica holders we told of the commit
    telling: set[int] = field(default_factory=set)  # members we hand our replica or the commit to
    holders: set[int] = field(default_factory=set)  # members known to hold our decided bytes
    # Members that answered a push or pull of this part with "it moved on" (ABORTED): they gave their
    # version up (or released its bytes), so a producer among them will never commit one to us.
    not_serving: set[int] = field(default_factory=set)
    released: bool = False  # we dropped our decided bytes: every live member has them
    # The replica went straight into our result: `decided` holds no bytes (with fp32, views of the result).
    in_result: bool = False

    @property
    def servable(self) -> bool:
        """We hold the part's committed average (the only version of it anyone may serve or use)."""
        return self.role is PartRole.DECIDED and self.committed


class Pulse:
    """Wakes every waiter whenever anything in the round changes; waiters re-check their condition."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait_next(self, timeout: float) -> None:
        """Wait for the next change (or timeout seconds)."""
        event = self._event
        with contextlib.suppress(TimeoutError):  # the caller re-checks its state either way
            async with asyncio.timeout(timeout):
                await event.wait()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait until predicate() holds (True) or timeout seconds pass (False)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            time_left = deadline - time.monotonic()
            if time_left <= 0:
                return False
            with contextlib.suppress(TimeoutError):  # either way, re-check the predicate
                async with asyncio.timeout(time_left):
                    await self._event.wait()
        return True


def _varint_num_bytes(value: int) -> int:
    return max(1, (value.bit_length() + 6) // 7)


def chunk_message_num_bytes(offset: int, num_elements: int, payload_num_bytes: int) -> int:
    """Serialized size of a ContributionMessage, ReplicaMessage or AverageMessage holding one chunk.

    Equal to the message's ByteSize(), which upb computes by walking the whole message: that costs
    ~60 us per 256 KiB chunk, and every chunk is counted on both ends. Every field number here is
    below 16, so each tag is one byte; proto3 leaves out zero numbers and empty bytes.
    """
    inner = 0
    if offset:
        inner += 1 + _varint_num_bytes(offset)
    if num_elements:
        inner += 1 + _varint_num_bytes(num_elements)
    if payload_num_bytes:
        inner += 1 + _varint_num_bytes(payload_num_bytes) + payload_num_bytes
    return 1 + _varint_num_bytes(inner) + inner


def result_views(output: torch.Tensor, start: int, chunk_sizes: Sequence[int]) -> tuple[memoryview, ...]:
    """The fp32 bytes of a part's chunks where they lie in our result (the part starts at `start`)."""
    offsets = accumulate(chunk_sizes, initial=start)
    return tuple(
        fp32_view(output[offset : offset + size]) for offset, size in zip(offsets, chunk_sizes, strict=False)
    )


def remaining(deadline: float) -> float:
    """Seconds left until a time.monotonic() deadline (0 once it passed)."""
    return max(0.0, deadline - time.monotonic())
