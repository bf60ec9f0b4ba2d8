"""The swarm all-reduce's arithmetic for N members in one process, and the bytes it and DDP send.

``SimulatedAllReduce`` does to N vectors what the butterfly all-reduce of ``protocol.allreduce`` does,
with the same code where it can (``split_by_weight``, ``chunk_sizes``, ``ErrorFeedback``, the real
codecs and ``PartReducer``) and no sockets. With a sparse codec (top-k) it does what the sparse round
does instead (issue 30: the owners relay the contributors' own payloads, nobody re-encodes a sum; see
``SimulatedAllReduce._reduce_sparse``). ``payload_bytes``, ``sends_per_payload`` and
``ddp_bytes_per_step`` are the byte formulas ``bench_convergence.py`` reports against; its docstring
derives them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from protocol.allreduce.group import split_by_weight
from protocol.allreduce.reducer import PartReducer, chunk_sizes
from protocol.allreduce.robust import AggregationRule
from protocol.codecs import Codec, TopKCodec
from protocol.error_feedback import ErrorFeedback

FP32_BYTES = 4


# --- bytes -----------------------------------------------------------------------------------------


def ddp_bytes_per_step(num_workers: int, num_params: int) -> float:
    """Bytes one rank sends in a ring all-reduce of the fp32 gradients: 2 (N - 1) / N x 4 x params."""
    return 2 * (num_workers - 1) / num_workers * FP32_BYTES * num_params


def is_sparse(codec: Codec) -> bool:
    """True for the codecs whose rounds relay the contributors' payloads instead of re-encoding a mean."""
    return isinstance(codec, TopKCodec)


def relays(codec: Codec, owner_sparsifies: bool) -> bool:
    """True when a round relays the contributors' own payloads (the sparse round as built, issue 30's
    design (a)); False when each part's owner encodes its mean (dense codecs, and top-k under design
    (b): the owner re-sparsifies the mean with its own error feedback)."""
    return is_sparse(codec) and not owner_sparsifies


def sends_per_payload(codec: Codec, num_members: int, *, owner_sparsifies: bool = False) -> float:
    """Bytes a member sends per round, in units of one member's whole encoded vector (``payload_bytes``).

    Owner encodes the mean (dense, or top-k under design (b)): 2 (N - 1) / N (its slices of the N - 1
    other parts, then its part's mean to the N - 1 others). Relay (top-k, design (a)): (N - 1) / N +
    (N - 1) (its slices of the other parts, then the N payloads of its part, one N-th of a vector
    each, to the N - 1 others) = (N - 1)(N + 1) / N."""
    n = num_members
    return (n - 1) * (n + 1) / n if relays(codec, owner_sparsifies) else 2 * (n - 1) / n


def payload_bytes(codec: Codec, num_elements: int, num_members: int, chunk_num_elements: int) -> int:
    """The encoded vector as the all-reduce cuts it: sum over equal parts and their chunks."""
    bounds = split_by_weight(num_elements, [1.0] * num_members)
    return sum(
        codec.encoded_num_bytes(size)
        for low, high in zip(bounds[:-1], bounds[1:], strict=True)
        for size in chunk_sizes(high - low, chunk_num_elements)
    )


# --- the simulated swarm all-reduce ----------------------------------------------------------------


