"""Robust aggregation rules an owner applies to its part, so one bad contribution cannot wreck the average.

    mean     sum(w_i x_i) / sum(w_i): the plain weighted mean (the default; `reducer.py` folds it).
    clipped  each contribution is scaled down to at most clip_factor x the median of the contributions'
             L2 norms over the part, then the weighted mean: sum(w_i s_i x_i) / sum(w_i), with
             s_i = min(1, clip_factor * median_j ||x_j|| / ||x_i||). A x100 scaled or huge-norm
             contribution then weighs no more than a few honest ones (centered clipping in spirit:
             Karimireddy et al. 2021, "Learning from History for Byzantine Robust Optimization",
             arXiv:2012.10333; here clipped around zero, since a pseudo-gradient's scale is the signal).
    trimmed  coordinate-wise trimmed mean (Yin et al. 2018, "Byzantine-Robust Distributed Learning:
             Towards Optimal Statistical Rates", arXiv:1803.01498): per element, the `trim_per_side`
             largest and smallest values are dropped and the rest averaged. Token weights combine as a
             *trimmed weighted mean*: which values are dropped depends on the values only (ties are
             broken by member order), the kept ones are averaged with their own weights,
             sum_kept(w_i x_i) / sum_kept(w_i), per element. With fewer than 2 * trim_per_side + 1
             contributions, only (num - 1) // 2 per side are dropped, so at least one value is kept.

The norms and the median are over whole contributions to the part, so both robust rules wait for every
contribution of the part to arrive before summing (see `PartReducer`). Everything depends only on the
set of contributors and their bytes, in member order, never on arrival order: a backup that reduces
the part again from the same bytes gets the same bits.

Non-finite contributions never get this far: `Codec.validate` rejects them as they arrive.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["mean", "clipped", "trimmed"]
AGGREGATIONS: tuple[Aggregation, ...] = ("mean", "clipped", "trimmed")


@dataclass(frozen=True, kw_only=True)
class AggregationRule:
    """How an owner combines the contributions to its part (the same on every member of a group)."""

    kind: Aggregation = "mean"
    """"mean", "clipped" or "trimmed" (see the module docstring)."""
    clip_factor: float = 2.0
    """clipped: a contribution's norm over the part is clipped to this many times the median norm."""
    trim_per_side: int = 1
    """trimmed: values dropped per element on each side (the largest and the smallest ones)."""

    def __post_init__(self) -> None:
        if self.kind not in AGGREGATIONS:
            raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.kind!r}")
        if not (math.isfinite(self.clip_factor) and self.clip_factor > 0):
            raise ValueError(f"clip_factor must be finite and positive, got {self.clip_factor}")
        if self.trim_per_side < 0:
            raise ValueError(f"trim_per_side must be >= 0, got {self.trim_per_side}")

    @property
    def waits_for_all(self) -> bool:
        """True if the part can only be summed once every contribution to it has arrived."""
        return self.kind != "mean"


def clip_scales(norms: Sequence[float], clip_factor: float) -> list[float]:
    """Per contribution, the factor that brings its norm down to clip_factor x the median norm (or 1).

    The median of an even count is the mean of the two middle norms. Computed in float64 on a handful
    of numbers, so it is the same on every machine given the same norms.
    """
    threshold = clip_factor * statistics.median(norms)
    return [1.0 if norm <= threshold else threshold / norm for norm in norms]


def squared_norm(values: torch.Tensor) -> float:
    """sum(x^2) of an fp32 chunk in float64 (each square is exact there, so only the sum rounds)."""
    as_double = values.to(torch.float64)
    return float(torch.dot(as_double, as_double))


def trimmed_weighted_mean(
    values: torch.Tensor, weights: torch.Tensor, trim_per_side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element of `values` (M, S), drop the b largest and b smallest of the M values, average the rest.

    `weights` (M,) fp32 are the contributions' weights, rows in member order. The kept values are
    summed in sorted order (a stable sort: ties keep member order), a multiply then an add in fp32, so
    the result is defined bit for bit. Returns the (S,) average and, per member, on how many of the S
    elements its value was dropped.
    """
    num_members, num_elements = values.shape
    trim = min(trim_per_side, (num_members - 1) // 2)
    sorted_values, order = torch.sort(values, dim=0, stable=True)  # (M, S) each
    kept_values = sorted_values[trim : num_members - trim]  # (K, S)
    kept_weights = weights[order[trim : num_members - trim]]  # (K, S)
    total = torch.zeros(num_elements, dtype=torch.float32)
    weight_total = torch.zeros(num_elements, dtype=torch.float32)
    for row in range(num_members - 2 * trim):  # rows in sorted order: a defined summation order
        total += kept_values[row] * kept_weights[row]
        weight_total += kept_weights[row]
    dropped = torch.cat([order[:trim], order[num_members - trim :]]).flatten()
    return total / weight_total, torch.bincount(dropped, minlength=num_members)
