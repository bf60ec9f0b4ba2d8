"""Peers that vanish at named points of a round (SIGKILL or SIGSTOP injected deterministically by the
worker itself, never by sleeping): the survivors must finish on time, bit-identical, with exactly the
weighted mean of the contributors they report; the next round runs without the dead peer.

Each test runs scripts/workers/allreduce_worker.py processes on loopback with the `none` codec (forked
from a server that imported torch and gRPC once: a process start costs more than a case), so the
worker's own check (the exact float32 weighted mean over each part's reported contributors, summed in
member order) must come out at an error of exactly 0. Every case runs with the result written into a
new tensor and in place (into each peer's vector, whose numbers are then no longer there to resend).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from scripts.workers.allreduce_worker import make_vector
from tests.protocol.allreduce.support import Workers

NUM_PEERS = 4
NUM_ROUNDS = 2
DEADLINE_SECONDS = 20.0
VICTIM = 1
COMMON_ARGS = [
    "--elements", "200000",
    "--chunk-elements", "32768",  # two chunks per part
    "--codec", "none",
    "--weighted",
    "--rounds", str(NUM_ROUNDS),
    "--deadline-seconds", str(DEADLINE_SECONDS),
    "--stall-seconds", "3",  # a live peer starved of CPU by parallel tests must not read as stalled
    "--log-level", "INFO",
    "--keep-payloads",  # the result's encoded bytes must rebuild it under every fault too
]  # fmt: skip
EVERYONE = [f"peer-{i}" for i in range(NUM_PEERS)]


def run_workers(
    tmp_path: Path, faults: dict[int, str], result: str, extra: list[str] | None = None
) -> tuple[Workers, dict[int, list[dict[str, object]]]]:
    """Start the workers with the given fault plans; return the survivors' per-round records."""
    in_place = ["--in-place"] if result == "in-place" else []
    workers = Workers(tmp_path, NUM_PEERS, COMMON_ARGS + in_place + (extra or []), forked=True)
    workers.start({index: ["--fault", plan] for index, plan in faults.items()})
    survivors = [i for i in range(NUM_PEERS) if i not in faults]
    records = {i: workers.read_records(i, NUM_ROUNDS, timeout=90) for i in survivors}
    return workers, records


def check_survivors(workers: Workers, records: dict[int, list[dict[str, object]]]) -> None:
    """Every survivor finished every round on time, exactly, and bit-identical to the others."""
    for index, rounds in records.items():
        assert len(rounds) == NUM_ROUNDS, f"worker {index} stopped early:\n{workers.stderr(index)[-3000:]}"
    for round_id in range(NUM_ROUNDS):
        by_survivor = [rounds[round_id] for rounds in records.values()]
        for record in by_survivor:
            assert record["fell_back"] is False, record["failures"]
            assert record["max_abs_error"] == 0.0, record
            assert record["payloads_sha256"] == record["sha256"], record
            assert float(record["seconds"]) < DEADLINE_SECONDS  # type: ignore[arg-type]
        assert len({r["sha256"] for r in by_survivor}) == 1, [r["failures"] for r in by_survivor]
        assert len({str(r["contributors"]) for r in by_survivor}) == 1


def contributors(records: dict[int, list[dict[str, object]]], round_id: int) -> list[list[str]]:
    return next(iter(records.values()))[round_id]["contributors"]  # type: ignore[return-value]


def producers(records: dict[int, list[dict[str, object]]], round_id: int) -> list[str]:
    return next(iter(records.values()))[round_id]["producers"]  # type: ignore[return-value]


# The victim (peer 1) owns part 1; peer 2 is part 1's first backup.
FAULT_POINTS = [
    "round_open:0",  # before the reduce-scatter
    "push_chunk:0:0",  # during the reduce-scatter, after its first contribution chunk
    "reduce_done:0",  # after reducing its part, before handing over the replica
    "replica_chunk:0:0",  # during the replica hand-off
    "serve_chunk:0:0",  # during the all-gather, after serving one chunk of its part
    "pull_chunk:0:0",  # during the all-gather, after receiving one chunk
    "round_done:0",  # after the all-gather, before allreduce() returns
]


RESULTS = ["copy", "in-place"]


def check_first_round_record(index: int, record: dict[str, object], *, bound: float) -> None:
    """A round-0 record ended within `bound` seconds: fallen back to exactly its own vector (seed 0,
    rebuilt here), or averaged with no error against the exact mean."""
    assert float(record["seconds"]) < bound, record["failures"]  # type: ignore[arg-type]
    if record["fell_back"]:
        own = make_vector(0, index, 0, int(record["elements"]))  # type: ignore[call-overload]
        assert record["sha256"] == hashlib.sha256(own.numpy().data).hexdigest()
    else:
        assert record["max_abs_error"] == 0.0, record


