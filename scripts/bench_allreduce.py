"""dtnode's all-reduce against hivemind's DecentralizedAverager: same peers, same links, same vectors.

For every combination of ``--peers``, ``--elements`` and ``--codec``, N peer processes average one fp32
vector of E numbers, first with dtnode (``scripts/allreduce_worker.py``: ``--rounds`` rounds of its
reduce-scatter + all-gather), then with hivemind 1.1.12 (``scripts/hivemind_worker.py``: one step of
its butterfly all-reduce, Ryabinin et al., "Moshpit SGD", NeurIPS 2021) with the closest codec:
none -> NoCompression, fp16 / bf16 -> Float16Compression, int8 / int4 -> Uniform8BitQuantization.
Both generate peer i's vector with ``allreduce_worker.make_vector(seed, i, round, E)`` and hivemind
averages the inputs of dtnode's round 0, so both average bit-identical inputs; both check their
result against torch's exact mean of the regenerated vectors. With ``--link-mbit M`` the peers run
in ``scripts/wan_emulator.py``'s network namespaces, each uplink capped at M Mbit/s (needs root,
else exit 2); without it, on loopback 127.0.0.1. The two never run at the same time.

Fields of the JSON object printed per configuration (a one-line summary follows it):

seconds: a worker reports the wall time of its ``allreduce()`` call. Peers do not enter a round in
    lock-step (each first generates its vector, and after a round runs an exact-mean check whose
    duration varies with the load), so an early peer's time includes waiting for the last one. The
    last to enter has the shortest call, running from the moment all peers are present until it
    holds the full average: a round's time is the MINIMUM over peers (``seconds_max_peer_per_round``
    keeps the maximum, skew included). ``seconds`` is the steady state: the median over rounds 1..,
    as a long-running node keeps its connections open from round to round (round 0 itself if
    ``--rounds 1``; ``seconds_statistic`` says which). Round 0 also opens every connection and warms
    the allocators: it is reported on its own as ``first_round_seconds`` (and
    ``first_round_link_efficiency``). ``hivemind_seconds`` is the minimum over peers of hivemind's
    all-reduce phase in its single step (``allreduce_seconds``: from RUNNING_ALLREDUCE, after
    matchmaking has gathered the group, to the end of the step).
cpu_seconds_per_peer: CPU time of a peer process (all its threads) during its ``allreduce()`` call,
    mean over peers and timed rounds; with ``cpu_cores`` it shows how close the peers, which share
    this machine's cores, come to being limited by the CPU rather than the links.
wire_bytes = codec.encoded_num_bytes(E), the full vector as the codec encodes it (int8: E bytes and
    one fp32 scale per 256 numbers). ``wire_bytes_per_peer``: gRPC bytes each peer sent in a round,
    mean over peers and timed rounds, as counted when its ``allreduce()`` returned (a peer that is done
    early still serves its part afterwards, so this can undercount); ``interface_tx_bytes_per_peer``
    (emulator only): all bytes that left each eth0 per round, TCP/IP headers included.
link_bound_seconds = 2 * (N - 1) / N * wire_bytes / (M * 1e6 / 8): the time of a bandwidth-optimal
    all-reduce with this codec on this link, each peer uploading (N - 1) / N of the encoded vector in
    reduce-scatter and again in all-gather (Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", JPDC 2009). link_efficiency = link_bound_seconds / seconds.
speedup_vs_hivemind = hivemind_seconds / seconds.
max_abs_error: max over peers and rounds of |result - exact mean| (per round too); same for hivemind.
peak_rss_bytes_per_peer: max over peers of the whole process's peak resident size (ru_maxrss after
    its last round). About 250 MB of it is the interpreter with torch and grpc and the idle server
    (``baseline_rss_bytes_per_peer``: resident size just before the first round's vector was built),
    so ``peak_rss_above_baseline_bytes`` (max over peers of peak minus that peer's baseline) is what
    the all-reduce adds, the peer's own input vector included. Both are also given as multiples of
    the fp32 vector (4 E bytes): ``peak_rss_x_vector`` (raw) and ``peak_rss_above_baseline_x_vector``
    (the one the memory target applies to). A hivemind peer
    is a main process (``hivemind_peak_rss_bytes_per_peer`` and baseline) plus averager and p2pd
    children (``hivemind_peak_rss_children_bytes``: the largest); forked children share pages with
    the main process, so a sum would overcount.
bit_identical: in every round, every peer's result has the same sha256 (``bit_identical_per_round``).

Targets (``targets``; PASS / FAIL in the summary; only those that apply to the configuration):
    link_efficiency >= 0.85 for int8 at N = 4 and 8 under a 100 Mbit/s cap, 25M-100M numbers;
    speedup_vs_hivemind >= 2 for int8 at N = 2 and 4 on loopback, 25M-100M numbers;
    peak RSS per peer above the baseline <= 3 x the fp32 vector (the raw ratio is printed too).

    python scripts/bench_allreduce.py --peers 2,4 --elements 25000000 --codec int8,none --rounds 3
    python scripts/bench_allreduce.py --peers 4,8 --elements 25000000 --codec int8 --link-mbit 100

Exit code: 0 if every run completed (the verdicts are in the output), 1 if a run failed, 2 if the
setup is impossible (no root for the emulator, too little memory), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any

from hivemind_worker import descendant_pids
from wan_emulator import WanEmulator, unavailable_reason

from protocol.codecs import CODEC_NAMES, get_codec

SCRIPTS_DIR = Path(__file__).resolve().parent
HIVEMIND_CODECS = {"none": "none", "fp16": "fp16", "bf16": "fp16", "int8": "int8", "int4": "int8"}
MEMORY_BUDGET_BYTES = 24 << 30
# Planning estimate of one peer's footprint: interpreter + hivemind (~1 GiB) and up to six fp32
# copies of the vector (hivemind's own, averaged and reference vectors plus check temporaries).
PEER_FIXED_BYTES = 1 << 30
PEER_VECTOR_COPIES = 6
# Timeouts are planned for this goodput where no cap is set (loopback on a loaded 2-core machine).
PLANNING_LOOPBACK_BYTES_PER_SECOND = 20e6
# Generous rate of regenerating vectors for the exact-mean checks (numbers per second per peer).
PLANNING_CHECK_NUMBERS_PER_SECOND = 10e6
RENDEZVOUS_SECONDS = 120.0
TARGET_ELEMENTS = (25_000_000, 100_000_000)
TARGET_LINK_EFFICIENCY = 0.85
TARGET_SPEEDUP = 2.0
TARGET_MEMORY_X_VECTOR = 3.0
STOP_GRACE = datetime.timedelta(seconds=5)
# Once a peer failed, the others get this long to finish (or fail) on their own before being stopped.
FAILURE_GRACE = datetime.timedelta(seconds=60)


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One configuration of the benchmark."""

    num_peers: int
    num_elements: int
    codec: str
    link_mbit: float | None
    num_rounds: int
    seed: int

    @property
    def vector_bytes(self) -> int:
        return 4 * self.num_elements

    def ideal_seconds(self, num_bytes: int) -> float:
        """Bandwidth-optimal all-reduce time of a num_bytes vector at the cap (or the planning rate)."""
        rate = self.link_mbit * 1e6 / 8 if self.link_mbit else PLANNING_LOOPBACK_BYTES_PER_SECOND
        return 2 * (self.num_peers - 1) / self.num_peers * num_bytes / rate

    @property
    def round_deadline_seconds(self) -> float:
        """Deadline of one round, for either implementation: ten times the fp32 ideal, at least 2 min."""
        return max(120.0, 10 * self.ideal_seconds(self.vector_bytes))

    @property
    def check_seconds(self) -> float:
        """Time allowed for a peer's exact-mean check: it regenerates all N vectors, N peers share 2 cores."""
        return self.num_peers**2 * self.num_elements / PLANNING_CHECK_NUMBERS_PER_SECOND + 30


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--peers", default="4", help="peer counts, comma-separated (e.g. 2,4)")
    parser.add_argument("--elements", default="25000000", help="vector lengths, comma-separated")
    parser.add_argument("--codec", default="int8", help=f"codecs, comma-separated: {', '.join(CODEC_NAMES)}")
    parser.add_argument("--link-mbit", type=float, default=None, help="uplink cap; omit for loopback")
    parser.add_argument("--rounds", type=int, default=3, help="dtnode rounds (the first warms up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the vectors (both implementations)")
    parser.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline")
    parser.add_argument("--json-out", type=Path, default=None, help="also write all records here")
    parser.add_argument("--keep-logs", type=Path, default=None, help="keep every peer's stdout/stderr here")
    args = parser.parse_args(argv)
    try:
        args.peers = [int(item) for item in args.peers.split(",") if item]
        args.elements = [int(item) for item in args.elements.split(",") if item]
    except ValueError as error:
        parser.error(f"--peers and --elements take comma-separated integers: {error}")
    args.codec = [item for item in args.codec.split(",") if item]
    if not args.peers or min(args.peers) < 2:
        parser.error("--peers: every count must be >= 2")
    if not args.elements or min(args.elements) < 1:
        parser.error("--elements: every length must be >= 1")
    if unknown := [codec for codec in args.codec if codec not in CODEC_NAMES]:
        parser.error(f"--codec: unknown {unknown}; choose from {', '.join(CODEC_NAMES)}")
    if args.keep_logs is not None and args.keep_logs.exists() and any(args.keep_logs.iterdir()):
        parser.error("--keep-logs must be a new or empty directory (stale rendezvous files confuse peers)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if args.link_mbit is not None and args.link_mbit <= 0:
        parser.error("--link-mbit must be positive")
    return args


def available_memory_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def check_memory(setups: list[Setup]) -> str | None:
    """Why the largest configuration would not fit (N peers at once), or None if it fits."""
    limit = min(MEMORY_BUDGET_BYTES, available_memory_bytes())
    for setup in setups:
        needed = setup.num_peers * (PEER_FIXED_BYTES + PEER_VECTOR_COPIES * setup.vector_bytes)
        if needed > limit:
            return (
                f"N={setup.num_peers} x E={setup.num_elements} needs ~{needed / 2**30:.1f} GiB, "
                f"more than the {limit / 2**30:.1f} GiB available (budget 24 GiB)"
            )
    return None


class PeerHosts:
    """Where the N peers run: the namespaces of a WanEmulator (capped uplinks) or this machine's loopback.

    A context manager: leaving it (also on Ctrl-C or SIGTERM) stops every peer process with its
    children, then removes the emulator's namespaces.
    """

    def __init__(self, num_peers: int, link_mbit: float | None) -> None:
        self.num_peers = num_peers
        self.emulator = WanEmulator(num_peers, link_mbit) if link_mbit is not None else None
        self.processes: list[subprocess.Popen] = []

    def address(self, index: int) -> str:
        return self.emulator.address(index) if self.emulator is not None else "127.0.0.1"

    def popen(self, index: int, argv: Sequence[str], stdout: IO[str], stderr: IO[str]) -> subprocess.Popen:
        if self.emulator is not None:
            process = self.emulator.popen(index, argv, stdout=stdout, stderr=stderr, text=True)
        else:
            # Own session: a Ctrl-C on the terminal reaches only us, and we stop the peers in order.
            process = subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        self.processes.append(process)
        return process

    def tx_bytes(self) -> list[int] | None:
        """Bytes each host's eth0 has sent so far (None on loopback, where all peers share `lo`)."""
        if self.emulator is None:
            return None
        counts = []
        for index in range(self.num_peers):
            command = ["ip", "-n", self.emulator.namespace(index), "-j", "-s", "link", "show", "dev", "eth0"]
            output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=20).stdout
            counts.append(int(json.loads(output)[0]["stats64"]["tx"]["bytes"]))
        return counts

    def stop(self, processes: Sequence[subprocess.Popen]) -> None:
        """SIGTERM each running peer's process group, SIGKILL it after STOP_GRACE, and kill its
        descendants too (hivemind's p2pd may leave the group)."""
        running = [process for process in processes if process.poll() is None]
        descendants = [pid for process in running for pid in descendant_pids(process.pid)]
        for process in running:
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE.total_seconds()
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process.pid, signal.SIGKILL)
                process.wait(timeout=STOP_GRACE.total_seconds())
        for pid in descendants:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it exited with its parent

    def __enter__(self) -> PeerHosts:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop(self.processes)
        finally:
            if self.emulator is not None:
                self.emulator.close()


