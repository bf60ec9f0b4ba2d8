"""The outer step against a hand-computed Nesterov update, through the outer round as the loop runs it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from node.outer.diloco import DiLoCo
from node.outer.round import OuterRound, RoundSettings
from node.outer.seam import Averaged, RoundOutcome, RoundRequest, RoundStats, SoloAverager
from node.outer.state import tensor_hash


class RecordingAverager:
    """Records what the node sends and answers with a fixed 'swarm mean'."""

    def __init__(self, answers: list[torch.Tensor]) -> None:
        self.answers = answers
        self.sent: list[torch.Tensor] = []
        self.requests: list[RoundRequest] = []

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        self.sent.append(vector.clone())
        self.requests.append(request)
        return RoundOutcome(
            Averaged(self.answers[request.round_index - 1]),
            RoundStats(num_peers=3, bytes_sent=10, bytes_recv=20),
        )


class NoData:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def skip(self, num_steps: int) -> None: ...

    def reshard(self, shard_index: int, num_shards: int) -> None: ...

    def end_round(
        self, shard: tuple[int, int] | None, *, phase_shards: int | None = None, phase_tokens: int = 0
    ) -> None: ...


def one_step_rounds(diloco: DiLoCo, averager: Any) -> OuterRound:
    """An outer round due after every inner step (H = 1), alone."""
    settings = RoundSettings(inner_steps=1, model="test", corpus_sha256="none")
    return OuterRound(
        diloco, averager=averager, swarm=None, settings=settings, data=NoData(), stop_requested=lambda: False
    )


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_outer_steps_match_hand_computed_nesterov() -> None:
    model = make_model()
    theta0 = flat(model).clone()
    n = theta0.numel()
    g1, g2 = torch.linspace(-1, 1, n), torch.linspace(0.5, -0.25, n)
    averager = RecordingAverager([g1, g2])
    lr, m = 0.7, 0.9
    diloco = DiLoCo(model, outer_lr=lr, outer_momentum=m, nesterov=True)
    rounds = one_step_rounds(diloco, averager)

    # Round 1: the inner steps moved the local params by -0.1.
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.1)
    rounds.count_step(100, 1.0)
    report = rounds.at_step_boundary()
    assert report is not None and report.kind == "averaged" and report.weight == 100.0
    assert averager.requests[0].lineage == (0, tensor_hash(theta0)) and averager.requests[0].round_index == 1
    torch.testing.assert_close(averager.sent[0], torch.full((n,), 0.1), rtol=0, atol=1e-6)
    # Hand-computed torch-style Nesterov: b1 = g1; θ1 = θ0 − lr (g1 + m b1)
    b1 = g1
    theta1 = theta0 - lr * (g1 + m * b1)
    torch.testing.assert_close(flat(model), theta1, rtol=0, atol=1e-6)
    # The hash covers exactly the global params, which the model now holds bit for bit.
    assert report.param_hash == tensor_hash(flat(model)) and report.num_peers == 3

    # Round 2: b2 = m b1 + g2; θ2 = θ1 − lr (g2 + m b2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    rounds.count_step(100, 1.0)
    assert rounds.at_step_boundary() is not None and rounds.progress.round == 2
    torch.testing.assert_close(averager.sent[1], torch.full((n,), -0.05), rtol=0, atol=1e-6)
    b2 = m * b1 + g2
    theta2 = theta1 - lr * (g2 + m * b2)
    torch.testing.assert_close(flat(model), theta2, rtol=0, atol=1e-6)
    torch.testing.assert_close(diloco.global_params, theta2, rtol=0, atol=1e-6)


def test_swarm_of_one_with_lr_1_no_momentum_keeps_local_params() -> None:
    """Outer SGD with lr 1 and no momentum: θ_global − Δ = θ_local, i.e. plain local training."""
    model = make_model()
    diloco = DiLoCo(model, outer_lr=1.0, outer_momentum=0.0, nesterov=False)
    rounds = one_step_rounds(diloco, SoloAverager())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    local = flat(model).clone()
    rounds.count_step(1, 1.0)
    report = rounds.at_step_boundary()
    assert report is not None and report.kind == "solo" and report.num_peers == 1  # a swarm of one
    torch.testing.assert_close(flat(model), local, rtol=0, atol=1e-6)


def test_sparseloco_outer_step_is_plain_sgd_with_nesterov_left_on() -> None:
    """``--outer-momentum 0 --outer-lr 1`` (SparseLoCo's outer step; --outer-nesterov keeps its default):
    θ ← θ − Δ̄ each round, by hand, and no momentum is kept (nor served, nor checkpointed)."""
    diloco = DiLoCo(make_model(), outer_lr=1.0, outer_momentum=0.0)
    generator = torch.Generator().manual_seed(3)
    theta = diloco.global_params.clone()
    for _ in range(2):
        mean = torch.randn(diloco.num_elements, generator=generator)
        diloco.apply_mean(mean)
        theta = theta - mean
        assert torch.equal(diloco.global_params, theta)
        assert diloco.momentum_buffer() is None


def test_offload_keeps_outer_state_on_cpu_and_state_round_trips() -> None:
    model = make_model()
    diloco = DiLoCo(model, offload=True)
    assert diloco.global_params.device.type == "cpu"
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.2)
    diloco.outer_step(diloco.pseudo_gradient())  # a swarm of one: Δ̄ = Δ
    state = diloco.state_dict()
    other = DiLoCo(make_model(), offload=True)
    other.load_state_dict(state)
    assert other.param_hash() == diloco.param_hash()
    momentum, other_momentum = diloco.momentum_buffer(), other.momentum_buffer()
    assert momentum is not None and other_momentum is not None
    torch.testing.assert_close(other_momentum, momentum)
