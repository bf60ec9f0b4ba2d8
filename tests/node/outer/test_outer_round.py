"""The outer round's two sides tested apart, as torchft tests its Manager: the loop's round
(``OuterRound``) against a scripted fake swarm, and the swarm side (``SwarmSession``) against a
scripted fake ``SwarmNode``. No sockets; each asserts what crosses the seam and what it does.

The references are independent: a hand-computed Nesterov step (torch.optim.SGD's documented update),
the adopted state's own tensors and counters, and the scripted round results.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from node.config import ConfigError
from node.outer.diloco import DiLoCo, flatten_params
from node.outer.round import OuterRound, RoundSettings
from node.outer.seam import (
    Adopt,
    AdoptedState,
    Averaged,
    FellBack,
    JoinAnswer,
    JoinRequest,
    RoundDecision,
    RoundRequest,
    StartAnswer,
)
from node.outer.state import tensor_hash
from node.swarm.session import SwarmSession
from node.swarm.state import GLOBAL_PARAMS, round_mean_id, state_snapshot
from protocol.allreduce.allreduce import AllReduceResult
from protocol.codecs import get_codec
from protocol.membership.lineage import Lineage, LineageDecision
from protocol.membership.records import SwarmView
from protocol.statesync.fetch import FetchReport
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.config import PROTOCOL_VERSION
from protocol.swarm.result import GroupAveraged, LineageResync, RoundNotFormed
from tests.node.outer.scripted_swarm import ScriptedSwarm

LR, MOMENTUM = 0.7, 0.9
H = 3


def nesterov(
    theta: torch.Tensor, buffer: torch.Tensor | None, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = grad.clone() if buffer is None else MOMENTUM * buffer + grad
    return theta - LR * (grad + MOMENTUM * buffer), buffer


def params_of(model: nn.Module) -> torch.Tensor:
    return flatten_params(list(model.parameters()), device="cpu")


class Data:
    """The loop's data cursor, recorded."""

    def __init__(self) -> None:
        self.shard = (0, 1)
        self.position: dict[str, Any] = {"epoch": 0, "position": 0}
        self.skipped = 0

    def state_dict(self) -> dict[str, Any]:
        return dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = {k: v for k, v in state.items() if k != "shard_index"}

    def skip(self, num_steps: int) -> None:
        self.skipped += num_steps

    def reshard(self, shard_index: int, num_shards: int) -> None:
        self.shard = (shard_index, num_shards)

    def end_round(
        self, shard: tuple[int, int] | None, *, phase_shards: int | None = None, phase_tokens: int = 0
    ) -> None:
        if shard is not None:
            self.reshard(*shard)


def make_round(
    swarm: ScriptedSwarm, *, inner_steps: int = H, overlap: bool = False
) -> tuple[OuterRound, nn.Module, Data]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    diloco = DiLoCo(model, outer_lr=LR, outer_momentum=MOMENTUM)
    data = Data()
    settings = RoundSettings(inner_steps=inner_steps, overlap=overlap, model="fake", corpus_sha256="c" * 64)
    outer_round = OuterRound(
        diloco, averager=swarm, swarm=swarm, settings=settings, data=data, stop_requested=lambda: False
    )
    return outer_round, model, data


def train_phase(outer_round: OuterRound, model: nn.Module, steps: int, shift: float) -> list[Any]:
    """``steps`` "inner steps", each moving every param by ``shift``; the rounds applied meanwhile."""
    applied = []
    for _ in range(steps):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(shift)
        outer_round.count_step(10, 0.01)
        if (round := outer_round.at_step_boundary()) is not None:
            applied.append(round)
    return applied


def swarm_state(num_elements: int, *, round: int, step: int, seed: int) -> AdoptedState:
    generator = torch.Generator().manual_seed(seed)
    params = torch.randn(num_elements, generator=generator)
    momentum = torch.randn(num_elements, generator=generator)
    return AdoptedState(
        round=round, param_hash=tensor_hash(params), global_params=params, outer_momentum=momentum,
        metadata={"step": step, "data": {"epoch": 3, "position": 40}},
    )  # fmt: skip


def test_the_start_barrier_sets_the_shard_and_the_round_zero_state_before_the_first_step() -> None:
    """The barrier's answer is acted on before step 1: the swarm's round-0 params loaded and served
    (our init was not the barrier's lineage), then our data shard; the swarm is told our identity."""
    swarm = ScriptedSwarm()
    outer_round, model, data = make_round(swarm)
    theirs = swarm_state(params_of(model).numel(), round=0, step=0, seed=9)
    swarm.start_answer = StartAnswer(adopt=theirs, shard=(1, 2))
    outer_round.start()
    assert swarm.calls == ["join", "publish", "await_start_peers", "publish"]
    assert data.shard == (1, 2) and outer_round.progress.step == 0
    assert torch.equal(params_of(model), theirs.global_params)
    assert swarm.served[-1].state_id == theirs.param_hash
    request = swarm.join_request
    assert request is not None and len(request.identity) == 64 and request.rank is None


