"""The outer round driving streamed fragments (node/outer/round.py with --fragments), against the
convergence benchmark's loop of the same algorithm (scripts/bench/convergence_variants.py,
run_streaming): at every step due, fragment f's Δ_f averaged as its own vector; τ steps later its mean
applied to θ_global,f and its local params mixed. The reference drives ``FragmentedDiLoCo`` (whose
outer step tests/node/outer/test_fragments.py checks by hand) with no round, thread or schedule
object of the daemon's."""

from __future__ import annotations

import threading

import pytest
import torch

from node.model.gpt import GPT, model_config
from node.outer.diloco import DiLoCo, flatten_params
from node.outer.fragments import (
    FragmentedDiLoCo,
    FragmentedOuterState,
    FragmentSchedule,
    due_fragments,
    model_fragment_plan,
)
from node.outer.round import OuterRound, RoundApplied, RoundSettings
from node.outer.seam import (
    AdoptedState,
    Averaged,
    FellBack,
    RoundDecision,
    RoundOutcome,
    RoundRequest,
    RoundStats,
)
from node.outer.state import tensor_hash
from tests.node.outer.scripted_swarm import ScriptedSwarm
from tests.node.outer.test_diloco import NoData

H, F, MIX, LR, MOMENTUM = 8, 4, 0.5, 0.7, 0.9


class HalvingAverager:
    """The 'swarm mean' is half of our Δ; records each round's index, fragment, size and thread."""

    def __init__(self) -> None:
        self.rounds: list[tuple[int, int | None, int]] = []
        self.threads: set[str] = set()

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        self.rounds.append((request.round_index, request.fragment, vector.numel()))
        self.threads.add(threading.current_thread().name)
        return RoundOutcome(Averaged(0.5 * vector), RoundStats(num_peers=2))


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(model_config("nano", vocab_size=64, seq_len=16))


@torch.no_grad()
def _inner_steps(model: GPT, generator: torch.Generator) -> None:
    """A stand-in for an inner step: every parameter moves by a seeded random amount."""
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=generator) * 1e-2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tau", [0, 1, 2])  # 2 = H/F: a round lands as the next one goes
def test_fragment_rounds_follow_the_schedule_and_match_the_benchmarks_loop(tau: int) -> None:
    model, reference_model = _gpt(), _gpt()
    plan = model_fragment_plan(model, F)
    outer = FragmentedOuterState(
        list(model.parameters()), plan, device=torch.device("cpu"), lr=LR, momentum=MOMENTUM, nesterov=True
    )
    diloco = DiLoCo(model, outer=outer)
    averager = HalvingAverager()
    settings = RoundSettings(
        inner_steps=H, model="test", corpus_sha256="none", fragment_mix=MIX,
        fragments=FragmentSchedule(inner_steps=H, num_fragments=F, overlap_steps=tau),
    )  # fmt: skip
    rounds = OuterRound(
        diloco, averager=averager, swarm=None, settings=settings, data=NoData(), stop_requested=lambda: False
    )
    reference = FragmentedDiLoCo(reference_model, plan, outer_lr=LR, outer_momentum=MOMENTUM)
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}  # fragment -> (the step it lands after, mean)
    generator, reference_generator = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    applied_at = []
    for step in range(1, 3 * H + 1):
        _inner_steps(model, generator)
        rounds.count_step(1, 1.0)
        applied = rounds.at_step_boundary()
        if applied is not None:
            applied_at.append((step, applied.round_index, applied.fragment))
        # The reference, in the benchmark's order: land what is due, then start the rounds due.
        _inner_steps(reference_model, reference_generator)
        for fragment, (due, mean) in list(in_flight.items()):
            if due == step:
                reference.land(fragment, mean, mix=MIX)
                del in_flight[fragment]
        for fragment in due_fragments(step, inner_steps=H, num_fragments=F):
            mean = 0.5 * reference.pseudo_gradient(fragment)
            if tau == 0:
                reference.land(fragment, mean, mix=MIX)
            else:
                in_flight[fragment] = (step + tau, mean)
        assert torch.equal(flatten_params(list(model.parameters()), device="cpu"),
                           flatten_params(list(reference_model.parameters()), device="cpu")), step  # fmt: skip
        if not rounds.in_flight:
            assert torch.equal(diloco.global_params, reference.global_params()), step
            assert diloco.param_hash() == reference.param_hash()
    rounds.finish()

    sizes = outer.fragment_sizes()
    expected = [(r, r % F, sizes[r % F]) for r in range(1, 3 * F + 1)]
    assert averager.rounds == expected  # one sequence of rounds, each its fragment's own vector
    # Round r goes after step s_r = 2r (offsets 0, 2, 4, 6 of H = 8) and is applied τ steps later.
    assert applied_at == [(2 * r + tau, r, r % F) for r in range(1, 3 * F + (tau == 0))]
    assert (averager.threads == {"MainThread"}) == (tau == 0)  # τ > 0: on the averaging thread
    assert sum(sizes) == diloco.num_elements


