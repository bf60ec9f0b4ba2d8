"""The averages of a sparse round: the contributors' own top-k payloads, summed by every member alike.

With a sparse codec (top-k, `protocol.codecs.TopKCodec`) an owner does not re-encode its part's
average. A sum of N sparse contributions is up to N times denser than any of them, so encoding it to
top-k again would drop most of it, on the owner's side where no sender's error feedback remembers it.
Instead the owner's decided bytes for a chunk are the contributors' own encoded chunks, one after
another in member order (a *bundle*), and the header says how much each one weighs:

    average = (((0 + v_a x_a) + v_b x_b) + ...) / ((0 + w_a) + w_b + ...)    a < b < ... contributors

in float32 (a multiply, then an add), where x_i = decode(payload_i), w_i the member's token weight and
v_i its weight as applied: w_i for "mean", w_i * s_i for "clipped" (the owner computes the clip scales
s_i over the whole part and sends v_i). Each add touches only the numbers a payload sent
(`TopKCodec.add_into`, bit for bit the dense sum). Every member decodes the same committed bundle with
the same weights in the same order, so every survivor holds the same bits, and nothing is encoded
twice: what a sender's top-k left out stays in that sender's error-feedback residual
(`protocol.error_feedback`).
The commit machinery (replicas to a strict majority, backups, fallbacks) is the dense round's
(`round.py`): only what is decided differs. The byte formulas, the measurements and the design this
was chosen over are in ARCHITECTURE.md ("Sparse contributions").

"trimmed" does not apply: with top-k most members send zero at most elements, so a coordinate-wise
trimmed mean would drop every number fewer than trim_per_side + 1 members sent, which the senders'
residuals already counted as sent. The round refuses it, and so does a swarm's config
(`check_sparse_aggregation`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from protocol.allreduce.config import MESSAGE_OVERHEAD_BYTES, AllReduceConfig
from protocol.codecs import Codec, CodecError, Payload, TopKCodec, as_uint8

FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_sparse(codec: Codec) -> bool:
    """True for the codecs whose rounds sum the contributors' payloads instead of re-encoding a mean."""
    return isinstance(codec, TopKCodec)


def as_float32(value: float) -> float:
    """`value` rounded to float32 (as the wire carries it), so the owner decodes what it sends."""
    return float(np.float32(value))


def check_sparse_aggregation(codec: Codec, config: AllReduceConfig) -> None:
    """Raise ValueError if the config's aggregation rule does not apply to this codec ("trimmed" with top-k)."""
    if is_sparse(codec) and config.aggregation == "trimmed":
        raise ValueError(
            f"aggregation 'trimmed' does not apply to the sparse codec {codec.name!r}: most members send "
            "zero at most numbers, so a trimmed mean drops what only a few sent; use 'clipped' or 'mean'"
        )


def check_sparse_round(codec: Codec, config: AllReduceConfig, num_members: int) -> None:
    """Raise ValueError if a round of `num_members` cannot run with this codec and config."""
    check_sparse_aggregation(codec, config)
    if not is_sparse(codec):
        return
    bundle_num_bytes = num_members * codec.encoded_num_bytes(config.chunk_num_elements)
    if bundle_num_bytes + MESSAGE_OVERHEAD_BYTES > config.max_message_bytes:
        raise ValueError(
            f"a chunk of the average holds {num_members} members' {codec.name} payloads "
            f"({bundle_num_bytes} bytes), more than max_message_bytes={config.max_message_bytes}; "
            "raise it or lower chunk_num_elements"
        )


class SummedContributions:
    """Validates and decodes one part's average chunks in a sparse round (see the module docstring)."""

    def __init__(self, codec: Codec, weights: Sequence[float], weight_sum: float) -> None:
        self.codec = codec
        self.weights = [as_float32(w) for w in weights]  # v_i, in contributor order
        self.weight_sum = torch.tensor(weight_sum, dtype=torch.float32)

    def encoded_num_bytes(self, num_elements: int) -> int:
        return len(self.weights) * self.codec.encoded_num_bytes(num_elements)

    def _pieces(self, payload: Payload, num_elements: int) -> list[torch.Tensor]:
        """The contributors' payloads in a chunk's bundle (CodecError if its length is wrong)."""
        raw = as_uint8(payload)
        if raw.numel() != self.encoded_num_bytes(num_elements):
            raise CodecError(
                f"a sparse average of {num_elements} numbers from {len(self.weights)} contributors must be "
                f"{self.encoded_num_bytes(num_elements)} bytes, got {raw.numel()}"
            )
        size = self.codec.encoded_num_bytes(num_elements)
        return [raw[i * size : (i + 1) * size] for i in range(len(self.weights))]

    def check_sum(self, payload: Payload, num_elements: int) -> None:
        """CodecError unless a chunk's weighted sum and average stay far from float32's overflow.

        Each payload is finite, but a sum of large ones (or a tiny weight sum) need not be:
        sum_i v_i max|x_i| and that over the weight sum must stay below half of float32's largest."""
        self._check_bound(self._pieces(payload, num_elements), num_elements)

    def _check_bound(self, pieces: list[torch.Tensor], num_elements: int) -> None:
        assert isinstance(self.codec, TopKCodec)
        total = sum(
            weight * self.codec.max_magnitude(piece, num_elements)
            for piece, weight in zip(pieces, self.weights, strict=True)
        )
        limit = FLOAT32_MAX / 2
        if not (total <= limit and total / float(self.weight_sum) <= limit):
            raise CodecError(
                f"the weighted sum of these {len(pieces)} payloads could overflow float32 "
                f"(bound {total:.3g}, weight sum {float(self.weight_sum):.3g})"
            )

    def validate(self, payload: Payload, num_elements: int) -> None:
        pieces = self._pieces(payload, num_elements)
        for piece in pieces:
            self.codec.validate(piece, num_elements)
        self._check_bound(pieces, num_elements)

    def decode_into(self, payload: Payload, out: torch.Tensor) -> torch.Tensor:
        """Sum the weighted contributions in contributor order into `out` (fp32), then divide."""
        pieces = self._pieces(payload, out.numel())
        self._check_bound(pieces, out.numel())
        assert isinstance(self.codec, TopKCodec)
        out.zero_()
        for piece, weight in zip(pieces, self.weights, strict=True):
            self.codec.add_into(piece, out, weight)  # = out += decode(piece) * weight, sparsely
        return out.div_(self.weight_sum)


def check_weights(weights: Sequence[float], num_contributors: int, *, sparse: bool) -> None:
    """Raise ValueError unless an average header's contributor weights fit its codec: one finite,
    non-negative weight per contributor with a sparse codec, none otherwise."""
    if not sparse:
        if weights:
            raise ValueError("contributor weights come only with a sparse codec")
        return
    if len(weights) != num_contributors:
        raise ValueError(f"{len(weights)} contributor weights for {num_contributors} contributors")
    if not all(math.isfinite(w) and w >= 0 for w in weights):
        raise ValueError(f"contributor weights must be finite and >= 0, got {list(weights)}")


def average_codec(codec: Codec, weights: Sequence[float], weight_sum: float) -> Codec | SummedContributions:
    """What decodes a part's average chunks: the round's codec, or (sparse) the summed contributions."""
    return SummedContributions(codec, weights, weight_sum) if is_sparse(codec) else codec