def _signal_group(process_group: int, signum: int) -> None:
    try:
        os.killpg(process_group, signum)
    except ProcessLookupError:
        return  # the whole group already exited


@dataclass(frozen=True, kw_only=True)
class PeerRun:
    """What the N processes of one implementation left behind."""

    stdouts: list[str]
    error: str | None
    """None if every peer exited 0; else which one failed (with its stderr's tail) or timed out."""
    tx_bytes: list[int] | None
    """Bytes each host's interface sent during the run (emulator only)."""


def run_peers(
    hosts: PeerHosts, argvs: list[list[str]], log_dir: Path, timeout: datetime.timedelta
) -> PeerRun:
    """Run one process per peer until all exit, one fails (then the others get FAILURE_GRACE) or timeout."""
    log_dir.mkdir(parents=True)
    tx_before = hosts.tx_bytes()
    processes, files = [], []
    try:
        for index, argv in enumerate(argvs):
            stdout = open(log_dir / f"peer-{index}.out", "w")  # closed in finally
            stderr = open(log_dir / f"peer-{index}.err", "w")
            files += [stdout, stderr]
            processes.append(hosts.popen(index, argv, stdout, stderr))
        deadline = time.monotonic() + timeout.total_seconds()
        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            if any(p.poll() not in (None, 0) for p in processes):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE.total_seconds())
            time.sleep(0.2)
        timed_out = [i for i, p in enumerate(processes) if p.poll() is None]
        hosts.stop(processes)
    finally:
        for file in files:
            file.close()
    tx_after = hosts.tx_bytes()
    error = None
    for index, process in enumerate(processes):
        if index in timed_out or process.returncode != 0:
            tail = (log_dir / f"peer-{index}.err").read_text().strip().splitlines()[-3:]
            status = "did not finish in time" if index in timed_out else f"exited {process.returncode}"
            error = f"peer {index} {status}: {' / '.join(tail)[-400:]}"
            break
    return PeerRun(
        stdouts=[(log_dir / f"peer-{index}.out").read_text() for index in range(len(processes))],
        error=error,
        tx_bytes=None
        if tx_before is None
        else [b - a for a, b in zip(tx_before, tx_after or [], strict=True)],
    )


