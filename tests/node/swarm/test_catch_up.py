"""A member behind the swarm steps to its state with the rounds' means, over real sockets.

Two SwarmNodes on loopback (hivemind DHT, gRPC): the first serves a trainer's states after rounds 2
and 3, each with its round's mean beside it (``round_mean_snapshot``); the second holds the same
trainer's state after round 1. When its next round's lineage check sends it to the swarm's state,
its SwarmSession fetches only the two means (their int8 bytes, each under 1/7 of the state's), steps
itself to the swarm's param_hash and outer momentum through round 2's, and its loop serves round 3's
mean on. When no source serves a mean, it fetches the whole state instead.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import node.swarm.session as session_module
from node.outer.seam import JoinAnswer, JoinRequest
from node.swarm.catch_up import max_catch_up_rounds, rejoin_due
from node.swarm.session import SwarmSession
from node.swarm.setup import swarm_config
from node.swarm.state import adopted_state, caught_up_state, round_mean_id, round_mean_snapshot
from node.train.trainer import Trainer
from protocol.allreduce.allreduce import AllReduceResult, EncodedChunk
from protocol.codecs import get_codec
from protocol.error_feedback import ErrorFeedback
from protocol.membership.lineage import Lineage, LineageDecision
from protocol.membership.records import SwarmView
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.node import SwarmNode
from protocol.swarm.result import GroupAveraged, LineageResync, RoundResult
from tests.node.swarm.test_swarm_session import (
    RecordingAverager,
    corpus_file,
    end_phase,
    one_round,
    small_config,
    stepper,
)
from tests.protocol.membership.fake_swarm import PROTOCOL_VERSION, fake_hash, make_record
from tests.protocol.swarm.test_swarm_node import started_nodes, wait_for_lineages

__all__ = ["corpus_file"]  # fixture


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Poll ``condition`` every 0.1 s for up to ``seconds``; whether it held."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def resync_to(decision: LineageDecision) -> Callable[..., RoundResult]:
    """A ``SwarmNode.run_round`` whose lineage check finds us off the swarm's lineage: ``decision``."""

    def run_round(vector: torch.Tensor, *, round: int, **_: object) -> RoundResult:
        return LineageResync(round=round + 1, decision=decision)

    return run_round


@pytest.fixture
def two_nodes() -> Iterator[list[SwarmNode]]:
    with started_nodes(2, f"catch-up-{uuid.uuid4().hex[:12]}") as started:
        yield started


def answer_joins_with(monkeypatch: pytest.MonkeyPatch, session: SwarmSession, state: Any) -> None:
    """The session's joins are answered with `state` (as a joiner's is with a state fetched whole)."""
    join = session.join

    def join_answered(request: JoinRequest) -> JoinAnswer:
        join(request)
        return JoinAnswer(state)

    monkeypatch.setattr(session, "join", join_answered)


