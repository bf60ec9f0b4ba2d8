"""Rounds due by steps with uneven speeds (issue 33, item 3): the defaults keep fast nodes busy.

A round is due for the swarm when its first members reach H steps. The real ``OuterRound`` of one
node runs on an injected clock against a scripted swarm whose other members reach H after
``FAST_PHASE`` seconds of each phase (they start each phase when the previous round's group ends,
as every member does): ``round_forming`` says so from then on, and ``average`` returns when the
group forms, at the later of our readiness and theirs, with the wait as ``seconds_forming``. What
the fast members waited for us in a round is how far past their readiness our own readiness came.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import node.outer.round as round_module
from node.outer.diloco import DiLoCo
from node.outer.round import OuterRound, RoundApplied, RoundSettings
from node.outer.seam import Averaged, RoundOutcome, RoundRequest, RoundStats
from protocol.membership.records import PeerRecord, SwarmView
from protocol.swarm.config import PROTOCOL_VERSION
from tests.node.outer.scripted_swarm import ScriptedSwarm
from tests.node.outer.test_outer_round import Data, FakeNode, held_state, session_with

H = 10
FAST_PHASE = 10.0  # seconds the first members take for H steps
TOKENS_PER_STEP = 64


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FirstMembers(ScriptedSwarm):
    """The swarm's other members, H steps every FAST_PHASE seconds: the round is due once they are
    ready; it forms when we are ready too (``lag`` records how long after them, per round)."""

    clock: Clock = field(default_factory=Clock)
    phase_started: float = 0.0
    lag: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # await_round_forming's bounds, one per call
    ready_first: list[bool] = field(default_factory=list)  # we said we are ready before they did

    def __post_init__(self) -> None:
        self.phase_started = self.clock.now
        self.forming = lambda: self.clock.now >= self.phase_started + FAST_PHASE

    def await_round_forming(self, seconds: float) -> bool:
        self.waits.append(seconds)
        theirs = self.phase_started + FAST_PHASE
        self.clock.now = max(self.clock.now, min(theirs, self.clock.now + seconds))
        return self.forming()

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        self.requests.append(request)
        theirs = self.phase_started + FAST_PHASE
        self.lag.append(max(self.clock.now - theirs, 0.0))
        self.ready_first.append(self.clock.now < theirs)
        forming = max(theirs - self.clock.now, 0.0) + 0.05  # we wait for them; then the formation's own
        self.clock.now += forming
        self.phase_started = self.clock.now  # every member leaves the round together
        return RoundOutcome(
            Averaged(vector), RoundStats(num_peers=4, members=("a", "b", "c", "d"), seconds_forming=forming)
        )


def run_node(
    swarm: FirstMembers, monkeypatch: pytest.MonkeyPatch, *, step_seconds: float, rounds: int
) -> tuple[OuterRound, list[RoundApplied]]:
    """One node's loop: inner steps of ``step_seconds`` until ``rounds`` rounds were applied."""
    clock = swarm.clock
    monkeypatch.setattr(round_module, "time", SimpleNamespace(monotonic=clock, perf_counter=clock))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    settings = RoundSettings(inner_steps=H, model="fake", corpus_sha256="c" * 64)
    outer_round = OuterRound(
        DiLoCo(model, outer_lr=0.7, outer_momentum=0.9), averager=swarm, swarm=swarm, settings=settings,
        data=Data(), stop_requested=lambda: False,
    )  # fmt: skip
    outer_round.start()
    swarm.phase_started = clock.now
    applied: list[RoundApplied] = []
    while len(applied) < rounds:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        clock.now += step_seconds
        outer_round.count_step(TOKENS_PER_STEP, step_seconds)
        if (round := outer_round.at_step_boundary()) is not None:
            applied.append(round)
    return outer_round, applied


@pytest.mark.timeout(60)
def test_a_node_at_a_quarter_of_the_speed_keeps_no_one_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node 4x slower per step (4x the batch) is in every round with the steps it trained, weighted
    by their tokens; the first round's members wait for it at most one of its steps (it sees the
    round due at its next step boundary), later ones not at all: it learned the swarm's pace and is
    ready first (it waits for the round to be due at its last step boundary before the pace, 2 s
    here, and its record counts the wait as blocked). Today's code: it trains its H steps, and the
    others wait 30 s of every 40 s round."""
    swarm = FirstMembers()
    outer_round, applied = run_node(swarm, monkeypatch, step_seconds=4 * FAST_PHASE / H, rounds=8)
    assert [r.round_index for r in applied] == list(range(1, 9))
    assert swarm.lag[0] <= 4 * FAST_PHASE / H
    assert swarm.lag[1:] == [0.0] * 7
    assert len(swarm.waits) == 7 and all(r.seconds_waited == pytest.approx(2.05) for r in applied[1:])
    # Never ready before the first members: a node's readiness says the round is due to the others,
    # so a slow node ready first would make nodes of the swarm's speed end their phases short.
    assert swarm.ready_first == [False] * 8
    weights = [request.weight for request in swarm.requests]
    assert all(0 < weight < H * TOKENS_PER_STEP for weight in weights)  # the tokens it trained, not H's
    assert weights[1:] == [2 * TOKENS_PER_STEP] * 7  # 2 steps of 4 s fit before the others' 10 s
    # On the swarm's step count: H per round, as every member's.
    assert outer_round.progress.step == 8 * H
    assert outer_round.progress.tokens == sum(int(w) for w in weights)


@pytest.mark.timeout(60)
def test_a_node_of_the_swarms_speed_trains_h_steps_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal speeds: a node that reaches H a second after the first members (the start barrier's
    lag, jitter) trains H steps in every round, its Δ weighted as today."""
    swarm = FirstMembers()
    swarm.forming = lambda: swarm.clock.now >= swarm.phase_started + FAST_PHASE - 1.0
    _, applied = run_node(swarm, monkeypatch, step_seconds=FAST_PHASE / H, rounds=4)
    assert [request.weight for request in swarm.requests] == [H * TOKENS_PER_STEP] * 4


def test_the_swarm_side_says_the_round_forms_when_a_peer_of_our_lineage_is_ready() -> None:
    """``SwarmSession.round_forming`` from the view in memory: a peer of the lineage we hold ready for
    its next round; not a peer of another lineage, not one that is not ready, not ourselves. Asking
    turns on watching the view closely (every view_refresh between rounds)."""
    node = FakeNode([])
    session = session_with(node, 8)
    held = held_state(8)
    ours, other = (0, held.state_id), (0, "f" * 64)

    def peer(peer_id: str, lineage: tuple[int, str], ready: int | None) -> PeerRecord:
        return PeerRecord.from_dict(
            {
                "peer_id": peer_id, "grpc_address": "10.0.0.1:5000", "protocol_version": PROTOCOL_VERSION,
                "round": lineage[0], "param_hash": lineage[1], "ready_for_round": ready, "tokens_per_s": 1.0,
                "bandwidth_bytes_per_s": 1e6, "status": "active", "expires_at": 160.0,
            }
        )  # fmt: skip

    def forming(*peers: PeerRecord) -> bool:
        node.driver = SimpleNamespace(
            view=SwarmView.build(list(peers), now=100.0, protocol_version=PROTOCOL_VERSION)
        )  # type: ignore[attr-defined]
        return session.round_forming()

    assert not forming(peer("b", ours, None), peer("c", other, 1), peer("me", ours, 1))
    assert node.closely == [True]
    assert forming(peer("b", ours, 1))
