"""Round formation: several peers' state machines on a fake network under a fake clock.

Every scenario checks the agreement property the daemon relies on: all peers that start an
all-reduce for a group hold the identical ``GroupSpec`` (compared as objects), and no peer is in
two groups. Timing assertions use the configured durations, so they say *why* a time is right.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

import pytest

from protocol.membership.actions import MissedRound, Publish, Resync, RoundFailed, Send, StartAllReduce
from protocol.membership.messages import (
    Accept,
    Begin,
    Cancel,
    GroupMember,
    GroupSpec,
    JoinRequest,
    Message,
    Proposal,
    Reason,
    Reject,
    Withdraw,
)
from protocol.membership.parts import part_boundaries
from protocol.membership.records import PeerRecord, SwarmView
from protocol.membership.rounds import Phase, RoundConfig, RoundFormation, TooFewPolicy
from protocol.membership.wire import to_envelope
from tests.protocol.membership.fake_swarm import (
    H0,
    PROTOCOL_VERSION,
    FakeNetwork,
    FakeSwarm,
    fake_hash,
    make_record,
)

CONFIG = RoundConfig(
    min_peers=2,
    join_window=timedelta(seconds=30),
    max_wait=timedelta(seconds=180),
    proposal_timeout=timedelta(seconds=5),
    begin_timeout=timedelta(seconds=10),
)
WINDOW = CONFIG.join_window.total_seconds()
MAX_WAIT = CONFIG.max_wait.total_seconds()
BEGIN_TIMEOUT = CONFIG.begin_timeout.total_seconds()
PROPOSAL_TIMEOUT = CONFIG.proposal_timeout.total_seconds()
FAN_OUT_MS = 0.01
"""A leader's fan-out to a handful of peers on the fake records' 1 MB/s uplinks takes a few ms
(``fan_out.py``): the timeouts it stretches are that much longer."""

M = TypeVar("M")


def sends(actions: Sequence[object], message_type: type[M]) -> list[tuple[str, M]]:
    """``(to, message)`` of every Send of a ``message_type`` among ``actions``."""
    return [(a.to, a.message) for a in actions if isinstance(a, Send) and isinstance(a.message, message_type)]


def assert_one_agreed_group(swarm: FakeSwarm, expected_members: list[str], leader: str) -> GroupSpec:
    groups = swarm.groups()
    assert sorted(groups) == sorted(expected_members), swarm.outcomes
    specs = [outcome.group for outcome in groups.values()]
    first = specs[0]
    for spec in specs[1:]:
        assert spec == first  # the identical object, field by field
    assert first.member_ids == tuple(sorted(expected_members))
    assert first.leader_id == leader
    return first


def assert_groups_consistent(swarm: FakeSwarm) -> None:
    """Everyone locked into group id G holds the same spec; groups are disjoint; each >= min_peers."""
    by_id: dict[str, list[tuple[str, GroupSpec]]] = {}
    for peer_id, outcome in swarm.groups().items():
        by_id.setdefault(outcome.group.group_id, []).append((peer_id, outcome.group))
        assert peer_id in outcome.group.member_ids
    seen: set[str] = set()
    for members in by_id.values():
        specs = {spec for _, spec in members}
        assert len(specs) == 1, specs
        locked = {peer_id for peer_id, _ in members}
        assert not locked & seen
        seen |= locked
        assert len(next(iter(specs)).members) >= swarm.config.min_peers


def test_three_ready_peers_form_one_agreed_group() -> None:
    records = [
        make_record(p, bandwidth=b, port=5000 + i)
        for i, (p, b) in enumerate([("a", 1e6), ("b", 3e6), ("c", 2e6)])
    ]
    swarm = FakeSwarm(CONFIG, records, vector_length=600)
    tokens = {"a": 100, "b": 300, "c": 200}
    for peer_id in ("c", "a", "b"):
        swarm.make_ready(peer_id, num_tokens=tokens[peer_id])
    swarm.run_until(MAX_WAIT)

    group = assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")
    # Everyone was ready, so the leader did not wait for the join window: one round trip + Begin.
    assert max(swarm.outcome_times.values()) == pytest.approx(0.3)
    assert group.round == 1 and group.param_hash == H0 and group.vector_length == 600
    assert [(m.peer_id, m.num_tokens) for m in group.members] == [("a", 100), ("b", 300), ("c", 200)]
    assert [m.grpc_address for m in group.members] == ["10.0.0.1:5000", "10.0.0.1:5001", "10.0.0.1:5002"]
    assert group.part_boundaries == (0, 100, 400, 600)  # 1 : 3 : 2 of the bandwidth
    assert group.total_tokens == 600
    # Every peer announced its readiness first.
    for peer_id in "abc":
        assert swarm.sent_by(peer_id)[0] == Publish(1)


def test_leader_waits_out_the_join_window_for_a_lineage_peer() -> None:
    records = [make_record(p) for p in "abcd"]
    swarm = FakeSwarm(CONFIG, records)
    for peer_id in "abc":
        swarm.make_ready(peer_id)
    swarm.run_until(WINDOW - 0.01)
    assert swarm.outcomes == {}  # d is live and in the lineage: worth waiting for
    swarm.run_until(MAX_WAIT)
    assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")
    assert min(swarm.outcome_times.values()) >= WINDOW


def syncing_record(peer_id: str, *, ready_at: float | None, param_hash: str = H0) -> PeerRecord:
    """``peer_id`` fetches the state ``(0, param_hash)`` and expects to hold it at ``ready_at``."""
    return replace(make_record(peer_id, param_hash=param_hash), status="syncing", ready_at=ready_at)


def test_leader_waits_for_a_joiner_that_will_hold_its_lineage_state_within_the_window() -> None:
    swarm = FakeSwarm(CONFIG, [make_record("a"), make_record("b"), syncing_record("j", ready_at=10.0)])
    for peer_id in "ab":
        swarm.make_ready(peer_id)
    swarm.run_until(10.0)
    assert swarm.outcomes == {}  # j said it holds the state at t=10: worth waiting for
    swarm.set_record(make_record("j"))  # j holds (0, H0) and trains its first inner step
    swarm.run_until(12.0)
    assert swarm.outcomes == {}  # j is in the lineage now, not ready yet: waited for as any member
    swarm.make_ready("j")
    swarm.run_until(MAX_WAIT)
    group = assert_one_agreed_group(swarm, ["a", "b", "j"], leader="a")
    assert group.round == 1 and max(swarm.outcome_times.values()) < 13.0  # long before the window's end


@pytest.mark.parametrize(
    "joiner",
    [
        syncing_record("j", ready_at=WINDOW + 1.0),  # holds the state only after the window: next round
        syncing_record("j", ready_at=None),  # cannot tell yet
        syncing_record("j", ready_at=1.0, param_hash=fake_hash("other params")),  # another lineage's state
        replace(syncing_record("j", ready_at=1.0), expires_at=0.0),  # its record expired (a crashed joiner)
    ],
    ids=["due-after-the-window", "no-estimate", "other-lineage", "expired"],
)
def test_leader_does_not_wait_for_a_joiner_not_due_in_its_window(joiner: PeerRecord) -> None:
    swarm = FakeSwarm(CONFIG, [make_record("a"), make_record("b"), joiner])
    for peer_id in "ab":
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT)
    assert_one_agreed_group(swarm, ["a", "b"], leader="a")
    assert max(swarm.outcome_times.values()) == pytest.approx(0.3)  # one round trip and Begin


def test_a_joiner_whose_estimate_went_stale_holds_up_the_round_one_window_at_most() -> None:
    """j said at t=0 it would hold the state at t=5, then went silent (a stuck fetch)."""
    swarm = FakeSwarm(CONFIG, [make_record("a"), make_record("b"), syncing_record("j", ready_at=5.0)])
    swarm.run_until(20.0)
    for peer_id in "ab":
        swarm.make_ready(peer_id)  # at t=20: j's estimate is 15 s old, within a window: wait
    swarm.run_until(MAX_WAIT)
    assert_one_agreed_group(swarm, ["a", "b"], leader="a")
    assert max(swarm.outcome_times.values()) == pytest.approx(5.0 + WINDOW + 0.3)  # stale at t=35

    later = FakeSwarm(CONFIG, [make_record("a"), make_record("b"), syncing_record("j", ready_at=5.0)])
    later.run_until(40.0)
    for peer_id in "ab":
        later.make_ready(peer_id)  # at t=40 the estimate is already stale: no wait at all
    later.run_until(MAX_WAIT)
    assert_one_agreed_group(later, ["a", "b"], leader="a")
    assert max(later.outcome_times.values()) == pytest.approx(40.3)


def test_late_peer_misses_the_round_resyncs_and_joins_the_next() -> None:
    records = [make_record(p) for p in "abcd"]
    swarm = FakeSwarm(CONFIG, records)
    for peer_id in "abc":
        swarm.make_ready(peer_id)
    swarm.run_until(WINDOW + 5)
    assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")

    # d is ready after the window closed, while a, b, c run their all-reduce. It asks a to include
    # it; a answers that the round started, so d misses it at once rather than forming a second group.
    # It names a, whose record the daemon watches while it waits for the group's new params.
    swarm.make_ready("d")
    late_at = swarm.now
    swarm.run_until(late_at + 1)
    assert swarm.outcomes["d"] == MissedRound(1, Reason.ROUND_STARTED, told_by="a")
    assert swarm.outcome_times["d"] == pytest.approx(late_at + 0.2)
    assert swarm.dht["d"].ready_for_round is None

    new_hash = fake_hash("round 1 of a, b, c")
    swarm.finish_round(["a", "b", "c"], new_hash)  # they publish (1, new_hash)
    swarm.make_ready("d")  # the daemon tries again once the view changed: d must re-sync
    resync = swarm.outcomes["d"]
    assert isinstance(resync, Resync)
    assert resync.canonical.round == 1 and resync.canonical.param_hash == new_hash
    assert sorted(resync.sources) == ["a", "b", "c"]

    # d re-syncs from a source, then all four form round 2 together.
    swarm.set_record(replace(swarm.dht["d"], round=1, param_hash=new_hash, ready_for_round=None))
    start = swarm.now
    for peer_id in "abcd":
        swarm.make_ready(peer_id)
    swarm.run_until(start + MAX_WAIT)
    group = assert_one_agreed_group(swarm, ["a", "b", "c", "d"], leader="a")
    assert group.round == 2 and group.param_hash == new_hash


def test_peer_cut_off_from_the_others_misses_at_max_wait() -> None:
    """d sees the others' records but none of its messages get through."""
    network = FakeNetwork(drop=lambda sender, to, message, now: sender == "d")
    swarm = FakeSwarm(CONFIG, [make_record(p) for p in "abcd"], network=network)
    for peer_id in "abcd":
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT + 1)
    assert swarm.outcomes["d"] == MissedRound(1, Reason.MAX_WAIT)
    assert swarm.outcome_times["d"] == MAX_WAIT
    # a invited d (it looked ready), heard nothing, and began without it after the proposal timeout.
    assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")
    # (plus the ~2 ms its 1 MB/s uplink takes to send three small proposals: fan_out.py)
    assert swarm.outcome_times["a"] == pytest.approx(PROPOSAL_TIMEOUT, abs=FAN_OUT_MS)


