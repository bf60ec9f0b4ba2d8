"""No two live nodes read the same windows within a round (issue 31, item 2): for a node that starts
reading after its round began (a late joiner, a starter beyond the start barrier's N), and for the
members of a round, who leave it at one agreed data position (starters that read round 1 with
different shard counts, members of uneven speed with ``--round-seconds``).

The real loop (``Trainer``: ``OuterRound`` over ``ShardedBatches``) and the real swarm side
(``SwarmSession``: join, start barrier, the records' data lanes) run over a fake ``SwarmNode`` that
holds a scripted DHT view: the live members' records, each saying which data it reads
(``data_lane``). The windows a node reads are caught where the loader gathers them; the members'
are written by hand from the window permutation: shard ``i`` of ``n`` reads the permutation's
positions ``P + s*n*B + i + n*k`` at step ``s`` of a round that starts at position ``P``. For whole
rounds the fake node forms scripted groups (``GroupedSwarmNode``: the members and each one's tokens,
as a group's spec carries them), and the nodes train their phases in turn.
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

import node.data.batches as batches_module
import node.outer.round as outer_round_module
from node.config import NodeConfig
from node.data.batches import window_permutation
from node.swarm.session import SwarmSession
from node.swarm.state import adopted_state
from node.train.trainer import Trainer
from protocol.allreduce.allreduce import AllReduceResult
from protocol.codecs import NoneCodec
from protocol.membership.lineage import LineageDecision, decide_lineage
from protocol.membership.messages import GroupMember, GroupSpec
from protocol.membership.records import PeerRecord, SwarmView
from protocol.statesync.fetch import FetchReport
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.config import PROTOCOL_VERSION
from protocol.swarm.result import GroupAveraged

SEQ_LEN, BATCH_SIZE, INNER_STEPS = 32, 4, 2
NOW = 100.0


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(inspect.getsource(inspect) * 2)  # ~250 KB of Python source: thousands of windows
    return path


def small_config(corpus_file: Path, run_dir: Path, **overrides: object) -> NodeConfig:
    settings: dict[str, object] = dict(
        model="nano", seq_len=SEQ_LEN, batch_size=BATCH_SIZE, inner_steps=INNER_STEPS, eval_batches=1,
        warmup_steps=2, total_steps=30, data=str(corpus_file), run_dir=str(run_dir), log_every=100,
    )  # fmt: skip
    settings.update(overrides)
    return NodeConfig.from_flat(**settings)


def record(peer_id: str, *, round: int, param_hash: str, lane: tuple[int, int] | None) -> PeerRecord:
    """A live member's record as the DHT gives it (``data_lane`` a list, as msgpack returns it; None:
    a node that has not said yet)."""
    said = {"data_lane": list(lane)} if lane is not None else {}
    return PeerRecord.from_dict(
        {
            "peer_id": peer_id, "grpc_address": "10.0.0.1:5000", "protocol_version": PROTOCOL_VERSION,
            "round": round, "param_hash": param_hash, "ready_for_round": None, "tokens_per_s": 1000.0,
            "bandwidth_bytes_per_s": 1e6, "status": "active", "expires_at": NOW + 60, **said,
        }
    )  # fmt: skip


@dataclass
class FakeSwarmNode:
    """What ``SwarmSession`` calls on ``protocol.swarm.node.SwarmNode``, over a scripted view of the
    live members; the state a joiner fetches is ``snapshot``."""

    peer_id: str
    members: list[PeerRecord]
    snapshot: Snapshot | None = None
    data_lane: tuple[int, int] | None = None
    stored: list[PeerRecord] = field(default_factory=list)  # our records, as stored in the DHT
    codec: Any = field(default_factory=lambda: SimpleNamespace(name="none"))
    config: Any = field(
        default_factory=lambda: SimpleNamespace(
            run_name="spare",
            error_feedback_decay=1.0,
            sync_deadline=timedelta(seconds=5),
            dht_call_timeout=timedelta(seconds=1),
            view_refresh=timedelta(seconds=0.01),
        )  # fmt: skip
    )
    stream_addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.driver = SimpleNamespace(record=None, view=self.view())

    def view(self) -> SwarmView:
        return SwarmView.build(self.members, now=NOW, protocol_version=PROTOCOL_VERSION)

    def view_or_last(self, why: str) -> SwarmView:
        return self.view()

    def wait_for_peers(self, num_peers: int, timeout: timedelta, *, or_foreign: bool = False) -> SwarmView:
        return self.view()

    def set_identity(self, identity: str, *, rank: int | None) -> None:
        self.identity = identity

    def _local(self, round: int, param_hash: str) -> PeerRecord:
        lane = list(self.data_lane) if self.data_lane is not None else None
        changes = {"peer_id": self.peer_id, "round": round, "param_hash": param_hash, "data_lane": lane}
        return PeerRecord.from_dict({**self.members[0].to_dict(), **changes})

    def lineage(self, *, round: int, param_hash: str, defer: bool = False) -> LineageDecision:
        return decide_lineage(self.view().peers, self._local(round, param_hash), defer=defer)

    def fetch_state(self, decision: LineageDecision, *, announce: bool = False) -> FetchReport:
        assert self.snapshot is not None and decision.canonical.param_hash == self.snapshot.state_id
        return FetchReport(
            snapshot=self.snapshot,
            bytes_by_source={decision.sync_sources[0]: 1},
            excluded={},
            elapsed=timedelta(0),
        )

    def publish(self, *, round: int, param_hash: str, tokens_per_s: float, snapshot: Snapshot | None,
                companions: Any = ()) -> None:  # fmt: skip
        self.driver.record = self._local(round, param_hash)
        self.stored.append(self.driver.record)

    def set_data_lane(self, lane: tuple[int, int], *, store_now: bool = False) -> None:
        self.data_lane = lane
        if store_now and self.driver.record is not None:
            self.driver.record = self._local(self.driver.record.round, self.driver.record.param_hash)
            self.stored.append(self.driver.record)

    def watch_closely(self, on: bool) -> None:
        pass

    def advertise_rate(self, tokens_per_s: float, *, step_seconds: float | None = None) -> None:
        pass


class WindowSpy:
    """The windows each loader gathers (``node.data.batches._gather_windows``), while ``reading``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.windows: list[int] = []
        self._on = False
        gather = batches_module._gather_windows

        def spy(tokens: Any, windows: np.ndarray, seq_len: int) -> Any:
            if self._on:
                self.windows += [int(window) for window in windows]
            return gather(tokens, windows, seq_len)

        monkeypatch.setattr(batches_module, "_gather_windows", spy)

    @contextmanager
    def reading(self) -> Iterator[None]:
        self._on = True
        yield
        self._on = False


