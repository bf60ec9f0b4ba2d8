"""The simulator with uneven speeds on the default schedule (rounds due by steps; issue 33, item 3):
its nodes end their phases short by the product's own rule (``node/outer/uneven.py``), so a swarm of
speeds 1x-4x averages every node in every round, while a swarm of equal speeds never ends a phase
short."""

from __future__ import annotations

import statistics

import pytest

import node.outer.round as daemon_round
import node.outer.uneven as uneven
from scripts.sim import node as sim_node
from scripts.sim.settings import SimSettings
from scripts.sim.swarm import Swarm

NUM_NODES = 12
SMALL = {"num_params": 1_000_000, "link_mbit_min": 100.0, "link_mbit_max": 100.0}  # all-reduce ~0.2 s


def run(settings: SimSettings, monkeypatch: pytest.MonkeyPatch) -> tuple[Swarm, dict[str, object], list[str]]:
    """The run's result and the peers whose phase ended short, once per short phase."""
    ended_short: list[str] = []
    end_short = sim_node.SimNode._end_short

    def counted(node: sim_node.SimNode) -> None:
        ended_short.append(node.peer_id)
        end_short(node)

    monkeypatch.setattr(sim_node.SimNode, "_end_short", counted)
    swarm = Swarm(settings)
    return swarm, swarm.run(), ended_short


def test_the_simulated_node_ends_short_by_the_daemons_rule() -> None:
    assert sim_node.ShortPhases is daemon_round.ShortPhases is uneven.ShortPhases
    assert sim_node.uneven is daemon_round.uneven is uneven.uneven


@pytest.mark.timeout(120)
def test_nodes_of_speeds_1x_to_4x_average_every_round_with_their_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """12 nodes of speeds 1.1x-3.6x (drawn from 1x-4x), H steps (the default), 8 rounds, no faults:
    every node averages in every round, the lagging ones with the tokens they trained (short phases),
    and the fastest wait for the round to form ~3 s of their 33 s phase (measured 3.0 s; 15 s, the
    join window, when only the nodes 1.5x slower than the fastest ended short: those within it
    trained H). Without the rule (a fixed H) the slower nodes miss rounds: the join window closes
    before they reach H."""
    settings = SimSettings(num_nodes=NUM_NODES, num_rounds=8, seed=3, **SMALL)  # type: ignore[arg-type]
    swarm, result, ended_short = run(settings, monkeypatch)
    totals = result["totals"]
    assert isinstance(totals, dict)
    assert totals["participation"] == 1.0
    speeds = {peer_id: node.speed for peer_id, node in swarm.world.nodes.items()}
    fastest = max(speeds.values())
    assert fastest / min(speeds.values()) > 3
    slow = {peer_id for peer_id, speed in speeds.items() if speed * uneven.SLOW_STEP_RATIO <= fastest}
    assert slow <= set(ended_short)  # every node 1.5x slower than the fastest, and others that lag
    # The fastest nodes' wait in the round's formation, per round after the first: a few seconds.
    quick = {peer_id for peer_id, speed in speeds.items() if speed >= 0.9 * fastest}
    waits = [
        formed.seconds
        for round_index, formations in swarm.recorder.formations.items()
        if round_index > 1
        for formed in formations
        if formed.peer_id in quick
    ]
    phase = settings.phase_seconds / fastest
    assert statistics.mean(waits) < 0.15 * phase, (statistics.mean(waits), phase)


@pytest.mark.timeout(120)
def test_nodes_of_equal_speed_never_end_a_phase_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal speeds (with the DHT's delays between them): every node trains H steps in every round."""
    settings = SimSettings(num_nodes=NUM_NODES, num_rounds=5, seed=3, speed_max=1.0, **SMALL)  # type: ignore[arg-type]
    _, result, ended_short = run(settings, monkeypatch)
    assert ended_short == []
    totals = result["totals"]
    assert isinstance(totals, dict) and totals["participation"] == 1.0
