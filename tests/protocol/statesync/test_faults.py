"""Fault plans parse and validate."""

from __future__ import annotations

import pytest

from protocol.statesync import ServeFaultPlan


def test_parse() -> None:
    assert ServeFaultPlan.parse("chunk:die:3") == ServeFaultPlan(point="chunk", action="die", after=3)
    assert ServeFaultPlan.parse("manifest:stall") == ServeFaultPlan(point="manifest", action="stall", after=0)
    assert ServeFaultPlan.parse("chunk:corrupt:2").persistent
    assert not ServeFaultPlan.parse("chunk:abort:2").persistent


@pytest.mark.parametrize(
    "spec", ["chunk", "chunk:explode", "disk:die:1", "chunk:die:x", "chunk:die:-1", "a:b:c:d"]
)
def test_parse_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError):
        ServeFaultPlan.parse(spec)