def test_dead_ready_peer_is_not_waited_for_past_the_proposal_timeout() -> None:
    swarm = FakeSwarm(CONFIG, [make_record(p) for p in "abcd"])
    swarm.set_record(make_record("d", ready=True))  # d died while ready: its record lingers
    swarm.kill("d")
    for peer_id in "abc":
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT)
    assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")
    # All four looked ready, so a proposed at once and gave d until the proposal timeout.
    assert max(swarm.outcome_times.values()) == pytest.approx(PROPOSAL_TIMEOUT + 0.1, abs=FAN_OUT_MS)


@pytest.mark.parametrize("record_vanishes", [False, True])
def test_leader_dies_after_proposing_and_the_rest_reelect(record_vanishes: bool) -> None:
    records = [make_record(p) for p in "abcd"]
    network = FakeNetwork()
    swarm = FakeSwarm(CONFIG, records, network=network)
    for peer_id in "abcd":
        swarm.make_ready(peer_id)
    swarm.run_until(0.0)
    assert any(
        message_to == "b" and isinstance(m, Proposal) for _, s, message_to, m in network.sent if s == "a"
    )
    swarm.kill("a")  # its proposals are on the wire; it will never send Begin
    if record_vanishes:  # b, c, d accept at t = 0.1, then a's tombstone appears
        swarm.run_until(1.0)
        swarm.set_record(replace(swarm.dht["a"], status="left", expires_at=60.0))
    swarm.run_until(MAX_WAIT)

    group = assert_one_agreed_group(swarm, ["b", "c", "d"], leader="b")
    assert group.group_id.startswith("b/1/")
    formed_at = max(swarm.outcome_times.values())
    # After the re-election b proposes at once (everyone left is ready): proposal, accept, Begin.
    if record_vanishes:  # the tombstone told them at once
        assert formed_at == pytest.approx(1.0 + 0.3)
    else:  # they accepted at 0.1 and gave a the begin timeout (and its uplink's few ms for 4 members)
        assert formed_at == pytest.approx(0.1 + BEGIN_TIMEOUT + 0.3, abs=FAN_OUT_MS)
    assert formed_at < MAX_WAIT
    for peer_id in "cd":  # each member told the dead leader it moved on
        assert any(
            isinstance(a, Send) and a.to == "a" and isinstance(a.message, Withdraw)
            for a in swarm.sent_by(peer_id)
        )


