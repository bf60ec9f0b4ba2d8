"""Paced fragment rounds (node/outer/pace.py, ``--pace-sends``): the send window an overlapped fragment
round asks the swarm for is PACE_MARGIN x τ x the median of the last inner steps' times, none for a
synchronous or whole-model round; a round the loop has to wait on stays paced unless the node stops."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

from node.model.gpt import GPT, model_config
from node.outer.diloco import DiLoCo
from node.outer.fragments import FragmentedOuterState, FragmentSchedule, model_fragment_plan
from node.outer.pace import PACE_MARGIN, StepTimes, send_window
from node.outer.round import OuterRound, RoundSettings
from node.outer.seam import Averaged, RoundDecision, RoundRequest
from tests.node.outer.scripted_swarm import ScriptedSwarm
from tests.node.outer.test_diloco import NoData

H, F = 8, 4


def test_the_window_is_the_margin_of_tau_median_steps() -> None:
    times = StepTimes(kept=4)
    times.add(2.0)
    assert times.median() is None  # one step measured: not yet
    for seconds in (1.0, 30.0, 1.5, 1.0):  # an eval at one boundary (30 s) does not stretch it
        times.add(seconds)
    assert times.median() == pytest.approx(1.25)  # the last 4: 1.0, 30.0, 1.5, 1.0
    assert send_window(1.25, 2, margin=0.6) == timedelta(seconds=0.6 * 2 * 1.25)
    assert send_window(1.25, 0) is None  # a synchronous round (τ = 0) has no steps to spread over
    assert send_window(None, 2) is None
    with pytest.raises(ValueError, match="margin"):
        send_window(1.0, 2, margin=1.5)


def _rounds(
    swarm: ScriptedSwarm,
    *,
    overlap_steps: int,
    pace: bool,
    fragments: bool = True,
    stop_requested: Callable[[], bool] = lambda: False,
) -> OuterRound:
    torch.manual_seed(0)
    model = GPT(model_config("nano", vocab_size=64, seq_len=16))
    schedule = None
    if fragments:
        plan = model_fragment_plan(model, F)
        outer = FragmentedOuterState(
            list(model.parameters()), plan, device=torch.device("cpu"), lr=0.7, momentum=0.9, nesterov=True
        )
        diloco = DiLoCo(model, outer=outer)
        schedule = FragmentSchedule(inner_steps=H, num_fragments=F, overlap_steps=overlap_steps)
    else:
        diloco = DiLoCo(model)
    settings = RoundSettings(
        inner_steps=H, model="test", corpus_sha256="none", fragments=schedule, pace_sends=pace,
        overlap=not fragments and overlap_steps > 0,
    )  # fmt: skip
    rounds = OuterRound(
        diloco, averager=swarm, swarm=swarm, settings=settings, data=NoData(), stop_requested=stop_requested
    )
    rounds.start()
    return rounds


def _train(rounds: OuterRound, step_seconds: list[float]) -> None:
    for seconds in step_seconds:
        rounds.count_step(1, seconds)
        rounds.at_step_boundary()
    rounds.finish()


@pytest.mark.timeout(60)
def test_an_overlapped_fragment_round_asks_for_the_window_of_its_tau_steps() -> None:
    swarm = ScriptedSwarm()
    # Rounds after steps 2, 4, 6, ... (H/F = 2); steps of 0.5 s, one of 40 s (an eval) after step 5.
    step_seconds = [0.5] * 5 + [40.0] + [0.5] * 10
    _train(_rounds(swarm, overlap_steps=2, pace=True), step_seconds)
    windows = [(r.round_index, r.fragment, r.send_window) for r in swarm.requests]
    expected = timedelta(seconds=PACE_MARGIN * 2 * 0.5)  # the median of the last steps: 0.5 s
    assert windows == [(r, r % F, expected) for r in range(1, 9)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("overlap_steps", "pace", "fragments"),
    [(0, True, True), (2, False, True), (1, True, False)],  # synchronous, --pace-sends off, whole model
)
def test_no_window_for_a_synchronous_unpaced_or_whole_model_round(
    overlap_steps: int, pace: bool, fragments: bool
) -> None:
    swarm = ScriptedSwarm()
    _train(_rounds(swarm, overlap_steps=overlap_steps, pace=pace, fragments=fragments), [0.5] * 16)
    assert swarm.requests and all(r.send_window is None for r in swarm.requests)


@pytest.mark.timeout(60)
def test_a_late_paced_round_stays_paced_and_a_stopping_node_sends_the_rest_at_full_rate() -> None:
    stopping = threading.Event()
    lifted = threading.Event()

    def decide(delta: torch.Tensor, request: RoundRequest) -> RoundDecision:
        if request.round_index == 1:
            time.sleep(0.5)  # late: the loop reaches round 1's land step (step 4) long before
        if request.round_index == 3:  # the run's last, in flight when the node is asked to stop
            assert lifted.wait(20), "a stopping node waited on a paced round without lifting its pace"
        return Averaged(0.5 * delta)

    swarm = ScriptedSwarm(decide=decide)
    swarm_lift = swarm.lift_pace

    def lift_pace(round_index: int) -> None:
        swarm_lift(round_index)
        lifted.set()

    swarm.lift_pace = lift_pace  # type: ignore[method-assign]
    rounds = _rounds(swarm, overlap_steps=2, pace=True, stop_requested=stopping.is_set)
    for _ in range(6):
        rounds.count_step(1, 0.5)
        rounds.at_step_boundary()
    stopping.set()
    rounds.finish()
    assert swarm.lifted == [3]  # round 1 was waited on paced; round 3 lifted as the node stopped
    assert [r.round_index for r in swarm.requests] == [1, 2, 3]
