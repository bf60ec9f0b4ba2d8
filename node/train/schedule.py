"""Inner learning-rate schedules as pure functions of the global inner step.

The LR is a function of the step count alone, so a resumed run needs no scheduler state and every
peer of the swarm that sits at the same step uses the same LR.

- ``cosine``: linear warmup, then cosine decay from the peak to ``min_lr_ratio`` x peak
  (Loshchilov & Hutter, 2017, SGDR).
- ``wsd``: warmup-stable-decay: linear warmup, a constant plateau, then a linear decay over the last
  ``decay_fraction`` of the horizon (Hu et al., 2024, MiniCPM; Hägele et al., 2024). A run can be
  extended by moving the horizon without disturbing the plateau.
- ``constant``: linear warmup, then the peak.

With a horizon of 0 (a run with no end) every schedule is constant after warmup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LRSchedule:
    kind: str
    peak_lr: float
    warmup_steps: int
    horizon_steps: int
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    def factor(self, step: int) -> float:
        """Multiplier of the peak LR for 0-based inner step ``step``."""
        if self.warmup_steps and step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant" or self.horizon_steps <= self.warmup_steps:
            return 1.0
        floor = self.min_lr_ratio
        if self.kind == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / (self.horizon_steps - self.warmup_steps))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "wsd":
            decay_steps = max(1, round(self.decay_fraction * self.horizon_steps))
            decay_start = self.horizon_steps - decay_steps
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / decay_steps)
            return 1 - (1 - floor) * progress
        raise ValueError(f"unknown LR schedule {self.kind!r}")

    def lr(self, step: int) -> float:
        return self.peak_lr * self.factor(step)
