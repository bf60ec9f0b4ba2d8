"""No two live nodes read the same windows within a round, for a node that starts reading after its
round began (issue 31, item 2): a late joiner, and a starter beyond the start barrier's N.

The real loop (``Trainer``: ``OuterRound`` over ``ShardedBatches``) and the real swarm side
(``SwarmSession``: join, start barrier, the records' data lanes) run over a fake ``SwarmNode`` that
holds a scripted DHT view: the live members' records, each saying which data it reads
(``data_lane``). The windows a node reads are caught where the loader gathers them; the members'
are written by hand from the window permutation: shard ``i`` of ``n`` reads the permutation's
positions ``P + s*n*B + i + n*k`` at step ``s`` of a round that starts at position ``P``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import node.data.batches as batches_module
from node.config import NodeConfig
from node.data.batches import window_permutation
from node.swarm.session import SwarmSession
from node.swarm.state import adopted_state
from node.train.trainer import Trainer
from protocol.membership.lineage import LineageDecision, decide_lineage
from protocol.membership.records import PeerRecord, SwarmView
from protocol.statesync.fetch import FetchReport
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.config import PROTOCOL_VERSION

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


def record(peer_id: str, *, round: int, param_hash: str, lane: tuple[int, int]) -> PeerRecord:
    """A live member's record as the DHT gives it (``data_lane`` a list, as msgpack returns it)."""
    return PeerRecord.from_dict(
        {
            "peer_id": peer_id, "grpc_address": "10.0.0.1:5000", "protocol_version": PROTOCOL_VERSION,
            "round": round, "param_hash": param_hash, "ready_for_round": None, "tokens_per_s": 1000.0,
            "bandwidth_bytes_per_s": 1e6, "status": "active", "expires_at": NOW + 60, "data_lane": list(lane),
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

    def advertise_rate(self, tokens_per_s: float) -> None:
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


@pytest.mark.timeout(180)
def test_a_late_joiners_first_partial_round_reads_no_window_a_live_node_reads(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lineage: 3 rounds of H = 2 steps, alone (1 shard: position 3 * 2 * B = 24), then two
    # members read shards 0 and 1 of 2, and a node that joined before us reads spare lane 0.
    source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=3))
    source.run()
    source.batches.reshard(0, 2)  # as after a round in a group of two
    snapshot = source.round.snapshot()
    lineage = dict(round=3, param_hash=snapshot.state_id)
    start = source.batches.position
    assert (start, source.batches.epoch) == (3 * INNER_STEPS * BATCH_SIZE, 0)
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
    source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=3))
    source.run()
    source.batches.reshard(0, 2)
    snapshot = source.round.snapshot()
    lineage = dict(round=3, param_hash=snapshot.state_id)
    start = source.batches.position
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