def test_the_loop_acts_on_each_decision_once_and_tells_the_swarm_what_it_needs() -> None:
    swarm = ScriptedSwarm(shard=(1, 2))
    outer_round, model, data = make_round(swarm)
    theta = params_of(model).clone()
    num = theta.numel()
    adopted = swarm_state(num, round=7, step=70, seed=5)
    script: list[Any] = [
        lambda delta, request: Averaged(0.5 * delta),
        lambda delta, request: FellBack(delta, "only 1 peer ready"),
        lambda delta, request: Adopt(adopted),
    ]
    swarm.decide = lambda delta, request: script[request.round_index - 1](delta, request)
    outer_round.start()
    # Start: the swarm is told the model's identity and the state held now; that state is served.
    assert swarm.calls == ["join", "publish", "await_start_peers"]
    assert swarm.join_request.num_elements == num and swarm.join_request.held.state_id == tensor_hash(theta)
    assert swarm.served[0].round_id == 0 and swarm.served[0].state_id == tensor_hash(theta)

    # Round 1: Averaged(Δ̄ = Δ/2): a hand-computed Nesterov step; the model restarts from θ_global.
    (first,) = train_phase(outer_round, model, H, -0.1)
    delta = torch.full((num,), 0.3)
    theta1, buffer = nesterov(theta, None, 0.5 * delta)
    torch.testing.assert_close(params_of(model), theta1, rtol=0, atol=1e-6)
    request = swarm.requests[0]
    assert (request.round_index, request.weight, request.lineage) == (1, 30.0, (0, tensor_hash(theta)))
    assert request.tokens_per_s == pytest.approx(10 / 0.01)  # what the phase trained per second
    assert (first.kind, first.round_index, first.param_hash) == ("averaged", 1, tensor_hash(params_of(model)))
    assert outer_round.progress.round == 1 and data.shard == (1, 2)  # resharded as the swarm said
    assert swarm.served[-1].round_id == 1 and swarm.served[-1].state_id == first.param_hash

    # Round 2: FellBack(own Δ): stepped with our own Δ, counted, its reason kept.
    (second,) = train_phase(outer_round, model, H, 0.05)
    theta2, buffer = nesterov(theta1, buffer, torch.full((num,), -0.15))
    torch.testing.assert_close(params_of(model), theta2, rtol=0, atol=1e-6)
    assert (second.kind, second.reason, outer_round.progress.round) == ("fell_back", "only 1 peer ready", 2)
    assert swarm.requests[1].lineage == (1, first.param_hash)

    # Round 3: Adopt(state): the swarm's params, momentum, counters and data position, nothing stepped.
    (third,) = train_phase(outer_round, model, H, 0.2)
    assert (third.kind, third.param_hash, third.pseudo_gradient_norm) == ("adopted", adopted.param_hash, 0.0)
    assert torch.equal(params_of(model), adopted.global_params)
    momentum = outer_round.diloco.momentum_buffer()
    assert momentum is not None and torch.equal(momentum, adopted.outer_momentum)
    assert (outer_round.progress.step, outer_round.progress.round) == (70, 7)
    assert data.position == {"epoch": 3, "position": 40}
    assert swarm.served[-1].round_id == 7 and swarm.served[-1].state_id == adopted.param_hash
    # Each round reached the swarm once more after the loop acted on it; nothing else crossed the seam.
    rounds = ["average", "after_step", "publish"] * 2 + ["average", "after_adopt", "publish"]
    assert swarm.calls == ["join", "publish", "await_start_peers", *rounds] and swarm.num_adoptions == 1
    # A new phase of H steps starts at the swarm's step 70.
    assert train_phase(outer_round, model, H - 1, 0.0) == [] and outer_round.progress.step == 72