def test_a_leader_on_a_slow_uplink_forms_one_group_of_everyone() -> None:
    """Each peer's messages leave one at a time over its uplink (its record's bandwidth), each as
    many bytes as its protobuf envelope: a leader's proposals and Begins, which list every member,
    take seconds to reach the last of 60 peers. Before the waits grew with the leader's fan-out
    (fan_out.py) the leader closed its proposal at the proposal timeout without the peers its
    proposal had not reached yet, and members withdrew at the begin timeout before their Begin came
    (the 1,000-node breakdown of BENCHMARKS.md, "A slow leader's uplink")."""
    rate = 5_000.0  # bytes per second, every peer (a leader's 60 Begins take ~30 s)
    free_at: dict[str, float] = {}

    def uplink(sender: str, to: str, message: Message, now: float) -> float:
        size = to_envelope(message, sender_id=sender, protocol_version=PROTOCOL_VERSION).ByteSize()
        free_at[sender] = max(now, free_at.get(sender, 0.0)) + size / rate
        return free_at[sender] - now + 0.05  # then a latency

    peer_ids = [f"peer-{i:02d}" for i in range(60)]
    network = FakeNetwork(delay=uplink)
    swarm = FakeSwarm(CONFIG, [make_record(p, bandwidth=rate) for p in peer_ids], network=network)
    for peer_id in peer_ids:
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT)

    assert_one_agreed_group(swarm, peer_ids, leader=peer_ids[0])
    begins_done = max(swarm.outcome_times.values())
    assert begins_done > PROPOSAL_TIMEOUT + BEGIN_TIMEOUT  # the fixed waits alone would have run out
    # One proposal per peer: a member asking again while its copy is still on the leader's uplink
    # gets no second copy queued behind it.
    proposals = [m for _, sender, _, m in network.sent if sender == peer_ids[0] and isinstance(m, Proposal)]
    assert len(proposals) == len(peer_ids) - 1


