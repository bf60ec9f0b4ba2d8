"""How long a node takes to join a running swarm: from its start to its first contributed outer round.

Each trial runs in ``scripts/tools/wan_emulator.py``'s network namespaces, one host
per node, every link capped at ``--link-mbit``:

1. start ``--nodes`` nodes (``dtnode join``; host 0 first, the others with ``--peers`` = host 0's
   multiaddr) and wait until every one has finished an outer round with all of them;
2. start the joiner on a host of its own with the same ``--peers``. It sees the swarm in the DHT,
   finds its own ``(round, param_hash)`` outside the canonical lineage, fetches the global state
   (fp32 global params + fp32 outer momentum, ~8 bytes per parameter) from the swarm's nodes over
   gRPC, trains H inner steps and takes part in the next round;
3. stop every process and remove the namespaces (also on Ctrl-C, SIGTERM or an error).

The joiner's output is read line by line and each line stamped with the wall clock when it arrives;
its ``metrics.jsonl`` records carry the joiner's own ``time.time()`` (same machine, same clock).
Every time below is in seconds from the joiner's process start:

    start -> imports, DHT up -> sees the swarm ("joining: adopting ...") -> fetch -> load ("now at
    round") -> inner steps -> round formation, all-reduce, outer step, eval -> record
                   (corpus, model: built meanwhile, before the load; see node/swarm/join.py)

startup_seconds:        to the "joining: adopting the swarm's state" line (Python/torch import, DHT
                        start, waiting to see the swarm in the DHT; a node with a checkpoint, which
                        does not fetch ahead, also builds its corpus and model first).
fetch_seconds:          the state fetch as timed by the fetcher itself (its "fetched Snapshot(...)"
                        log line): manifests, all ranges, verification.
inner_phase_seconds:    the joiner's H inner steps before its first contributed round: from the
                        adoption it trained on (or its previous round) to its last inner step.
round_seconds:          from that last inner step to the round record: waiting for the group,
                        all-reduce, outer step, eval.
seconds_to_first_round: to the joiner's first round record with adopted == false, peers >= 2 and
                        fell_back == false, i.e. a round it contributed its pseudo-gradient to.
swarm_round_period_seconds, swarm_inner_phase_seconds: node 0's median time between round
                        records and median inner-phase compute time, up to the joiner's first round.
timeline:               every event above, plus ``swarm_up`` (DHT and gRPC started) and
                        ``trainer_ready`` (model and data built, the trainer's first log line).
num_adoptions:          states loaded before the first contributed round: 1 when the joiner caught
                        the next round, more when it missed one and had to re-sync (see "Chasing").
num_caught_up, caught_up_megabytes: of those, the ones stepped to from the state before with a
                        round's mean instead of a whole fetch (node/swarm/session.py), and the bytes fetched.
state_bytes:            tensor bytes of the fetched snapshot plus its metadata (the log line's
                        ``num_bytes`` and ``metadata``); params: the model's parameter count.
bound_seconds:          state_bytes * 8 / (link_mbit * 1e6), the fetch at the link rate.
                        ``bound_link`` says whose link that is. With --cap-downlink (the default)
                        every host's downlink is capped too, so the joiner's own downlink is the
                        bottleneck and the bound is a true lower bound. Without it only uplinks are capped, and
                        the joiner fetching from N sources in parallel may get up to N times the
                        rate: the bound is then one source's uplink, not a true lower bound.
target_seconds:         1.5 * bound_seconds + 10; met: seconds_to_first_round <= target.
seconds_to_state:       to the "now at round" line of the first adoption: the joiner holds the
                        swarm's state and starts its inner steps; met_to_state: that <= target.
                        seconds_to_first_round adds the H inner steps every joiner must train before
                        it has a pseudo-gradient to contribute, which the target does not scale with.
param_hash_matches_swarm: after that round the joiner's param_hash equals node 0's.

Round boundaries. A leader waits (up to the join window) for the peers of its lineage and for a
joiner that says (its ``syncing`` record) it will hold the lineage's state before the window ends;
the joiner then trains one inner step and joins that round. So the first contribution comes at
about max(state held + one step, the swarm's next round boundary) + the round itself: the target
is within reach only when the swarm's round period (``swarm_round_period_seconds``) is, which is
why the default is H=10 (a ~15 s period for the tiny model on 2 cores; H=20 gives ~30 s). A joiner
whose fetch outlasts the window misses rounds and steps to the swarm's state with their means
(``num_caught_up``: the wire codec's bytes, a fraction of the state); ``num_adoptions`` > 1 shows
that it fetched the whole state again.

    python scripts/bench/bench_join.py                        # tiny model, 100 Mbit/s, H=10, 2 nodes + joiner
    python scripts/bench/bench_join.py --model nano --inner-steps 10 --link-mbit 20 --trials 3

Exit code: 0 if every trial reached its first contributed round (the verdicts are in the output),
1 if one did not, 2 if the emulator cannot run here (needs root and iproute2), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.ops.metrics import read_metrics
from scripts.bench.join_log import (
    ADOPTED,
    CAUGHT_UP,
    FETCHED,
    JOIN_DECIDED,
    JOIN_FETCH_FAILED,
    SWARM_UP,
    TRAINER_READY,
    StampedOutput,
)
from scripts.common import REPO_ROOT, add_output_flags, exit_on_sigterm, print_json, scratch_dir, write_json
from scripts.tools.wan_emulator import WanEmulator, unavailable_reason

POLL_SECONDS = 0.2
HASH_CHECK_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One benchmark configuration (the same for every trial)."""

    model: str
    link_mbit: float
    cap_downlink: bool
    num_nodes: int
    inner_steps: int
    batch_size: int
    join_window_seconds: float
    wait_timeout: datetime.timedelta
    overlap: bool = False  # every node runs with --overlap

    @property
    def min_peers(self) -> int:
        return min(2, self.num_nodes)

    def bound_seconds(self, state_bytes: int) -> float:
        return state_bytes * 8 / (self.link_mbit * 1e6)