def shard_windows(permutation: np.ndarray, start: int, shard: tuple[int, int], steps: int) -> list[int]:
    """By hand: shard ``(i, n)``'s windows in the ``steps`` steps of a round starting at ``start``."""
    index, count = shard
    positions = [
        start + s * count * BATCH_SIZE + index + count * k for s in range(steps) for k in range(BATCH_SIZE)
    ]
    return [int(permutation[p]) for p in positions]


def assert_disjoint(reads: dict[str, list[int]]) -> None:
    for (name_a, a), (name_b, b) in itertools.combinations(reads.items(), 2):
        shared = set(a) & set(b)
        assert not shared, f"{name_a} and {name_b} both read window(s) {sorted(shared)[:8]} in the round"


def lineage_at_round_3(corpus_file: Path, tmp_path: Path) -> tuple[Snapshot, dict[str, Any], int]:
    """The lineage a joiner adopts: a node's state after 3 rounds, resharded as after a round in a group
    of two; its snapshot, the record fields naming it (round, param_hash) and its data position."""
    source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=3))
    source.run()
    source.batches.reshard(0, 2)
    start = source.batches.position
    assert (start, source.batches.epoch) == (3 * INNER_STEPS * BATCH_SIZE, 0)
    snapshot = source.round.snapshot()
    return snapshot, dict(round=3, param_hash=snapshot.state_id), start


