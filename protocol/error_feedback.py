"""Error feedback: a sender remembers what its codec lost and sends it again next round.

Quantizing the same kind of update every round with a biased codec (int4 rounds small values to zero)
makes the error accumulate. Error feedback (Seide et al. 2014, "1-bit stochastic gradient descent";
Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", arXiv:1901.09847) keeps the residual

    compensated = x + residual
    payload     = encode(compensated)
    residual    = compensated - decode(payload)

so the sum of what was sent over R rounds differs from the sum of the true vectors by one residual,
not by R quantization errors: the error of a running average shrinks like 1/R.

A decay β < 1 (SparseLoCo's error feedback, below) forgets old residuals geometrically:

    compensated = x + β · residual

so a number left out for many rounds fades instead of arriving all at once, stale from params that
have moved on. β = 1 is the classic rule above, computed exactly as before (no multiplication).

With the sparse top-k codec the same three lines are SparseLoCo's error feedback (Sarfi et al. 2025,
arXiv:2508.15706): decode writes zeros where nothing was sent, so the residual holds every number a
round left out (plus the 2-bit rounding of those it sent), and a number goes out once its accumulated
value is among its block's largest.

In the all-reduce one buffer of the full vector's size serves both roles of a peer: on the parts it
sends to other owners it holds the sender's residual, on the part it owns it holds the residual of
the averaged part the owner broadcasts. If ownership moves between rounds, a slice changes role;
both residuals are quantization errors of the same order, so this only perturbs one round. With a
sparse codec (top-k) the owner re-encodes nothing (`protocol/allreduce/sparse.py`): the whole buffer
is this peer's sender residual, every part included, whoever owns it.
"""

from __future__ import annotations

import torch

from protocol.codecs import Codec


def check_decay(decay: float) -> None:
    """ValueError unless ``decay`` (the residual's factor per round, β) is in [0, 1]."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"error-feedback decay must be in [0, 1], got {decay}")


class ErrorFeedback:
    """Holds the fp32 residual of one flat vector, shape (num_elements,), and its decay β per round."""

    def __init__(self, num_elements: int, *, decay: float = 1.0) -> None:
        if num_elements < 0:
            raise ValueError(f"num_elements must be >= 0, got {num_elements}")
        check_decay(decay)
        self.decay = decay
        self.residual = torch.zeros(num_elements, dtype=torch.float32)  # (E,)

    @property
    def num_elements(self) -> int:
        return self.residual.numel()

    def encode(self, codec: Codec, values: torch.Tensor, offset: int) -> torch.Tensor:
        """Encode values (elements [offset, offset + n) of the vector) plus their residual; update it.

        Returns the payload, and leaves residual[offset:offset + n] = compensated - decode(payload),
        where compensated = values + decay * residual[offset:offset + n].
        """
        num_elements = values.numel()
        if offset < 0 or offset + num_elements > self.num_elements:
            raise ValueError(
                f"slice [{offset}, {offset + num_elements}) is outside the residual of {self.num_elements}"
            )
        residual = self.residual[offset : offset + num_elements]
        compensated = values + residual if self.decay == 1.0 else values + residual * self.decay
        payload = codec.encode(compensated)
        decoded = codec.decode_into(payload, residual)  # reuse the residual slice as scratch
        torch.sub(compensated, decoded, out=residual)
        return payload

    def reset(self) -> None:
        """Forget all residuals (e.g. after the vector's meaning changed)."""
        self.residual.zero_()

    def norm(self) -> float:
        """L2 norm of the residual, for logging."""
        return float(torch.linalg.vector_norm(self.residual))
