"""Overlapped DiLoCo: round k's averaging runs during phase k+1, its update lands one round late.

The reference is a hand computation of the one-round-delayed outer Nesterov step (torch.optim.SGD's
documented update: b ← μb + g; θ ← θ − lr(g + μb)) on a tiny linear model whose "inner steps" we
set by hand, so every number is known.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from node.config import NodeConfig
from node.outer.diloco import DiLoCo
from node.outer.round import OuterRound, RoundSettings
from node.outer.seam import Adopt, AdoptedState, Averaged, RoundOutcome, RoundRequest, RoundStats
from node.outer.state import tensor_hash
from node.train.trainer import Trainer
from tests.node.outer.test_diloco import NoData

LR, MOMENTUM = 0.7, 0.9


class HalvingAverager:
    """Pretends the other peers contributed nothing: the 'swarm mean' is half of our Δ.

    Runs on the outer round's averaging thread; records which thread and which rounds it saw.
    """

    def __init__(self, *, gated: bool = False) -> None:
        self.rounds: list[int] = []
        self.threads: set[str] = set()
        # gated: each round answers only once the test releases it, so the test can read the global
        # params between one round landing and the next one (in flight at once) being applied.
        self.gate = threading.Semaphore(0) if gated else None

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        if self.gate is not None:
            assert self.gate.acquire(timeout=30), "the test never released the round"
        self.rounds.append(request.round_index)
        self.threads.add(threading.current_thread().name)
        return RoundOutcome(Averaged(0.5 * vector), RoundStats(num_peers=2))


def nesterov(theta: torch.Tensor, buffer: torch.Tensor | None, grad: torch.Tensor):
    buffer = grad.clone() if buffer is None else MOMENTUM * buffer + grad
    return theta - LR * (grad + MOMENTUM * buffer), buffer


def local_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def test_overlapped_rounds_apply_the_mean_one_round_late():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    averager = HalvingAverager(gated=True)
    diloco = DiLoCo(model, outer_lr=LR, outer_momentum=MOMENTUM)
    settings = RoundSettings(inner_steps=1, overlap=True, model="test", corpus_sha256="none")
    rounds = OuterRound(
        diloco, averager=averager, swarm=None, settings=settings, data=NoData(), stop_requested=lambda: False
    )
    theta = local_params(model).clone()  # θ_global, by hand
    buffer = None
    steps = [torch.randn_like(theta) * 0.1 for _ in range(4)]  # what each phase's inner steps do
    pending_delta = None
    try:
        for phase, step in enumerate(steps, start=1):
            start = local_params(model).clone()
            torch.nn.utils.vector_to_parameters(start - step, model.parameters())  # "inner steps"
            torch.testing.assert_close(diloco.phase_delta(), step, rtol=0, atol=1e-6)  # Δ_k: this phase's
            rounds.count_step(1, 1.0)
            report = rounds.at_step_boundary()  # round k-1 lands, round k goes in flight
            if pending_delta is None:
                assert report is None  # nothing in flight after the first phase
            else:
                theta, buffer = nesterov(theta, buffer, 0.5 * pending_delta)
                assert report is not None and report.round_index == phase - 1 and report.kind == "averaged"
                torch.testing.assert_close(diloco.global_params, theta, rtol=0, atol=1e-6)
            assert rounds.in_flight and rounds.phase == phase + 1
            # The next phase starts from the newest global params plus this phase's own progress.
            torch.testing.assert_close(local_params(model), theta - step, rtol=0, atol=1e-6)
            pending_delta = step
            assert averager.gate is not None
            averager.gate.release()  # round `phase` may land now (during the next phase)
        last = rounds.finish()
        theta, buffer = nesterov(theta, buffer, 0.5 * pending_delta)
        assert last is not None and last.round_index == len(steps) and last.model_is_global
        torch.testing.assert_close(diloco.global_params, theta, rtol=0, atol=1e-6)
        torch.testing.assert_close(
            local_params(model), diloco.global_params, rtol=0, atol=0
        )  # the model ends on θ_global
    finally:
        rounds.close()
    assert averager.rounds == [1, 2, 3, 4]
    assert all(name.startswith("outer-averaging") for name in averager.threads)


@pytest.mark.timeout(120)
def test_trainer_with_overlap_records_every_round(tmp_path):
    config = NodeConfig.from_flat(
        model="nano", run_dir=str(tmp_path / "run"), max_rounds=3, inner_steps=4, batch_size=2,
        eval_batches=1, log_every=100, overlap=True, swarm=False, threads=1,
    )  # fmt: skip
    trainer = Trainer(config, averager=HalvingAverager())
    trainer.run()
    rounds = [r for r in _read(trainer) if r["kind"] == "round"]
    assert [r["round"] for r in rounds] == [1, 2, 3]
    assert all(r["overlap"] for r in rounds)
    assert all(0 < r["utilization"] <= 1 for r in rounds[:-1])
    assert rounds[-1]["utilization"] is None  # applied after the last phase, with no phase beside it
    # Three phases of four steps: the run ends after the third phase with the last round applied.
    assert trainer.progress.step == 12 and trainer.progress.round == 3
    assert rounds[-1]["param_hash"] == tensor_hash(trainer.diloco.global_params)
    # The model ends on the global params (the last round was applied, not left in flight).
    torch.testing.assert_close(local_params(trainer.model), trainer.diloco.global_params, rtol=0, atol=0)
    steps = [r for r in _read(trainer) if r["kind"] == "step"]
    assert [s["round"] for s in steps] == [1] * 4 + [2] * 4 + [3] * 4
    # Every phase's inner compute is in some round record, the first phase's too (its round's record
    # is written a phase later): the records' compute is the steps' own time, summed.
    tokens = [0] + [s["tokens"] for s in steps]
    step_seconds = [(tokens[i + 1] - tokens[i]) / s["tokens_per_s"] for i, s in enumerate(steps)]
    assert sum(r["seconds_compute"] for r in rounds) == pytest.approx(sum(step_seconds), rel=1e-6)
    assert rounds[0]["seconds_compute"] == pytest.approx(sum(step_seconds[:8]), rel=1e-6)


def _read(trainer: Trainer) -> list[dict]:
    from node.ops.metrics import read_metrics

    return read_metrics(trainer.run_dir / "metrics.jsonl")


class AdoptingAverager:
    """Round 1 sends us to adopt ``state`` (as a swarm whose lineage moved on would); later rounds halve."""

    def __init__(self, state: AdoptedState) -> None:
        self.state, self.rounds = state, []

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        self.rounds.append(request.round_index)
        if request.round_index == 1:
            return RoundOutcome(Adopt(self.state), RoundStats(num_peers=0))
        return RoundOutcome(Averaged(0.5 * vector), RoundStats(num_peers=2))


def test_an_adoption_from_the_round_in_flight_is_taken_mid_phase(tmp_path):
    """Overlap: when the round in flight ends by sending us to adopt the swarm's state, the trainer
    adopts at its next step, not at the phase's end: the steps in between would train params that
    adoption throws away, and the node would reach the swarm a round late again."""
    from node.swarm.state import adopted_state

    settings = dict(
        model="nano", inner_steps=4, batch_size=2, eval_batches=1, log_every=100, swarm=False, threads=1
    )
    source = Trainer(NodeConfig.from_flat(run_dir=str(tmp_path / "source"), max_rounds=2, **settings))
    source.run()  # round 2, step 8
    state = adopted_state(
        source.round.snapshot(), num_elements=source.diloco.num_elements, corpus_sha256=source.corpus.sha256
    )
    averager = AdoptingAverager(state)
    trainer = Trainer(
        NodeConfig.from_flat(run_dir=str(tmp_path / "run"), max_rounds=3, overlap=True, **settings),
        averager=averager,
    )
    trainer.run()
    records = _read(trainer)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    (adopted,) = [r for r in records if r["kind"] == "round" and r["adopted"]]
    # The swarm's counters, taken at once, and the record names the params the node now holds.
    assert adopted["round"] == 2 and adopted["step"] == 8 and adopted["param_hash"] == state.param_hash
    before = [step for step in steps if step <= 8]
    # Phase 1 (steps 1-4), then at most a few steps of phase 2 before the adoption (the averaging
    # thread answers at once), then the swarm's phase from its step 8 on; never all of phase 2.
    assert before[:4] == [1, 2, 3, 4] and 5 <= before[-1] < 8, steps
    assert steps[len(before) :] == [9, 10, 11, 12], steps
    assert averager.rounds == [1, 3] and trainer.progress.round == 3