@pytest.mark.parametrize("a_delay", [0.05, 0.1, 0.15])
def test_two_would_be_leaders_converge_to_the_smaller_id(a_delay: float) -> None:
    """b does not see a's record, so both think they lead; a's proposal must win everywhere."""
    records = [make_record(p) for p in "abcd"]
    network = FakeNetwork(delay=lambda sender, to, message, now: a_delay if sender == "a" else 0.1)
    swarm = FakeSwarm(
        CONFIG,
        records,
        network=network,
        view_of=lambda observer, record, now: None if observer == "b" and record.peer_id == "a" else record,
    )
    for peer_id in "abcd":
        swarm.make_ready(peer_id)
    swarm.run_until(0.0)
    # Both proposed right away.
    proposers = {sender for _, sender, _, message in network.sent if isinstance(message, Proposal)}
    assert proposers == {"a", "b"}
    swarm.run_until(MAX_WAIT)
    assert_one_agreed_group(swarm, ["a", "b", "c", "d"], leader="a")
    cancels = sends(swarm.sent_by("b"), Cancel)
    # b cancelled its proposal for c and d; Accepts that crossed the Cancel got a STALE_PROPOSAL.
    assert [to for to, cancel in cancels if cancel.reason is Reason.STEPPED_DOWN] == ["c", "d"]
    assert all(cancel.reason in (Reason.STEPPED_DOWN, Reason.STALE_PROPOSAL) for _, cancel in cancels)


