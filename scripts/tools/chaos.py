"""Chaos benchmark: a swarm in the WAN emulator under random faults, then checks that nothing broke.

``--nodes`` ``dtnode join`` nodes (nano preset, short phases) run on the hosts
of ``scripts/tools/wan_emulator.py`` (one network namespace each, uplinks capped at ``--link-mbit``),
each forked from one server that imported the node once (a fresh interpreter per start would import
torch and the node again). They start together at the start barrier (``--start-peers``), so none
trains rounds alone while the others start. Once all of them finished a round together, ``--trials`` times a fault is drawn at random (seeded):

    kill          SIGKILL a node's process group (daemon, DHT process, p2pd); the others go on
                  without it. It is restarted (same run dir: it resumes from its checkpoint and
                  re-syncs) once the survivors recovered, so the swarm keeps its size.
    stop          SIGSTOP a node for a while (a frozen machine), then SIGCONT.
    restart       SIGKILL a node and start it again at once.
    partition     split the hosts 2-vs-(N-2) (every packet between the sides dropped), then heal.
    slow_link     cap one host's uplink at 1 Mbit/s for a while, then restore it.

Each fault lasts a random ``--fault-seconds`` span and starts at a random moment of the swarm's phase
(a random delay first). After it is undone, the trial waits (``--recovery-timeout``) until every
node alive has written a round record after the undo and the live nodes agree on the param_hash of
a round all of them reached since: that wait is the trial's recovery time.

Checks over every node's ``metrics.jsonl`` at the end (the records of ``node/ops/metrics.py``):

    hangs         a trial whose live nodes did not all take part in a new round (not adopted, not
                  fallen back) within the recovery timeout, plus rounds whose all-reduce outlasted ``--round-deadline`` (+ 10 s);
    divergences   two records of the same round and the same agreed group (``members``) with
                  different param_hash (fell-back and adopted records excepted: they are not the
                  group's result). A 2-vs-4 partition gives two groups per round, not a divergence;
    non_finite    a step loss or eval loss that is NaN/Inf (written as null);
    rejoined      every killed or restarted node contributed to an averaged round again and matched
                  the others' param_hash there;
    loss_fell     the swarm's mean eval loss over its last 3 rounds is below that of its first 3.

Output: one JSON object (trials, faults by kind, rounds, hangs, divergences, non_finite, rejoined,
recovery seconds p50/p90/max, eval loss first/last, wall seconds) and a one-line summary.

``--cycle MINUTES`` runs another shape instead of the trials (issue 31): nodes joined by hand, with
``dtnode join``'s own round and network settings (join window, max wait, deadlines, heartbeat, TTL),
and ONE victim (``--victim``, default the first node, whose address every other node was given in
``--peers``) that is, every ``--cycle-gap`` seconds (10-25), in turn frozen (SIGSTOP, held
``--stop-seconds``, 5-20, then SIGCONT) and killed and restarted at once, for MINUTES. The check:
every other node (live all along) writes a round record (averaged, fallen back or adopted) at least
every ``--bound`` seconds; its longest gap (from the cycle's start to the end of the run, after the
final wait for every node to recover, the ends counted) is reported per node, and a gap past the
bound fails the run (besides divergences and non-finite values).
The default bound is ARCHITECTURE.md's ("No stall under faults"): 2 x P + J + S, with P the round
period (the median gap between two records of those nodes in this run), J the join window (15 s) and
S the all-reduce's stall timeout (30 s), the defaults of ``dtnode join``.

    python scripts/tools/chaos.py                                     # 6 nodes, 50 trials, 100 Mbit/s
    python scripts/tools/chaos.py --nodes 4 --trials 3 --kinds kill,stop,partition   # a quick look
    python scripts/tools/chaos.py --nodes 5 --cycle 4 --seed 1        # one victim frozen / restarted

Exit code: 0 if every check passed, 1 if one failed, 2 if the emulator cannot run here (needs root
and iproute2), 130 on Ctrl-C or SIGTERM (every node is stopped and the namespaces removed first).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.context
import multiprocessing.process
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.ops.metrics import read_metrics
from scripts.common import (
    REPO_ROOT,
    ForkedProcess,
    add_output_flags,
    exit_as_the_interpreter_would,
    exit_on_sigterm,
    print_json,
    scratch_dir,
    write_json,
)
from scripts.tools.wan_emulator import (
    WanEmulator,
    cleanup_leftovers,
    enter_network_namespace,
    unavailable_reason,
)

FAULT_KINDS = ("kill", "stop", "restart", "partition", "slow_link")
SLOW_LINK_MBIT = 1.0
NAME_PREFIX = "dtchaos"
# dtnode join's join window and the all-reduce's stall timeout: the --cycle nodes run with them.
JOIN_WINDOW_SECONDS = 15.0
STALL_TIMEOUT_SECONDS = 30.0
POLL_SECONDS = 0.5
# What a node imports before its first step (torch._dynamo: on torch's first optimizer step; the swarm's
# modules, hivemind's among them), once, in the forkserver every node is forked from: a fresh interpreter
# would spend ~4 CPU-s importing them. Last, scripts.forkserver_gc freezes them: a node's garbage
# collections then skip them (~0.5 CPU-s a node).
NODE_PRELOAD = [
    "__main__",
    "node.ops.cli",
    "node.train.trainer",
    "protocol.allreduce",
    "node.swarm.setup",
    "node.swarm.session",
    "node.swarm.join",
    "torch._dynamo",
    "scripts.forkserver_gc",
]


def _forkserver() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(NODE_PRELOAD)
    return context


def _run_forked_node(argv: list[str], log_path: str, netns: str) -> None:
    """In the forked child: what ``ip netns exec NETNS python -m node.ops.cli ARGV`` in a session of its
    own, output appended to LOG_PATH, would do."""
    os.setsid()  # a signal to the node's group reaches its DHT process and p2pd
    enter_network_namespace(netns)  # a forkserver's child has one thread
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.chdir(REPO_ROOT)
    from node.ops.cli import main

    exit_as_the_interpreter_would(lambda: main(argv))


@dataclass
class ChaosNode:
    index: int
    run_dir: Path
    log_path: Path
    process: ForkedProcess | None = None
    stopped: bool = False  # SIGSTOPped right now
    starts: list[float] = field(default_factory=list)  # wall-clock time of every (re)start

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rounds(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir / "metrics.jsonl", kind="round")

    def signal(self, signum: int) -> None:
        if self.alive:
            assert self.process is not None
            os.killpg(self.process.pid, signum)

    def multiaddrs(self) -> list[str]:
        try:
            return list(json.loads((self.run_dir / "node.json").read_text())["multiaddrs"])
        except (OSError, ValueError, KeyError):
            return []


class Swarm:
    """The nodes on the emulator's hosts: start, kill, restart, pause; every wait is bounded."""

    def __init__(self, wan: WanEmulator, root: Path, args: argparse.Namespace) -> None:
        self.wan, self.args = wan, args
        self.nodes = [ChaosNode(i, root / f"node-{i}", root / f"node-{i}.log") for i in range(args.nodes)]

    def argv(self, node: ChaosNode, peers: Sequence[str], start_peers: int = 1) -> list[str]:
        address = self.wan.address(node.index)
        args = self.args
        argv = [
            "join",
            "--name",
            "chaos",
            "--run-dir",
            str(node.run_dir),
        ]
        argv += ["--model", "nano", "--seq-len", str(args.seq_len), "--batch-size", "4"]
        argv += ["--eval-batches", "1", "--threads", "1"]
        argv += ["--eval-every", "1"]  # every round's eval_loss: null counts as non-finite below
        argv += ["--inner-steps", str(args.inner_steps), "--log-every", "1000", "--min-peers", "2"]
        if not args.cycle:  # the cycle runs nodes as a user starts them by hand: dtnode join's settings
            argv += ["--join-window", "5", "--max-wait", "60", "--round-deadline", str(args.round_deadline)]
            argv += ["--heartbeat", "2", "--record-ttl", "16"]
        argv += ["--checkpoint-every", "1"]
        argv += ["--start-peers", str(start_peers)]
        argv += [
            "--listen",
            f"{address}:0",
            "--dht-listen",
            f"{address}:0",
            "--bandwidth-mbit",
            str(args.link_mbit),
        ]
        if peers:
            argv += ["--peers", ",".join(peers)]
        return argv

    def start_all(self) -> None:
        """Start every node: the first, then the others together through it. Each waits at the start
        barrier (``--start-peers``) for all of them, so none trains rounds alone while the others start."""
        first, *others = self.nodes
        self.start(first, start_peers=len(self.nodes))
        for node in others:
            self.launch(node, start_peers=len(self.nodes))
        for node in others:
            self.wait_up(node)

    def start(self, node: ChaosNode, start_peers: int = 1) -> None:
        """(Re)start ``node``, joining through every other live node's multiaddr."""
        self.launch(node, start_peers)
        self.wait_up(node)

    def launch(self, node: ChaosNode, start_peers: int = 1) -> None:
        peers = [
            a for other in self.nodes if other is not node and other.alive for a in other.multiaddrs()[:1]
        ]
        (node.run_dir / "node.json").unlink(missing_ok=True)
        argv = self.argv(node, peers, start_peers)
        process = _forkserver().Process(
            target=_run_forked_node, args=(argv, str(node.log_path), self.wan.namespace(node.index))
        )
        process.start()
        node.process = ForkedProcess(process)
        deadline = time.monotonic() + 30
        while node.process.poll() is None and time.monotonic() < deadline:  # killpg needs its setsid first
            try:
                if os.getpgid(node.process.pid) == node.process.pid:
                    break
            except ProcessLookupError:
                break
            time.sleep(0.01)
        node.stopped = False
        node.starts.append(time.time())

    def wait_up(self, node: ChaosNode) -> None:
        wait_until(lambda: bool(node.multiaddrs()), 90, f"node {node.index} to come up", lambda: node.alive)

    def kill(self, node: ChaosNode) -> None:
        node.signal(signal.SIGKILL)
        if node.process is not None:
            node.process.wait(timeout=30)
        node.stopped = False

    def stop_all(self) -> None:
        for node in self.nodes:
            if node.stopped:
                node.signal(signal.SIGCONT)
            node.signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    node.signal(signal.SIGKILL)
                    node.process.wait(timeout=30)

    def live(self) -> list[ChaosNode]:
        return [n for n in self.nodes if n.alive and not n.stopped]


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, still: Callable[[], bool] = lambda: True
) -> bool:
    """Poll until ``condition()``; False after ``timeout`` s; RuntimeError if ``still()`` turns false."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if not still():
            raise RuntimeError(f"gave up waiting for {what}: the process exited")
        time.sleep(POLL_SECONDS)
    return False


def recovered_since(nodes: Sequence[ChaosNode], moment: float) -> bool:
    """Every node took part in a round after ``moment`` (not fell back, not adopted: an adopted
    record names the swarm's state, not a round the node took part in), and all agree on the hash of
    a round they all reached."""
    later = [
        [r for r in n.rounds() if r["time"] > moment and not r["fell_back"] and not r["adopted"]]
        for n in nodes
    ]
    if not nodes or any(not rounds for rounds in later):
        return False
    hashes = [{r["round"]: r["param_hash"] for r in rounds} for rounds in later]
    shared = set.intersection(*(set(h) for h in hashes))
    return any(len({h[r] for h in hashes}) == 1 for r in shared)


def run_trial(swarm: Swarm, kind: str, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    """Inject one fault of ``kind``, undo it, wait for recovery; the trial's record."""
    nodes = swarm.nodes
    time.sleep(rng.uniform(0, args.max_delay))  # a random moment of the phase
    victim = rng.choice(swarm.live())
    hold = rng.uniform(*args.fault_seconds)
    record: dict[str, Any] = {"kind": kind, "node": victim.index, "hold_seconds": round(hold, 1)}
    restart_after: ChaosNode | None = None
    if kind == "kill":
        swarm.kill(victim)
        time.sleep(hold)
        restart_after = victim
    elif kind == "restart":
        swarm.kill(victim)
        swarm.start(victim)
    elif kind == "stop":
        victim.signal(signal.SIGSTOP)
        victim.stopped = True
        time.sleep(hold)
        victim.signal(signal.SIGCONT)
        victim.stopped = False
    elif kind == "partition":
        side = rng.sample(range(len(nodes)), 2)
        record["node"] = sorted(side)
        swarm.wan.isolate(side, [i for i in range(len(nodes)) if i not in side])
        time.sleep(hold)
        swarm.wan.heal()
    elif kind == "slow_link":
        swarm.wan.set_link_mbit(victim.index, SLOW_LINK_MBIT)
        time.sleep(hold)
        swarm.wan.set_link_mbit(victim.index, args.link_mbit)
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
    undone = time.time()
    live = swarm.live()
    record["recovered"] = wait_until(lambda: recovered_since(live, undone), args.recovery_timeout, "recovery")
    record["recovery_seconds"] = round(time.time() - undone, 1) if record["recovered"] else None
    record["silent_nodes"] = [n.index for n in live if not any(r["time"] > undone for r in n.rounds())]
    if restart_after is not None:
        swarm.start(restart_after)
    record["dead_nodes"] = [n.index for n in nodes if not n.alive]
    return record


def run_cycle(swarm: Swarm, rng: random.Random, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``--cycle`` shape: for ``args.cycle`` minutes, every ``--cycle-gap`` seconds the victim is
    in turn frozen for ``--stop-seconds`` (then continued) and killed and restarted at once; one
    record per fault (what, when, for how long)."""
    victim = swarm.nodes[args.victim]
    faults: list[dict[str, Any]] = []
    end = time.monotonic() + 60 * args.cycle
    while time.monotonic() < end:
        time.sleep(min(rng.uniform(*args.cycle_gap), max(end - time.monotonic(), 0.0)))
        if time.monotonic() >= end:
            break
        kind = ("stop", "restart")[len(faults) % 2]
        fault: dict[str, Any] = {"kind": kind, "node": victim.index, "time": round(time.time(), 1)}
        if kind == "stop":
            hold = min(rng.uniform(*args.stop_seconds), max(end - time.monotonic(), 0.1))
            victim.signal(signal.SIGSTOP)
            victim.stopped = True
            time.sleep(hold)
            victim.signal(signal.SIGCONT)
            victim.stopped = False
            fault["hold_seconds"] = round(hold, 1)
        else:
            swarm.kill(victim)
            swarm.start(victim)
        faults.append(fault)
        print(json.dumps({"fault": len(faults) - 1, **fault}), file=sys.stderr, flush=True)
    return faults


def record_gaps(swarm: Swarm, since: float, until: float, skip: int) -> tuple[dict[int, float], float]:
    """Per node but ``skip`` (the victim): the longest time between two of its round records (any:
    averaged, fallen back, adopted) within ``[since, until]``, the two ends counted as records; and the
    round period, the median gap between two records of those nodes."""
    longest, all_gaps = {}, []
    for node in swarm.nodes:
        if node.index == skip:
            continue
        times = [since, *sorted(r["time"] for r in node.rounds() if since < r["time"] < until), until]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        longest[node.index] = round(max(gaps), 1)
        all_gaps += gaps[1:-1]  # between two records (not from or to an end)
    return longest, round(statistics.median(all_gaps), 1) if all_gaps else 0.0


def stall_bound(period: float) -> float:
    """ARCHITECTURE.md's bound on the time a live node goes without a round record, whatever one other
    node does: 2 x the round period + the join window + the all-reduce's stall timeout (dtnode join's
    defaults: 15 s and 30 s)."""
    return round(2 * period + JOIN_WINDOW_SECONDS + STALL_TIMEOUT_SECONDS, 1)


def check(swarm: Swarm, trials: Sequence[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """The end-of-run checks over every node's records (see the module docstring)."""
    all_rounds = [(n.index, r) for n in swarm.nodes for r in n.rounds()]
    by_group: dict[tuple[int, tuple[str, ...]], set[str]] = {}
    for _, r in all_rounds:
        if r["adopted"] or r["fell_back"] or not r.get("members"):
            continue
        by_group.setdefault((r["round"], tuple(sorted(r["members"]))), set()).add(r["param_hash"])
    divergences = [
        {"round": round, "members": len(members), "hashes": sorted(h)}
        for (round, members), h in by_group.items()
        if len(h) > 1
    ]
    slow_rounds = [
        {"node": i, "round": r["round"], "seconds_comm": r["seconds_comm"]}
        for i, r in all_rounds
        if r["seconds_comm"] > args.round_deadline + 10
    ]
    steps = [s for n in swarm.nodes for s in read_metrics(n.run_dir / "metrics.jsonl", kind="step")]
    non_finite = sum(1 for s in steps if s["loss"] is None) + sum(
        1 for _, r in all_rounds if r["eval_loss"] is None
    )
    rejoined = []
    for node in swarm.nodes:
        if len(node.starts) < 2:
            continue
        later = [
            r for r in node.rounds() if r["time"] > node.starts[-1] and not r["adopted"] and r["peers"] >= 2
        ]
        others = {(r["round"], r["param_hash"]) for n in swarm.nodes if n is not node for r in n.rounds()}
        rejoined.append(any((r["round"], r["param_hash"]) in others for r in later))
    evals = sorted(
        (
            (r["round"], r["eval_loss"])
            for _, r in all_rounds
            if r["eval_loss"] is not None and not r["adopted"]
        ),
    )
    per_round: dict[int, list[float]] = {}
    for round, loss in evals:
        per_round.setdefault(round, []).append(loss)
    ordered = [statistics.fmean(per_round[r]) for r in sorted(per_round)]
    first, last = (statistics.fmean(ordered[:3]), statistics.fmean(ordered[-3:])) if ordered else (None, None)
    hangs = sum(1 for t in trials if not t["recovered"] and t["silent_nodes"]) + len(slow_rounds)
    recoveries = sorted(t["recovery_seconds"] for t in trials if t["recovery_seconds"] is not None)

    def percentile(q: float) -> float | None:
        return recoveries[min(len(recoveries) - 1, int(q * len(recoveries)))] if recoveries else None

    return {
        "rounds": max((r["round"] for _, r in all_rounds), default=0),
        "hangs": hangs,
        "not_recovered": sum(1 for t in trials if not t["recovered"]),
        "slow_rounds": slow_rounds,
        "divergences": len(divergences),
        "divergence_details": divergences[:10],
        "non_finite": non_finite,
        "restarted_nodes": len(rejoined),
        "rejoined": sum(rejoined),
        "recovery_seconds_p50": percentile(0.5),
        "recovery_seconds_p90": percentile(0.9),
        "recovery_seconds_max": recoveries[-1] if recoveries else None,
        "eval_loss_first": first,
        "eval_loss_last": last,
        "loss_fell": first is not None and last is not None and last < first,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=6, help="swarm size (>= 4 for a 2-vs-rest partition)")
    parser.add_argument("--trials", type=int, default=50, help="faults to inject, one after the other")
    parser.add_argument(
        "--kinds", default=",".join(FAULT_KINDS), help=f"fault kinds: {', '.join(FAULT_KINDS)}"
    )
    parser.add_argument("--in-turn", action="store_true", help="take the kinds in turn, not at random")
    parser.add_argument("--link-mbit", type=float, default=100.0, help="every host's uplink cap")
    parser.add_argument("--inner-steps", type=int, default=20, help="H of every node (nano: ~2-5 s)")
    parser.add_argument("--seq-len", type=int, default=0, help="every node's --seq-len (0: nano's 128)")
    parser.add_argument("--round-deadline", type=float, default=60.0, help="the nodes' --round-deadline")
    parser.add_argument(
        "--fault-seconds", type=float, nargs=2, default=(4.0, 15.0), help="how long a fault holds"
    )
    parser.add_argument("--max-delay", type=float, default=5.0, help="random wait before each fault")
    parser.add_argument("--recovery-timeout", type=float, default=180.0, help="seconds to wait for recovery")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    parser.add_argument(
        "--cycle", type=float, default=0.0, metavar="MINUTES",
        help="instead of --trials: one victim frozen and restarted in turn for MINUTES (see above)",
    )  # fmt: skip
    parser.add_argument("--victim", type=int, default=0, help="--cycle: the node frozen and restarted")
    parser.add_argument(
        "--cycle-gap", type=float, nargs=2, default=(10.0, 25.0), help="--cycle: seconds between faults"
    )
    parser.add_argument(
        "--stop-seconds", type=float, nargs=2, default=(5.0, 20.0), help="--cycle: how long a freeze holds"
    )
    parser.add_argument(
        "--bound", type=float, default=None,
        help="--cycle: the longest a live node may go without a round record, seconds (default: 2 x the "
        "round period + 15 s + 30 s, see above; 0: report, check nothing)",
    )  # fmt: skip
    add_output_flags(parser, keep_logs=True)  # --json-out: the summary and every trial
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := [k for k in args.kinds if k not in FAULT_KINDS]:
        parser.error(f"--kinds: unknown {unknown}; choose from {', '.join(FAULT_KINDS)}")
    if args.nodes < 3 or ("partition" in args.kinds and args.nodes < 4):
        parser.error("--nodes must be >= 3 (>= 4 with partition faults)")
    if args.trials < 1 or args.inner_steps < 1:
        parser.error("--trials and --inner-steps must be >= 1")
    if args.seq_len < 0:
        parser.error("--seq-len must be >= 0")
    if args.cycle < 0 or not 0 <= args.victim < args.nodes:
        parser.error("--cycle must be >= 0 and --victim one of the nodes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (reason := unavailable_reason()) is not None:
        print(f"chaos: cannot run the WAN emulator: {reason}", file=sys.stderr)
        return 2
    exit_on_sigterm()  # unwinds the `with WanEmulator`, which stops every node
    cleanup_leftovers(NAME_PREFIX)
    rng = random.Random(args.seed)
    started = time.monotonic()
    trials: list[dict[str, Any]] = []
    try:
        with (
            scratch_dir(args.keep_logs, "", prefix="chaos-") as root,
            WanEmulator(args.nodes, args.link_mbit, name_prefix=NAME_PREFIX) as wan,
        ):
            swarm = Swarm(wan, root, args)
            try:
                swarm.start_all()
                up = time.time()
                if not wait_until(
                    lambda: recovered_since(swarm.nodes, up), args.recovery_timeout, "a first round"
                ):
                    print("chaos: the swarm never completed a first round", file=sys.stderr)
                    return 1
                cycle: dict[str, Any] = {}
                since = time.time()
                if args.cycle:
                    cycle["cycle_faults"] = run_cycle(swarm, rng, args)
                for index in range(0 if args.cycle else args.trials):
                    kind = args.kinds[index % len(args.kinds)] if args.in_turn else rng.choice(args.kinds)
                    trial = run_trial(swarm, kind, rng, args)
                    trials.append(trial)
                    print(json.dumps({"trial": index, **trial}), file=sys.stderr, flush=True)
                # A node restarted by the last trial gets the same chance to rejoin as the others.
                settled = time.time()
                wait_until(lambda: recovered_since(swarm.live(), settled), args.recovery_timeout, "the end")
                if args.cycle:  # up to now: a silence that began in the cycle counts whole
                    gaps, period = record_gaps(swarm, since, time.time(), skip=args.victim)
                    bound = stall_bound(period) if args.bound is None else args.bound
                    cycle.update(longest_gap_seconds=gaps, round_period_seconds=period, bound_seconds=bound)
                result = {**check(swarm, trials, args), **cycle}
            finally:
                swarm.stop_all()
    except KeyboardInterrupt:
        return 130
    kinds = {k: sum(1 for t in trials if t["kind"] == k) for k in args.kinds}
    summary = {
        "nodes": args.nodes,
        "trials": len(trials),
        "faults": kinds,
        **result,
        "wall_seconds": round(time.monotonic() - started, 1),
        "seed": args.seed,
    }
    gaps, bound = list(result.get("longest_gap_seconds", {}).values()), result.get("bound_seconds", 0.0)
    passed = (
        (not bound or max(gaps, default=0.0) <= bound)
        and summary["hangs"] == 0
        and summary["divergences"] == 0
        and summary["non_finite"] == 0
        and summary["rejoined"] == summary["restarted_nodes"]
        and summary["loss_fell"]
    )
    summary["passed"] = passed
    print_json(summary)
    write_json(args.json_out, {"summary": summary, "trials": trials})
    if args.cycle:
        print(
            f"chaos: node {args.victim} frozen / restarted {len(result['cycle_faults'])} times in {args.cycle:g} "
            f"min; the others' longest gaps without a round record: {result['longest_gap_seconds']} s "
            f"(bound {result['bound_seconds']:g} s: round period {result['round_period_seconds']:g} s)"
        )
    print(
        f"chaos: {len(trials)} trials on {args.nodes} nodes, {summary['rounds']} rounds: "
        f"{summary['hangs']} hangs, {summary['divergences']} divergences, {summary['non_finite']} non-finite, "
        f"{summary['rejoined']}/{summary['restarted_nodes']} restarted nodes rejoined, recovery p50 "
        f"{summary['recovery_seconds_p50']} s / p90 {summary['recovery_seconds_p90']} s, eval loss "
        f"{summary['eval_loss_first']} -> {summary['eval_loss_last']}: {'PASS' if passed else 'FAIL'}"
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