@pytest.mark.timeout(120)
def test_a_member_two_rounds_behind_fetches_their_means_not_the_state(
    corpus_file: Path, tmp_path: Path, two_nodes: list[SwarmNode], monkeypatch: pytest.MonkeyPatch
) -> None:
    server, client = two_nodes
    source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=1))
    source.run()
    session = SwarmSession(client, joining=False)
    behind = Trainer(small_config(corpus_file, tmp_path / "behind", seed=1), swarm=session)
    round_1 = adopted_state(source.round.snapshot(), num_elements=behind.diloco.num_elements,
                            corpus_sha256=behind.corpus.sha256)  # fmt: skip
    previous = (1, source.diloco.param_hash())

    companions = []
    for round in (2, 3):  # two rounds without `behind`; the server keeps both publishes
        round_mean = one_round(source, RecordingAverager("int8"))
        state = source.round.snapshot()
        companions.append(round_mean_snapshot(state, round_mean))
        server.publish(round=round, param_hash=state.state_id, tokens_per_s=1.0, snapshot=state,
                       companions=companions[-1:])  # fmt: skip
    assert companions[0].state_id in server.server.state_provider.kept_state_ids

    # `behind` holds the swarm's state after round 1: its join is answered with it (as a joiner's
    # join is with a state fetched whole); its loop loads it and serves round 1.
    answer_joins_with(monkeypatch, session, round_1)
    behind.round.start()
    wait_for_lineages(
        two_nodes, {server.peer_id: Lineage(3, state.state_id), client.peer_id: Lineage(*previous)}
    )

    # Its next round's lineage check sends it to the swarm's state, which it steps to with the means.
    decision = client.lineage(round=1, param_hash=previous[1])
    assert not decision.in_canonical and decision.canonical == Lineage(3, state.state_id)
    monkeypatch.setattr(client, "run_round", resync_to(decision))
    applied = end_phase(behind)
    assert applied.kind == "adopted" and applied.caught_up and session.num_caught_up == 1
    # Both rounds' int8 bytes, well under the one state's.
    assert applied.stats.bytes_recv_state_sync == sum(c.num_bytes for c in companions) < state.num_bytes / 3.5
    assert session.catching_up and client.driver.watch_closely  # to see the swarm's next round sooner
    assert behind.diloco.param_hash() == applied.param_hash == state.state_id
    assert behind.progress.round == 3
    assert torch.equal(behind.diloco.momentum_buffer(), source.diloco.momentum_buffer())
    assert client.server.state_provider.kept_state_ids[:2] == [state.state_id, round_mean_id(state.state_id)]

    # Round 4 served without its mean (e.g. its members ran with --overlap): the whole state it is.
    one_round(source, RecordingAverager("int8"))
    newer = source.round.snapshot()
    assert not session.phase_should_end()  # the swarm is where we are, and not ready yet
    server.publish(round=4, param_hash=newer.state_id, tokens_per_s=1.0, snapshot=newer)
    wait_for_lineages(two_nodes, {server.peer_id: Lineage(4, newer.state_id)})
    # The swarm moved past the state we adopted: end the phase now (its round catches us up),
    # rather than train a whole phase on params nobody else holds (the view is read every second).
    assert wait_until(session.phase_should_end, 10)
    decision = client.lineage(round=3, param_hash=state.state_id)
    assert decision.canonical == Lineage(4, newer.state_id)
    monkeypatch.setattr(client, "run_round", resync_to(decision))
    behind.inner_step()
    early = behind.round.at_step_boundary()  # one step into the phase of H = 2
    assert early is not None and early.kind == "adopted"
    assert early.param_hash == newer.state_id and not early.caught_up
    assert session.num_caught_up == 1 and early.stats.bytes_recv_state_sync == newer.num_bytes

    # Our round 5 fails (the swarm's loop misses its deadline) and we step on our own Δ, while the
    # swarm steps to rounds 5 and 6 and serves both means: no chain of means leads to our state, but
    # one leads from the state we held before that step (round 4's, which our provider keeps beside
    # our own): we step from it with the two means, not the whole state (before, the whole state).
    def late_round(*args: object, **kwargs: object) -> None:
        raise TimeoutError("injected: the round's loop missed its deadline")

    monkeypatch.setattr(client, "run_round", late_round)
    applied = end_phase(behind)
    assert applied.round_index == behind.progress.round == 5 and applied.kind == "fell_back"
    assert session._stepped_alone
    means = []
    for round in (5, 6):
        round_mean = one_round(source, RecordingAverager("int8"))
        newest = source.round.snapshot()
        means.append(round_mean_snapshot(newest, round_mean))
        server.publish(round=round, param_hash=newest.state_id, tokens_per_s=1.0, snapshot=newest,
                       companions=means[-1:])  # fmt: skip
    wait_for_lineages(two_nodes, {server.peer_id: Lineage(6, newest.state_id)})
    decision = client.lineage(round=5, param_hash=behind.diloco.param_hash())
    assert not decision.in_canonical and decision.canonical == Lineage(6, newest.state_id)
    monkeypatch.setattr(client, "run_round", resync_to(decision))
    applied = end_phase(behind)
    assert applied.kind == "adopted" and applied.param_hash == newest.state_id and applied.caught_up
    assert session.num_caught_up == 2
    assert applied.stats.bytes_recv_state_sync == sum(m.num_bytes for m in means) < newest.num_bytes / 3.5
    assert behind.diloco.param_hash() == newest.state_id
    assert torch.equal(behind.diloco.momentum_buffer(), source.diloco.momentum_buffer())

    # Two rounds on our own Δ in a row: the state before the first is no longer kept, so the whole
    # state is fetched at once, without first trying (and paying for) a mean.
    monkeypatch.setattr(client, "run_round", late_round)
    for round in (7, 8):
        applied = end_phase(behind)
        assert applied.round_index == round and applied.kind == "fell_back"
    for round in (7, 8, 9):  # the swarm's rounds, each served with its mean
        round_mean = one_round(source, RecordingAverager("int8"))
        newest = source.round.snapshot()
        server.publish(round=round, param_hash=newest.state_id, tokens_per_s=1.0, snapshot=newest,
                       companions=[round_mean_snapshot(newest, round_mean)])  # fmt: skip
    wait_for_lineages(two_nodes, {server.peer_id: Lineage(9, newest.state_id)})
    decision = client.lineage(round=8, param_hash=behind.diloco.param_hash())
    assert not decision.in_canonical and decision.canonical == Lineage(9, newest.state_id)
    monkeypatch.setattr(client, "run_round", resync_to(decision))
    applied = end_phase(behind)
    assert applied.kind == "adopted" and applied.param_hash == newest.state_id and not applied.caught_up
    assert session.num_caught_up == 2 and applied.stats.bytes_recv_state_sync == newest.num_bytes