def test_member_outside_the_canonical_lineage_resyncs_at_start() -> None:
    other = fake_hash("diverged")
    records = [make_record(p) for p in "abc"] + [make_record("d", param_hash=other)]
    swarm = FakeSwarm(CONFIG, records)
    for peer_id in "abcd":
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT)
    resync = swarm.outcomes.pop("d")
    assert isinstance(resync, Resync)
    assert resync.canonical.param_hash == H0 and sorted(resync.sources) == ["a", "b", "c"]
    assert Publish(1) not in swarm.sent_by("d")  # never announced readiness with the wrong params
    # a, b, c did not wait for d (another lineage) and did not invite it.
    assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")
    assert max(swarm.outcome_times.values()) == pytest.approx(0.3)


def test_proposal_with_other_params_is_rejected_and_the_view_triggers_resync() -> None:
    """a's view still shows d's old hash, so a proposes to d; d (whose own view is stale) rejects."""
    other = fake_hash("diverged")
    records = [make_record(p) for p in "abc"] + [make_record("d", param_hash=other)]

    def view_of(observer: str, record, now: float):  # noqa: ANN001, ANN202 - test hook
        if observer == "d" and record.peer_id != "d" and now < 1.0:
            return None  # d sees only itself until t = 1
        if observer != "d" and record.peer_id == "d":
            return replace(record, param_hash=H0)  # the others see d's stale record
        return record

    swarm = FakeSwarm(CONFIG, records, view_of=view_of)
    for peer_id in "abcd":
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT)
    rejects = sends(swarm.sent_by("d"), Reject)
    assert [(to, reject.reason) for to, reject in rejects] == [("a", Reason.LINEAGE_MISMATCH)]
    assert isinstance(swarm.outcomes.pop("d"), Resync)
    assert swarm.outcome_times["a"] < 1.0  # a did not wait for d once it said no
    assert_one_agreed_group(swarm, ["a", "b", "c"], leader="a")


@pytest.mark.parametrize("policy", ["fail", "proceed_alone"])
def test_too_few_peers_fail_at_max_wait(policy: TooFewPolicy) -> None:
    config = replace(CONFIG, min_peers=3, on_too_few=policy)
    swarm = FakeSwarm(config, [make_record(p) for p in "ab"])
    for peer_id in "ab":
        swarm.make_ready(peer_id)
    swarm.run_until(MAX_WAIT - 0.01)
    assert swarm.outcomes == {}
    swarm.run_until(MAX_WAIT + 1)
    assert swarm.outcome_times == {"a": MAX_WAIT, "b": MAX_WAIT}
    if policy == "fail":
        assert swarm.outcomes == {
            "a": RoundFailed(1, Reason.TOO_FEW_PEERS),
            "b": RoundFailed(1, Reason.TOO_FEW_PEERS),
        }
        assert swarm.dht["a"].ready_for_round is None and swarm.dht["b"].ready_for_round is None
    else:
        for peer_id, outcome in swarm.outcomes.items():
            assert isinstance(outcome, StartAllReduce) and outcome.group.member_ids == (peer_id,)
            assert outcome.group.part_boundaries == (0, 1000)


def test_min_peers_one_lets_a_lone_peer_proceed() -> None:
    swarm = FakeSwarm(replace(CONFIG, min_peers=1), [make_record("a")])
    swarm.make_ready("a")
    assert_one_agreed_group(swarm, ["a"], leader="a")
    assert swarm.outcome_times["a"] == 0.0