def dtnode_argv(setup: Setup, index: int, address: str, rendezvous: Path) -> list[str]:
    return [
        sys.executable,
        str(SCRIPTS_DIR / "allreduce_worker.py"),
        *["--index", str(index), "--num-peers", str(setup.num_peers), "--rendezvous", str(rendezvous)],
        *["--host", address, "--elements", str(setup.num_elements), "--codec", setup.codec],
        *["--rounds", str(setup.num_rounds), "--seed", str(setup.seed)],
        *["--deadline-seconds", str(setup.round_deadline_seconds)],
        *["--rendezvous-timeout-seconds", str(RENDEZVOUS_SECONDS)],
    ]


def hivemind_argv(setup: Setup, index: int, address: str, rendezvous: Path, timeout: float) -> list[str]:
    return [
        sys.executable,
        str(SCRIPTS_DIR / "hivemind_worker.py"),
        *["--index", str(index), "--num-peers", str(setup.num_peers), "--rendezvous", str(rendezvous)],
        *["--host", address, "--elements", str(setup.num_elements), "--codec", HIVEMIND_CODECS[setup.codec]],
        *["--seed", str(setup.seed), "--vector-round", "0"],
        *["--rendezvous-seconds", str(RENDEZVOUS_SECONDS), "--timeout", str(timeout)],
        *["--step-timeout", str(setup.round_deadline_seconds)],
    ]


def rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize_dtnode(setup: Setup, run: PeerRun) -> dict[str, object]:
    """The dtnode fields of a configuration's record (module docstring) from its peers' JSON lines."""
    records = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for out in run.stdouts]
    if run.error or any(len(peer) != setup.num_rounds for peer in records):
        counts = [len(peer) for peer in records]
        return {"error": run.error or f"expected {setup.num_rounds} records per peer, got {counts}"}
    by_round = list(zip(*records, strict=True))  # [round][peer]
    identical = [len({r["sha256"] for r in peers}) == 1 for peers in by_round]
    per_round = [min(r["seconds"] for r in peers) for peers in by_round]
    timed = list(range(1, setup.num_rounds)) or [0]
    seconds = round(statistics.median(per_round[k] for k in timed), 4)
    wire_bytes = get_codec(setup.codec).encoded_num_bytes(setup.num_elements)
    sent = statistics.mean(r["bytes_sent"] for k in timed for r in by_round[k])
    last = by_round[-1]  # ru_maxrss only grows, so the last round holds each peer's peak
    peak_rss = max(r["peak_rss_bytes"] for r in last)
    above_baseline = max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in last)
    link_bound = setup.ideal_seconds(wire_bytes) if setup.link_mbit else None
    summary: dict[str, object] = {
        "seconds": seconds,
        "seconds_statistic": (
            f"median over rounds {timed[0]}..{timed[-1]} of the fastest peer's time"
            + (" (round 0, which opens the connections, is first_round_seconds)" if timed[0] else "")
        ),
        "first_round_seconds": per_round[0],
        "first_round_link_efficiency": rounded(link_bound / per_round[0] if link_bound else None),
        "seconds_per_round": per_round,
        "seconds_max_peer_per_round": [max(r["seconds"] for r in peers) for peers in by_round],
        "wire_bytes": wire_bytes,
        "wire_bytes_per_peer": round(sent),
        "wire_bytes_ideal_per_peer": round(2 * (setup.num_peers - 1) / setup.num_peers * wire_bytes),
        "link_bound_seconds": rounded(link_bound),
        "link_efficiency": rounded(link_bound / seconds if link_bound else None),
        "max_abs_error": max(r["max_abs_error"] for peers in by_round for r in peers),
        "max_abs_error_per_round": [max(r["max_abs_error"] for r in peers) for peers in by_round],
        "cpu_seconds_per_peer": rounded(
            statistics.mean(r["cpu_seconds"] for k in timed for r in by_round[k])
        ),
        "cpu_cores": os.cpu_count(),
        "peak_rss_bytes_per_peer": peak_rss,
        "peak_rss_bytes_per_round": [max(r["peak_rss_bytes"] for r in peers) for peers in by_round],
        "baseline_rss_bytes_per_peer": max(r["baseline_rss_bytes"] for r in last),
        "peak_rss_above_baseline_bytes": above_baseline,
        "peak_rss_x_vector": rounded(peak_rss / setup.vector_bytes, 3),
        "peak_rss_above_baseline_x_vector": rounded(above_baseline / setup.vector_bytes, 3),
        "bit_identical": all(identical),
        "bit_identical_per_round": identical,
        "fell_back": any(r["fell_back"] for peers in by_round for r in peers),
        "failures": sorted({f for peers in by_round for r in peers for f in r["failures"]}),
    }
    if run.tx_bytes is not None:
        summary["interface_tx_bytes_per_peer"] = round(statistics.mean(run.tx_bytes) / setup.num_rounds)
    return summary


