"""One hivemind ``DecentralizedAverager`` peer: the baseline dtnode's all-reduce is measured against.

Every peer of a run executes this script once (``--index 0 .. --num-peers - 1``), e.g. one per network
namespace of ``scripts/tools/wan_emulator.py``. The run is a single averaging step of hivemind 1.1.12
(Ryabinin et al., "Moshpit SGD", NeurIPS 2021, which describes the matchmaking + butterfly all-reduce
hivemind implements), timed and checked against the exact answer:

Phase 1 (rendezvous): peer 0 starts a DHT bound to ``--host`` and atomically writes its visible
    multiaddrs to ``--rendezvous/hivemind_initial_peers.txt``; the others poll for that file (bounded
    wait) and bootstrap their own DHT from it. Once its averager is up, each peer drops a ``ready_<i>``
    flag there and waits for all ``n`` flags, so the timed step starts together on every peer (and a
    ``done_<i>`` barrier at the end keeps every peer serving until all have their result).
Phase 2 (matchmaking): every peer asks for a group of exactly ``--num-peers`` (``target_group_size`` and
    ``min_group_size`` both ``n``), so hivemind retries matchmaking until the whole group is present or
    ``--step-timeout`` passes.
Phase 3 (all-reduce): hivemind's butterfly all-reduce averages a flat fp32 vector of ``--elements``
    values with the chosen codec (``none`` / ``fp16`` / ``int8`` = ``NoCompression`` /
    ``Float16Compression`` / ``Uniform8BitQuantization``).
Phase 4 (check): the peer regenerates every peer's vector and compares its result with torch's exact
    mean ``torch.stack(vectors).mean(0)``, taken one generation block at a time so no peer ever holds
    all ``n`` vectors.

Vectors come from ``scripts/workers/allreduce_worker.py``'s generator (imported, not copied): peer ``i``'s
vector is ``make_vector(seed, i, vector_round, E)``, a function of ``(seed, index, round)`` only. With
the same ``--seed`` and ``--vector-round`` both baselines therefore average bit-identical inputs, e.g.
this script's single step and round 0 of the dtnode worker.

hivemind may fail *silently*: when a codec raises inside the all-reduce (its 8-bit codecs do under
numpy >= 2.4) the averager logs the error and leaves (part of) the tensor un-averaged. ``averaged_ok``
catches that: the vector is cut into chunks and every chunk must have moved most of the way from the
peer's own values to the exact mean.

The script prints exactly one JSON line on stdout (hivemind logs go to stderr) and exits 0 iff
``averaged_ok``. A watchdog enforces ``--timeout`` even if hivemind hangs: it kills every descendant
process (averager, DHT, p2pd) and exits with code 124.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

import torch

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.common import exit_on_sigterm, print_json
from scripts.workers.allreduce_worker import GENERATION_BLOCK, make_vector, vector_block

CODECS = ("none", "fp16", "int8")
RENDEZVOUS_FILE_NAME = "hivemind_initial_peers.txt"
# An un-averaged chunk keeps relative error 1.0 (it still equals the peer's own values); int8 leaves
# a few percent. Anything above one half means hivemind did not really average that chunk.
MAX_CHUNK_RELATIVE_ERROR = 0.5
NUM_CHECK_CHUNKS = 1000
TIMEOUT_EXIT_CODE = 124


def make_peer_vector(seed: int, index: int, vector_round: int, num_elements: int) -> torch.Tensor:
    """The vector peer ``index`` contributes: the dtnode worker's own generator. # (E,)"""
    return make_vector(seed, index, vector_round, num_elements)