@pytest.mark.timeout(180)
def test_a_late_joiners_first_partial_round_reads_no_window_a_live_node_reads(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lineage: 3 rounds of H = 2 steps, alone (1 shard: position 3 * 2 * B = 24), then two
    # members read shards 0 and 1 of 2, and a node that joined before us reads spare lane 0.
    snapshot, lineage, start = lineage_at_round_3(corpus_file, tmp_path)
    members = [
        record("peer-m0", lane=(0, 2), **lineage),
        record("peer-m1", lane=(1, 2), **lineage),
        record("peer-j0", lane=(2, 2), **lineage),  # spare lane 0, beside the 2 shards
    ]
    node = FakeSwarmNode("peer-new", members, snapshot=snapshot)
    joiner = Trainer(
        small_config(corpus_file, tmp_path / "joiner", seed=1),
        swarm=SwarmSession(node, joining=True, join_timeout=timedelta(seconds=1)),  # type: ignore[arg-type]
    )
    spy = WindowSpy(monkeypatch)
    joiner.round.start()  # joins: fetches and adopts the lineage's state at the round's start
    assert joiner.diloco.param_hash() == snapshot.state_id and joiner.progress.round == 3
    with spy.reading():
        for _ in range(INNER_STEPS):  # its phase of the round the members are in (at most H steps)
            joiner.inner_step()

    permutation = window_permutation(joiner.batches.num_windows, seed=0, epoch=0)
    behind = [int(permutation[p]) for p in range(start - INNER_STEPS * BATCH_SIZE, start)]
    reads = {
        "member 0": shard_windows(permutation, start, (0, 2), INNER_STEPS),
        "member 1": shard_windows(permutation, start, (1, 2), INNER_STEPS),
        "joiner of spare lane 0": behind,
        "the late joiner": spy.windows,
    }
    assert len(spy.windows) == INNER_STEPS * BATCH_SIZE
    assert_disjoint(reads)
    # Spare lane 1: the H*B positions behind lane 0's, which the lineage read in an earlier round.
    lane_1 = range(start - 2 * INNER_STEPS * BATCH_SIZE, start - INNER_STEPS * BATCH_SIZE)
    assert spy.windows == [int(permutation[p]) for p in lane_1]
    # It said so in the record it serves (so the next joiner takes lane 2), and stays in lockstep:
    # at the round's end it reshards at the members' position.
    assert node.stored[-1].data_lane == (3, 2) and (node.stored[-1].round, node.stored[-1].param_hash) == (
        3,
        snapshot.state_id,
    )
    assert joiner.batches.position == start + INNER_STEPS * 2 * BATCH_SIZE
    # The state it serves names no lane of its own: the lineage's position only, as every member's.
    served = adopted_state(
        joiner.round.snapshot(), num_elements=joiner.diloco.num_elements, corpus_sha256=joiner.corpus.sha256
    )
    assert not set(served.metadata["data"]) & {"shard_index", "spare_lane", "spare_anchor"}


@pytest.mark.timeout(180)
def test_a_starter_beyond_the_start_barriers_nodes_reads_no_window_they_read_in_round_1(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --start-peers 2 and three nodes: peer-b and peer-c passed the barrier seeing each other and read
    # shards 0 and 1 of 2 from step 1. peer-a sees all three: without their records' lanes it would
    # take shard 0 of 3 (it sorts first), reading position 0 as peer-b does.
    config = small_config(corpus_file, tmp_path / "a", start_peers=2)
    probe = Trainer(small_config(corpus_file, tmp_path / "probe"))
    round_0 = dict(round=0, param_hash=probe.diloco.param_hash())  # the same seed: the same init
    members = [record("peer-b", lane=(0, 2), **round_0), record("peer-c", lane=(1, 2), **round_0)]
    node = FakeSwarmNode("peer-a", members)
    starter = Trainer(
        config,
        swarm=SwarmSession(node, joining=True, join_timeout=timedelta(seconds=1), start_peers=2),  # type: ignore[arg-type]
    )
    spy = WindowSpy(monkeypatch)
    starter.round.start()  # join (the same lineage: nothing to adopt), then the start barrier
    with spy.reading():
        for _ in range(INNER_STEPS):  # round 1
            starter.inner_step()

    permutation = window_permutation(starter.batches.num_windows, seed=0, epoch=0)
    num_windows = starter.batches.num_windows
    reads = {
        "peer-b": shard_windows(permutation, 0, (0, 2), INNER_STEPS),
        "peer-c": shard_windows(permutation, 0, (1, 2), INNER_STEPS),
        "peer-a": spy.windows,
    }
    assert len(spy.windows) == INNER_STEPS * BATCH_SIZE
    assert_disjoint(reads)
    # Spare lane 0 of a round from position 0: the epoch's last H*B positions.
    tail = range(num_windows - INNER_STEPS * BATCH_SIZE, num_windows)
    assert spy.windows == [int(permutation[p]) for p in tail]
    assert node.stored[-1].data_lane == (2, 2)  # stored at once: a fourth starter takes lane 1
    assert starter.batches.position == INNER_STEPS * 2 * BATCH_SIZE  # the others' count: in lockstep


@pytest.mark.timeout(180)
def test_two_joiners_that_chose_one_spare_lane_part_at_the_next_step_boundary(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two nodes adopt the lineage's state at once; neither sees the other's record yet, so both take
    # spare lane 0. Once our view shows the other's (it orders before us), we move to lane 1.
    snapshot, lineage, start = lineage_at_round_3(corpus_file, tmp_path)
    members = [record("peer-m0", lane=(0, 2), **lineage), record("peer-m1", lane=(1, 2), **lineage)]
    node = FakeSwarmNode("peer-new", members, snapshot=snapshot)
    joiner = Trainer(
        small_config(corpus_file, tmp_path / "joiner", seed=1),
        swarm=SwarmSession(node, joining=True, join_timeout=timedelta(seconds=1)),  # type: ignore[arg-type]
    )
    spy = WindowSpy(monkeypatch)
    joiner.round.start()
    assert node.stored[-1].data_lane == (2, 2)  # spare lane 0
    steps: list[list[int]] = []
    for step in range(INNER_STEPS):
        if step == 1:  # the other joiner's record reaches our view
            node.members.append(record("peer-j0", lane=(2, 2), **lineage))
            node.driver.view = node.view()
        assert joiner.round.at_step_boundary() is None
        before = len(spy.windows)
        with spy.reading():
            joiner.inner_step()
        steps.append(spy.windows[before:])

    permutation = window_permutation(joiner.batches.num_windows, seed=0, epoch=0)
    lane_0 = [int(permutation[p]) for p in range(start - INNER_STEPS * BATCH_SIZE, start)]
    lane_1 = [
        int(permutation[p])
        for p in range(start - 2 * INNER_STEPS * BATCH_SIZE, start - INNER_STEPS * BATCH_SIZE)
    ]
    assert steps[0] == lane_0[:BATCH_SIZE]  # the step read before we saw it: shared with peer-j0
    assert steps[1] == lane_1[BATCH_SIZE:]  # then lane 1, at the same step of the round
    assert node.stored[-1].data_lane == (3, 2)  # said at once
    assert_disjoint(
        {
            "member 0": shard_windows(permutation, start, (0, 2), INNER_STEPS),
            "member 1": shard_windows(permutation, start, (1, 2), INNER_STEPS),
            "peer-j0": lane_0,
            "us, after moving": steps[1],
        }
    )


# --- One agreed data position at a round's end -----------------------------------------------------
#
# Each member's own position moves by n*B per batch with its own n and its own number of steps; the
# round's end moves every member of the group to one position computed from what the group agreed on
# (node/data/batches.py, "One agreed position at a round's end"). Three batches of B = 3 windows: an
# odd H*B, so positions that drifted by H*B put two members of one shard count on one residue.


@dataclass
class GroupedSwarmNode(FakeSwarmNode):
    """A fake node whose rounds form the scripted groups: ``groups[r]`` is round r's members and the
    tokens each trained in its phase, as the leader put them in the group's spec (from each member's
    Accept); every member steps on its own Δ as the mean (the data is what is tested here)."""

    groups: dict[int, dict[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.driver.clock = lambda: NOW
        self.server = SimpleNamespace(state_provider=SimpleNamespace(served_lately=lambda seconds: False))
        self.config.rounds = SimpleNamespace(join_window=timedelta(seconds=15))
        self.codec = NoneCodec()

    def run_round(self, vector: torch.Tensor, *, round: int, param_hash: str, num_tokens: int,
                  tokens_per_s: float, error_feedback: object = None, vector_name: str = "",
                  send_window: object = None) -> GroupAveraged:  # fmt: skip
        tokens = self.groups[round + 1]
        assert tokens[self.peer_id] == num_tokens  # the script says what this member trained
        members = tuple(
            GroupMember(
                peer_id=peer, grpc_address="10.0.0.1:5000", num_tokens=count, bandwidth_bytes_per_s=1e6
            )
            for peer, count in sorted(tokens.items())
        )
        length = vector.numel()
        group = GroupSpec(
            round=round + 1, group_id=f"group-{round + 1}", leader_id=members[0].peer_id, param_hash=param_hash,
            vector_length=length, members=members, part_boundaries=(0, *[length] * len(members)),
        )  # fmt: skip
        outcome = AllReduceResult(
            averaged=vector.clone(), contributors=[list(group.member_ids)], producers=[members[0].peer_id],
            fell_back=False, failures=[], bytes_sent=0, bytes_recv=0, bytes_sent_by_phase={},
            bytes_recv_by_phase={}, seconds=0.0,
        )  # fmt: skip
        return GroupAveraged(round=round + 1, group=group, allreduce=outcome)


class PhaseClock:
    """The outer rounds' clock (``--round-seconds``), one per node (they train in turn here): still
    while a node's phase trains, past the phase's end at the boundary where the test ends it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 0.0
        self.nodes: dict[int, float] = {}
        monkeypatch.setattr(
            outer_round_module,
            "time",
            SimpleNamespace(monotonic=lambda: self.now, perf_counter=time.perf_counter),
        )

    def at(self, trainer: Trainer, *, phase_over: bool) -> None:
        """The clock as ``trainer`` reads it now: its phase's start, or once it lasted long enough."""
        if phase_over:
            self.nodes[id(trainer)] = self.nodes.get(id(trainer), 0.0) + 100.0
        self.now = self.nodes.get(id(trainer), 0.0)


def train_phase(trainer: Trainer, steps: int, spy: WindowSpy, clock: PhaseClock | None = None) -> list[int]:
    """``steps`` inner steps and the round at the last boundary (by steps, or by the clock): the
    windows read."""
    before = len(spy.windows)
    for step in range(steps):
        with spy.reading():
            trainer.inner_step()
        if clock is not None:
            clock.at(trainer, phase_over=step == steps - 1)  # the phase has lasted --round-seconds
        applied = trainer.round.at_step_boundary()
        assert (applied is not None) == (step == steps - 1), f"step {step}: {applied}"
    return spy.windows[before:]


def starter(corpus_file: Path, run_dir: Path, peer_id: str, sees: list[str], groups: dict[int, dict[str, int]],
            **overrides: object) -> Trainer:  # fmt: skip
    """A fresh node started with ``--start-peers 2`` whose barrier view holds the nodes ``sees``."""
    probe = Trainer(small_config(corpus_file, run_dir / "probe"))
    round_0 = dict(round=0, param_hash=probe.diloco.param_hash(), lane=None)  # one seed: one init
    node = GroupedSwarmNode(peer_id, [record(peer, **round_0) for peer in sees], groups=groups)
    trainer = Trainer(
        small_config(corpus_file, run_dir / peer_id, start_peers=2, batch_size=3, **overrides),
        swarm=SwarmSession(node, joining=True, join_timeout=timedelta(seconds=1), start_peers=2),  # type: ignore[arg-type]
    )
    trainer.round.start()  # join (one lineage: nothing to adopt), then the start barrier
    return trainer


@pytest.mark.timeout(300)
def test_starters_on_different_views_read_disjoint_windows_from_round_2_on(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # peer-a passed the barrier seeing three nodes (shard 0 of 3), peer-b at the same moment seeing
    # two (shard 1 of 2): round 1 reads overlap (the race), and each ends its phase at its own
    # position (3*H*B vs 2*H*B). peer-c never comes: round 1's group is {a, b}, then rounds 2 and 3.
    steps, batch = 3, 3
    tokens = steps * batch * SEQ_LEN
    groups = {r: {"peer-a": tokens, "peer-b": tokens} for r in (1, 2, 3)}
    spy = WindowSpy(monkeypatch)
    a = starter(corpus_file, tmp_path, "peer-a", ["peer-b", "peer-c"], groups, inner_steps=steps)
    b = starter(corpus_file, tmp_path, "peer-b", ["peer-a"], groups, inner_steps=steps)
    assert (a.batches.lane, b.batches.lane) == ((0, 3), (1, 2))
    reads: dict[int, dict[str, list[int]]] = {}
    for round_index in (1, 2, 3):
        reads[round_index] = {"peer-a": train_phase(a, steps, spy), "peer-b": train_phase(b, steps, spy)}
        # One position and one shard count for the whole group after every round.
        assert (a.batches.epoch, a.batches.position) == (b.batches.epoch, b.batches.position)
        assert (a.batches.lane, b.batches.lane) == ((0, 2), (1, 2))
    for round_index in (2, 3):
        assert_disjoint(reads[round_index])
        assert all(len(windows) == steps * batch for windows in reads[round_index].values())
    # From round 2 on, the agreed position is round 1's phase counted as read by 2 shards (the group's
    # size: each member read it as its own view's count), then H*2*B a round; peer-a is shard 0.
    permutation = window_permutation(a.batches.num_windows, seed=0, epoch=0)
    for round_index in (2, 3):
        start = (round_index - 1) * steps * 2 * batch
        expected = [
            int(permutation[start + s * 2 * batch + 2 * k]) for s in range(steps) for k in range(batch)
        ]
        assert reads[round_index]["peer-a"] == expected


@pytest.mark.timeout(300)
def test_members_of_uneven_speed_never_read_one_window_in_a_round_with_round_seconds(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --round-seconds: each node trains as many steps as its phase's time allows. Round 1 is all
    # three (shards of 3 from the barrier); peer-c then leaves: round 2's phase is still read as 3
    # shards (its shard unread), round 3's as 2. Each node's own position drifts by its own steps:
    # entering round 3 peer-a's would stand 9 windows (odd) ahead of peer-b's, on one residue of 2.
    batch, per_step = 3, 3 * SEQ_LEN
    steps = {
        1: {"peer-a": 3, "peer-b": 2, "peer-c": 2},
        2: {"peer-a": 2, "peer-b": 2},
        3: {"peer-a": 3, "peer-b": 2},
    }
    groups = {r: {peer: n * per_step for peer, n in by_peer.items()} for r, by_peer in steps.items()}
    clock = PhaseClock(monkeypatch)
    spy = WindowSpy(monkeypatch)
    nodes = {
        peer: starter(
            corpus_file, tmp_path, peer, [p for p in steps[1] if p != peer], groups, round_seconds=10
        )
        for peer in steps[1]
    }
    assert [node.batches.lane for node in nodes.values()] == [(0, 3), (1, 3), (2, 3)]
    every: list[int] = []
    for round_index, by_peer in steps.items():
        reads = {peer: train_phase(nodes[peer], n, spy, clock) for peer, n in by_peer.items()}
        assert_disjoint(reads)  # within the round
        every += [window for windows in reads.values() for window in windows]
        positions = {(nodes[peer].batches.epoch, nodes[peer].batches.position) for peer in by_peer}
        assert len(positions) == 1, f"round {round_index}: the members part at {positions}"
    # Nor across the rounds: each round starts past every window its group read (the fast node's
    # steps bound the phase), so no window of the epoch is read twice.
    assert len(every) == len(set(every)) == sum(sum(by_peer.values()) for by_peer in steps.values()) * batch
    # The group's position: 3 steps of 3 shards, 2 steps of 3 shards, 3 steps of 2 shards.
    assert nodes["peer-a"].batches.position == (3 * 3 + 2 * 3 + 3 * 2) * batch


@pytest.mark.timeout(180)
def test_a_late_joiner_with_round_seconds_reads_an_endless_spare_lane(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rounds due by time: a joiner's phase lasts until the members' round forms, however many steps
    # that is. It reads 3*H steps on spare lane 1 (lane 0 is another joiner's): never a window twice,
    # never one of lane 0's or of the members' (who read 3*H steps too).
    snapshot, lineage, start = lineage_at_round_3(corpus_file, tmp_path)
    members = [
        record("peer-m0", lane=(0, 2), **lineage),
        record("peer-m1", lane=(1, 2), **lineage),
        record("peer-j0", lane=(2, 2), **lineage),  # spare lane 0
    ]
    node = FakeSwarmNode("peer-new", members, snapshot=snapshot)
    joiner = Trainer(
        small_config(corpus_file, tmp_path / "joiner", seed=1, round_seconds=10),
        swarm=SwarmSession(node, joining=True, join_timeout=timedelta(seconds=1)),  # type: ignore[arg-type]
    )
    spy = WindowSpy(monkeypatch)
    joiner.round.start()
    assert node.stored[-1].data_lane == (3, 2)  # spare lane 1
    steps = 3 * INNER_STEPS
    with spy.reading():
        for _ in range(steps):
            joiner.inner_step()

    permutation = window_permutation(joiner.batches.num_windows, seed=0, epoch=0)

    def lane(index: int) -> list[int]:  # by hand: batch 2**j * (2k + 1) - 1 behind the round's start
        behind = [(2**index * (2 * k + 1) - 1) * BATCH_SIZE for k in range(steps)]
        return [int(permutation[start - b - BATCH_SIZE + w]) for b in behind for w in range(BATCH_SIZE)]

    assert len(spy.windows) == len(set(spy.windows)) == steps * BATCH_SIZE  # never its own window twice
    assert spy.windows == lane(1)
    assert_disjoint(
        {
            "member 0": shard_windows(permutation, start, (0, 2), steps),
            "member 1": shard_windows(permutation, start, (1, 2), steps),
            "peer-j0 on lane 0": lane(0),
            "the late joiner": spy.windows,
        }
    )