@pytest.mark.parametrize("seed", range(100))
def test_random_networks_views_and_deaths_keep_groups_consistent(seed: int) -> None:
    """Whatever the network, the views and the deaths do: every live peer finishes by max_wait,
    everyone locked into a group holds the same spec, and no peer is in two groups."""
    rng = random.Random(seed)
    peer_ids = [f"p{i}" for i in range(rng.randint(2, 6))]
    drop_rate = rng.choice([0.0, 0.0, 0.1, 0.3])
    max_delay = rng.choice([0.5, 2.0])  # below proposal_timeout / 2: a round trip fits
    delays: dict[tuple[str, str], float] = {}

    def delay(sender: str, to: str, message: object, now: float) -> float:
        return delays.setdefault((sender, to), rng.uniform(0.01, max_delay))

    stale = {(rng.choice(peer_ids), rng.choice(peer_ids)) for _ in range(rng.randint(0, 3))}
    stale_until = rng.uniform(0, 40)

    def view_of(observer: str, record: PeerRecord, now: float) -> PeerRecord | None:
        hidden = (observer, record.peer_id) in stale and observer != record.peer_id and now < stale_until
        return None if hidden else record

    network = FakeNetwork(delay=delay, drop=lambda *args: rng.random() < drop_rate)
    config = replace(CONFIG, min_peers=rng.randint(1, 3))
    records = [make_record(p, bandwidth=rng.uniform(1e5, 1e7)) for p in peer_ids]
    swarm = FakeSwarm(config, records, network=network, view_of=view_of)
    events = [(rng.uniform(0, 60), "ready", p) for p in peer_ids]
    if rng.random() < 0.3:
        events.append((rng.uniform(0, 70), "kill", rng.choice(peer_ids)))
    for t, kind, peer_id in sorted(events):
        swarm.run_until(t)
        if kind == "kill":
            swarm.kill(peer_id)
        elif peer_id not in swarm.dead:
            swarm.make_ready(peer_id)
    swarm.run_until(200 + MAX_WAIT)

    ready_at = {peer_id: t for t, kind, peer_id in events if kind == "ready"}
    for peer_id in peer_ids:
        if peer_id in swarm.dead:
            continue
        assert peer_id in swarm.outcomes
        assert swarm.outcome_times[peer_id] <= ready_at[peer_id] + MAX_WAIT + 1e-9
        assert swarm.machines[peer_id].next_deadline() is None
    assert_groups_consistent(swarm)
    times = sorted(ready_at.values())
    calm = drop_rate == 0.0 and not stale and len(events) == len(peer_ids)
    if calm and times[-1] - times[0] < WINDOW and len(peer_ids) >= config.min_peers:
        # Everyone ready within one window on a calm network: one group of everyone.
        assert len({o.group.group_id for o in swarm.groups().values()}) == 1
        assert sorted(swarm.groups()) == sorted(peer_ids)


# --- single-machine unit tests: feed messages by hand ---


def _machine(peer_id: str, peers: str, *, now: float = 0.0) -> tuple[RoundFormation, list]:
    records = [make_record(p, ready=True) for p in peers]
    view = SwarmView.build(records, now=now, protocol_version=PROTOCOL_VERSION)
    machine = RoundFormation(
        config=CONFIG, local=make_record(peer_id), num_tokens=10, vector_length=100, now=now
    )
    return machine, machine.start(view, now)


def _proposal(leader: str, members: str, attempt: int = 1) -> Proposal:
    return Proposal(round=1, proposal_id=f"{leader}/1/{attempt}", param_hash=H0, members=tuple(members))


