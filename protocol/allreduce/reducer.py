"""Reduce one part: collect weighted contributions, sum them in member order, encode the average once.

A `PartReducer` is a plain state machine with no sockets and no event loop; the round feeds it
contributions as they arrive and asks it to fold the ones it may.

Determinism. Float addition is not associative, so the owner must add contributions in an order that
does not depend on arrival: member order. A member's contribution is only folded into the running
sum once it is complete and every lower-indexed member is resolved (folded or excluded); a member
excluded after lower ones were folded would otherwise force us to subtract it, which is not exact.
So the sum is

    average = (((0 + w_a x_a) + w_b x_b) + ...) / ((0 + w_a) + w_b + ...)     a < b < ... contributors

in float32, and with equal weights it equals torch's `torch.stack(xs).mean(0)` bit for bit (torch
sums the rows of a small stack in the same order). The average is encoded once, chunk by chunk;
every member later decodes these same bytes, which makes all results bit-identical.

Memory: a contribution waits as its encoded chunks (e.g. 1 byte per number for int8) until it is
folded; folding decodes one chunk at a time into a reused scratch buffer.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import grpc
import torch

from protocol.allreduce.errors import ProtocolError, invalid
from protocol.codecs import Codec, CodecError
from protocol.error_feedback import ErrorFeedback


class SenderStatus(enum.Enum):
    WAITING = "waiting"  # nothing heard yet
    STREAMING = "streaming"  # chunks are arriving
    COMPLETE = "complete"  # every number arrived and validated; not folded yet
    FOLDED = "folded"  # part of the running sum
    EXCLUDED = "excluded"  # left out of this part (failed, stalled, rejected or too late)


FOLD_CHUNK = 1 << 18
"""Numbers of a local fp32 contribution multiplied by its weight at a time (bounded scratch)."""


@dataclass
class _Contribution:
    status: SenderStatus = SenderStatus.WAITING
    weight: float = 0.0
    payloads: list[bytes] = field(default_factory=list)  # encoded chunks, in order
    chunk_sizes: list[int] = field(default_factory=list)
    num_received: int = 0
    raw: torch.Tensor | None = None  # a local contribution, kept as fp32 instead of encoded
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ReducedPart:
    """The decided average of one part: its encoded chunks and who contributed."""

    part_index: int
    producer_index: int
    contributor_indices: tuple[int, ...]
    weight_sum: float
    chunk_sizes: tuple[int, ...]
    payloads: tuple[bytes, ...]

    @property
    def num_elements(self) -> int:
        return sum(self.chunk_sizes)

    @property
    def num_payload_bytes(self) -> int:
        return sum(len(p) for p in self.payloads)


def chunk_sizes(num_elements: int, chunk_num_elements: int) -> list[int]:
    """Split a part into streamed chunks: full chunks, then the remainder."""
    sizes = [chunk_num_elements] * (num_elements // chunk_num_elements)
    if num_elements % chunk_num_elements:
        sizes.append(num_elements % chunk_num_elements)
    return sizes


class PartReducer:
    """Collects the contributions to one part and folds them, in member order, into a float32 sum."""

    def __init__(
        self,
        *,
        part_index: int,
        producer_index: int,
        num_elements: int,
        num_members: int,
        codec: Codec,
        accumulator: torch.Tensor | None = None,
    ) -> None:
        """`accumulator`, if given, is (num_elements,) fp32 scratch to sum into (it is zeroed first)."""
        self.part_index = part_index
        self.producer_index = producer_index
        self.num_elements = num_elements
        self.codec = codec
        self._contributions = [_Contribution() for _ in range(num_members)]
        if accumulator is None:
            accumulator = torch.empty(num_elements, dtype=torch.float32)
        assert accumulator.shape == (num_elements,) and accumulator.dtype == torch.float32
        self._accumulator = accumulator.zero_()  # (part,)
        self._weight_sum = torch.zeros((), dtype=torch.float32)
        self._next_to_fold = 0
        self._contributors: list[int] = []
        self.finalized = False

    # --- feeding contributions (called on the event loop) -------------------------------------------

    def status(self, member: int) -> SenderStatus:
        return self._contributions[member].status

    def begin(self, member: int, weight: float) -> None:
        """A member starts streaming its contribution; refuse duplicates and latecomers."""
        contribution = self._contributions[member]
        if contribution.status in (SenderStatus.COMPLETE, SenderStatus.FOLDED):
            raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS, f"already hold your part {self.part_index}")
        if contribution.status is SenderStatus.STREAMING:
            raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS, "you are already streaming this part")
        if self.finalized or contribution.status is SenderStatus.EXCLUDED:
            raise ProtocolError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"part {self.part_index} was decided without you ({contribution.reason or 'too late'})",
            )
        if not (math.isfinite(weight) and weight > 0):
            raise invalid(f"weight must be finite and positive, got {weight}")
        contribution.status = SenderStatus.STREAMING
        contribution.weight = weight

    def add_chunk(self, member: int, offset: int, num_elements: int, payload: bytes) -> None:
        """Validate and keep one encoded chunk of a streaming member (raises ProtocolError)."""
        contribution = self._contributions[member]
        if contribution.status is not SenderStatus.STREAMING:
            raise ProtocolError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"part {self.part_index} was decided without you ({contribution.reason or 'too late'})",
            )
        if offset != contribution.num_received:
            raise invalid(f"chunk offset {offset} != {contribution.num_received} numbers received so far")
        if num_elements <= 0 or offset + num_elements > self.num_elements:
            raise invalid(
                f"chunk [{offset}, {offset + num_elements}) is outside the part of {self.num_elements}"
            )
        try:
            self.codec.validate(payload, num_elements)
        except CodecError as error:
            raise invalid(str(error)) from error
        contribution.payloads.append(payload)
        contribution.chunk_sizes.append(num_elements)
        contribution.num_received += num_elements

    def complete(self, member: int) -> None:
        """The member's stream ended; it must have delivered the whole part."""
        contribution = self._contributions[member]
        if contribution.status is not SenderStatus.STREAMING:
            raise ProtocolError(
                grpc.StatusCode.FAILED_PRECONDITION, f"part {self.part_index} already decided"
            )
        if contribution.num_received != self.num_elements:
            raise invalid(f"truncated: got {contribution.num_received} of {self.num_elements} numbers")
        contribution.status = SenderStatus.COMPLETE

    def add_local(self, member: int, weight: float, values: torch.Tensor) -> None:
        """This peer's own fp32 contribution (never encoded: it does not cross the wire)."""
        if values.numel() != self.num_elements:
            raise ValueError(f"local contribution has {values.numel()} numbers, part has {self.num_elements}")
        self.begin(member, weight)
        contribution = self._contributions[member]
        contribution.raw = values
        contribution.num_received = self.num_elements
        contribution.status = SenderStatus.COMPLETE

    def exclude(self, member: int, reason: str) -> bool:
        """Leave a member out (its stream failed or was rejected); False if it already delivered."""
        contribution = self._contributions[member]
        if contribution.status in (SenderStatus.COMPLETE, SenderStatus.FOLDED):
            return False  # a validated contribution is kept: it may already be folding
        if contribution.status is not SenderStatus.EXCLUDED:
            contribution.status = SenderStatus.EXCLUDED
            contribution.reason = reason
            contribution.payloads.clear()
            contribution.raw = None
        return True

    def give_up_on(self, member: int, reason: str) -> None:
        """Stop waiting for a member we believe dead, unless its contribution is already arriving."""
        if self._contributions[member].status is SenderStatus.WAITING:
            self.exclude(member, reason)

    @property
    def contributors(self) -> tuple[int, ...]:
        """Members folded into the sum so far, in order."""
        return tuple(self._contributors)

    def all_resolved(self) -> bool:
        """True once no member is still waiting or streaming."""
        unresolved = (SenderStatus.WAITING, SenderStatus.STREAMING)
        return all(c.status not in unresolved for c in self._contributions)

    def finalize(self) -> None:
        """The deadline passed (or all are resolved): everyone not complete is excluded for good."""
        for contribution in self._contributions:
            if contribution.status in (SenderStatus.WAITING, SenderStatus.STREAMING):
                contribution.status = SenderStatus.EXCLUDED
                contribution.reason = contribution.reason or "did not deliver before the deadline"
                contribution.payloads.clear()
        self.finalized = True

    # --- folding (CPU work; may run on a worker thread) -----------------------------------------------

    def next_foldable(self) -> int | None:
        """Skip excluded members in order; return the next complete member to fold, or None."""
        while self._next_to_fold < len(self._contributions):
            status = self._contributions[self._next_to_fold].status
            if status is SenderStatus.EXCLUDED:
                self._next_to_fold += 1
            elif status is SenderStatus.COMPLETE:
                return self._next_to_fold
            else:
                return None
        return None

    def fold(self, member: int) -> None:
        """Add w * x of a complete member into the running sum, one chunk at a time."""
        assert member == self._next_to_fold, (member, self._next_to_fold)
        contribution = self._contributions[member]
        assert contribution.status is SenderStatus.COMPLETE
        weight = contribution.weight
        # Multiply, then add (no fused multiply-add), chunk by chunk into a small scratch buffer.
        if contribution.raw is not None:
            raw = contribution.raw
            scratch = torch.empty(min(FOLD_CHUNK, self.num_elements), dtype=torch.float32)
            for offset in range(0, self.num_elements, FOLD_CHUNK):
                size = min(FOLD_CHUNK, self.num_elements - offset)
                product = torch.mul(raw[offset : offset + size], weight, out=scratch[:size])
                self._accumulator[offset : offset + size] += product
        else:
            offset = 0
            scratch = torch.empty(max(contribution.chunk_sizes, default=0), dtype=torch.float32)
            for size, payload in zip(contribution.chunk_sizes, contribution.payloads, strict=True):
                decoded = self.codec.decode_into(payload, scratch[:size])
                decoded.mul_(weight)
                self._accumulator[offset : offset + size] += decoded
                offset += size
        self._weight_sum += weight
        contribution.payloads.clear()
        contribution.raw = None
        contribution.status = SenderStatus.FOLDED
        self._contributors.append(member)
        self._next_to_fold += 1

    def encode_average(
        self, *, chunk_num_elements: int, error_feedback: ErrorFeedback | None, part_offset: int
    ) -> ReducedPart:
        """Divide by the weight sum and encode the average chunk by chunk (with the owner's feedback)."""
        assert self.finalized and self.next_foldable() is None, "fold every complete member first"
        assert self._contributors, "an owner always contributes to its own part"
        average = self._accumulator.div_(self._weight_sum)  # (part,)
        sizes = chunk_sizes(self.num_elements, chunk_num_elements)
        payloads: list[bytes] = []
        offset = 0
        for size in sizes:
            values = average[offset : offset + size]
            if error_feedback is None:
                encoded = self.codec.encode(values)
            else:
                encoded = error_feedback.encode(self.codec, values, part_offset + offset)
            payloads.append(encoded.numpy().tobytes())
            offset += size
        self._accumulator = torch.empty(0)  # the encoded chunks are all we keep
        return ReducedPart(
            part_index=self.part_index,
            producer_index=self.producer_index,
            contributor_indices=tuple(self._contributors),
            weight_sum=float(self._weight_sum),
            chunk_sizes=tuple(sizes),
            payloads=tuple(payloads),
        )

    def exclusion_reasons(self) -> dict[int, str]:
        """Why each excluded member was left out."""
        return {
            member: c.reason
            for member, c in enumerate(self._contributions)
            if c.status is SenderStatus.EXCLUDED and c.reason
        }