class SimulatedAllReduce:
    """The swarm's reduce-scatter + all-gather arithmetic for N members in one process (no sockets).

    Member m owns part m. Phase 1 (reduce-scatter): every member encodes its slice of every other
    part (with its error feedback) and the owner folds them with its own fp32 slice in a
    ``PartReducer``. Phase 2 (all-gather): the owner encodes the weighted mean once (with its
    residual) and every member decodes those bytes. ``bytes_sent[m]`` counts the payloads m sends.
    """

    def __init__(
        self,
        *,
        num_members: int,
        num_elements: int,
        codec: Codec,
        error_feedback: bool,
        chunk_num_elements: int,
        rule: AggregationRule | None = None,
        error_feedback_decay: float = 1.0,
        owner_sparsifies: bool = False,
    ) -> None:
        """``rule``: the owners' aggregation rule (``protocol.allreduce.robust``; None = the weighted
        mean; a sparse codec takes the mean only); ``error_feedback_decay``: the residuals' β;
        ``owner_sparsifies``: a sparse codec's round as issue 30's design (b), the dense round's path
        (each owner encodes its part's mean with its own error feedback), not the relay as built."""
        if is_sparse(codec) and (rule is not None or not error_feedback):
            raise ValueError("the simulated sparse round runs the weighted mean, with error feedback")
        self.relay = relays(codec, owner_sparsifies)
        self.num_members = num_members
        self.rule = rule
        self.adjustments: list[str] = []  # every "member m ... clipped / trimmed" the owners reported
        self.codec = codec
        self.chunk_num_elements = chunk_num_elements
        self.bounds = split_by_weight(num_elements, [1.0] * num_members)
        self.feedback = (
            [ErrorFeedback(num_elements, decay=error_feedback_decay) for _ in range(num_members)]
            if error_feedback
            else None
        )
        self.bytes_sent = [0] * num_members  # cumulative over rounds

    def _encode(self, member: int, values: torch.Tensor, offset: int) -> bytes:
        if self.feedback is None:
            return self.codec.encode(values).numpy().tobytes()
        return self.feedback[member].encode(self.codec, values, offset).numpy().tobytes()

    def reduce(self, vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """The token-weighted mean of ``vectors`` as every member decodes it: (E,) fp32."""
        if len(vectors) != self.num_members or len(weights) != self.num_members:
            raise ValueError(f"need {self.num_members} vectors and weights")
        if self.relay:
            return self._reduce_sparse(vectors, weights)
        if is_sparse(self.codec):
            return self._reduce_owner_sparsified(vectors, weights)
        averaged = torch.empty_like(vectors[0])  # (E,)
        for part in range(self.num_members):
            low, high = self.bounds[part], self.bounds[part + 1]
            reducer = PartReducer(
                part_index=part, producer_index=part, num_elements=high - low, num_members=self.num_members,
                codec=self.codec, chunk_num_elements=self.chunk_num_elements, rule=self.rule,
            )  # fmt: skip
            # Phase 1: the owner's slice stays fp32; every other member's crosses the wire encoded.
            for member, (vector, weight) in enumerate(zip(vectors, weights, strict=True)):
                if member == part:
                    reducer.add_local(member, weight, vector[low:high])
                    continue
                reducer.begin(member, weight)
                offset = 0
                for size in chunk_sizes(high - low, self.chunk_num_elements):
                    payload = self._encode(member, vector[low + offset : low + offset + size], low + offset)
                    reducer.add_chunk(member, offset, size, payload)
                    self.bytes_sent[member] += len(payload)
                    offset += size
                reducer.complete(member)
            reducer.finalize()
            jobs = reducer.plan_folds()
            reducer.run_folds(jobs)
            reducer.folds_done(jobs)
            assert reducer.is_done() and len(reducer.contributors) == self.num_members
            self.adjustments += [f"part {part}: member {m} {note}" for m, note in reducer.adjustments.items()]
            owner_feedback = None if self.feedback is None else self.feedback[part]
            reduced = reducer.encode_average(error_feedback=owner_feedback, part_offset=low)
            # Phase 2: the owner serves its encoded mean to the N - 1 others; all decode the same bytes.
            self.bytes_sent[part] += (self.num_members - 1) * sum(len(p) for p in reduced.payloads)
            offset = low
            for size, payload in zip(reduced.chunk_sizes, reduced.payloads, strict=True):
                self.codec.decode_into(payload, averaged[offset : offset + size])
                offset += size
        return averaged

    def _chunks(self) -> Iterator[tuple[int, int, int]]:
        """(part, first number, size) of every chunk, part by part."""
        for part in range(self.num_members):
            offset = self.bounds[part]
            for size in chunk_sizes(self.bounds[part + 1] - offset, self.chunk_num_elements):
                yield part, offset, size
                offset += size

    def _reduce_owner_sparsified(self, vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """Issue 30's design (b) for a sparse codec: each member sends its top-k (with its error
        feedback) of every other part's chunks to that part's owner, which sums them with its own fp32
        slice in member order, divides by the weight sum and sends the top-k of that mean, with its own
        error feedback (the owner's residual at its part's numbers, which it never encodes as a
        member), to the N - 1 others. (``PartReducer`` relays sparse payloads; this is its dense path's
        arithmetic with decoded top-k contributions.)"""
        assert self.feedback is not None  # checked in __init__
        weight_sum, scales = _float32_weights(weights)
        averaged = torch.empty_like(vectors[0])  # (E,)
        for part, offset, size in self._chunks():
            total = torch.zeros(size, dtype=torch.float32)
            for member, vector in enumerate(vectors):
                values = vector[offset : offset + size]
                if member != part:  # phase 1: its top-k of this chunk to the owner
                    payload = self._encode(member, values, offset)
                    self.bytes_sent[member] += len(payload)
                    values = self.codec.decode(payload, size)
                total += values * scales[member]
            # Phase 2: the owner's top-k of the mean, to the N - 1 others; all decode these bytes.
            mean_payload = self._encode(part, total / weight_sum, offset)
            self.bytes_sent[part] += (self.num_members - 1) * len(mean_payload)
            averaged[offset : offset + size] = self.codec.decode(mean_payload, size)
        return averaged

    def _reduce_sparse(self, vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """A sparse round: every member encodes its whole vector with its own error feedback (the
        owner its own slice too); each part's owner relays the N payloads of each chunk to the N - 1
        others (phase 2), and every member sums their decoded values in member order, float32:

            mean = (((0 + w_0 x_0) + w_1 x_1) + ...) / ((0 + w_0) + w_1 + ...)

        so nothing is encoded twice and what a member's top-k left out stays in its residual."""
        assert self.feedback is not None  # checked in __init__
        weight_sum, scales = _float32_weights(weights)
        averaged = torch.empty_like(vectors[0])  # (E,)
        for part, offset, size in self._chunks():
            total = torch.zeros(size, dtype=torch.float32)
            bundle_bytes = 0
            for member, vector in enumerate(vectors):
                # Phase 1: the member's own top-k of this chunk, to the part's owner (itself: free).
                payload = self._encode(member, vector[offset : offset + size], offset)
                bundle_bytes += len(payload)
                if member != part:
                    self.bytes_sent[member] += len(payload)
                total += self.codec.decode(payload, size) * scales[member]
            # Phase 2: the owner relays the chunk's N payloads to the N - 1 others.
            self.bytes_sent[part] += (self.num_members - 1) * bundle_bytes
            averaged[offset : offset + size] = total / weight_sum
        return averaged


def _float32_weights(weights: list[float]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(the weight sum, each weight) in float32; the sum in member order, like the sums it divides."""
    weight_sum = torch.zeros((), dtype=torch.float32)
    for weight in weights:
        weight_sum += weight
    return weight_sum, [torch.tensor(weight, dtype=torch.float32) for weight in weights]