class SwarmOfOne:
    """Just enough of SwarmNode for a SwarmSession whose rounds have one member: each round's mean is
    our vector through the int8 codec with error feedback, in chunks whose bytes are kept, as the
    all-reduce hands them back (``keep_payloads``); every publish is recorded."""

    CHUNK = 100_000

    def __init__(self) -> None:
        self.codec, self.peer_id, self.stream_addresses = get_codec("int8"), "solo", ()
        self.published: list[dict[str, Any]] = []
        # What participation.peer_due reads: nobody fetches from a swarm of one.
        self.config = SimpleNamespace(view_refresh=timedelta(seconds=1), error_feedback_decay=1.0)
        self.server = SimpleNamespace(state_provider=SimpleNamespace(served_lately=lambda within: False))
        self.driver = SimpleNamespace(record=None)

    def publish(self, **kwargs: Any) -> None:
        self.published.append(kwargs)

    def watch_closely(self, on: bool) -> None:
        pass  # no view to read: a swarm of one

    def set_identity(self, identity: str, *, rank: int | None) -> None:
        self.identity = (identity, rank)  # what the session says it trains (SwarmNode.set_identity)

    def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
        pass  # nobody reads a swarm of one's record

    def set_data_lane(self, lane: tuple[int, int], *, store_now: bool = False) -> None:
        pass  # nobody reads a swarm of one's record

    def lift_pace(self, round: int) -> None:
        pass  # a swarm of one's round sends nothing (SwarmNode.lift_pace)

    def run_round(
        self, vector: torch.Tensor, *, round: int, num_tokens: int, error_feedback: ErrorFeedback | None,
        **_: Any,
    ) -> RoundResult:  # fmt: skip
        assert error_feedback is not None
        mean, chunks = torch.empty_like(vector), []
        for offset in range(0, vector.numel(), self.CHUNK):
            piece = vector[offset : offset + self.CHUNK]
            payload = error_feedback.encode(self.codec, piece, offset)
            self.codec.decode_into(payload, mean[offset : offset + piece.numel()])
            chunks.append(EncodedChunk(offset, piece.numel(), payload.numpy().tobytes()))
        allreduce = AllReduceResult(
            averaged=mean, contributors=[[self.peer_id]], producers=[self.peer_id], fell_back=False,
            failures=[], bytes_sent=0, bytes_recv=0, bytes_sent_by_phase={}, bytes_recv_by_phase={},
            seconds=0.0, payloads=tuple(chunks),
        )  # fmt: skip
        member = SimpleNamespace(num_tokens=num_tokens)  # what the group's spec says we trained
        group = SimpleNamespace(round=round + 1, member_ids=(self.peer_id,), members=(member,), num_streams=1)
        return GroupAveraged(round=round + 1, group=group, allreduce=allreduce)  # type: ignore[arg-type]

    def leave(self) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.timeout(120)
