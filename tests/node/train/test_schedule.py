import math

import pytest

from node.train.schedule import LRSchedule


def test_warmup_then_cosine_to_floor() -> None:
    s = LRSchedule(kind="cosine", peak_lr=1.0, warmup_steps=10, horizon_steps=110, min_lr_ratio=0.1)
    assert s.lr(0) == pytest.approx(0.1) and s.lr(9) == pytest.approx(1.0)
    assert s.lr(10) == pytest.approx(1.0)
    assert s.lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr(110) == pytest.approx(0.1) and s.lr(500) == pytest.approx(0.1)


def test_wsd_plateau_then_linear_decay() -> None:
    s = LRSchedule(
        kind="wsd", peak_lr=2.0, warmup_steps=0, horizon_steps=100, min_lr_ratio=0.0, decay_fraction=0.2
    )
    assert s.lr(0) == 2.0 and s.lr(79) == 2.0
    assert s.lr(90) == pytest.approx(1.0) and s.lr(100) == pytest.approx(0.0)


def test_no_horizon_is_constant_after_warmup() -> None:
    for kind in ("cosine", "wsd", "constant"):
        s = LRSchedule(kind=kind, peak_lr=1.0, warmup_steps=4, horizon_steps=0)
        assert s.lr(1) == pytest.approx(0.5) and s.lr(1000) == 1.0
