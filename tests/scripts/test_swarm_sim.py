"""The swarm simulator (scripts/sim, scripts/tools/swarm_sim.py): it drives the product's own classes,
forms one full group per round without faults with the bytes of the byte formula computed here by
hand, forms later rounds without a crashed node, and is a pure function of its seed."""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import random
import re
from pathlib import Path

import pytest

import node.swarm.setup as daemon_setup
import protocol.membership.lineage as product_lineage
import protocol.membership.rounds as product_rounds
import protocol.swarm.driver as daemon_driver
from node.config import NodeConfig
from node.swarm.catch_up import rejoin_due
from protocol.membership.messages import Begin, GroupMember, GroupSpec, Proposal
from protocol.membership.records import PeerRecord, PeerStatus, SwarmView, newest_per_peer
from protocol.swarm.config import PROTOCOL_VERSION
from protocol.swarm.participation import MissedRoundWait, missed_round_wait, peer_due
from scripts.sim import node as sim_node
from scripts.sim import settings as sim_settings
from scripts.sim.dht import SimulatedDht, restamped
from scripts.sim.links import LinkProfile, Network
from scripts.sim.report import RunRecorder
from scripts.sim.settings import FaultRates, SimSettings
from scripts.sim.swarm import Swarm, simulate
from tests.scripts.script_loader import SCRIPTS_DIR, load_script

swarm_sim = load_script("swarm_sim")

NUM_NODES = 8
PART = 40_960  # numbers per member: 160 int8 blocks of 256, inside one 2^18-number chunk
EQUAL_LINKS = {"link_mbit_min": 100.0, "link_mbit_max": 100.0}  # equal uplinks: equal parts


def fault_free(**changes: object) -> SimSettings:
    """Equal speeds and links, so every node is ready for every round within the join window."""
    base: dict[str, object] = {
        "num_nodes": NUM_NODES,
        "num_rounds": 3,
        "seed": 7,
        "num_params": NUM_NODES * PART,
        "speed_max": 1.0,
        **EQUAL_LINKS,
    }
    return SimSettings(**{**base, **changes})  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_the_simulator_drives_the_daemons_classes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon builds its formations in protocol/swarm/driver.py from the SwarmConfig that
    # node/swarm/setup.py's swarm_config makes: the same class and builder the simulator uses.
    driver_source = inspect.getsource(daemon_driver.RoundDriver.form)
    assert re.search(r"RoundFormation\(\s*config=self\.config\.rounds", driver_source)
    assert daemon_driver.RoundFormation is product_rounds.RoundFormation
    assert "SwarmNode(swarm_config(config))" in inspect.getsource(daemon_setup.start_swarm)
    assert sim_settings.swarm_config is daemon_setup.swarm_config
    assert sim_node.RoundFormation is product_rounds.RoundFormation
    assert sim_node.decide_lineage is product_lineage.decide_lineage
    assert (sim_node.rejoin_due, sim_node.peer_due, sim_node.MissedRoundWait) == (
        rejoin_due,
        peer_due,
        MissedRoundWait,
    )
    # No second implementation: the simulator defines none of the product's decisions.
    sim_source = "\n".join(path.read_text() for path in (SCRIPTS_DIR / "sim").glob("*.py"))
    for name in ("RoundFormation", "decide_lineage", "canonical_lineage", "part_boundaries", "rejoin_due"):
        assert not re.search(rf"^\s*(class|def) {name}\b", sim_source, re.MULTILINE), name

    # Every formation of a run is the product's class, fed through its own events.
    calls: dict[str, int] = {"start": 0, "on_message": 0, "tick": 0}
    for method in calls:
        original = getattr(product_rounds.RoundFormation, method)

        def counted(self: object, *args: object, _original: object = original, _name: str = method) -> object:
            calls[_name] += 1
            return _original(self, *args)  # type: ignore[operator]

        monkeypatch.setattr(product_rounds.RoundFormation, method, counted)
    settings = fault_free(num_rounds=2)
    swarm = Swarm(settings)
    swarm.run()
    expected = daemon_setup.swarm_config(NodeConfig.from_flat(codec="int8", join_window=15.0, max_wait=120.0))
    assert swarm.config == expected
    formations = [node.formation for node in swarm.world.nodes.values()]
    assert all(isinstance(formation, product_rounds.RoundFormation) for formation in formations)
    assert all(formation.config is swarm.config.rounds for formation in formations)  # type: ignore[union-attr]
    assert calls["start"] == NUM_NODES * 2
    assert calls["on_message"] > 0 and calls["tick"] > 0