def test_an_overlapped_member_serves_means_that_step_a_member_behind_to_its_states(
    corpus_file: Path, tmp_path: Path
) -> None:
    # With --overlap a round's mean is applied a phase late, on the averaging thread, but still to
    # the state the round started from: served beside each new state, the means chain them.
    swarm = SwarmOfOne()
    source = Trainer(
        small_config(corpus_file, tmp_path / "source", overlap=True, max_rounds=3),
        swarm=SwarmSession(swarm, joining=False),  # type: ignore[arg-type]
    )
    source.run()
    served = {p["round"]: p for p in swarm.published if p["snapshot"] is not None}
    # Each round served once, as soon as it was applied (not a phase later: a joiner that sees the
    # swarm's lineage can fetch it at once), at the step of the round's end (H = 2), with its mean.
    assert sorted(p["round"] for p in swarm.published if p["snapshot"] is not None) == [0, 1, 2, 3]
    assert [json.loads(served[r]["snapshot"].metadata)["step"] for r in (0, 1, 2, 3)] == [0, 2, 4, 6]
    assert [len(served[r]["companions"]) for r in (1, 2, 3)] == [1, 1, 1]
    assert source.diloco.param_hash() == served[3]["param_hash"]

    # A member behind, on round 1's state: it steps through rounds 2 and 3 with their means.
    behind = Trainer(small_config(corpus_file, tmp_path / "behind", seed=1))
    num_elements, corpus_sha256 = behind.diloco.num_elements, behind.corpus.sha256
    round_1 = adopted_state(served[1]["snapshot"], num_elements=num_elements, corpus_sha256=corpus_sha256)
    state, previous = None, (1, served[1]["param_hash"])
    start = round_1_start = (round_1.global_params, round_1.outer_momentum)
    for round in (2, 3):
        (companion,) = served[round]["companions"]
        assert companion.state_id == round_mean_id(served[round]["param_hash"])
        target = (round, served[round]["param_hash"])
        state = caught_up_state(stepper(behind), companion, previous=previous, target=target, start=start,
                                num_elements=num_elements, corpus_sha256=corpus_sha256)  # fmt: skip
        previous, start = target, (state.global_params, state.outer_momentum)
    assert state is not None and state.param_hash == source.diloco.param_hash()
    assert torch.equal(state.outer_momentum, source.diloco.momentum_buffer())
    # Not a chain of anything: the mean of round 3 does not step round 1's state.
    with pytest.raises(ValueError, match="another state"):
        caught_up_state(stepper(behind), served[3]["companions"][0], previous=(1, served[1]["param_hash"]),
                        target=(3, served[3]["param_hash"]), start=round_1_start, num_elements=num_elements,
                        corpus_sha256=corpus_sha256)  # fmt: skip


@pytest.mark.timeout(120)
def test_an_overlapped_member_builds_its_round_means_on_the_averaging_thread(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--overlap: the mean served beside a round's state (fp32 with top-k: a copy and two SHA-256
    passes) is built with that state on the averaging thread once the round's step is applied
    (``SwarmSession.prepare_publish``); publish, on the training thread, serves the one built. That
    the served means step a member behind to the served states is the test above."""
    built: list[tuple[Snapshot, str]] = []

    def recorded(state: Snapshot, round_mean: Any) -> Snapshot:
        companion = round_mean_snapshot(state, round_mean)
        built.append((companion, threading.current_thread().name))
        return companion

    monkeypatch.setattr(session_module, "round_mean_snapshot", recorded)
    swarm = SwarmOfOne()
    source = Trainer(
        small_config(corpus_file, tmp_path / "source", overlap=True, max_rounds=3),
        swarm=SwarmSession(swarm, joining=False),  # type: ignore[arg-type]
    )
    source.run()
    served = [companion for published in swarm.published for companion in published["companions"]]
    assert [companion.round_id for companion in served] == [1, 2, 3]
    assert len(built) == 3 and all(
        one is companion for (one, _), companion in zip(built, served, strict=True)
    )
    assert all(thread.startswith("outer-averaging") for _, thread in built), built


# --- rejoin_due on a SwarmView: the same answer as a pass over its peers ---


@pytest.mark.parametrize("seed", range(3))
def test_rejoin_due_on_a_view_is_the_scan_of_its_peers(seed: int) -> None:
    """The reference is ``rejoin_due`` over the view's records as a plain iterable (every peer read)."""
    rng = random.Random(seed)
    hashes = [fake_hash("a"), fake_hash("b")]
    for _ in range(300):
        records = [
            make_record(
                f"p{index:02d}",
                round=rng.choice((3, 4, 5)),
                param_hash=rng.choice(hashes),
                ready=rng.random() < 0.4,
            )
            for index in rng.sample(range(30), rng.randrange(0, 8))
        ]
        view = SwarmView.build(records, now=0.0, protocol_version=PROTOCOL_VERSION)
        me = rng.choice([record.peer_id for record in records] + ["p99"])
        adopted = (rng.choice((3, 4, 5)), rng.choice(hashes))
        assert rejoin_due(view, me, adopted) == rejoin_due(iter(view.peers), me, adopted)


