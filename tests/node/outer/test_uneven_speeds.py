"""Rounds due by steps with uneven speeds (issue 33, item 3): the defaults keep fast nodes busy,
and nodes of equal speed train exactly H steps whatever the lag between them.

A round is due for the swarm when its first members reach H steps. The real ``OuterRound`` of one
node runs on an injected clock against a scripted swarm whose other members reach H after
``FAST_PHASE`` seconds of each phase (they start each phase when the previous round's group ends,
as every member does) and announce a step time of ``FAST_PHASE / H`` (``peer_steps``): ``round_forming`` says the
round is due from then on, and ``average`` returns when the group forms, at the later of our
readiness and theirs, with the wait as ``seconds_forming``. What the fast members waited for us in
a round is how far past their readiness our own readiness came.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import node.outer.round as round_module
import node.outer.uneven as uneven
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
    due_after: float = FAST_PHASE  # seconds into each phase at which the first members are ready
    phase_started: float = 0.0
    lag: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # await_round_forming's bounds, one per call
    ready_first: list[bool] = field(default_factory=list)  # we said we are ready before they did

    def __post_init__(self) -> None:
        self.phase_started = self.clock.now
        self.forming = lambda: self.clock.now >= self.phase_started + self.due_after
        self.peer_steps = (FAST_PHASE / H, FAST_PHASE / H)

    def await_round_forming(self, seconds: float) -> bool:
        self.waits.append(seconds)
        theirs = self.phase_started + self.due_after
        self.clock.now = max(self.clock.now, min(theirs, self.clock.now + seconds))
        return self.forming()

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        self.requests.append(request)
        theirs = self.phase_started + self.due_after
        self.lag.append(max(self.clock.now - theirs, 0.0))
        self.ready_first.append(self.clock.now < theirs)
        forming = max(theirs - self.clock.now, 0.0) + 0.05  # we wait for them; then the formation's own
        self.clock.now += forming
        self.phase_started = self.clock.now  # every member leaves the round together
        return RoundOutcome(
            Averaged(vector), RoundStats(num_peers=4, members=("a", "b", "c", "d"), seconds_forming=forming)
        )


def run_node(
    swarm: FirstMembers,
    monkeypatch: pytest.MonkeyPatch,
    *,
    step_seconds: float | Callable[[int], float],
    rounds: int,
) -> tuple[OuterRound, list[RoundApplied]]:
    """One node's loop: inner steps of ``step_seconds`` (or ``step_seconds(i)`` for the i-th step)
    until ``rounds`` rounds were applied."""
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
    steps = itertools.count()
    while len(applied) < rounds:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.01)
        seconds = step_seconds(next(steps)) if callable(step_seconds) else step_seconds
        clock.now += seconds
        outer_round.count_step(TOKENS_PER_STEP, seconds)
        if (round := outer_round.at_step_boundary()) is not None:
            applied.append(round)
    return outer_round, applied


@pytest.mark.timeout(60)
def test_a_node_at_a_quarter_of_the_speed_keeps_no_one_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node 4x slower per step (4x the batch) is in every round with the steps it trained, weighted
    by their tokens; the first round's members wait for it at most one of its steps (it sees the
    round due at its next step boundary), later ones not at all: it learned the swarm's pace and is
    ready first (it waits for the round to be due at its last step boundary before the pace, 2 s
    here, and its record counts the wait as blocked). Without the rule: it trains its H steps, and
    the others wait 30 s of every 40 s round."""
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
    lag, jitter) trains H steps in every round, its Δ weighted as without the rule."""
    swarm = FirstMembers()
    swarm.due_after = FAST_PHASE - 1.0
    _, applied = run_node(swarm, monkeypatch, step_seconds=FAST_PHASE / H, rounds=4)
    assert [request.weight for request in swarm.requests] == [H * TOKENS_PER_STEP] * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ratio", [uneven.SLOW_STEP_RATIO, 0.0], ids=["gated", "ungated"])
def test_jitter_between_nodes_of_equal_speed_never_ends_a_phase_short(
    monkeypatch: pytest.MonkeyPatch, ratio: float
) -> None:
    """A loaded machine: a node of the swarm's speed gets the CPU in bursts (steps of 0.6 s and 1.4 s,
    a few stalls of 4 s) and reaches H up to ~15 s after the first members, who are ready after
    10 s. Its median step time stays within SLOW_STEP_RATIO of the speed they announce, so it trains
    exactly H steps every round: a seeded swarm ends on one param_hash however the load falls. With
    the gate off (ratio 0: the reverted rule, which judged slowness by the round being due long
    before it would reach H) the same node ends phases short, and two runs of one swarm part."""
    monkeypatch.setattr(uneven, "SLOW_STEP_RATIO", ratio)
    jitter = [0.6, 1.4, 0.6, 1.4, 4.0, 0.6, 1.4, 0.6, 4.0, 1.4, 0.6, 4.0, 1.4]
    swarm = FirstMembers()
    outer_round, applied = run_node(
        swarm, monkeypatch, step_seconds=lambda i: jitter[i % len(jitter)], rounds=6
    )
    weights = [request.weight for request in swarm.requests]
    if ratio:
        assert weights == [H * TOKENS_PER_STEP] * 6
        assert outer_round._step_times.median() < uneven.SLOW_STEP_RATIO * FAST_PHASE / H
    else:
        assert any(weight < H * TOKENS_PER_STEP for weight in weights)


@pytest.mark.timeout(60)
def test_a_slow_node_trains_h_steps_until_a_faster_peer_announces_its_speed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate needs a measured pace on both sides: while no peer of its lineage announces a step
    time (peers of an older version, or none measured yet), a 4x slower node trains H steps."""
    swarm = FirstMembers()
    swarm.peer_steps = None
    _, applied = run_node(swarm, monkeypatch, step_seconds=4 * FAST_PHASE / H, rounds=3)
    assert [request.weight for request in swarm.requests] == [H * TOKENS_PER_STEP] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("slowest_peer", [FAST_PHASE / H, 4 * FAST_PHASE / H], ids=["equal", "uneven"])