def test_a_joiner_adopts_the_swarms_state_through_the_one_adoption_path() -> None:
    swarm = ScriptedSwarm()
    outer_round, model, data = make_round(swarm)
    adopted = swarm_state(params_of(model).numel(), round=4, step=12, seed=9)
    swarm.join_answer = JoinAnswer(adopted)
    outer_round.start({"error_feedback": torch.zeros(3)})
    assert torch.equal(params_of(model), adopted.global_params)
    assert (outer_round.progress.round, outer_round.progress.step, data.position) == (
        4,
        12,
        {"epoch": 3, "position": 40},
    )
    # Served once loaded; the checkpoint's residual was of our old state: the swarm side decides (it
    # counted no adoption here, so it is handed over).
    assert swarm.calls == ["join", "publish", "await_start_peers", "load_state_dict"]
    assert swarm.served[0].state_id == adopted.param_hash
    # A state the swarm says only brings us closer (serve=False) is loaded but not served.
    swarm = ScriptedSwarm(join_answer=JoinAnswer(adopted, serve=False))
    outer_round, model, _ = make_round(swarm)
    outer_round.start()
    assert (
        swarm.calls == ["join", "await_start_peers"] and outer_round.diloco.param_hash() == adopted.param_hash
    )


def test_a_catching_up_node_ends_its_phase_when_the_swarm_says_and_skips_to_its_step() -> None:
    swarm = ScriptedSwarm(decide=lambda delta, request: Averaged(delta))
    outer_round, model, data = make_round(swarm, inner_steps=5)
    outer_round.start()
    train_phase(outer_round, model, 2, 0.0)
    swarm.end_phase = True
    (applied,) = train_phase(outer_round, model, 1, 0.0)
    # Three steps done of five: the two missing ones are skipped in the data and counted.
    assert data.skipped == 2 and outer_round.progress.step == 5 and applied.round_index == 1


def test_a_phase_runs_on_while_a_node_fetches_our_state() -> None:
    swarm = ScriptedSwarm(decide=lambda delta, request: Averaged(delta), peer_due=True)
    outer_round, model, _ = make_round(swarm)
    outer_round.start()
    assert train_phase(outer_round, model, 2 * H, 0.0) == []  # due after H, held while the peer fetches
    swarm.peer_due = False
    assert len(train_phase(outer_round, model, 1, 0.0)) == 1


def test_a_state_is_served_at_the_lineages_step_not_the_nodes_own() -> None:
    """A node that trained on while its round formed (here: 2H + 1 steps in round 1, where another
    member may have taken H + 3) serves the state at the step every member shares, r·H: the members'
    served states must be byte-identical for a joiner to fetch from all of them at once (before: each
    served its own step, and a joiner over a slow link took the whole state from one source)."""
    swarm = ScriptedSwarm(decide=lambda delta, request: Averaged(delta), peer_due=True)
    outer_round, model, _ = make_round(swarm)
    outer_round.start()
    assert train_phase(outer_round, model, 2 * H, 0.0) == []
    swarm.peer_due = False
    (applied,) = train_phase(outer_round, model, 1, 0.0)
    assert applied.round_index == 1 and outer_round.progress.step == 2 * H + 1
    served = json.loads(swarm.served[-1].metadata)
    assert swarm.served[-1].round_id == 1 and served["step"] == H == outer_round.lineage_step(1)


def test_an_overlapped_round_lands_during_the_next_phase_and_is_served_at_once() -> None:
    release = threading.Event()

    def decide(delta: torch.Tensor, request: RoundRequest) -> RoundDecision:
        assert threading.current_thread().name.startswith("outer-averaging")
        if request.round_index == 1:
            assert release.wait(30)
        return Averaged(0.5 * delta)

    swarm = ScriptedSwarm(decide=decide)
    outer_round, model, data = make_round(swarm, overlap=True)
    outer_round.start()
    assert train_phase(outer_round, model, H, -0.1) == [] and outer_round.in_flight  # round 1 in flight
    boundary_position = dict(data.position)
    data.position = {"epoch": 0, "position": 99}  # the next phase reads on
    release.set()
    in_flight = outer_round._in_flight
    assert in_flight is not None
    in_flight.result(timeout=30)  # round 1 landed on the averaging thread (applied to θ_global)
    # At the next step boundary it is served, with the step and data position of its own phase's end,
    # not the loop's now; the loop still counts it only at the phase's end.
    train_phase(outer_round, model, 1, 0.0)
    assert len(swarm.served) == 2 and swarm.served[-1].round_id == 1 and outer_round.progress.round == 0
    assert (
        f'"step": {H}' in swarm.served[-1].metadata.decode()
        and '"position": 0' in swarm.served[-1].metadata.decode()
    )
    assert boundary_position == {"epoch": 0, "position": 0}
    applied = outer_round.finish()
    assert applied is None or applied.round_index in (1, 2)
    outer_round.close()


# --- the swarm side against a fake SwarmNode ------------------------------------------------------


@dataclass
class FakeGroup:
    member_ids: tuple[str, ...]
    num_streams: int = 1