# --- --fragments: a member behind steps each missed round's fragment with its served mean ---


class ServingSwarm(SwarmOfOne):
    """A SwarmOfOne that also serves fetches, from the states (and their round means) another node
    published: ``fetch_state`` with a ``state_id`` answers with the companion of that id, without one
    with the canonical state whole; every fetch is recorded."""

    def __init__(self, published: dict[int, dict[str, Any]]) -> None:
        super().__init__()
        self.states = {p["param_hash"]: p["snapshot"] for p in published.values()}
        self.companions = {c.state_id: c for p in published.values() for c in p["companions"]}
        self.fetched: list[str | None] = []

    def announce_syncing(self, lineage: object) -> None:
        pass  # nobody reads our record

    def view_or_last(self, why: str) -> SwarmView:
        return SwarmView(now=0.0, peers=())  # the member's record is not needed: any spare lane does

    def fetch_state(
        self, decision: LineageDecision, *, state_id: str | None = None, announce: bool = False
    ) -> SimpleNamespace:
        self.fetched.append(state_id)
        snapshot = (
            self.states[decision.canonical.param_hash] if state_id is None else self.companions.get(state_id)
        )
        if snapshot is None:
            raise TimeoutError(f"no source serves {state_id}")  # what SwarmNode.fetch_state raises
        return SimpleNamespace(snapshot=snapshot, bytes_by_source={"solo": snapshot.num_bytes})


def fragment_hashes(trainer: Trainer) -> list[str]:
    """Every fragment's hash of ``trainer``'s global params."""
    fragments = trainer.round.fragments
    assert fragments is not None
    return [fragments.fragment(f).hash() for f in range(fragments.num_fragments)]


def fragment_member_and_behind(
    corpus_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    *,
    held_round: int,
    overlap_steps: int = 0,
) -> tuple[Trainer, dict[int, dict[str, Any]], Trainer, SwarmSession, ServingSwarm]:
    """A member that ran 4 fragment rounds (--fragments 2, int8, each round's mean served beside its
    state; ``overlap_steps``: τ), and a second node on the state the member served after ``held_round``, whose next
    round's lineage check sends it to the member's round 4."""
    settings = dict(fragments=2, overlap_steps=overlap_steps)
    member = Trainer(
        small_config(corpus_file, tmp_path / "member", max_rounds=4, **settings),
        swarm=SwarmSession(SwarmOfOne(), joining=False),  # type: ignore[arg-type]
    )
    member.run()
    assert member.round.swarm is not None
    published = {p["round"]: p for p in member.round.swarm.swarm.published if p["snapshot"] is not None}  # type: ignore[attr-defined]
    swarm = ServingSwarm(published)
    session = SwarmSession(swarm, joining=False)  # type: ignore[arg-type]
    behind = Trainer(small_config(corpus_file, tmp_path / "behind", seed=1, **settings), swarm=session)
    assert behind.round.fragments is not None
    held = adopted_state(published[held_round]["snapshot"], num_elements=behind.diloco.num_elements,
                         corpus_sha256=behind.corpus.sha256, assemble=behind.round.fragments.assemble)  # fmt: skip
    answer_joins_with(monkeypatch, session, held)
    behind.round.start()
    canonical = Lineage(4, published[4]["param_hash"])
    decision = LineageDecision(canonical=canonical, num_canonical_peers=1, local=Lineage(*held.lineage),
                               in_canonical=False, sync_sources=("solo",))  # fmt: skip
    monkeypatch.setattr(swarm, "run_round", resync_to(decision))
    return member, published, behind, session, swarm