def test_a_node_of_the_fast_class_lagging_ends_short_only_in_a_swarm_of_uneven_speeds(
    monkeypatch: pytest.MonkeyPatch, slowest_peer: float
) -> None:
    """A node of the first members' speed that lags them by 3 s every round (it got less CPU): in a
    swarm of equal speeds it trains H steps every round (its lag is no reason); in a swarm with a
    node at 4x their step time, rounds follow wall-clock time anyway, and it ends its phases short
    rather than hold the round (a lag over the grace, 1.5 s here)."""
    swarm = FirstMembers()
    swarm.peer_steps = (FAST_PHASE / H, slowest_peer)
    swarm.due_after = FAST_PHASE - 3.0
    _, applied = run_node(swarm, monkeypatch, step_seconds=FAST_PHASE / H, rounds=4)
    weights = [request.weight for request in swarm.requests]
    if slowest_peer == FAST_PHASE / H:
        assert weights == [H * TOKENS_PER_STEP] * 4
    else:
        assert weights[0] == (H - 3) * TOKENS_PER_STEP  # at its first step boundary once due
        assert all(weight < H * TOKENS_PER_STEP for weight in weights)
        assert swarm.lag == [0.0] * 4


def test_uneven_is_the_span_of_the_lineages_step_times() -> None:
    """``uneven``: the longest step time of the lineage (the peers' and ours) at least SLOW_STEP_RATIO
    x the shortest, and a phase of such steps lags by more than SHORT_PHASE_GRACE_S; unknown on
    either side is not uneven."""
    ratio, grace_s = uneven.SLOW_STEP_RATIO, uneven.SHORT_PHASE_GRACE_S
    assert uneven.uneven(ratio * 1.0, (1.0, 1.0), 10)  # we are the slow one
    assert uneven.uneven(1.0, (1.0, ratio * 1.0), 10)  # a peer is
    assert not uneven.uneven(ratio * 1.0, (ratio * 1.0, ratio * 1.0), 10)
    assert not uneven.uneven(ratio * 0.99, (1.0, 1.0), 10)
    assert not uneven.uneven(None, (0.2, 0.2), 10)
    assert not uneven.uneven(1.0, None, 10)
    assert not uneven.uneven(1.0, (0.0, 1.0), 10)
    # Tiny steps: 3x apart, but a phase of 5 lags by 0.5 s (medians of 20-200 ms steps jitter that
    # much on a loaded machine); of 50 steps, by 5 s.
    assert not uneven.uneven(0.15, (0.05, 0.05), 5)
    assert uneven.uneven(0.15, (0.05, 0.05), 50)
    assert not uneven.uneven(0.05 + grace_s / 50, (0.05, 0.05), 50)


