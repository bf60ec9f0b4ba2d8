"""A phase is ``--inner-steps`` H steps from its first, the first phase of a process included: with
H = 1 every round is one step, whether the run starts fresh, resumes from a checkpoint or adopts the
swarm's state (at its join, or at a round it missed).

The phase's first step used to be fixed at the first phase-end check, after the first step was
counted (``step - step % H`` with the step already 1), so ``--inner-steps 1`` made round 1 two
steps; it is fixed before the step is counted (``OuterRound.count_step``). The reference is the
step count itself: the steps each round was handed by the loop.
"""

from __future__ import annotations

from node.outer.round import RoundProgress
from tests.node.outer.scripted_swarm import ScriptedSwarm
from tests.node.outer.test_outer_round import make_round, params_of, swarm_state, train_phase


def steps_per_round(
    num_steps: int, *, swarm: ScriptedSwarm, restored: RoundProgress | None = None
) -> list[int]:
    """Train ``num_steps`` steps of H = 1, one at a time: the steps each applied round took."""
    outer_round, model, _ = make_round(swarm, inner_steps=1)
    if restored is not None:
        outer_round.restore(restored)
    outer_round.start()
    rounds, since = [], outer_round.progress.step
    for _ in range(num_steps):
        applied = train_phase(outer_round, model, 1, 0.01)
        if applied:
            rounds.append(outer_round.progress.step - since)
            since = outer_round.progress.step
    return rounds


def test_with_one_inner_step_every_round_is_one_step_from_the_first() -> None:
    assert steps_per_round(4, swarm=ScriptedSwarm()) == [1, 1, 1, 1]


def test_a_resumed_run_of_one_inner_step_rounds_is_one_step_a_round() -> None:
    restored = RoundProgress(step=5, round=5, tokens=50, round_tokens=0)
    assert steps_per_round(3, swarm=ScriptedSwarm(), restored=restored) == [1, 1, 1]


def test_after_adopting_the_swarms_state_a_round_is_still_one_step() -> None:
    at_join = ScriptedSwarm()
    _, model, _ = make_round(at_join, inner_steps=1)
    at_join.hand(swarm_state(params_of(model).numel(), round=7, step=7, seed=1))  # a joiner adopts at start
    assert steps_per_round(3, swarm=at_join) == [1, 1, 1]

    missed = ScriptedSwarm()
    outer_round, model, _ = make_round(missed, inner_steps=1)
    outer_round.start()
    assert len(train_phase(outer_round, model, 1, 0.01)) == 1
    missed.hand(swarm_state(params_of(model).numel(), round=9, step=9, seed=2))  # its round 2 is missed
    (adopted,) = train_phase(outer_round, model, 1, 0.01)
    assert adopted.kind == "adopted" and outer_round.progress.step == 9
    assert [len(train_phase(outer_round, model, 1, 0.01)) for _ in range(3)] == [1, 1, 1]
    assert outer_round.progress.step == 12