@dataclass
class FakeConfig:
    run_name: str = "fake"
    round_deadline: timedelta = timedelta(seconds=1)
    record_ttl: timedelta = timedelta(seconds=1)
    view_refresh: timedelta = timedelta(seconds=0.01)
    error_feedback_decay: float = 1.0


class FakeNode:
    """A scripted ``SwarmNode``: ``results`` answer ``run_round`` in turn; ``states`` are what
    ``fetch_state`` serves by state id."""

    def __init__(self, results: list[Any], states: dict[str, Snapshot] | None = None) -> None:
        self.results = results
        self.states = states or {}
        self.codec = get_codec("int8")
        self.peer_id = "me"
        self.config = FakeConfig()
        self.stream_addresses: tuple[str, ...] = ()
        self.published: list[tuple[int, str, int]] = []
        self.fetched: list[str] = []
        self.closely: list[bool] = []
        self.lanes: list[tuple[int, int]] = []

    def run_round(self, vector: torch.Tensor, **kwargs: Any) -> Any:
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    def publish(
        self,
        *,
        round: int,
        param_hash: str,
        tokens_per_s: float,
        snapshot: Snapshot,
        companions: list[Snapshot],
    ) -> None:
        self.published.append((round, param_hash, len(companions)))

    def fetch_state(
        self, decision: LineageDecision, *, state_id: str | None = None, announce: bool = False
    ) -> FetchReport:
        wanted = state_id or decision.canonical.param_hash
        self.fetched.append(wanted)
        return FetchReport(
            snapshot=self.states[wanted], bytes_by_source={"src": 100}, excluded={}, elapsed=timedelta(0)
        )

    def watch_closely(self, on: bool) -> None:
        self.closely.append(on)

    def set_identity(self, identity: str, *, rank: int | None) -> None:
        self.identity = (identity, rank)  # what the session says it trains (SwarmNode.set_identity)

    def set_data_lane(self, lane: tuple[int, int], *, store_now: bool = False) -> None:
        self.lanes.append(lane)  # what our records say we read (SwarmNode.set_data_lane)

    def view_or_last(self, why: str) -> SwarmView:
        return SwarmView.build([], now=0.0, protocol_version=PROTOCOL_VERSION)  # nobody else reads a lane

    def lineage(self, *, round: int, param_hash: str) -> LineageDecision:
        raise AssertionError("not reached in these scripts")


def allreduce(averaged: torch.Tensor, *, fell_back: bool = False) -> AllReduceResult:
    return AllReduceResult(
        averaged=averaged, contributors=[["me", "peer"]], producers=["me"], fell_back=fell_back,
        failures=["peer: lost"] if fell_back else [], bytes_sent=10, bytes_recv=20,
        bytes_sent_by_phase={"reduce_scatter": 6, "all_gather": 4}, bytes_recv_by_phase={"reduce_scatter": 12, "all_gather": 8},
        seconds=0.5,
    )  # fmt: skip


def held_state(num_elements: int, round: int = 0, seed: int = 1) -> Snapshot:
    params = torch.randn(num_elements, generator=torch.Generator().manual_seed(seed))
    return state_snapshot(
        global_params=params,
        outer_momentum=None,
        round=round,
        step=0,
        data={},
        model="fake",
        corpus_sha256="c" * 64,
    )


def session_with(node: FakeNode, num_elements: int) -> SwarmSession:
    session = SwarmSession(node, joining=False)  # type: ignore[arg-type]
    held = held_state(num_elements)
    answer = session.join(
        JoinRequest(
            num_elements=num_elements, corpus_sha256="c" * 64, held=held,
            stepper=lambda mean, start: (start[0] - mean, None), stop_requested=lambda: False,
        )
    )  # fmt: skip
    assert answer == JoinAnswer()  # not joining: our own state, served by the loop
    return session


def request(round_index: int, lineage_hash: str) -> RoundRequest:
    return RoundRequest(
        round_index=round_index, weight=5.0, lineage=(round_index - 1, lineage_hash), tokens_per_s=1.0
    )