def test_the_swarm_side_names_the_span_of_its_lineages_step_times() -> None:
    """``SwarmSession.step_seconds_range`` from the view in memory: the shortest and longest step time
    the peers of the lineage we hold announce; not ours, not another lineage's, not a peer that
    announces none; None when no peer does."""
    node = FakeNode([])
    session = session_with(node, 8)
    held = held_state(8)
    ours, other = (0, held.state_id), (0, "f" * 64)

    def span(*peers: PeerRecord) -> tuple[float, float] | None:
        node.driver = SimpleNamespace(
            view=SwarmView.build(list(peers), now=100.0, protocol_version=PROTOCOL_VERSION)
        )  # type: ignore[attr-defined]
        return session.step_seconds_range()

    assert span(peer("me", ours, None, step_seconds=0.1)) is None
    assert span(peer("b", ours, None), peer("c", other, None, step_seconds=0.1)) is None
    assert span(
        peer("b", ours, 1, step_seconds=0.8), peer("c", ours, None, step_seconds=0.5),
        peer("d", other, None, step_seconds=0.1), peer("e", other, None, step_seconds=9.0),
        peer("me", ours, None, step_seconds=0.2), peer("f", ours, None, step_seconds=0.6),
    ) == (0.5, 0.8)  # fmt: skip
    assert span(peer("me", ours, None, step_seconds=9.0), peer("b", ours, None, step_seconds=0.8)) == (
        0.8,
        0.8,
    )


def test_a_record_carries_the_step_time_and_reads_without_it() -> None:
    """``PeerRecord.step_seconds`` is optional: stored and read back, absent in a record of a peer that
    does not announce one (and then left out of its dict), never negative."""
    record = peer("b", (0, "a" * 64), None, step_seconds=0.25)
    assert PeerRecord.from_dict(record.to_dict()).step_seconds == 0.25
    bare = peer("b", (0, "a" * 64), None)
    assert "step_seconds" not in bare.to_dict()
    assert PeerRecord.from_dict(bare.to_dict()).step_seconds is None
    with pytest.raises(ValueError, match="step_seconds"):
        PeerRecord.from_dict({**record.to_dict(), "step_seconds": -1.0})


def peer(
    peer_id: str, lineage: tuple[int, str], ready: int | None, *, step_seconds: float | None = None
) -> PeerRecord:
    """A live record of ``lineage``, ready for round ``ready`` (or not: None)."""
    fields: dict[str, object] = {
        "peer_id": peer_id, "grpc_address": "10.0.0.1:5000", "protocol_version": PROTOCOL_VERSION,
        "round": lineage[0], "param_hash": lineage[1], "ready_for_round": ready, "tokens_per_s": 1.0,
        "bandwidth_bytes_per_s": 1e6, "status": "active", "expires_at": 160.0,
    }  # fmt: skip
    if step_seconds is not None:
        fields["step_seconds"] = step_seconds
    return PeerRecord.from_dict(fields)


def test_the_swarm_side_says_the_round_forms_when_a_peer_of_our_lineage_is_ready() -> None:
    """``SwarmSession.round_forming`` from the view in memory: a peer of the lineage we hold ready for
    its next round; not a peer of another lineage, not one that is not ready, not ourselves. Asking
    turns on watching the view closely (every view_refresh between rounds)."""
    node = FakeNode([])
    session = session_with(node, 8)
    held = held_state(8)
    ours, other = (0, held.state_id), (0, "f" * 64)

    def forming(*peers: PeerRecord) -> bool:
        node.driver = SimpleNamespace(
            view=SwarmView.build(list(peers), now=100.0, protocol_version=PROTOCOL_VERSION)
        )  # type: ignore[attr-defined]
        return session.round_forming()

    assert not forming(peer("b", ours, None), peer("c", other, 1), peer("me", ours, 1))
    assert node.closely == [True]
    assert forming(peer("b", ours, 1))
