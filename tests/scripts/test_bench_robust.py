"""bench_robust: the attacks it simulates, the robust rules in its simulated all-reduce, and its verdict."""

from __future__ import annotations

import pytest
import torch

from protocol.allreduce.robust import AggregationRule
from protocol.codecs import get_codec
from tests.scripts.script_loader import load_script

simulated = load_script("simulated_allreduce")
bench = load_script("bench_robust")


def test_attacks() -> None:
    delta = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    assert torch.equal(bench.attacked(delta, "scaled", 100.0, generator), delta * 100)
    assert torch.equal(bench.attacked(delta, "sign_flipped", 100.0, generator), -delta)
    noise = bench.attacked(delta, "noise", 100.0, generator)
    assert float(noise.norm()) == pytest.approx(100 * float(delta.norm()), rel=1e-5)


@pytest.mark.parametrize("kind", ["clipped", "trimmed"])
def test_simulated_allreduce_applies_the_rule(kind: str) -> None:
    """A x100 member barely moves the robust mean; the owners report it in every part."""
    generator = torch.Generator().manual_seed(0)
    vectors = [torch.randn(1001, generator=generator) for _ in range(5)]
    honest = torch.stack(vectors).mean(0)
    vectors[2] = vectors[2] * 100
    allreduce = simulated.SimulatedAllReduce(
        num_members=5, num_elements=1001, codec=get_codec("none"), error_feedback=False,
        chunk_num_elements=100, rule=AggregationRule(kind=kind),  # type: ignore[arg-type]
    )  # fmt: skip
    averaged = allreduce.reduce(vectors, [1.0] * 5)
    plain = torch.stack(vectors).mean(0)  # off by 99/5 x ||x_2|| ~ 20 x the clip bound
    assert (averaged - honest).norm() < 0.05 * (plain - honest).norm()
    assert sum("member 2 " in note for note in allreduce.adjustments) == 5


def test_summary_verdict() -> None:
    records = [
        {"scenario": "clean:mean", "eval_loss": 4.0},
        {"scenario": "scaled:mean", "eval_loss": 6.0},
        {"scenario": "scaled:clipped", "eval_loss": 4.1},
    ]
    line = bench.summary(records)
    assert line.startswith("robust aggregation [PASS") and "+50.0%" in line
    records[2]["eval_loss"] = 4.4
    assert bench.summary(records).startswith("robust aggregation [FAIL")