@pytest.mark.timeout(180)
@pytest.mark.parametrize("overlap_steps", [0, 1], ids=["synchronous", "overlapped"])
def test_a_member_two_fragment_rounds_behind_steps_each_fragment_with_its_served_mean(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overlap_steps: int
) -> None:
    member, published, behind, session, swarm = fragment_member_and_behind(
        corpus_file, tmp_path, monkeypatch, held_round=2, overlap_steps=overlap_steps
    )
    # Every fragment round's mean is served beside its state, naming its fragment (round r: r mod F)
    # and the whole param_hash it stepped from; it holds the fragment's int8 bytes only.
    sizes = member.round.fragments.fragment_sizes()  # type: ignore[union-attr]
    for round in (1, 2, 3, 4):
        (companion,) = published[round]["companions"]
        metadata = json.loads(companion.metadata)
        assert companion.state_id == round_mean_id(published[round]["param_hash"])
        assert metadata["fragment"] == round % 2
        assert metadata["previous_round"] == round - 1
        assert metadata["previous_param_hash"] == published[round - 1]["param_hash"]
        assert companion.tensors["round_mean_payload"].numel() < sizes[round % 2] * 1.1
    assert published[3]["param_hash"] != published[2]["param_hash"] != published[4]["param_hash"]

    applied = end_phase(behind)
    # Rounds 3 (fragment 1) and 4 (fragment 0) stepped with their means, newest fetched first; no
    # whole state fetched.
    assert swarm.fetched == [
        round_mean_id(published[4]["param_hash"]),
        round_mean_id(published[3]["param_hash"]),
    ]
    assert applied.kind == "adopted" and applied.caught_up and session.num_caught_up == 1
    assert applied.stats.bytes_recv_state_sync == sum(published[r]["companions"][0].num_bytes for r in (3, 4))
    assert behind.progress.round == 4
    # Bit for bit the member's: the whole param_hash, every fragment's hash, the outer momentum.
    assert behind.diloco.param_hash() == applied.param_hash == member.diloco.param_hash()
    assert fragment_hashes(behind) == fragment_hashes(member)
    assert torch.equal(behind.diloco.global_params, member.diloco.global_params)
    assert torch.equal(behind.diloco.momentum_buffer(), member.diloco.momentum_buffer())


@pytest.mark.timeout(180)
def test_a_member_three_fragment_rounds_behind_steps_with_their_means_within_2f(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With --fragments 2 a node steps with the means of up to 2F = 4 fragment rounds (two whole
    rounds' worth of bytes), which members keep for as many publishes (StateSyncConfig.
    num_companions_kept from the node's config). Here 3 behind: before, more than 2 meant the whole
    state."""
    member, published, behind, session, swarm = fragment_member_and_behind(
        corpus_file, tmp_path, monkeypatch, held_round=1
    )
    applied = end_phase(behind)
    assert swarm.fetched == [round_mean_id(published[r]["param_hash"]) for r in (4, 3, 2)]
    assert applied.kind == "adopted" and applied.caught_up and session.num_caught_up == 1
    assert behind.diloco.param_hash() == applied.param_hash == member.diloco.param_hash()
    assert fragment_hashes(behind) == fragment_hashes(member)
    assert torch.equal(behind.diloco.momentum_buffer(), member.diloco.momentum_buffer())
    config = small_config(corpus_file, tmp_path / "config", fragments=2)
    assert swarm_config(config).statesync.num_companions_kept == 4 == max_catch_up_rounds(2)
    assert swarm_config(small_config(corpus_file, tmp_path / "whole")).statesync.num_companions_kept == 2


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["numbers", "fragment", "missing"])
def test_a_bad_fragment_mean_falls_back_to_the_whole_state(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    member, published, behind, session, swarm = fragment_member_and_behind(
        corpus_file, tmp_path, monkeypatch, held_round=2
    )
    mean_id = round_mean_id(published[3]["param_hash"])
    companion = swarm.companions.pop(mean_id)
    if fault == "numbers":  # one byte of round 3's int8 payload off: not the members' step
        tensors = dict(companion.tensors)
        payload = tensors["round_mean_payload"].clone()
        payload[len(payload) // 2] ^= 1
        tensors["round_mean_payload"] = payload
        swarm.companions[mean_id] = Snapshot(round_id=companion.round_id, state_id=mean_id, tensors=tensors,
                                             metadata=companion.metadata)  # fmt: skip
    elif fault == "fragment":  # says it is fragment 0's (round 3 is fragment 1's)
        metadata = {**json.loads(companion.metadata), "fragment": 0}
        swarm.companions[mean_id] = Snapshot(round_id=companion.round_id, state_id=mean_id,
                                             tensors=dict(companion.tensors), metadata=json.dumps(metadata).encode())  # fmt: skip
    applied = end_phase(behind)
    # Round 4's mean, then round 3's (bad or missing), then the whole state.
    assert swarm.fetched == [round_mean_id(published[4]["param_hash"]), mean_id, None]
    assert applied.kind == "adopted" and not applied.caught_up and session.num_caught_up == 0
    assert behind.diloco.param_hash() == applied.param_hash == member.diloco.param_hash()
    assert fragment_hashes(behind) == fragment_hashes(member)
    assert torch.equal(behind.diloco.momentum_buffer(), member.diloco.momentum_buffer())