class TrialError(RuntimeError):
    """A trial could not be measured (a node died, a wait ran out); the message says which."""


def node_argv(settings: Settings, run_dir: Path, address: str, peers: str | None) -> list[str]:
    """`dtnode join` for one host of the emulator, small and quick apart from the model and link."""
    argv = [
        sys.executable, "-m", "node.ops.cli", "join", "--name", "benchjoin", "--run-dir", str(run_dir),
        "--model", settings.model, "--batch-size", str(settings.batch_size), "--eval-batches", "1",
        "--threads", "1", "--inner-steps", str(settings.inner_steps), "--log-every", "1000",
        "--min-peers", str(settings.min_peers), "--join-window", str(settings.join_window_seconds),
        "--max-wait", str(max(120.0, 2 * settings.join_window_seconds)), "--round-deadline", "300",
        "--heartbeat", "2", "--record-ttl", "16", "--checkpoint-every", "0",
        "--bandwidth-mbit", str(settings.link_mbit), "--listen", f"{address}:0", "--dht-listen", f"{address}:0",
    ]  # fmt: skip
    if peers is not None:
        argv += ["--peers", peers]
    if settings.overlap:
        argv.append("--overlap")
    return argv


def read_records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` records of a node's metrics.jsonl so far (a half-written last line is skipped)."""
    return read_metrics(run_dir / "metrics.jsonl", kind=kind)


def wait_until(
    condition: Callable[[], bool],
    timeout: datetime.timedelta,
    what: str,
    watched: Sequence[tuple[str, subprocess.Popen[Any]]],
) -> None:
    """Poll ``condition``; TrialError if a watched process exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if condition():
            return
        for name, process in watched:
            if process.poll() is not None:
                raise TrialError(f"{name} exited with {process.returncode} while waiting for {what}")
        time.sleep(POLL_SECONDS)
    raise TrialError(f"timed out after {timeout} waiting for {what}")


def has_round_of(run_dir: Path, num_peers: int) -> bool:
    return any(record["peers"] == num_peers for record in read_records(run_dir, "round"))


def contributed(record: dict[str, Any]) -> bool:
    """A round the node took part in with others: not adopted, not a fallback to its own Δ."""
    return not record["adopted"] and not record["fell_back"] and record["peers"] >= 2


def start_swarm(
    wan: WanEmulator, settings: Settings, workdir: Path, env: dict[str, str]
) -> tuple[list[subprocess.Popen[Any]], str]:
    """Start the existing swarm's nodes on hosts 0..N-1; returns them and host 0's multiaddr."""
    processes: list[subprocess.Popen[Any]] = []
    peers: str | None = None
    for index in range(settings.num_nodes):
        address = wan.address(index)
        run_dir = workdir / f"node-{index}"
        with (workdir / f"node-{index}.log").open("wb") as log:
            argv = node_argv(settings, run_dir, address, peers)
            processes.append(
                wan.popen(index, argv, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        if peers is None:
            identity = run_dir / "node.json"
            wait_until(
                identity.exists, settings.wait_timeout, "node 0's node.json", [("node 0", processes[0])]
            )
            multiaddrs = json.loads(identity.read_text())["multiaddrs"]
            on_emulator = [a for a in multiaddrs if a.startswith(f"/ip4/{address}/")]
            if not on_emulator:
                raise TrialError(f"node 0 advertises no multiaddr on {address}: {multiaddrs}")
            peers = on_emulator[0]
    assert peers is not None
    return processes, peers


def tail_of(path: Path, num_lines: int = 30) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])


def swarm_round_period(records: list[dict[str, Any]]) -> float | None:
    """Median seconds between consecutive round records of a node (its inner phase plus round)."""
    times = [r["time"] for r in records]
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    return statistics.median(gaps) if gaps else None


def measure_joiner(
    settings: Settings, output: StampedOutput, run_dir: Path, started: float
) -> dict[str, Any]:
    """The joiner's timeline up to its first contributed round (which must already be written)."""
    rounds = read_records(run_dir, "round")
    first_index = next(index for index, record in enumerate(rounds) if contributed(record))
    first_round = rounds[first_index]
    trainer_ready = output.first(TRAINER_READY)
    join_decided = output.first(JOIN_DECIDED)
    fetches = [(stamp, m) for stamp, m in output.matches(FETCHED) if stamp <= first_round["time"]]
    adoptions = [(stamp, m) for stamp, m in output.matches(ADOPTED) if stamp <= first_round["time"]]
    catch_ups = [(stamp, m) for stamp, m in output.matches(CAUGHT_UP) if stamp <= first_round["time"]]
    steps = [s for s in read_records(run_dir, "step") if s["round"] == first_round["round"]]
    if trainer_ready is None or not steps:
        raise TrialError("the joiner's log lacks its 'training ...' line or its inner steps")
    last_step_time = max(s["time"] for s in steps)
    # The inner phase of the contributed round began at the adoption or round record just before it.
    phase_starts = [stamp for stamp, _ in adoptions if stamp <= last_step_time]
    phase_starts += [r["time"] for r in rounds[:first_index]]
    phase_start = max(phase_starts, default=started)

    join_fetch = (
        fetches[0] if fetches and join_decided is not None and fetches[0][0] >= join_decided[0] else None
    )
    state_bytes = None
    if join_fetch is not None:
        state_bytes = int(join_fetch[1]["num_bytes"]) + int(join_fetch[1]["metadata_bytes"])
    swarm_up = output.first(SWARM_UP)
    timeline = {
        "swarm_up": swarm_up[0] if swarm_up else None,
        "trainer_ready": trainer_ready[0],
        "join_decided": join_decided[0] if join_decided else None,
        "fetched": join_fetch[0] if join_fetch else None,
        "adopted": adoptions[0][0] if adoptions else None,
        "caught_up": catch_ups[0][0] if catch_ups else None,
        "last_inner_step": last_step_time,
        "first_round": first_round["time"],
    }
    bound = settings.bound_seconds(state_bytes) if state_bytes is not None else None
    seconds_to_first_round = first_round["time"] - started
    target = 1.5 * bound + 10 if bound is not None else None
    fetch_seconds = float(join_fetch[1]["seconds"]) if join_fetch else None
    fetch_mbit = state_bytes * 8 / fetch_seconds / 1e6 if state_bytes and fetch_seconds else None
    seconds_to_state = timeline["adopted"] - started if timeline["adopted"] is not None else None
    return {
        "params": int(trainer_ready[1]["params"].replace(",", "")),
        "state_bytes": state_bytes,
        "startup_seconds": _since(join_decided[0] if join_decided else None, started),
        "fetch_seconds": fetch_seconds,
        "fetch_mbit": _rounded(fetch_mbit),
        "join_fetch_failed": bool(output.first(JOIN_FETCH_FAILED)),
        "inner_phase_seconds": _rounded(last_step_time - phase_start),
        "round_seconds": _rounded(first_round["time"] - last_step_time),
        "seconds_to_first_round": _rounded(seconds_to_first_round),
        "bound_seconds": _rounded(bound),
        "target_seconds": _rounded(target),
        "met": target is not None and seconds_to_first_round <= target,
        "seconds_to_state": _rounded(seconds_to_state),
        "met_to_state": target is not None and seconds_to_state is not None and seconds_to_state <= target,
        "num_adoptions": len(adoptions),
        "num_caught_up": len(catch_ups),
        "caught_up_megabytes": _rounded(sum(float(m["megabytes"]) for _, m in catch_ups)),
        "rounds_before_first": len(rounds[:first_index]),
        "first_round": first_round["round"],
        "first_round_peers": first_round["peers"],
        "first_round_param_hash": first_round["param_hash"],
        "timeline": {event: _since(stamp, started) for event, stamp in timeline.items()},
    }


def _since(stamp: float | None, origin: float) -> float | None:
    return None if stamp is None else round(stamp - origin, 3)


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def run_trial(settings: Settings, trial: int, workdir: Path) -> dict[str, Any]:
    """One swarm, one joiner; the trial's record (with ``error`` if it could not be measured)."""
    workdir.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {
        "trial": trial,
        "model": settings.model,
        "link_mbit": settings.link_mbit,
        "cap_downlink": settings.cap_downlink,
        "bound_link": "joiner_downlink" if settings.cap_downlink else "one_source_uplink",
        "nodes": settings.num_nodes,
        "inner_steps": settings.inner_steps,
        "overlap": settings.overlap,
        "batch_size": settings.batch_size,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
    }
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    joiner_index = settings.num_nodes
    with WanEmulator(settings.num_nodes + 1, settings.link_mbit, cap_downlink=settings.cap_downlink) as wan:
        output: StampedOutput | None = None
        try:
            nodes, peers = start_swarm(wan, settings, workdir, env)
            watched = [(f"node {index}", process) for index, process in enumerate(nodes)]
            for index in range(settings.num_nodes):
                all_together = functools.partial(has_round_of, workdir / f"node-{index}", settings.num_nodes)
                what = f"node {index}'s first round with all {settings.num_nodes} node(s)"
                wait_until(all_together, settings.wait_timeout, what, watched)

            joiner_dir = workdir / "joiner"
            argv = node_argv(settings, joiner_dir, wan.address(joiner_index), peers)
            started = time.time()
            joiner = wan.popen(
                joiner_index, argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            assert joiner.stdout is not None
            output = StampedOutput(joiner.stdout, workdir / "joiner.log")
            wait_until(
                lambda: any(contributed(r) for r in read_records(joiner_dir, "round")),
                settings.wait_timeout,
                "the joiner's first contributed round",
                [*watched, ("the joiner", joiner)],
            )
            record.update(measure_joiner(settings, output, joiner_dir, started))

            # The joiner's params after that round must be the swarm's (one lineage).
            first_round = record["first_round"]
            node0 = workdir / "node-0"
            wait_until(
                lambda: any(r["round"] == first_round for r in read_records(node0, "round")),
                HASH_CHECK_TIMEOUT,
                f"node 0's record of round {first_round}",
                watched[:1],
            )
            swarm_rounds = read_records(node0, "round")
            hashes = {r["param_hash"] for r in swarm_rounds if r["round"] == first_round}
            record["param_hash_matches_swarm"] = hashes == {record.pop("first_round_param_hash")}
            before_joiner = [r for r in swarm_rounds if r["round"] <= first_round]
            record["swarm_round_period_seconds"] = _rounded(swarm_round_period(before_joiner))
            record["swarm_inner_phase_seconds"] = _rounded(
                statistics.median(r["seconds_compute"] for r in before_joiner)
            )
        except TrialError as error:
            record["error"] = str(error)
            if output is not None:
                last_lines = f"the joiner's last lines:\n{output.tail()}"
            else:
                last_lines = f"node 0's last lines:\n{tail_of(workdir / 'node-0.log')}"
            print(f"bench_join: trial {trial}: {error}; {last_lines}", file=sys.stderr)
        finally:
            wan.close()  # stops every node; the joiner's pipe closes with it
            if output is not None:
                output.close()
    record["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    return record


def summary_line(records: list[dict[str, Any]]) -> str:
    """One line over all trials: median time to the first round against the target, and the split."""
    measured = [r for r in records if "error" not in r and r["bound_seconds"] is not None]
    if not measured:
        return f"bench_join: no trial measured ({len(records)} failed)"
    first = measured[0]
    link = f"{first['link_mbit']:g} Mbit/s ({first['bound_link']})"

    def median(key: str) -> float:
        values = [r[key] for r in measured if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    num_met = sum(r["met"] for r in measured)
    return (
        f"bench_join: {first['model']} ({first['params']:,} params, state {first['state_bytes'] / 1e6:.1f} MB), "
        f"{first['nodes']} node(s) + joiner at {link}: first round after {median('seconds_to_first_round'):.1f} s "
        f"(median of {len(measured)}; startup {median('startup_seconds'):.1f} s, fetch {median('fetch_seconds'):.1f} s, "
        f"state held at {median('seconds_to_state'):.1f} s, "
        f"H={first['inner_steps']} inner {median('inner_phase_seconds'):.1f} s, round {median('round_seconds'):.1f} s) "
        f"vs bound {first['bound_seconds']:.1f} s, target {first['target_seconds']:.1f} s: "
        f"{'PASS' if num_met == len(records) else 'FAIL'} ({num_met}/{len(records)} met)"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="model preset of every node (tiny: 10.8M params)")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="every host's link cap in Mbit/s")
    parser.add_argument(
        "--cap-downlink",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cap downlinks too, so the joiner's own link bounds the fetch",
    )
    parser.add_argument("--nodes", type=int, default=2, help="size of the swarm the joiner joins")
    parser.add_argument(
        "--inner-steps", type=int, default=10, help="H, inner steps per round (see Round boundaries above)"
    )
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per inner step")
    parser.add_argument(
        "--join-window", type=float, default=30.0, help="seconds a leader waits for its lineage"
    )
    parser.add_argument("--overlap", action="store_true", help="every node runs with --overlap")
    parser.add_argument("--trials", type=int, default=1, help="independent swarm + joiner runs")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds each wait may take")
    add_output_flags(parser, keep_logs=True)
    args = parser.parse_args(argv)
    if args.nodes < 1 or args.trials < 1 or args.inner_steps < 1 or args.batch_size < 1:
        parser.error("--nodes, --trials, --inner-steps and --batch-size must be >= 1")
    if args.link_mbit <= 0 or args.timeout <= 0 or args.join_window <= 0:
        parser.error("--link-mbit, --timeout and --join-window must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        print(f"bench_join: cannot run the WAN emulator: {reason}", file=sys.stderr)
        return 2
    exit_on_sigterm()  # unwinds the emulator's `with`, which stops every node
    settings = Settings(
        model=args.model,
        link_mbit=args.link_mbit,
        cap_downlink=args.cap_downlink,
        num_nodes=args.nodes,
        inner_steps=args.inner_steps,
        batch_size=args.batch_size,
        join_window_seconds=args.join_window,
        wait_timeout=datetime.timedelta(seconds=args.timeout),
        overlap=args.overlap,
    )
    records: list[dict[str, Any]] = []
    try:
        for trial in range(args.trials):
            with scratch_dir(args.keep_logs, f"trial-{trial}", prefix="bench_join-") as workdir:
                record = run_trial(settings, trial, workdir)
            records.append(record)
            print_json(record)
    except KeyboardInterrupt:
        print("bench_join: interrupted; every node and namespace was stopped", file=sys.stderr)
        return 130
    finally:
        write_json(args.json_out, records)
    print(summary_line(records), flush=True)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