@pytest.mark.timeout(120)
@pytest.mark.parametrize("result", RESULTS)
@pytest.mark.parametrize("plan", FAULT_POINTS)
def test_survivors_agree_when_a_peer_is_killed(tmp_path: Path, plan: str, result: str) -> None:
    workers, records = run_workers(tmp_path, {VICTIM: plan}, result)
    try:
        check_survivors(workers, records)
        assert workers.wait(VICTIM, timeout=10) == -9  # it really was SIGKILLed at the point
        round_zero = contributors(records, 0)
        point = plan.split(":")[0]
        if point in ("round_open", "push_chunk"):  # it never delivered a whole contribution
            assert all("peer-1" not in part for part in round_zero)
        if point in ("round_open", "push_chunk", "reduce_done", "replica_chunk"):
            assert producers(records, 0)[1] == "peer-2"  # its backup took part 1 over
            assert "peer-1" not in round_zero[1]
        if point in ("serve_chunk", "round_done"):  # its average was already replicated
            assert producers(records, 0)[1] == "peer-1" and "peer-1" in round_zero[1]
        if point == "round_done":
            assert round_zero == [EVERYONE] * NUM_PEERS
        assert all("peer-1" not in part for part in contributors(records, 1))  # dead in round 1
    finally:
        workers.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("result", RESULTS)
def test_survivors_agree_when_an_owner_freezes(tmp_path: Path, result: str) -> None:
    """SIGSTOP keeps the victim's sockets open: only heartbeats and the stall timeout reveal it."""
    # 2 s stall timeouts (the others' 3): the bound below is on a few of them.
    workers, records = run_workers(
        tmp_path, {VICTIM: "reduce_done:0:0:stall"}, result, ["--stall-seconds", "2"]
    )
    try:
        check_survivors(workers, records)
        assert producers(records, 0)[1] == "peer-2"
        for round_id in range(NUM_ROUNDS):
            for rounds in records.values():
                # A few 2 s stall timeouts, not the deadline a frozen owner would cost if it were
                # waited for (15 s leaves room for a loaded CI machine; 10.5 s was seen there).
                assert float(rounds[round_id]["seconds"]) < 0.75 * DEADLINE_SECONDS  # type: ignore[arg-type]
    finally:
        workers.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("result", RESULTS)
def test_last_survivor_returns_on_time_with_its_own_vector(tmp_path: Path, result: str) -> None:
    """N - 1 peers vanish at once: the survivor cannot tell them from live peers it cannot reach, which
    could still form a majority and agree without it, so it falls back to its own vector, on time."""
    workers, records = run_workers(tmp_path, {i: "round_open:0" for i in range(1, NUM_PEERS)}, result)
    try:
        (rounds,) = records.values()
        assert len(rounds) == NUM_ROUNDS, workers.stderr(0)[-3000:]
        for record in rounds:
            assert record["fell_back"] is True, record["failures"]
            assert record["contributors"] == [["peer-0"]] * NUM_PEERS
            assert float(record["seconds"]) < DEADLINE_SECONDS  # type: ignore[arg-type]
    finally:
        workers.stop()


# Five peers: the victim (peer 1) owns part 1, and a majority of the servers besides it is two
# voters, peers 2 and 3, the members after it in the part's chain.
UNTOLD_NUM_PEERS = 5
UNTOLD_DEADLINE_SECONDS = 30.0
UNTOLD_BOUND_SECONDS = 12.0  # a few 3 s stall timeouts; the deadline would cost 0.95 x 30 s