def exact_mean(seed: int, num_peers: int, vector_round: int, num_elements: int) -> torch.Tensor:
    """The reference answer: torch's mean over every peer's regenerated vector. # (E,)

    Computed per generation block (``torch.stack(blocks).mean(0)``): the mean over dim 0 is taken
    element by element, so this equals the mean of the stacked full vectors while holding only ``n``
    blocks instead of ``n`` vectors (8 peers x 25M numbers would be 800 MB per peer).
    """
    reference = torch.empty(num_elements)
    for block in range((num_elements + GENERATION_BLOCK - 1) // GENERATION_BLOCK):
        pieces = [vector_block(seed, i, vector_round, block, num_elements) for i in range(num_peers)]
        start = block * GENERATION_BLOCK
        reference[start : start + pieces[0].numel()] = torch.stack(pieces).mean(dim=0)  # (n, b) -> (b,)
    return reference


def is_really_averaged(averaged: torch.Tensor, original: torch.Tensor, reference: torch.Tensor) -> bool:
    """True iff every chunk of ``averaged`` moved most of the way from ``original`` to ``reference``.

    A chunk-wise relative L2 error (instead of one global number) catches a partial failure where only
    one peer's part of the butterfly all-reduce was left un-averaged.
    """
    num_chunks = min(NUM_CHECK_CHUNKS, averaged.numel())
    error_chunks = torch.tensor_split(averaged - reference, num_chunks)
    spread_chunks = torch.tensor_split(original - reference, num_chunks)
    error_norms = torch.stack([chunk.norm() for chunk in error_chunks])  # (num_chunks,)
    spread_norms = torch.stack([chunk.norm() for chunk in spread_chunks])  # (num_chunks,)
    # A chunk whose original already equals the mean (spread 0) is fine iff its error is tiny.
    tolerance = 1e-6 * (1.0 + reference.abs().max())
    ok_chunks = error_norms <= torch.maximum(MAX_CHUNK_RELATIVE_ERROR * spread_norms, tolerance)
    return bool(ok_chunks.all())


def descendant_pids(root_pid: int) -> list[int]:
    """All live descendants of ``root_pid`` (children first), read from /proc (Linux only)."""
    children_of: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # the process exited while we were listing
        # The command name is parenthesised and may contain spaces; fields after it are fixed.
        parent_pid = int(stat.rsplit(")", 1)[1].split()[1])
        children_of.setdefault(parent_pid, []).append(int(entry.name))
    found: list[int] = []
    frontier = [root_pid]
    while frontier:
        children = children_of.get(frontier.pop(), [])
        found.extend(children)
        frontier.extend(children)
    return found


def kill_descendants() -> None:
    for pid in descendant_pids(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # already gone


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    index: int
    """This peer's index in ``[0, num_peers)``; peer 0 starts the DHT."""
    num_peers: int
    """Group size every peer waits for."""
    num_elements: int
    """Length E of the averaged fp32 vector."""
    codec: str
    """Wire codec: one of ``CODECS``."""
    seed: int
    """Run seed; peer i's vector is ``allreduce_worker.make_vector(seed, i, vector_round, E)``."""
    vector_round: int
    """Round number fed to the vector generator: the dtnode worker's round whose inputs we average."""
    rendezvous_dir: Path
    """Fresh directory shared by all peers: peer 0 publishes its multiaddrs there, all peers a ready flag."""
    host: str
    """IPv4 address the DHT / p2p daemon binds to (the namespace's address under the WAN emulator)."""
    matchmaking_time: datetime.timedelta
    """hivemind's ``min_matchmaking_time``: how long a leader gathers followers before starting."""
    rendezvous_timeout: datetime.timedelta
    """How long peers > 0 wait for peer 0's multiaddr file, and every peer for the start barrier."""
    step_timeout: datetime.timedelta
    """Deadline for matchmaking and, separately, for the all-reduce itself."""
    timeout: datetime.timedelta
    """Hard deadline for the whole process (watchdog)."""
    save_result: Path | None = None
    """If set, ``torch.save`` the averaged vector there (lets a test check it independently)."""

    def __post_init__(self) -> None:
        if self.num_peers < 2:
            raise ValueError(f"--num-peers must be >= 2, got {self.num_peers}")
        if not 0 <= self.index < self.num_peers:
            raise ValueError(f"--index must be in [0, {self.num_peers}), got {self.index}")
        if self.vector_round < 0:
            raise ValueError(f"--vector-round must be >= 0, got {self.vector_round}")
        if self.num_elements < 1:
            raise ValueError(f"--elements must be >= 1, got {self.num_elements}")
        if self.codec not in CODECS:
            raise ValueError(f"--codec must be one of {CODECS}, got {self.codec!r}")
        if self.step_timeout <= self.matchmaking_time:
            raise ValueError("--step-timeout must exceed --matchmaking-seconds")


@dataclasses.dataclass(kw_only=True)
class StepReport:
    index: int
    num_peers: int
    elements: int
    codec: str
    seconds: float | None = None
    """Wall time of ``averager.step`` (matchmaking + all-reduce)."""
    allreduce_seconds: float | None = None
    """Wall time from the averager entering RUNNING_ALLREDUCE to the step's end."""
    max_abs_error: float | None = None
    relative_l2_error: float | None = None
    """||result - mean|| / ||own vector - mean||: 0 when exact, 1 when hivemind left the vector untouched."""
    group_size: int = 0
    baseline_rss_bytes: int = 0
    """Peak RSS of this (main) process with hivemind imported, before the vector exists."""
    peak_rss_bytes: int = 0
    """Peak RSS of this (main) process, measured right after the step, before the reference check."""
    peak_rss_children_bytes: int = 0
    """Largest peak RSS among the averager / DHT / p2pd children, measured after they were joined."""
    averaged_ok: bool = False
    error: str | None = None


def make_compression(codec: str):  # -> hivemind.compression.CompressionBase (imported lazily)
    from hivemind.compression import Float16Compression, NoCompression, Uniform8BitQuantization

    return {"none": NoCompression, "fp16": Float16Compression, "int8": Uniform8BitQuantization}[codec]()


def publish_initial_peers(directory: Path, maddrs: list[str]) -> None:
    """Write the bootstrap multiaddrs atomically so readers never see a half-written file."""
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / f".{RENDEZVOUS_FILE_NAME}.{os.getpid()}.tmp"
    temporary.write_text("\n".join(maddrs) + "\n")
    temporary.replace(directory / RENDEZVOUS_FILE_NAME)


def wait_for_initial_peers(directory: Path, timeout: datetime.timedelta) -> list[str]:
    path = directory / RENDEZVOUS_FILE_NAME
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if path.exists():
            maddrs = [line for line in path.read_text().splitlines() if line]
            if maddrs:
                return maddrs
        time.sleep(0.1)
    raise TimeoutError(f"no rendezvous file {path} after {timeout}")


def barrier(directory: Path, name: str, index: int, num_peers: int, timeout: datetime.timedelta) -> bool:
    """Drop flag ``<name>_<index>`` in the rendezvous directory and wait until all ``num_peers`` flags
    exist; False if they did not within ``timeout``."""
    (directory / f"{name}_{index}").touch()
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        if all((directory / f"{name}_{peer}").exists() for peer in range(num_peers)):
            return True
        time.sleep(0.05)
    return False


def _time_step(averager, config: WorkerConfig) -> tuple[dict | None, float, float | None]:
    """Run one step; returns (gathered, step seconds, all-reduce seconds or None if never started)."""
    from hivemind.averaging.control import AveragingStage

    started = time.perf_counter()
    control = averager.step(
        timeout=config.step_timeout.total_seconds(), allow_retries=True, wait=False, require_trigger=False
    )
    allreduce_started: float | None = None
    # The stage lives in shared memory, so the main process can watch the averager process reach the
    # all-reduce; polling every millisecond is negligible next to a multi-second step.
    while not control.done():
        if allreduce_started is None and control.stage == AveragingStage.RUNNING_ALLREDUCE:
            allreduce_started = time.perf_counter()
        time.sleep(0.001)
    finished = time.perf_counter()
    gathered = control.result(timeout=0)
    allreduce_seconds = None if allreduce_started is None else finished - allreduce_started
    return gathered, finished - started, allreduce_seconds


def run_worker(config: WorkerConfig, report: StepReport) -> None:
    """Phases 1-4 of the module docstring; fills ``report`` as it goes so a failure keeps partial data."""
    import hivemind

    report.baseline_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    own_vector = make_peer_vector(config.seed, config.index, config.vector_round, config.num_elements)  # (E,)
    averaged = own_vector.clone()  # hivemind averages this one in place (shared memory)
    initial_peers = None
    if config.index == 0 and (config.rendezvous_dir / RENDEZVOUS_FILE_NAME).exists():
        raise ValueError(
            f"stale {RENDEZVOUS_FILE_NAME} in {config.rendezvous_dir}: use a fresh --rendezvous dir"
        )
    if config.index > 0:
        initial_peers = wait_for_initial_peers(config.rendezvous_dir, config.rendezvous_timeout)
    previous_sigint = signal.getsignal(signal.SIGINT)
    dht = hivemind.DHT(
        initial_peers=initial_peers,
        start=True,
        host_maddrs=[f"/ip4/{config.host}/tcp/0"],
        # No UPnP / NAT-PMP probing of the real network: peers talk only to the given addresses.
        nat_port_map=False,
    )
    averager = None
    try:
        if config.index == 0:
            publish_initial_peers(
                config.rendezvous_dir, [str(m) for m in dht.get_visible_maddrs(latest=True)]
            )
        averager = hivemind.DecentralizedAverager(
            [averaged],
            dht,
            start=True,
            prefix=f"hivemind_baseline_{config.seed}",
            target_group_size=config.num_peers,
            min_group_size=config.num_peers,
            min_matchmaking_time=config.matchmaking_time.total_seconds(),
            # hivemind warns (and may deadlock) when a request may outlive the matchmaking window.
            request_timeout=config.matchmaking_time.total_seconds() / 2,
            allreduce_timeout=config.step_timeout.total_seconds(),
            compression=make_compression(config.codec),
        )
        # hivemind ignores SIGINT in the parent once it starts its process; restore Ctrl-C.
        signal.signal(signal.SIGINT, previous_sigint)
        # Start together, so the timed step measures matchmaking + all-reduce, not a slow peer's start-up.
        if not barrier(
            config.rendezvous_dir, "ready", config.index, config.num_peers, config.rendezvous_timeout
        ):
            raise TimeoutError(
                f"not all {config.num_peers} peers became ready within {config.rendezvous_timeout}"
            )
        gathered, report.seconds, report.allreduce_seconds = _time_step(averager, config)
        report.group_size = 0 if gathered is None else len(gathered)
        report.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with averager.get_tensors() as tensors:
            result = tensors[0].clone()
    finally:
        # step() returns once this peer holds *its* averaged vector, possibly while it is still streaming
        # averaged parts to the others: shutting down at once truncates theirs (seen under a 100 Mbit cap
        # as "received 86.9% results" and an un-averaged tail). So leave only when everyone is done.
        if not barrier(
            config.rendezvous_dir, "done", config.index, config.num_peers, config.rendezvous_timeout
        ):
            print(f"hivemind_worker: peers not all done after {config.rendezvous_timeout}", file=sys.stderr)
        if averager is not None:
            averager.shutdown()
        dht.shutdown()
    report.peak_rss_children_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024

    if config.save_result is not None:
        torch.save(result, config.save_result)
    reference = exact_mean(config.seed, config.num_peers, config.vector_round, config.num_elements)  # (E,)
    report.max_abs_error = float((result - reference).abs().max())
    report.relative_l2_error = float((result - reference).norm() / (own_vector - reference).norm())
    report.averaged_ok = report.group_size == config.num_peers and is_really_averaged(
        result, own_vector, reference
    )


def start_watchdog(timeout: datetime.timedelta, report: StepReport) -> None:
    """Kill hivemind's processes and exit 124 if the worker outlives ``timeout``, whatever it is doing."""

    def expire() -> None:
        report.error = f"worker timed out after {timeout}"
        print_json(dataclasses.asdict(report))
        kill_descendants()
        os._exit(TIMEOUT_EXIT_CODE)

    timer = threading.Timer(timeout.total_seconds(), expire)
    timer.daemon = True
    timer.start()


def parse_args(argv: list[str] | None) -> WorkerConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--index", type=int, required=True, help="this peer's index in [0, num-peers)")
    parser.add_argument("--num-peers", type=int, required=True, help="group size every peer waits for")
    parser.add_argument("--elements", type=int, required=True, help="length of the averaged fp32 vector")
    parser.add_argument("--codec", choices=CODECS, default="none", help="hivemind wire codec")
    parser.add_argument("--seed", type=int, default=0, help="seed of the vectors (allreduce_worker's rule)")
    parser.add_argument(
        "--vector-round", type=int, default=0, help="average the dtnode worker's inputs of this round"
    )
    parser.add_argument("--rendezvous", type=Path, required=True, help="shared dir for peer 0's multiaddrs")
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address the DHT / p2p daemon binds to")
    parser.add_argument(
        "--matchmaking-seconds", type=float, default=2.0, help="hivemind min_matchmaking_time"
    )
    parser.add_argument("--rendezvous-seconds", type=float, default=60.0, help="wait for peer 0's file")
    parser.add_argument(
        "--step-timeout", type=float, default=300.0, help="matchmaking and all-reduce deadline"
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="hard deadline for the whole process")
    parser.add_argument("--save-result", type=Path, default=None, help="torch.save the averaged vector here")
    args = parser.parse_args(argv)
    return WorkerConfig(
        index=args.index,
        num_peers=args.num_peers,
        num_elements=args.elements,
        codec=args.codec,
        seed=args.seed,
        vector_round=args.vector_round,
        rendezvous_dir=args.rendezvous,
        host=args.host,
        matchmaking_time=datetime.timedelta(seconds=args.matchmaking_seconds),
        rendezvous_timeout=datetime.timedelta(seconds=args.rendezvous_seconds),
        step_timeout=datetime.timedelta(seconds=args.step_timeout),
        timeout=datetime.timedelta(seconds=args.timeout),
        save_result=args.save_result,
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    report = StepReport(
        index=config.index, num_peers=config.num_peers, elements=config.num_elements, codec=config.codec
    )
    start_watchdog(config.timeout, report)
    exit_on_sigterm()  # unwinds through run_worker's finally: averager and DHT shut down
    try:
        run_worker(config, report)
    except Exception as error:
        # hivemind reports a failed step by raising from step() (AllreduceException, MatchmakingException,
        # TimeoutError, ...); the failure is the measurement here, so record it and print the report.
        report.error = f"{type(error).__name__}: {error}"
    finally:
        kill_descendants()  # belt and braces: nothing of this peer may outlive it
    print_json(dataclasses.asdict(report))
    return 0 if report.averaged_ok else 1


if __name__ == "__main__":
    sys.exit(main())
