"""A ``--client-mode`` node's health (``node/ops/liveness.py``): its run dir's ``liveness.json``, kept
by a metrics sink and read by ``dtnode health`` when ``node.json`` says client mode.

The sink runs on an injected clock; the bound B is recomputed here from its definition (2 x the median
of the last 5 rounds' wall time + J + S) with the numbers the records carry, and the verdicts are checked
on both sides of B: healthy while records come and rounds are shared, stuck past B, out of the swarm
past 2 x B without a round with a peer, unhealthy once stopped."""

from __future__ import annotations

import json
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from node.ops.cli import main
from node.ops.liveness import LIVENESS_FILE, LivenessBounds, LivenessSink, liveness_verdict, read_liveness

JOIN, STALL, SYNC = 15.0, 30.0, 600.0
BOUNDS = LivenessBounds(
    inner_steps=10,
    round_seconds=0.0,
    join_window=timedelta(seconds=JOIN),
    stall_timeout=timedelta(seconds=STALL),
    sync_deadline=timedelta(seconds=SYNC),
)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def step(number: int) -> dict[str, Any]:
    return {"kind": "step", "round": number // 10 + 1, "step": number, "loss": 2.0, "time": 0.0}


def round_record(number: int, *, wall: float, peers: int = 2, **flags: bool) -> dict[str, Any]:
    record = {"kind": "round", "round": number, "step": 10 * number, "peers": peers, "seconds_wall": wall}
    return {"solo": False, "fell_back": False, "adopted": False, **record, **flags}


def run_rounds(sink: LivenessSink, clock: Clock, walls: list[float], **flags: Any) -> None:
    """Ten steps a second apart, then a round whose wait makes its wall time ``wall``, per round."""
    for index, wall in enumerate(walls, start=1):
        for number in range(10 * (index - 1) + 1, 10 * index + 1):
            clock.now += 1.0
            sink.write(step(number))
        clock.now += wall - 10.0
        sink.write(round_record(index, wall=wall, **flags))


def verdict(path: Path, now: float) -> tuple[bool, str]:
    return liveness_verdict(read_liveness(path.parent), now)


@pytest.mark.timeout(30)
def test_a_node_that_rounds_with_peers_is_healthy_until_its_records_stop_for_longer_than_b(
    tmp_path: Path,
) -> None:
    clock = Clock(1_000.0)
    path = tmp_path / LIVENESS_FILE
    sink = LivenessSink(path, BOUNDS, clock=clock)
    walls = [31.0, 40.0, 29.0, 33.0, 90.0, 30.0]  # one slow round (a fault): the median ignores it
    run_rounds(sink, clock, walls)
    record = json.loads(path.read_text())
    expected_b = 2 * statistics.median(walls[-5:]) + JOIN + STALL  # 2 x 33 + 15 + 30 = 111 s
    assert record["bound_seconds"] == pytest.approx(expected_b) == pytest.approx(111.0)
    assert record["state"] == "training" and (record["round"], record["step"]) == (6, 60)
    assert record["time"] == clock.now == record["last_shared"]
    last = clock.now
    assert verdict(path, last + expected_b - 1)[0]
    healthy, why = verdict(path, last + expected_b + 1)
    assert not healthy and why.startswith("stuck: no step or round for 112 s (bound 111 s"), why


@pytest.mark.timeout(30)
def test_steps_are_written_at_most_once_a_second_and_rounds_always(tmp_path: Path) -> None:
    clock = Clock(1_000.0)
    path = tmp_path / LIVENESS_FILE
    sink = LivenessSink(path, BOUNDS, clock=clock)
    sink.write(step(1))
    clock.now += 0.25
    sink.write(step(2))  # within a second of the last write: the file keeps step 1
    assert json.loads(path.read_text())["step"] == 1
    sink.write(round_record(1, wall=0.25))
    assert json.loads(path.read_text())["step"] == 10


@pytest.mark.timeout(30)
def test_before_a_round_b_is_the_phase_measured_so_far_and_before_two_steps_the_start_up_bound(
    tmp_path: Path,
) -> None:
    clock = Clock(1_000.0)
    path = tmp_path / LIVENESS_FILE
    sink = LivenessSink(path, BOUNDS, clock=clock)
    record = json.loads(path.read_text())
    assert record["state"] == "starting" and record["started"] is None
    assert record["bound_seconds"] == 2 * SYNC + JOIN + STALL  # joining, fetching, the start barrier
    assert verdict(path, clock.now + 1_000)[0]  # starting: no round with a peer is asked for yet
    clock.now += 500.0
    sink.write(step(1))
    for number, seconds in zip(range(2, 6), (2.0, 4.0, 2.0, 2.0), strict=True):
        clock.now += seconds
        sink.write(step(number))
    record = json.loads(path.read_text())
    # P = 10 steps x the median step (2 s) + J; B = 2 P + J + S.
    assert record["bound_seconds"] == pytest.approx(2 * (10 * 2.0 + JOIN) + JOIN + STALL)
    assert record["state"] == "training" and record["started"] == 1_500.0


@pytest.mark.timeout(30)
def test_rounds_due_by_time_take_round_seconds_as_the_phase(tmp_path: Path) -> None:
    clock = Clock(1_000.0)
    bounds = LivenessBounds(
        inner_steps=10, round_seconds=60.0, join_window=timedelta(seconds=JOIN),
        stall_timeout=timedelta(seconds=STALL), sync_deadline=timedelta(seconds=SYNC),
    )  # fmt: skip
    path = tmp_path / LIVENESS_FILE
    sink = LivenessSink(path, bounds, clock=clock)
    for number in (1, 2):
        clock.now += 1.0
        sink.write(step(number))
    assert json.loads(path.read_text())["bound_seconds"] == pytest.approx(2 * (60.0 + JOIN) + JOIN + STALL)


@pytest.mark.parametrize(
    "flags", [{"solo": True, "peers": 1}, {"fell_back": True, "peers": 1}, {"peers": 1}], ids=str
)
@pytest.mark.timeout(30)
def test_a_node_without_a_round_with_a_peer_for_2_b_is_out_of_the_swarm(
    tmp_path: Path, flags: dict[str, Any]
) -> None:
    clock = Clock(1_000.0)
    path = tmp_path / LIVENESS_FILE
    sink = LivenessSink(path, BOUNDS, clock=clock)
    run_rounds(sink, clock, [30.0, 30.0])  # shared rounds: B = 2 x 30 + 15 + 30 = 105 s
    shared_at = clock.now
    assert json.loads(path.read_text())["last_shared"] == shared_at
    alone = {key: value for key, value in flags.items() if key != "peers"}
    for index in range(3, 11):  # rounds alone, each still written (the node is not stuck)
        for number in range(10 * (index - 1) + 1, 10 * index + 1):
            clock.now += 1.0
            sink.write(step(number))
        clock.now += 20.0
        sink.write(round_record(index, wall=30.0, peers=flags["peers"], **alone))
        healthy, why = verdict(path, clock.now)
        b = json.loads(path.read_text())["bound_seconds"]
        assert b == pytest.approx(105.0)
        assert healthy == (clock.now - shared_at <= 2 * b), (index, why)
    assert not healthy and why.startswith("out of the swarm: no round with a peer for 240 s"), why
    run_rounds(sink, clock, [30.0])  # a round with a peer again: healthy again
    assert verdict(path, clock.now)[0]


@pytest.mark.timeout(30)
def test_an_adopted_round_is_one_with_the_swarm(tmp_path: Path) -> None:
    clock = Clock(1_000.0)
    path = tmp_path / LIVENESS_FILE
    sink = LivenessSink(path, BOUNDS, clock=clock)
    run_rounds(sink, clock, [30.0], peers=1, adopted=True)
    assert json.loads(path.read_text())["last_shared"] == clock.now


@pytest.mark.timeout(30)
def test_a_stopped_node_a_missing_and_a_malformed_file_are_unhealthy(tmp_path: Path) -> None:
    clock = Clock(1_000.0)
    path = tmp_path / LIVENESS_FILE
    assert verdict(path, clock.now) == (False, "no liveness.json (the node has not started here)")
    sink = LivenessSink(path, BOUNDS, clock=clock)
    run_rounds(sink, clock, [30.0])
    sink.close()
    assert verdict(path, clock.now) == (False, "stopped at round 1 step 10")
    path.write_text('{"state": "training"}')
    healthy, why = verdict(path, clock.now)
    assert not healthy and why.startswith("liveness.json is malformed"), why


def write_client_run_dir(run_dir: Path, now: float) -> None:
    """A run dir as a client-mode node leaves it (node.json as node/swarm/setup.py writes it) with a
    liveness file its sink wrote at ``now``: one shared round of 30 s behind it (B = 105 s)."""
    run_dir.mkdir()
    identity = {"peer_id": "12D3KooWclient", "multiaddrs": [], "grpc_address": None, "local_address": None,
                "client_mode": True}  # fmt: skip
    (run_dir / "node.json").write_text(json.dumps(identity))
    clock = Clock(now - 30.0)
    run_rounds(LivenessSink(run_dir / LIVENESS_FILE, BOUNDS, clock=clock), clock, [30.0])
    assert clock.now == now


@pytest.mark.timeout(60)
def test_dtnode_health_answers_for_a_client_mode_node_from_its_liveness_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the image's HEALTHCHECK runs (`dtnode health`, no ADDR; DTNODE_LISTEN names a port nobody
    serves, as in a client-mode container): healthy from a fresh liveness file, 1 from a stale one.
    Before, it asked 127.0.0.1 at DTNODE_LISTEN's port and was unhealthy whatever the node did."""
    import time

    fresh, stale = tmp_path / "fresh", tmp_path / "stale"
    write_client_run_dir(fresh, time.time() - 5.0)
    write_client_run_dir(stale, time.time() - 200.0)  # past B = 105 s
    monkeypatch.setenv("DTNODE_LISTEN", "0.0.0.0:1")
    monkeypatch.setenv("DTNODE_RUN_DIR", str(fresh))
    assert main(["health"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{fresh / LIVENESS_FILE}: training at round 1 step 10; last record 5 s ago"), out
    monkeypatch.setenv("DTNODE_RUN_DIR", str(stale))
    assert main(["health"]) == 1
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{stale / LIVENESS_FILE}: stuck: no step or round for 200 s (bound 105 s"), out