def test_bound_member_switches_to_a_smaller_leader_and_defers_a_larger_one() -> None:
    machine, _ = _machine("c", "bcd")  # c's view: b would lead
    assert machine.on_message("b", _proposal("b", "bcd"), 0.1) == [
        Send(
            "b",
            Accept(
                round=1,
                proposal_id="b/1/1",
                grpc_address="10.0.0.1:5000",
                num_tokens=10,
                bandwidth_bytes_per_s=1e6,
            ),
        )
    ]
    assert machine.on_message("d", _proposal("d", "cd"), 0.2) == []  # deferred: d > b
    actions = machine.on_message("a", _proposal("a", "abcd"), 0.3)
    assert actions[0] == Send("b", Withdraw(round=1, proposal_id="b/1/1", reason=Reason.SWITCHED_LEADER))
    assert isinstance(actions[1], Send) and actions[1].to == "a" and isinstance(actions[1].message, Accept)
    # A Begin from b, whom c left, is refused; a's Begin locks c in and answers the deferred d.
    stale = _group("b", "bc", group_id="b/1/1")
    assert machine.on_message("b", Begin(group=stale), 0.4) == [
        Send("b", Withdraw(round=1, proposal_id="b/1/1", reason=Reason.NOT_BOUND))
    ]
    group = _group("a", "abc", group_id="a/1/1")
    actions = machine.on_message("a", Begin(group=group), 0.5)
    assert actions == [
        Send("d", Reject(round=1, proposal_id="d/1/1", reason=Reason.ALREADY_IN_GROUP)),
        StartAllReduce(group),
    ]
    assert machine.phase is Phase.LOCKED and machine.group == group
    assert machine.on_message("e", _proposal("e", "ce"), 0.6) == [
        Send("e", Reject(round=1, proposal_id="e/1/1", reason=Reason.ALREADY_IN_GROUP))
    ]


def _group(leader: str, members: str, *, group_id: str, vector_length: int = 100) -> GroupSpec:
    entries = tuple(
        GroupMember(peer_id=p, grpc_address="10.0.0.1:5000", num_tokens=10, bandwidth_bytes_per_s=1e6)
        for p in members
    )
    return GroupSpec(
        round=1,
        group_id=group_id,
        leader_id=leader,
        param_hash=H0,
        vector_length=vector_length,
        members=entries,
        part_boundaries=part_boundaries([1e6] * len(entries), vector_length),
    )


def test_member_withdraws_from_a_begin_that_breaks_the_rules() -> None:
    machine, _ = _machine("c", "bc")
    machine.on_message("b", _proposal("b", "bc"), 0.1)
    good = _group("b", "bc", group_id="b/1/1")
    tampered = replace(good, part_boundaries=(0, 99, 100))  # not what parts.py gives: b grabs the vector
    actions = machine.on_message("b", Begin(group=tampered), 0.2)
    assert actions[0] == Send("b", Withdraw(round=1, proposal_id="b/1/1", reason=Reason.INVALID_GROUP))
    assert machine.outcome is None and machine.phase is not Phase.BOUND


def test_collecting_leader_steps_down_for_a_smaller_one_and_invites_a_larger_one() -> None:
    machine, actions = _machine("b", "bcd")  # b leads in its view and proposes at once
    assert machine.phase is Phase.COLLECTING
    assert [a.to for a in actions if isinstance(a, Send)] == ["c", "d"]
    actions = machine.on_message("e", _proposal("e", "e"), 0.1)
    assert actions[0] == Send("e", Reject(round=1, proposal_id="e/1/1", reason=Reason.SMALLER_LEADER))
    assert [(to, p.members) for to, p in sends(actions, Proposal)] == [("e", ("b", "c", "d", "e"))]
    actions = machine.on_message("a", _proposal("a", "ab"), 0.2)
    assert [(to, c.reason) for to, c in sends(actions, Cancel)] == [
        ("c", Reason.STEPPED_DOWN),
        ("d", Reason.STEPPED_DOWN),
        ("e", Reason.STEPPED_DOWN),
    ]
    assert [to for to, _ in sends(actions, Accept)] == ["a"] and len(actions) == 4
    assert machine.phase is Phase.BOUND