@pytest.mark.timeout(150)
@pytest.mark.parametrize("action", ["kill", "stall"])
def test_an_owner_lost_before_telling_its_voters_costs_no_deadline(tmp_path: Path, action: str) -> None:
    """The owner dies (or freezes) the moment a majority holds its replicas, before it tells its voters
    the part is committed: they hold a version no one will tell them they may serve. They must stop
    waiting for that notice once they see the owner gone, so that every survivor ends the round within
    a few stall timeouts, not at the round's deadline, all alike (fallen back to exactly their own
    vectors), and the next round is exact and bit-identical again."""
    args = COMMON_ARGS + ["--deadline-seconds", str(UNTOLD_DEADLINE_SECONDS)]
    workers = Workers(tmp_path, UNTOLD_NUM_PEERS, args, forked=True)
    workers.start({VICTIM: ["--fault", f"votes_done:0:0:{action}"]})
    try:
        survivors = [i for i in range(UNTOLD_NUM_PEERS) if i != VICTIM]
        records = {i: workers.read_records(i, NUM_ROUNDS, timeout=120) for i in survivors}
        for index, rounds in records.items():
            assert len(rounds) == NUM_ROUNDS, (
                f"worker {index} stopped early:\n{workers.stderr(index)[-3000:]}"
            )
        if action == "kill":
            assert workers.wait(VICTIM, timeout=10) == -9  # it really was SIGKILLed at the point
        first, second = ([rounds[r] for rounds in records.values()] for r in range(NUM_ROUNDS))
        for index, record in zip(records, first, strict=True):
            check_first_round_record(index, record, bound=UNTOLD_BOUND_SECONDS)
        # No voter was told, so its voters' votes are spent on the owner's version and no other can win
        # a majority: survivors fall back. A fall-back is each node's own (its own vector, checked
        # above); what must never happen is two survivors averaging different means, or some averaged
        # and some fallen back (an owner that tells its voters late: the test below).
        averaged = [r for r in first if not r["fell_back"]]
        assert len({r["sha256"] for r in averaged}) <= 1, [r["failures"] for r in first]
        assert len({r["fell_back"] for r in first}) == 1, [r["failures"] for r in first]
        if action == "kill":  # a dead owner tells nobody late: every survivor falls back
            assert not averaged, [r["failures"] for r in first]
        for record in second:  # the next round runs without the victim
            assert record["fell_back"] is False, record["failures"]
            assert record["max_abs_error"] == 0.0, record
            assert all(f"peer-{VICTIM}" not in part for part in record["contributors"])  # type: ignore[attr-defined]
        assert len({r["sha256"] for r in second}) == 1
    finally:
        workers.stop()


def _process_state(pid: int) -> str:
    """The kernel's one-letter state of a process ("T": stopped), from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    return status.split("State:")[1].split()[0]


@pytest.mark.timeout(150)
def test_an_owner_that_tells_its_voters_late_leaves_no_survivor_averaged_alone(tmp_path: Path) -> None:
    """The owner freezes the moment a majority holds its replicas, before it tells its voters the part
    is committed; it is resumed only once a survivor has ended the round without the part (its voters
    sent that survivor on: the replica was stranded). The late commit notice must then not make the
    part usable: the voters that answered "stranded" refuse it, an owner no voter acknowledged does not
    use its version, and every member, the resumed owner included, ends the round the same way: all
    fallen back to their own vectors, or all averaged on one mean. Never some of each."""
    args = COMMON_ARGS + ["--deadline-seconds", str(UNTOLD_DEADLINE_SECONDS), "--rounds", "1"]
    workers = Workers(tmp_path, UNTOLD_NUM_PEERS, args, forked=True)
    workers.start({VICTIM: ["--fault", "votes_done:0:0:stall"]})
    try:
        survivors = [i for i in range(UNTOLD_NUM_PEERS) if i != VICTIM]
        victim_pid = workers.forked_processes[VICTIM].pid
        assert victim_pid is not None
        give_up = time.monotonic() + 90
        finished: dict[int, list[dict[str, object]]] = {}
        while not finished and time.monotonic() < give_up:
            time.sleep(0.05)
            finished = {i: r for i in survivors if (r := workers.read_records(i, 1, timeout=0))}
        assert finished, [workers.stderr(i)[-2000:] for i in survivors]
        assert _process_state(victim_pid) == "T", "the owner did not freeze itself at votes_done"
        for rounds in finished.values():  # nothing of part 1 could be had while its owner was frozen
            assert rounds[0]["fell_back"] is True, rounds[0]["failures"]
        os.kill(victim_pid, signal.SIGCONT)  # the owner wakes up and tells its voters late
        records = {i: workers.read_records(i, 1, timeout=120) for i in range(UNTOLD_NUM_PEERS)}
        for index, rounds in records.items():
            assert len(rounds) == 1, f"worker {index} stopped early:\n{workers.stderr(index)[-3000:]}"
        first = {index: rounds[0] for index, rounds in records.items()}
        outcomes = {index: (r["fell_back"], r["failures"]) for index, r in first.items()}
        assert len({r["fell_back"] for r in first.values()}) == 1, outcomes
        for index, record in first.items():
            check_first_round_record(index, record, bound=UNTOLD_DEADLINE_SECONDS)
        assert len({r["sha256"] for r in first.values() if not r["fell_back"]}) <= 1, outcomes
    finally:
        workers.stop()