def summarize_hivemind(setup: Setup, run: PeerRun) -> dict[str, object]:
    """The hivemind fields of a configuration's record from its peers' reports (one JSON line each)."""
    last_lines = [[line for line in out.splitlines() if line.startswith("{")][-1:] for out in run.stdouts]
    if not all(last_lines):
        return {"hivemind_ok": False, "hivemind_error": run.error or "a hivemind peer printed no report"}
    reports = [json.loads(lines[0]) for lines in last_lines]
    # A peer whose check failed says why in its report; the stderr tail (run.error) is the last resort.
    errors = [
        f"peer {i}: {r['error'] or 'not averaged'} (group {r['group_size']}/{setup.num_peers}, "
        f"relative L2 error {r['relative_l2_error']})"
        for i, r in enumerate(reports)
        if not r["averaged_ok"]
    ]
    allreduce = [r["allreduce_seconds"] for r in reports]
    timed = not errors and run.error is None and None not in allreduce
    peak_rss = max(r["peak_rss_bytes"] for r in reports)
    above_baseline = max(r["peak_rss_bytes"] - r["baseline_rss_bytes"] for r in reports)
    summary: dict[str, object] = {
        "hivemind_codec": HIVEMIND_CODECS[setup.codec],
        "hivemind_ok": not errors and run.error is None,
        "hivemind_error": "; ".join(errors) or run.error,
        "hivemind_seconds": rounded(min(allreduce)) if timed else None,
        "hivemind_seconds_max_peer": rounded(max(allreduce)) if timed else None,
        "hivemind_allreduce_seconds_per_peer": [rounded(seconds) for seconds in allreduce],
        "hivemind_step_seconds": rounded(max(r["seconds"] or 0.0 for r in reports)),
        "hivemind_max_abs_error": max(r["max_abs_error"] or 0.0 for r in reports) if timed else None,
        "hivemind_peak_rss_bytes_per_peer": peak_rss,
        "hivemind_baseline_rss_bytes_per_peer": max(r["baseline_rss_bytes"] for r in reports),
        "hivemind_peak_rss_children_bytes": max(r["peak_rss_children_bytes"] for r in reports),
        "hivemind_peak_rss_x_vector": rounded(peak_rss / setup.vector_bytes, 3),
        "hivemind_peak_rss_above_baseline_x_vector": rounded(above_baseline / setup.vector_bytes, 3),
    }
    if run.tx_bytes is not None:
        summary["hivemind_interface_tx_bytes_per_peer"] = round(statistics.mean(run.tx_bytes))
    return summary