def test_wrong_round_and_unknown_answers_get_replies_not_crashes() -> None:
    machine, _ = _machine("b", "bc")
    wrong = Proposal(round=7, proposal_id="x/7/1", param_hash=H0, members=("x",))
    assert machine.on_message("x", wrong, 0.1) == [
        Send("x", Reject(round=7, proposal_id="x/7/1", reason=Reason.WRONG_ROUND))
    ]
    stray = Accept(
        round=1, proposal_id="b/1/9", grpc_address="10.0.0.1:1", num_tokens=1, bandwidth_bytes_per_s=1.0
    )
    assert machine.on_message("c", stray, 0.2) == [
        Send("c", Cancel(round=1, proposal_id="b/1/9", reason=Reason.STALE_PROPOSAL))
    ]
    with pytest.raises(ValueError, match="sender"):
        machine.on_message("bad id", stray, 0.3)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="min_peers"):
        RoundConfig(min_peers=0)
    with pytest.raises(ValueError, match="join_window"):
        RoundConfig(join_window=timedelta(0))
    with pytest.raises(ValueError, match="begin_timeout"):
        RoundConfig(proposal_timeout=timedelta(seconds=10), begin_timeout=timedelta(seconds=10))
    with pytest.raises(ValueError, match="max_wait"):
        RoundConfig(join_window=timedelta(minutes=5), max_wait=timedelta(minutes=1))


# --- the ready peers of our lineage, from the view's index of its lineages ---


@pytest.mark.parametrize("seed", range(4))
def test_readiness_from_the_views_index_is_the_scan_of_every_peer(seed: int) -> None:
    """Who leads, how many are ready, who may still join: the same as a scan of the view with our
    record in place of the view's copy and the excluded peers left out (``_lineage_peers``)."""
    rng = random.Random(seed)
    hashes = [H0, fake_hash("other")]
    for _ in range(200):
        records = [
            replace(
                make_record(
                    f"p{index:02d}",
                    round=rng.choice((0, 1)),
                    param_hash=rng.choice(hashes),
                    ready=rng.random() < 0.6,
                ),
                client=rng.random() < 0.3,
            )
            for index in rng.sample(range(40), rng.randrange(0, 12))
        ]
        view = SwarmView.build(records, now=0.0, protocol_version=PROTOCOL_VERSION)
        local_id = rng.choice([record.peer_id for record in records] + ["p99"])
        local = replace(make_record(local_id, round=rng.choice((0, 1))), client=rng.random() < 0.3)
        machine = RoundFormation(config=CONFIG, local=local, num_tokens=1, vector_length=100, now=0.0)
        machine._view = view
        ids = [record.peer_id for record in records]
        machine._suspected = set(rng.sample(ids, rng.randrange(0, len(ids) + 1)))
        machine._unavailable = set(rng.sample(ids, rng.randrange(0, len(ids) + 1)))
        lineage_peers = machine._lineage_peers()  # the reference: a scan of every peer
        ready = [peer for peer in lineage_peers if peer.ready_for_round == machine.round]
        servers = [peer.peer_id for peer in ready if not peer.client]
        readiness = machine._readiness()
        assert readiness.first_server() == (servers[0] if servers else None)
        assert readiness.num_ready() == len(ready)
        assert readiness.ready_ids() == {peer.peer_id for peer in ready}
        assert readiness.peer_ids() == {peer.peer_id for peer in lineage_peers}


def test_a_members_events_do_not_walk_every_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A member re-evaluates its round on every view, tick and message: at 1000 peers that must cost
    the lineage's index (built once per view), not a pass over the view each time."""
    records = [make_record(f"p{index:04d}", ready=index % 2 == 0) for index in range(1000)]
    view = SwarmView.build(records, now=0.0, protocol_version=PROTOCOL_VERSION)
    machine = RoundFormation(
        config=CONFIG, local=make_record("p0999"), num_tokens=1, vector_length=100, now=0.0
    )
    actions = machine.start(view, 0.0)
    assert [to for to, _ in sends(actions, JoinRequest)] == ["p0000"]  # the smallest ready id leads
    walks = 0
    original = SwarmView.with_local

    def counted(self: SwarmView, local: PeerRecord) -> tuple[PeerRecord, ...]:
        nonlocal walks
        walks += 1
        return original(self, local)

    monkeypatch.setattr(SwarmView, "with_local", counted)
    for second in range(1, 20):
        machine.on_view(view, float(second))
        machine.tick(float(second) + 0.5)
    assert machine.phase is Phase.WAITING and walks == 0