def test_the_swarm_side_turns_each_round_result_into_one_decision(caplog: pytest.LogCaptureFixture) -> None:
    num = 64
    vector = torch.linspace(-1, 1, num)
    mean = 0.25 * vector
    canonical = held_state(num, round=3, seed=7)
    decision = LineageDecision(
        canonical=Lineage(3, canonical.state_id), num_canonical_peers=2, local=Lineage(0, "x"),
        in_canonical=False, sync_sources=("src",),
    )  # fmt: skip
    node = FakeNode(
        [
            GroupAveraged(round=1, group=FakeGroup(("me", "peer")), allreduce=allreduce(mean)),  # type: ignore[arg-type]
            GroupAveraged(
                round=2, group=FakeGroup(("me", "peer")), allreduce=allreduce(vector, fell_back=True)
            ),  # type: ignore[arg-type]
            RoundNotFormed(round=3, reason="only 1 peer ready"),
            TimeoutError("the swarm's loop"),
            LineageResync(round=5, decision=decision),
        ],
        states={canonical.state_id: canonical},
    )
    session = session_with(node, num)
    ours = held_state(num).state_id
    outcomes = [session.average(vector, request(i, ours)) for i in range(1, 6)]
    decisions = [o.decision for o in outcomes]
    # averaged: the group's mean, its members and bytes; members reshard the data.
    assert isinstance(decisions[0], Averaged) and torch.equal(decisions[0].mean, mean)
    stats = outcomes[0].stats
    assert (stats.num_peers, stats.members, stats.bytes_sent, stats.bytes_recv) == (2, ("me", "peer"), 10, 20)
    assert stats.bytes_by_phase == {
        "sent_reduce_scatter": 6,
        "sent_all_gather": 4,
        "recv_reduce_scatter": 12,
        "recv_all_gather": 8,
    }
    assert stats.seconds_allreduce == 0.5 and stats.codec_error is not None
    agreed = session.after_step(stats.members)
    assert agreed is not None and (agreed.shard_index, agreed.num_shards) == (0, 2)
    assert node.lanes == [(0, 2)]  # in our next record
    # fell back inside the all-reduce, no group formed, the swarm's loop out of time: our own Δ.
    assert [type(d) for d in decisions[1:4]] == [FellBack, FellBack, FellBack]
    assert [o.stats.failures_by_kind for o in outcomes[1:4]] == [
        {"peer": 1, "fell_back": 1},
        {"round_failed": 1},
        {"timeout": 1},
    ]
    assert decisions[2].reason == "only 1 peer ready"  # type: ignore[union-attr]
    # off the lineage: the canonical state, fetched whole (our last round fell back: no catch-up from it).
    adopt = decisions[4]
    assert (
        isinstance(adopt, Adopt)
        and adopt.state.param_hash == canonical.state_id
        and not adopt.state.caught_up
    )
    assert node.fetched == [canonical.state_id] and outcomes[4].stats.bytes_recv_state_sync == 100
    assert outcomes[4].stats.num_peers == 0
    # Rounds 2-4 stepped on our own Δ; the adopted state holds none of them: a WARNING names them.
    discarded = [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "discards" in r.getMessage()
    ]
    assert len(discarded) == 1 and "discards 3 round(s)" in discarded[0] and "round(s) 2-4" in discarded[0]
    residual = session.error_feedback
    # Adopted mid-phase: the lineage's members read the round's shards; we read spare lane 0 beside them.
    assert session.after_adopt(adopt.state) == 0 and node.lanes[-1][0] >= node.lanes[-1][1]
    assert session.num_adoptions == 1 and session.error_feedback is not residual  # fresh residual
    assert session.catching_up and node.closely == [True]


def test_the_swarm_side_refuses_a_state_of_another_model() -> None:
    num = 64
    other_model = held_state(num + 1, round=3, seed=7)
    decision = LineageDecision(
        canonical=Lineage(3, other_model.state_id), num_canonical_peers=2, local=Lineage(0, "x"),
        in_canonical=False, sync_sources=("src",),
    )  # fmt: skip
    node = FakeNode([LineageResync(round=1, decision=decision)], states={other_model.state_id: other_model})
    session = session_with(node, num)
    with pytest.raises(ConfigError, match="parameters"):
        session.average(torch.zeros(num), request(1, held_state(num).state_id))


def test_the_swarm_side_serves_the_round_mean_beside_the_state_it_led_to() -> None:
    num = 64
    mean = torch.full((num,), 0.5)
    node = FakeNode([GroupAveraged(round=1, group=FakeGroup(("me", "peer")), allreduce=allreduce(mean))])  # type: ignore[arg-type]
    session = session_with(node, num)
    ours = held_state(num)
    session.average(torch.zeros(num), request(1, ours.state_id))
    stepped = ours.tensors[GLOBAL_PARAMS] - mean
    after = state_snapshot(
        global_params=stepped,
        outer_momentum=None,
        round=1,
        step=3,
        data={},
        model="fake",
        corpus_sha256="c" * 64,
    )
    session.publish(after, tokens_per_s=2.0)
    assert node.published == [(1, after.state_id, 1)]  # the state and its round mean (one companion)
    assert round_mean_id(after.state_id).startswith("round-mean:")