@pytest.mark.timeout(60)
def test_a_fragment_round_that_falls_back_or_sends_the_node_to_adopt_is_one_round_of_the_sequence() -> None:
    model = _gpt()
    plan = model_fragment_plan(model, F)
    outer = FragmentedOuterState(
        list(model.parameters()), plan, device=torch.device("cpu"), lr=LR, momentum=MOMENTUM, nesterov=True
    )
    diloco = DiLoCo(model, outer=outer)
    own: dict[int, torch.Tensor] = {}

    def decide(delta: torch.Tensor, request: RoundRequest) -> RoundDecision:
        if request.round_index == 2:  # fragment 2's all-reduce failed (a member died in it): our own Δ_2
            own[2] = delta.clone()
            return FellBack(delta, "peer lost")
        return Averaged(0.5 * delta)

    swarm = ScriptedSwarm(decide=decide)
    applied: list[RoundApplied] = []
    settings = RoundSettings(
        inner_steps=H, model="test", corpus_sha256="none", fragment_mix=MIX,
        fragments=FragmentSchedule(inner_steps=H, num_fragments=F, overlap_steps=1),
    )  # fmt: skip
    rounds = OuterRound(
        diloco, averager=swarm, swarm=swarm, settings=settings, data=NoData(),
        stop_requested=lambda: False, on_applied=applied.append,
    )  # fmt: skip
    rounds.start()
    generator = torch.Generator().manual_seed(3)

    def step() -> None:
        _inner_steps(model, generator)
        rounds.count_step(1, 1.0)
        rounds.at_step_boundary()

    for _ in range(3):  # round 1 (fragment 1) after step 2, landed after 3
        step()
    before = outer.fragment(2).global_params.clone()  # (read before round 2's thread may step it)
    step()  # round 2 goes after step 4, on the averaging thread
    step()  # it lands: fragment 2 stepped on our own Δ_2 (Nesterov from a zero buffer, by hand)
    torch.testing.assert_close(
        outer.fragment(2).global_params, before - LR * (1 + MOMENTUM) * own[2], rtol=0, atol=1e-6
    )
    # The swarm's whole state at round 3 (every fragment's version), which round 3 sends us to adopt.
    theirs = diloco.global_params + 0.01
    state = AdoptedState(round=3, param_hash=tensor_hash(theirs), global_params=theirs,
                         outer_momentum=torch.full_like(theirs, 0.5), metadata={"step": 6, "data": {}})  # fmt: skip
    swarm.hand(state)  # round 3 is formed without us (handed before it goes: its thread may ask at once)
    step()  # round 3 goes after step 6
    step()  # it lands after step 7: we adopt
    assert [(a.round_index, a.fragment, a.kind) for a in applied] == [
        (1, 1, "averaged"), (2, 2, "fell_back"), (3, 3, "adopted"),
    ]  # fmt: skip
    assert (applied[2].param_hash, applied[2].fragment_hash) == (state.param_hash, "")
    assert (rounds.progress.round, rounds.progress.step) == (3, 6)  # the swarm's counters
    assert torch.equal(diloco.global_params, theirs) and torch.equal(
        diloco.momentum_buffer(), state.outer_momentum
    )
    assert torch.equal(flatten_params(list(model.parameters()), device="cpu"), theirs)  # no mix left to do
    for _ in range(3):  # round 4 goes after step 8 (the swarm's step 6 + 2): fragment 0's, from round 3
        step()
    rounds.finish()
    assert [(r.round_index, r.fragment, r.lineage) for r in swarm.requests[3:]] == [
        (4, 0, (3, state.param_hash))
    ]