def evaluate_targets(setup: Setup, record: dict[str, object]) -> dict[str, dict[str, object]]:
    """The module docstring's targets that apply to this configuration, each with its verdict."""
    targets: dict[str, dict[str, object]] = {}
    in_range = TARGET_ELEMENTS[0] <= setup.num_elements <= TARGET_ELEMENTS[1]
    if in_range and setup.codec == "int8" and setup.link_mbit == 100 and setup.num_peers in (4, 8):
        value = record.get("link_efficiency")
        targets["link_efficiency"] = {"value": value, "min": TARGET_LINK_EFFICIENCY}
    if in_range and setup.codec == "int8" and setup.link_mbit is None and setup.num_peers in (2, 4):
        value = record.get("speedup_vs_hivemind")
        targets["speedup_vs_hivemind"] = {"value": value, "min": TARGET_SPEEDUP}
    targets["peak_rss_above_baseline_x_vector"] = {
        "value": record.get("peak_rss_above_baseline_x_vector"),
        "max": TARGET_MEMORY_X_VECTOR,
    }
    for target in targets.values():
        value = target["value"]
        if value is None:
            target["pass"] = False  # the run failed, so the target is not met
        elif "min" in target:
            target["pass"] = value >= target["min"]  # type: ignore[operator]
        else:
            target["pass"] = value <= target["max"]  # type: ignore[operator]
    return targets


def run_setup(setup: Setup, with_hivemind: bool, workdir: Path) -> dict[str, object]:
    """Run dtnode then hivemind on the same hosts; one record (see the module docstring)."""
    record: dict[str, object] = {
        "peers": setup.num_peers,
        "codec": setup.codec,
        "elements": setup.num_elements,
        "link_mbit": setup.link_mbit,
        "rounds": setup.num_rounds,
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
    }
    with PeerHosts(setup.num_peers, setup.link_mbit) as hosts:
        rendezvous = workdir / "dtnode"
        dtnode_timeout = (
            RENDEZVOUS_SECONDS + 60 + setup.num_rounds * (setup.round_deadline_seconds + setup.check_seconds)
        )
        run = run_peers(
            hosts,
            [dtnode_argv(setup, i, hosts.address(i), rendezvous) for i in range(setup.num_peers)],
            workdir / "dtnode-logs",
            datetime.timedelta(seconds=dtnode_timeout),
        )
        record.update(summarize_dtnode(setup, run))
        if with_hivemind:
            record["load_avg_1min_before_hivemind"] = round(os.getloadavg()[0], 2)
            timeout = RENDEZVOUS_SECONDS + 2 * setup.round_deadline_seconds + setup.check_seconds + 60
            rendezvous = workdir / "hivemind"
            run = run_peers(
                hosts,
                [
                    hivemind_argv(setup, i, hosts.address(i), rendezvous, timeout)
                    for i in range(setup.num_peers)
                ],
                workdir / "hivemind-logs",
                datetime.timedelta(seconds=timeout + 30),
            )
            record.update(summarize_hivemind(setup, run))
    hivemind_seconds, seconds = record.get("hivemind_seconds"), record.get("seconds")
    if isinstance(hivemind_seconds, float) and isinstance(seconds, float):
        record["speedup_vs_hivemind"] = round(hivemind_seconds / seconds, 3)
    else:
        record["speedup_vs_hivemind"] = None
    record["load_avg_1min_after"] = round(os.getloadavg()[0], 2)
    record["targets"] = evaluate_targets(setup, record)
    return record