@pytest.mark.timeout(60)
def test_fault_free_rounds_form_with_every_node_and_the_formula_bytes() -> None:
    swarm = Swarm(fault_free())
    result = swarm.run()
    # By hand: int8 sends n bytes plus one fp32 scale per 256 numbers; a member sends its slice of each
    # of the 7 other parts, then its own part's mean to the 7 others: 2 (N - 1) encoded parts.
    encoded_part = PART + 4 * (PART // 256)
    by_hand = 2 * (NUM_NODES - 1) * encoded_part
    assert by_hand == 582_400
    assert [r["round"] for r in result["rounds"]] == [1, 2, 3]
    for figures in result["rounds"]:
        assert figures["group_sizes"] == [NUM_NODES]
        assert figures["split_groups"] == 0
        assert figures["participation"] == 1.0
        assert figures["outcomes"] == {"group": NUM_NODES}
        assert figures["bytes_sent_mean"] == by_hand and figures["bytes_sent_max"] == by_hand
    for round_index, sent in swarm.recorder.averaged_by.items():
        assert sent == {peer_id: by_hand for peer_id in swarm.world.nodes}, round_index
    # Identical outcome on every node: the same group each round, the same params at the end.
    for reports in swarm.recorder.groups.values():
        assert len(reports) == 1 and reports[0].contributors == tuple(sorted(swarm.world.nodes))
    assert len({node.lineage for node in swarm.world.nodes.values()}) == 1
    assert result["end"]["lineages"] == 1 and result["end"]["canonical_nodes"] == NUM_NODES
    assert result["end"]["canonical_round"] == 3


@pytest.mark.timeout(60)
def test_three_hundred_nodes_on_10_mbit_links_form_one_group() -> None:
    """A leader's proposals and Begins to 299 others take ~16 s on a 10 Mbit/s uplink. With fixed
    waits (3 s per send, 5 s to collect, 10 s for a Begin) 229 messages expired, 139 of the 300
    locked, the all-reduce had no majority and the round ended on 300 lineages (BENCHMARKS.md,
    "Today's single-group round at N = 1000"); the waits now grow with the leader's fan-out."""
    settings = SimSettings(
        num_nodes=300, num_rounds=1, seed=1, speed_max=1.0, link_mbit_min=10.0, link_mbit_max=10.0
    )
    swarm = Swarm(settings)
    result = swarm.run()
    (figures,) = result["rounds"]
    assert figures["group_sizes"] == [300] and figures["participation"] == 1.0
    assert swarm.network.num_messages_expired == 0 and figures["messages_expired"] == 0
    assert figures["leader"]["uplink_mbit"] == 10.0
    assert result["end"]["lineages"] == 1
    # The leader's uplink is the limit: its messages alone took longer than the old fixed waits.
    assert figures["formation_seconds_max"] > swarm.config.message_timeout.total_seconds() + 5


def test_a_message_past_its_deadline_is_counted_for_its_round() -> None:
    """The report's per-round count of expired messages (``links.Network``): a Begin of round 7 that
    a 1 kB/s uplink cannot send by its deadline, and a Proposal of round 8 queued behind it."""
    network = Network(PROTOCOL_VERSION)
    for peer_id in ("a", "b"):
        network.add(peer_id, LinkProfile(latency_s=0.01, up_bytes_per_s=1000.0, down_bytes_per_s=1000.0))
    member = GroupMember(peer_id="a", grpc_address="10.0.0.1:1", num_tokens=1, bandwidth_bytes_per_s=1000.0)
    spec = GroupSpec(
        round=7, group_id="a/7/1", leader_id="a", param_hash="0" * 64, vector_length=4,
        members=(member,), part_boundaries=(0, 4),
    )  # fmt: skip
    begin_bytes = network.wire_bytes("a", Begin(group=spec))
    assert network.send_time("a", "b", Begin(group=spec), 0.0, deadline=begin_bytes / 1000.0 / 2) is None
    proposal = Proposal(round=8, proposal_id="a/8/1", param_hash="0" * 64, members=("a", "b"))
    assert network.send_time("a", "b", proposal, 0.0, deadline=0.1) is None  # the uplink is busy until then
    assert network.expired_by_round == {7: 1, 8: 1} and network.num_messages_expired == 2


@pytest.mark.timeout(60)
def test_a_crashed_node_is_left_out_of_later_rounds() -> None:
    settings = fault_free(num_rounds=4)
    swarm = Swarm(settings)
    swarm.start()
    victim = swarm.world.nodes[sorted(swarm.world.nodes)[3]]
    crash_at = 115.0  # just before round 1 forms: its record outlives it by up to record_ttl (20 s)
    swarm.queue.at(crash_at, victim.crash)
    result = swarm.run()
    rounds = {r["round"]: r for r in result["rounds"]}
    assert sorted(rounds) == [1, 2, 3, 4]
    assert all(victim.peer_id not in sent for sent in swarm.recorder.averaged_by.values())
    # Round 1: the leader waited for the crashed node's lingering record (not ready) for its join
    # window, then formed without it.
    assert rounds[1]["group_sizes"] == [NUM_NODES - 1]
    ttl = swarm.config.record_ttl.total_seconds()
    for index in (2, 3, 4):  # after the TTL: every live node in the round, formed without waiting
        figures = rounds[index]
        assert figures["started_at"] > crash_at + ttl
        assert figures["group_sizes"] == [NUM_NODES - 1]
        assert figures["live_nodes"] == NUM_NODES - 1 and figures["participation"] == 1.0
        assert figures["formation_seconds_max"] < swarm.config.rounds.join_window.total_seconds()
    assert result["end"]["lineages"] == 1


@pytest.mark.timeout(60)
def test_a_node_that_missed_a_round_waits_for_the_groups_long_all_reduce_and_steps_to_it() -> None:
    """Eight nodes of one speed on 10 Mbit/s links, 100 M numbers: a round's all-reduce lasts ~140 s,
    far past ``missed_round_wait`` (37 s). One node is frozen across round 1's formation, so the
    others begin it without it; it thaws, asks to join and hears that the round started. It must wait
    for the group's all-reduce while the member that told it stays on their lineage, then step to
    round 1's params with the round's mean, and average rounds 2 and 3 with the others. Before, it
    stepped on its own Δ 37 s after the miss, so no chain of means led from its params: it fetched
    the whole state (800 MB, ~11 min at 10 Mbit/s), missed round 2 and was still off the canonical
    lineage at the end."""
    settings = fault_free(num_rounds=3, num_params=100_000_000, link_mbit_min=10.0, link_mbit_max=10.0)
    swarm = Swarm(settings)
    swarm.start()
    victim = swarm.world.nodes[sorted(swarm.world.nodes)[3]]
    # Frozen from 100 s to 140 s: its record expires before the others' phases end at ~120 s, so
    # they form round 1 at once without it; it thaws after they locked into the group.
    swarm.queue.at(100.0, lambda: victim.freeze(40.0))
    result = swarm.run()
    rounds = {r["round"]: r for r in result["rounds"]}
    assert rounds[1]["group_sizes"] == [NUM_NODES - 1]
    allreduce = rounds[1]["allreduce_seconds"]
    assert allreduce > 3 * missed_round_wait(swarm.config).total_seconds()
    missed = [f for f in swarm.recorder.formations[1] if f.peer_id == victim.peer_id]
    assert [f.outcome for f in missed] == ["missed"]
    assert victim.peer_id not in swarm.recorder.averaged_by[1]
    for index in (2, 3):
        assert rounds[index]["group_sizes"] == [NUM_NODES], index
        assert victim.peer_id in swarm.recorder.averaged_by[index], index
    end = result["end"]
    assert end["lineages"] == 1 and end["own_delta_nodes"] == 0
    assert end["canonical_nodes"] == NUM_NODES and end["canonical_round"] == 3


@pytest.mark.timeout(120)
def test_the_same_seed_gives_the_same_json(tmp_path: Path) -> None:
    # 8 rounds: with the default schedule's short phases (node/outer/uneven.py) 4 lasted too short a
    # simulated time for more than one fault of each kind.
    argv = ["--nodes", "30", "--rounds", "8", "--params", "1000000", "--crash-rate", "0.1",
            "--restart-after", "60", "--freeze-rate", "0.1", "--leave-rate", "0.05", "--join-rate", "0.1",
            "--partition-at", "100", "--partition-seconds", "60"]  # fmt: skip
    outputs = []
    for name in ("a.json", "b.json"):
        swarm_sim.main([*argv, "--seed", "3", "--json", str(tmp_path / name)])
        outputs.append((tmp_path / name).read_text())
    assert outputs[0] == outputs[1]
    result = json.loads(outputs[0])
    assert result["faults"].get("partition") == 1 and sum(result["faults"].values()) >= 6
    other = simulate(
        SimSettings(num_nodes=30, num_rounds=3, seed=4, num_params=1_000_000, faults=FaultRates(crash=0.03))
    )
    assert json.dumps(other, sort_keys=True) != json.dumps(result, sort_keys=True)


def test_a_heartbeats_restamped_record_is_the_replaced_one() -> None:
    record = sim_node.PeerRecord(
        peer_id="12D3KooWabc", grpc_address="10.0.0.1:31337", protocol_version=1, round=3,
        param_hash="a" * 64, ready_for_round=4, tokens_per_s=5.0, bandwidth_bytes_per_s=1e6,
        status="active", expires_at=10.0,
    )  # fmt: skip
    again = restamped(record, 32.5)
    assert again == dataclasses.replace(record, expires_at=32.5) and again.__dict__ == {
        **record.__dict__,
        "expires_at": 32.5,
    }
    assert record.expires_at == 10.0  # the stored one is untouched


@pytest.mark.timeout(60)
def test_the_dhts_kept_views_are_the_views_built_at_every_epoch() -> None:
    """The DHT rebuilds a side's view only when a record appears, expires, or changes in more than
    its expiry. The reference: at every epoch, ``SwarmView.build`` over every store visible by then
    (the newest per peer); the kept view must list the same records but for their ``expires_at``."""
    rng = random.Random(11)
    dht = SimulatedDht(rng=random.Random(12), protocol_version=1, delay=(0.2, 1.5), loss=0.1, epoch=0.25)
    stores: list[tuple[float, PeerRecord]] = []  # (visible at, record): what the reference applies

    def store(record: PeerRecord, now: float) -> None:
        pending = len(dht._pending)
        dht.store(record, now)
        if len(dht._pending) > pending:  # not lost
            stores.append((max(dht._pending, key=lambda entry: entry[1])[0], record))  # the latest store

    base = {
        f"p{index}": sim_node.PeerRecord(
            peer_id=f"p{index}", grpc_address="10.0.0.1:1", protocol_version=1, round=1, param_hash="a" * 64,
            ready_for_round=None, tokens_per_s=1.0, bandwidth_bytes_per_s=1.0, status="active", expires_at=0.0,
        )
        for index in range(8)
    }  # fmt: skip
    table: dict[str, PeerRecord] = {}  # the reference DHT: every store visible so far, newest per peer
    for step in range(2400):  # 600 simulated seconds in quarter-seconds
        now = step * 0.25 + rng.uniform(0.0, 0.24)
        for peer_id, record in base.items():
            roll = rng.random()
            if roll < 0.05:  # a heartbeat renews it
                store(restamped(record, now + 20.0), now)
            elif roll < 0.055:  # it says something new (ready, a new round, syncing, a goodbye)
                status: PeerStatus = rng.choice(["active", "active", "syncing", "left"])
                changed = dataclasses.replace(
                    record,
                    round=record.round + rng.randrange(0, 2),
                    ready_for_round=None,
                    status=status,
                    ready_at=now + 5.0 if status == "syncing" else None,
                    expires_at=now + 20.0,
                )
                if status == "active" and rng.random() < 0.5:
                    changed = dataclasses.replace(changed, ready_for_round=changed.round + 1)
                base[peer_id] = changed
                store(changed, now)
        view = dht.view("p0", now)
        at = int(now / 0.25) * 0.25
        stores.sort(key=lambda store: store[0])
        while stores and stores[0][0] <= at:  # visible by the epoch's start: the newest per peer wins
            record = stores.pop(0)[1]
            table[record.peer_id] = newest_per_peer([*table.values(), record])[record.peer_id]
        reference = SwarmView.build(table.values(), now=at, protocol_version=1)

        def said(records: tuple[PeerRecord, ...]) -> list[dict[str, object]]:
            return [{**record.__dict__, "expires_at": None} for record in records]

        assert said(view.peers) == said(reference.peers), now
        assert said(view.syncing) == said(reference.syncing) and view.left_peer_ids == reference.left_peer_ids
    assert 0 < dht.num_views_built < 2400 // 4  # kept across epochs, rebuilt when a record says more


PARTITION = (600.0, 720.0)


@pytest.mark.timeout(120)
def test_two_hundred_nodes_of_uneven_speeds_through_churn_and_a_partition() -> None:
    """200 nodes of speeds 1x-4x on rounds due by time (``--round-seconds 60``: every node's phase lasts
    60 s), 10 rounds, while 1% of the nodes crash, 2% leave and 2% join per nominal round (120 s), and
    30% of them are cut off from 600 s to 720 s. The swarm's invariants:

    - a round splits only across the partition: one group per side, never two on one side, and no
      split in a round the partition does not overlap (the protocol forms one group per lineage);
    - at least 99% of the live (node, round) pairs averaged (0.995 measured; 0.983 before a node
      that missed a round waited for the group's all-reduce, which lasts ~145 s here, instead of 37 s,
      and 0.918 before a node sending its state to a joiner stopped training on once the round formed
      without it: a node joining, re-syncing or cut off misses a round);
    - every live node on one lineage at the end (the partition's smaller side re-synced; before the
      missed-round wait followed the group, 8 nodes whose fetch ended during the last round's
      all-reduce were on params of their own Δ).

    The default schedule (a fixed H, so a 4x node waits for a 1x one) is not in this test: it
    averages ~0.64 of the pairs at this size (BENCHMARKS.md, "Swarm simulator"; issue 33, item 3)."""
    settings = SimSettings(
        num_nodes=200,
        num_rounds=10,
        seed=1,
        round_seconds=60.0,
        faults=FaultRates(
            crash=0.01,
            leave=0.02,
            join=0.02,
            partition_at=PARTITION[0],
            partition_seconds=PARTITION[1] - PARTITION[0],
        ),
    )
    swarm = Swarm(settings)
    sides: dict[str, int] = {}
    heal = swarm.faults._heal

    def heal_and_keep_sides() -> None:
        sides.update(swarm.world.network.side_of)  # peer -> 1 on the smaller side, before they merge
        heal()

    swarm.faults._heal = heal_and_keep_sides  # type: ignore[method-assign]
    result = swarm.run()
    assert result["faults"]["partition"] == result["faults"]["heal"] == 1
    assert min(result["faults"][kind] for kind in ("crash", "leave", "join")) >= 20
    rounds = {figures["round"]: figures for figures in result["rounds"]}
    assert sorted(rounds) == list(range(1, 11))
    for index, figures in rounds.items():
        overlaps = figures["started_at"] < PARTITION[1] and figures["ended_at"] > PARTITION[0]
        if not overlaps:
            assert figures["split_groups"] == 0, index
            continue
        averaged = [report for report in swarm.recorder.groups[index] if report.averaged]
        for parent in {report.parent for report in averaged}:
            of_parent = [report for report in averaged if report.parent == parent]
            side_of_group = [
                {sides.get(peer_id, 0) for peer_id in report.contributors} for report in of_parent
            ]
            assert all(len(group_sides) == 1 for group_sides in side_of_group), index  # each on one side
            assert len({next(iter(group_sides)) for group_sides in side_of_group}) == len(
                of_parent
            )  # one a side
    assert result["totals"]["participation"] >= 0.99
    end = result["end"]
    assert end["lineages"] == 1 and end["canonical_nodes"] == end["live_nodes"]
    assert end["canonical_round"] >= settings.num_rounds


@pytest.mark.timeout(60)
def test_a_run_makes_next_to_no_cyclic_garbage_keeps_no_dead_nodes_views_and_restores_the_collector() -> None:
    """A large run allocates millions of short-lived objects; the simulator runs with the cyclic
    collector's passes made rare (swarm.py, ``_few_collections``), which is sound only if its events
    make no reference cycles (each ``_after`` callback that named itself made one: ~3 objects in
    cycles per event here, and the passes over them were half the CPU of a 1000-node run)."""
    settings = SimSettings(  # 8 rounds: a simulated time long enough for restarts, freezes, 3 gone
        num_nodes=30, num_rounds=8, seed=5, num_params=1_000_000,
        faults=FaultRates(crash=0.1, restart_after=60, freeze=0.1, leave=0.05, join=0.1,
                          partition_at=100, partition_seconds=60),
    )  # fmt: skip
    swarm = Swarm(settings)
    thresholds = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        result = swarm.run()
        in_cycles = gc.collect()  # the swarm is still referenced: what it left behind, unreachable
    finally:
        gc.enable()
    events = result["end"]["events"]
    assert events > 3000 and result["faults"].get("restart", 0) > 0 and result["faults"].get("freeze", 0) > 0
    assert in_cycles < 0.05 * events, (in_cycles, events)  # 103 of 7063 events; before: 26,873
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
    # A node that stopped keeps no view (a few hundred records each): a long run's heap, and the
    # collector's passes over it, would grow with its churn (2 GB after 50 rounds of 1000 nodes).
    stopped = [node for node in swarm.world.nodes.values() if not node.alive]
    assert len(stopped) >= 3
    for node in stopped:
        assert len(node.stand_in.driver.view) == 0 and node._handled is None and node._tick is None


def test_the_report_splits_forming_time_and_utilization_by_speed() -> None:
    """``by_speed`` (issue 33's "fast nodes blocked"): per third of the speed range, the seconds its
    nodes spent forming rounds over their round records' wall time, and training over wall time.
    Figures here computed by hand: a 1.2x node formed 2 s and 6 s (of walls 40 and 60 s, training
    30 and 50 s), a 3.9x node formed 1 s (wall 50, training 45); round 3 is past ``last``."""
    recorder = RunRecorder(speeds={"slow": 1.2, "fast": 3.9, "middle": 2.5})
    recorder.formed("slow", 1, "group", 0.0, 2.0, 0, 0)
    recorder.formed("slow", 2, "missed", 0.0, 6.0, 0, 0)
    recorder.formed("fast", 1, "group", 0.0, 1.0, 0, 0)
    recorder.formed("fast", 3, "group", 0.0, 99.0, 0, 0)
    recorder.round_end("slow", 1, "averaged", 30.0, 40.0)
    recorder.round_end("slow", 2, "missed", 50.0, 60.0)
    recorder.round_end("fast", 1, "averaged", 45.0, 50.0)
    recorder.round_end("fast", 3, "averaged", 1.0, 100.0)
    assert recorder.by_speed(2, 1.0, 4.0) == [
        {"speeds": [1.0, 2.0], "nodes": 1, "formation_share": 0.08, "compute_utilization": 0.8},
        {"speeds": [2.0, 3.0], "nodes": 0, "formation_share": None, "compute_utilization": None},
        {"speeds": [3.0, 4.0], "nodes": 1, "formation_share": 0.02, "compute_utilization": 0.9},
    ]
