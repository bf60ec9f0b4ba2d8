"""The swarm simulator (scripts/sim, scripts/tools/swarm_sim.py): it drives the product's own classes,
forms one full group per round without faults with the bytes of the byte formula computed here by
hand, forms later rounds without a crashed node, and is a pure function of its seed."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

import node.swarm.setup as daemon_setup
import protocol.membership.lineage as product_lineage
import protocol.membership.rounds as product_rounds
import protocol.swarm.driver as daemon_driver
from node.config import NodeConfig
from node.swarm.catch_up import rejoin_due
from protocol.swarm.participation import missed_round_wait, peer_due
from scripts.sim import node as sim_node
from scripts.sim import settings as sim_settings
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
    assert (sim_node.rejoin_due, sim_node.peer_due, sim_node.missed_round_wait) == (
        rejoin_due,
        peer_due,
        missed_round_wait,
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


@pytest.mark.timeout(120)
def test_the_same_seed_gives_the_same_json(tmp_path: Path) -> None:
    argv = ["--nodes", "30", "--rounds", "3", "--params", "1000000", "--crash-rate", "0.1",
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
