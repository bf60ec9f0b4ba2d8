"""Reduce one part: fold weighted contributions chunk by chunk, in member order, and encode the average once.

A `PartReducer` is a plain state machine with no sockets and no event loop: the round feeds it chunks
as they arrive, asks it which chunks may be folded now (`plan_folds`), runs those folds on a worker
thread (`run_folds`) and reports them done (`folds_done`).

Determinism. Float addition is not associative, so every element must be summed in an order that does
not depend on arrival: member order. Member j may fold its chunk [a, b) only once every lower member
that can still contribute has folded (or queued before it) the same range; so for each element

    average = (((0 + w_a x_a) + w_b x_b) + ...) / ((0 + w_a) + w_b + ...)     a < b < ... contributors

in float32 (a multiply, then an add: no fused multiply-add), which with equal weights is torch's
`torch.stack(xs).mean(0)` bit for bit for small stacks (torch sums their rows in the same order).
Folds run in submission order on one worker thread, so a queued fold counts as done for ordering.

Failures. A member that never delivered anything is simply left out. A member that fails after some of
its chunks were summed cannot be taken out again exactly, so the reducer is *poisoned*: the round
then hands the part to its backup, which reduces it again from resent contributions. At the
phase deadline, members that have not started are left out, while members already partly summed are
waited for (they are alive and stream; a stalled one is cut off by the stall timeout).

Memory. Chunks wait, encoded, only while a lower member lags behind (the round stops reading a sender
that is `max_chunks_ahead` chunks ahead, see RoundState.hold_back); each fold decodes one chunk into a
reused scratch buffer and adds it into the accumulator in place.

Sparse codecs (`sparse.py`). With top-k the average is not re-encoded: like a robust rule the reducer
waits for every contribution (senders are not held back), keeps the chunks as they came, and its
decided bytes per chunk are the contributors' chunks in member order, with each one's weight
("clipped": times its clip scale); every member sums them alike when it decodes the average.

Robust rules (`robust.py`). "clipped" and "trimmed" need every contribution whole, so they fold nothing
until every member has completed or been left out (at the phase deadline, members still streaming are
left out: nothing of theirs is summed yet, so nothing is poisoned), holding the part's contributions
encoded meanwhile (num_members x the part's encoded size; senders are not held back). Then, on the
worker thread: "clipped" decodes each contribution once to get its norm, and folds as above in member
order with weight w_i * s_i; "trimmed" takes the part window by window (the chunk grid, which every
sender must follow), decodes the contributors' chunks of the window into an (M, window) matrix and
writes their trimmed weighted mean straight into the accumulator.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

import grpc
import torch

from protocol.allreduce.robust import AggregationRule, clip_scales, squared_norm, trimmed_weighted_mean
from protocol.allreduce.sparse import as_float32, is_sparse
from protocol.codecs import Codec, CodecError, all_finite, fp32_view
from protocol.error_feedback import ErrorFeedback
from protocol.errors import ProtocolError, invalid


class SenderStatus(enum.Enum):
    WAITING = "waiting"  # nothing heard yet
    STREAMING = "streaming"  # chunks are arriving
    COMPLETE = "complete"  # every number arrived and validated (folding may still be under way)
    EXCLUDED = "excluded"  # left out of this part (failed, stalled, rejected or too late)


@dataclass(frozen=True)
class FoldJob:
    """Add w * chunk into accumulator[offset : offset + size]; payload None means the local fp32 vector."""

    member: int
    offset: int
    size: int
    payload: bytes | None


@dataclass
class _Contribution:
    status: SenderStatus = SenderStatus.WAITING
    weight: float = 0.0
    pending: deque[FoldJob] = field(default_factory=deque)  # received, not yet handed to a fold
    num_received: int = 0
    num_planned: int = 0  # prefix of the part handed to folds (queued or done)
    num_folded: int = 0  # prefix of the part already in the sum
    raw: torch.Tensor | None = None  # this peer's own contribution, kept as fp32
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ReducedPart:
    """The decided average of one part: its encoded chunks and who contributed."""

    part_index: int
    producer_index: int
    contributor_indices: tuple[int, ...]
    weight_sum: float
    chunk_sizes: tuple[int, ...]
    payloads: tuple[bytes | memoryview, ...]
    """The encoded chunks; with the fp32 codec, views of the numbers where they already lie (the
    average's accumulator, or our result), not copies: nothing writes there while the part is held.
    With a sparse codec, each chunk's contributors' payloads one after another (`sparse.py`)."""
    contributor_weights: tuple[float, ...] = ()
    """Sparse codec: each contributor's weight as applied (float32 values), in contributor order;
    empty for the others."""

    @property
    def num_elements(self) -> int:
        return sum(self.chunk_sizes)


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
        chunk_num_elements: int,
        accumulator: torch.Tensor | None = None,
        rule: AggregationRule | None = None,
    ) -> None:
        """`accumulator`, if given, is (num_elements,) fp32 memory to sum into (it is zeroed first; a
        sparse codec sums nothing here and ignores it); `rule` is the aggregation rule (the plain
        weighted mean if None)."""
        self.part_index = part_index
        self.producer_index = producer_index
        self.num_elements = num_elements
        self.codec = codec
        self.chunk_num_elements = chunk_num_elements
        self._contributions = [_Contribution() for _ in range(num_members)]
        self.sparse = is_sparse(codec)
        if self.sparse:
            accumulator = torch.empty(0, dtype=torch.float32)
        elif accumulator is None:
            accumulator = torch.empty(num_elements, dtype=torch.float32)
        else:
            assert accumulator.shape == (num_elements,) and accumulator.dtype == torch.float32
        self._accumulator = accumulator.zero_()  # (part,); (0,) when sparse
        self._scratch = torch.empty(0, dtype=torch.float32)
        self.rule = rule or AggregationRule()
        # Sparse: every contribution's chunks, kept as they came, and each contributor's weight as applied.
        self.waits_for_all = self.rule.waits_for_all or self.sparse
        self._kept: list[FoldJob] = []
        self._applied_weights: dict[int, float] = {}
        self._averaged_in_place = False  # "trimmed" writes the average itself, not a sum to divide
        self.adjustments: dict[int, str] = {}  # member -> how the robust rule changed its contribution
        self.finalized = False
        self.poisoned = ""  # why this part can no longer be decided here ("" while it can)

    # --- feeding contributions (called on the event loop) -------------------------------------------

    def status(self, member: int) -> SenderStatus:
        return self._contributions[member].status

    def _refuse_if_poisoned(self) -> None:
        if self.poisoned:
            raise ProtocolError(grpc.StatusCode.ABORTED, f"part {self.part_index} moves to a backup")

    def begin(self, member: int, weight: float) -> None:
        """A member starts streaming its contribution; refuse duplicates and latecomers."""
        self._refuse_if_poisoned()
        contribution = self._contributions[member]
        if contribution.status in (SenderStatus.STREAMING, SenderStatus.COMPLETE):
            raise ProtocolError(
                grpc.StatusCode.ALREADY_EXISTS, f"already receiving your part {self.part_index}"
            )
        if self.finalized or contribution.status is SenderStatus.EXCLUDED:
            raise ProtocolError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"part {self.part_index} was decided without you ({contribution.reason or 'too late'})",
            )
        if not (math.isfinite(weight) and weight > 0):
            raise invalid(f"weight must be finite and positive, got {weight}")
        contribution.status, contribution.weight = SenderStatus.STREAMING, weight

    def add_chunk(self, member: int, offset: int, num_elements: int, payload: bytes) -> None:
        """Validate and queue one encoded chunk of a streaming member (raises ProtocolError)."""
        self._refuse_if_poisoned()
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
        if self.waits_for_all and (
            offset % self.chunk_num_elements
            or num_elements != min(self.chunk_num_elements, self.num_elements - offset)
        ):
            raise invalid(
                f"aggregation {self.rule.kind!r} with codec {self.codec.name!r} needs chunks of {self.chunk_num_elements} numbers, "
                f"got [{offset}, {offset + num_elements})"
            )
        try:
            self.codec.validate(payload, num_elements)
        except CodecError as error:
            raise invalid(str(error)) from error
        contribution.pending.append(FoldJob(member, offset, num_elements, payload))
        contribution.num_received += num_elements

    def complete(self, member: int) -> None:
        """The member's stream ended; it must have delivered the whole part."""
        self._refuse_if_poisoned()
        contribution = self._contributions[member]
        if contribution.status is not SenderStatus.STREAMING:
            raise ProtocolError(
                grpc.StatusCode.FAILED_PRECONDITION, f"part {self.part_index} already decided"
            )
        if contribution.num_received != self.num_elements:
            raise invalid(f"truncated: got {contribution.num_received} of {self.num_elements} numbers")
        contribution.status = SenderStatus.COMPLETE

    def add_local(self, member: int, weight: float, values: torch.Tensor) -> None:
        """This peer's own fp32 contribution (never encoded: it does not cross the wire); left out if it
        holds a NaN or an infinity, as any other member's would be."""
        if values.numel() != self.num_elements:
            raise ValueError(f"local contribution has {values.numel()} numbers, part has {self.num_elements}")
        self.begin(member, weight)
        if not all_finite(values):  # others' are refused by Codec.validate; ours too
            self.exclude(member, "its own contribution holds non-finite numbers")
            return
        contribution = self._contributions[member]
        contribution.raw = values
        for offset in range(0, self.num_elements, self.chunk_num_elements):
            size = min(self.chunk_num_elements, self.num_elements - offset)
            contribution.pending.append(FoldJob(member, offset, size, None))
        contribution.num_received = self.num_elements
        contribution.status = SenderStatus.COMPLETE

    def exclude(self, member: int, reason: str) -> None:
        """Leave a member out (it failed or was rejected); poisons the part if it was partly summed."""
        contribution = self._contributions[member]
        if contribution.status in (SenderStatus.COMPLETE, SenderStatus.EXCLUDED):
            return  # a validated contribution is kept whole
        if contribution.num_planned > 0:
            self.poisoned = f"member {member} failed after part of its contribution was summed ({reason})"
        contribution.status, contribution.reason = SenderStatus.EXCLUDED, reason
        contribution.pending.clear()

    def give_up_on(self, member: int, reason: str) -> None:
        """Stop waiting for a member we believe dead, unless its contribution is already arriving."""
        if self._contributions[member].status is SenderStatus.WAITING:
            self.exclude(member, reason)

    def finalize(self) -> None:
        """The phase deadline: leave out every member not yet summed at all; no newcomers after this.

        Members already partly summed must still finish (or fail, which poisons the part).
        """
        for member, contribution in enumerate(self._contributions):
            if (
                contribution.status in (SenderStatus.WAITING, SenderStatus.STREAMING)
                and not contribution.num_planned
            ):
                self.exclude(member, contribution.reason or "did not deliver before the deadline")
        self.finalized = True

    def is_done(self) -> bool:
        """True once every member is left out or completely summed."""
        return all(
            c.status is SenderStatus.EXCLUDED
            or (c.status is SenderStatus.COMPLETE and c.num_folded == self.num_elements)
            for c in self._contributions
        )

    def num_queued(self, member: int) -> int:
        """Chunks received from `member` that wait to be summed (behind a lower member's)."""
        return len(self._contributions[member].pending)

    def all_arrived(self) -> bool:
        """True once no member is still expected to send anything."""
        return all(c.status in (SenderStatus.COMPLETE, SenderStatus.EXCLUDED) for c in self._contributions)

    # --- folding -------------------------------------------------------------------------------------

    def plan_folds(self) -> list[FoldJob]:
        """Queued chunks that may be summed now, in an order that keeps every element in member order.

        Member j may fold up to the smallest prefix any lower, not excluded member has planned. A robust
        rule gets every chunk at once, once every member completed or was left out.
        """
        jobs: list[FoldJob] = []
        if self.waits_for_all and not (self.finalized and self.all_arrived()):
            return jobs
        frontier = self.num_elements
        for contribution in self._contributions:
            if contribution.status is SenderStatus.EXCLUDED:
                continue
            while (
                contribution.pending
                and contribution.pending[0].offset + contribution.pending[0].size <= frontier
            ):
                job = contribution.pending.popleft()
                contribution.num_planned += job.size
                jobs.append(job)
            frontier = min(frontier, contribution.num_planned)
        return jobs

    def run_folds(self, jobs: list[FoldJob]) -> None:
        """Sum the planned chunks (CPU work: run it on the worker thread, in the order planned)."""
        if not jobs:
            return
        if self.sparse:
            self._keep(jobs)
            return
        if self.rule.kind == "trimmed":
            self._run_trimmed(jobs)
            return
        multipliers = {member: c.weight for member, c in enumerate(self._contributions)}
        if self.rule.kind == "clipped":
            multipliers.update(self._clipped_weights(jobs))
        for job in jobs:
            scratch = self._decode(job).mul_(multipliers[job.member])  # a copy: never scale the caller's
            self._accumulator[job.offset : job.offset + job.size] += scratch

    def _keep(self, jobs: list[FoldJob]) -> None:
        """Sparse: keep every chunk as it came, and each contributor's weight as applied."""
        weights = {member: c.weight for member, c in enumerate(self._contributions)}
        if self.rule.kind == "clipped":
            weights.update(self._clipped_weights(jobs))
        self._kept.extend(jobs)
        for job in jobs:
            self._applied_weights[job.member] = as_float32(weights[job.member])

    def _decode(self, job: FoldJob, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 values of one chunk, in `out` or the reused scratch buffer."""
        if out is None:
            if self._scratch.numel() < job.size:
                self._scratch = torch.empty(job.size, dtype=torch.float32)
            out = self._scratch[: job.size]
        if job.payload is None:
            raw = self._contributions[job.member].raw
            assert raw is not None
            return out.copy_(raw[job.offset : job.offset + job.size])
        return self.codec.decode_into(job.payload, out)

    def _clipped_weights(self, jobs: list[FoldJob]) -> dict[int, float]:
        """w_i * s_i per contributor: its norm over the part clipped to clip_factor x the median norm."""
        squares: dict[int, float] = {}
        for job in jobs:  # every chunk of every contributor, in member then chunk order
            squares[job.member] = squares.get(job.member, 0.0) + squared_norm(self._decode(job))
        members = sorted(squares)
        norms = [math.sqrt(squares[member]) for member in members]
        weights: dict[int, float] = {}
        for member, norm, scale in zip(
            members, norms, clip_scales(norms, self.rule.clip_factor), strict=True
        ):
            weights[member] = self._contributions[member].weight * scale
            if scale < 1.0:
                self.adjustments[member] = f"norm {norm:.4g} clipped to {norm * scale:.4g}"
        return weights

    def _run_trimmed(self, jobs: list[FoldJob]) -> None:
        """Window by window (the chunk grid), the trimmed weighted mean of the contributors' chunks."""
        windows: dict[int, list[FoldJob]] = {}
        for job in jobs:  # member order within each window
            windows.setdefault(job.offset, []).append(job)
        members = [job.member for job in windows[0]] if windows else []
        weights = torch.tensor([self._contributions[m].weight for m in members], dtype=torch.float32)
        num_dropped = torch.zeros(len(members), dtype=torch.int64)
        for offset, window in windows.items():
            assert [job.member for job in window] == members, "every contributor covers every window"
            size = window[0].size
            values = torch.empty(len(window), size, dtype=torch.float32)  # (M, window)
            for row, job in enumerate(window):
                self._decode(job, out=values[row])
            average, dropped = trimmed_weighted_mean(values, weights, self.rule.trim_per_side)
            self._accumulator[offset : offset + size] = average
            num_dropped += dropped
        for member, count in zip(members, num_dropped.tolist(), strict=True):
            if count:
                self.adjustments[member] = f"trimmed at {count} of {self.num_elements} elements"
        self._averaged_in_place = True

    def folds_done(self, jobs: list[FoldJob]) -> None:
        """Record finished folds (back on the event loop)."""
        for job in jobs:
            self._contributions[job.member].num_folded += job.size
        for contribution in self._contributions:
            if contribution.raw is not None and contribution.num_folded == self.num_elements:
                contribution.raw = None

    # --- the result ----------------------------------------------------------------------------------

    @property
    def contributors(self) -> tuple[int, ...]:
        """Members whose whole contribution is in the sum, in order."""
        return tuple(
            member
            for member, c in enumerate(self._contributions)
            if c.status is SenderStatus.COMPLETE and c.num_folded == self.num_elements
        )

    def encode_average(self, *, error_feedback: ErrorFeedback | None, part_offset: int) -> ReducedPart:
        """Divide by the weight sum and encode the average chunk by chunk (with the owner's feedback)."""
        assert self.finalized and self.is_done() and not self.poisoned, "fold every contribution first"
        contributors = self.contributors
        assert contributors, "nothing to average"
        weight_sum = torch.zeros((), dtype=torch.float32)
        for member in contributors:  # float32, in member order, like the sum itself
            weight_sum += self._contributions[member].weight
        if self.sparse:
            return self._bundle(contributors, float(weight_sum))
        average = self._accumulator  # (part,)
        if not self._averaged_in_place:
            average.div_(weight_sum)
        sizes = chunk_sizes(self.num_elements, self.chunk_num_elements)
        payloads: list[bytes | memoryview] = []
        offset = 0
        for size in sizes:
            values = average[offset : offset + size]
            if error_feedback is not None:
                payloads.append(
                    error_feedback.encode(self.codec, values, part_offset + offset).numpy().tobytes()
                )
            elif self.codec.payload_is_fp32:
                payloads.append(fp32_view(values))  # the average's own bytes: no second copy
            else:
                payloads.append(self.codec.encode(values).numpy().tobytes())
            offset += size
        self._accumulator = self._scratch = torch.empty(0)  # the encoded chunks are all we keep
        return ReducedPart(
            part_index=self.part_index,
            producer_index=self.producer_index,
            contributor_indices=contributors,
            weight_sum=float(weight_sum),
            chunk_sizes=tuple(sizes),
            payloads=tuple(payloads),
        )

    def _bundle(self, contributors: tuple[int, ...], weight_sum: float) -> ReducedPart:
        """Sparse: per chunk, the contributors' payloads in member order (nothing is re-encoded)."""
        by_chunk: dict[int, dict[int, bytes]] = {}
        for job in self._kept:
            assert job.payload is not None, "a sparse contribution is always encoded"
            by_chunk.setdefault(job.offset, {})[job.member] = job.payload
        sizes = chunk_sizes(self.num_elements, self.chunk_num_elements)
        offsets = [i * self.chunk_num_elements for i in range(len(sizes))]
        payloads = tuple(b"".join(by_chunk[offset][member] for member in contributors) for offset in offsets)
        self._kept = []
        return ReducedPart(
            part_index=self.part_index,
            producer_index=self.producer_index,
            contributor_indices=contributors,
            weight_sum=weight_sum,
            chunk_sizes=tuple(sizes),
            payloads=payloads,
            contributor_weights=tuple(self._applied_weights[member] for member in contributors),
        )

    def exclusion_reasons(self) -> dict[int, str]:
        """Why each excluded member was left out."""
        return {
            member: c.reason
            for member, c in enumerate(self._contributions)
            if c.status is SenderStatus.EXCLUDED and c.reason
        }