def summary_line(r: dict[str, Any]) -> str:
    """One human-readable line for a record: times, speedup, errors, memory, agreement, verdicts."""
    link = f"{r['link_mbit']:g} Mbit/s" if r["link_mbit"] else "loopback"
    head = f"N={r['peers']} {r['codec']} E={r['elements']:,} {link}:"
    if "error" in r:
        return f"{head} dtnode FAILED: {r['error']}"
    parts = [f"dtnode {r['seconds']:.2f} s (first round {r['first_round_seconds']:.2f} s"]
    if r["link_bound_seconds"] is not None:
        parts[0] += (
            f"; link bound {r['link_bound_seconds']:.2f} s, efficiency {r['link_efficiency']:.2f}"
            f", first round {r['first_round_link_efficiency']:.2f}"
        )
    parts[0] += f"; {r['cpu_seconds_per_peer']:.2f} CPU-s per peer on {r['cpu_cores']} cores)"
    if r.get("hivemind_seconds") is not None:
        parts.append(f"hivemind {r['hivemind_seconds']:.2f} s -> {r['speedup_vs_hivemind']:.2f}x")
    elif "hivemind_ok" in r:
        parts.append(f"hivemind FAILED: {r['hivemind_error']}")
    errors = f"err {r['max_abs_error']:.3g}"
    if r.get("hivemind_max_abs_error") is not None:
        errors += f" (hivemind {r['hivemind_max_abs_error']:.3g})"
    rss = f"peak RSS {r['peak_rss_x_vector']:.2f}x vector"
    rss += f", {r['peak_rss_above_baseline_x_vector']:.2f}x above the pre-round baseline"
    if r.get("hivemind_peak_rss_x_vector") is not None:
        rss += f" (hivemind {r['hivemind_peak_rss_x_vector']:.2f}x"
        rss += f", {r['hivemind_peak_rss_above_baseline_x_vector']:.2f}x)"
    parts += [errors, rss]
    if r["fell_back"] or r["failures"]:
        parts.append(f"fell back: {r['fell_back']}, {len(r['failures'])} failure(s) recorded")
    parts.append("bit-identical" if r["bit_identical"] else "NOT bit-identical")
    verdicts = ", ".join(f"{name} {'PASS' if t['pass'] else 'FAIL'}" for name, t in r["targets"].items())
    return f"{head} {' | '.join(parts)} | targets: {verdicts}"


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds the `with PeerHosts` blocks, which stop every peer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_system_exit)
    common = {"link_mbit": args.link_mbit, "num_rounds": args.rounds, "seed": args.seed}
    setups = [
        Setup(num_peers=n, num_elements=e, codec=c, **common)  # type: ignore[arg-type]
        for n, e, c in itertools.product(args.peers, args.elements, args.codec)
    ]
    if args.link_mbit is not None and (reason := unavailable_reason()) is not None:
        print(
            f"bench_allreduce: cannot cap links: {reason}; run as root or drop --link-mbit", file=sys.stderr
        )
        return 2
    if (reason := check_memory(setups)) is not None:
        print(f"bench_allreduce: {reason}", file=sys.stderr)
        return 2
    records = []
    try:
        for setup in setups:
            with tempfile.TemporaryDirectory(prefix="bench_allreduce-") as scratch:
                name = f"n{setup.num_peers}-e{setup.num_elements}-{setup.codec}"
                workdir = Path(scratch) if args.keep_logs is None else args.keep_logs / name
                record = run_setup(setup, not args.no_hivemind, workdir)
            records.append(record)
            print(json.dumps(record), flush=True)
            print(summary_line(record), flush=True)
    except KeyboardInterrupt:
        print("bench_allreduce: interrupted; every peer and namespace was stopped", file=sys.stderr)
        return 130
    finally:
        if args.json_out is not None:
            args.json_out.write_text(json.dumps(records, indent=2) + "\n")
    failed = any("error" in r or r.get("hivemind_ok") is False for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
