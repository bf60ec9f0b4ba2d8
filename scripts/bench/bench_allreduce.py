"""dtnode's all-reduce against hivemind's DecentralizedAverager: same peers, same links, same vectors.

For every combination of ``--peers``, ``--elements`` and ``--codec``, N peer processes average one fp32
vector of E numbers, first with dtnode (``scripts/workers/allreduce_worker.py``: ``--rounds`` rounds of its
reduce-scatter + all-gather), then with hivemind 1.1.12 (``scripts/workers/hivemind_worker.py``: one step of
its butterfly all-reduce, Ryabinin et al., "Moshpit SGD", NeurIPS 2021) with the closest codec:
none -> NoCompression, fp16 / bf16 -> Float16Compression, int8 / int4 -> Uniform8BitQuantization.
Both generate peer i's vector with ``allreduce_worker.make_vector(seed, i, round, E)`` and hivemind
averages the inputs of dtnode's round 0, so both average bit-identical inputs; both check their
result against torch's exact mean of the regenerated vectors. With ``--codec topk`` (``--topk-density``,
default the codec's 62/4096) there is no hivemind run (hivemind has no sparse codec: the record says so in
``hivemind_skipped``, ``hivemind_seconds`` is null) and a dtnode peer checks its result against the
exact weighted mean of what the contributors sent (their top-k payloads, decoded, summed in member
order in float32, as ``allreduce_worker.sparse_mean_error``): ``max_abs_error`` is 0 when the round is
right. With ``--link-mbit M`` the peers run
in ``scripts/tools/wan_emulator.py``'s network namespaces, each uplink capped at M Mbit/s (needs root,
else exit 2); without it, on loopback 127.0.0.1. The two never run at the same time. dtnode writes
each peer's average into its vector (``allreduce(in_place=True)``, as torch.distributed does;
``result: "in-place"``) unless ``--result copy`` asks for a new tensor, one more vector of memory.

Fields of the JSON object printed per configuration (a one-line summary follows it):

seconds: a worker reports the wall time of its ``allreduce()`` call. The workers run in lock-step
    (``--lockstep``): all enter a round at a file barrier (polled every 2 ms), and none checks its
    result or builds its next vector until every peer's call returned, so the benchmark's own
    CPU-heavy work never shares the cores with a round in progress. A round's time is the MINIMUM
    over peers, the first peer to hold the full average, as for hivemind (``seconds_max_peer_per_round``
    keeps the maximum, the last peer to hold it). ``seconds`` is the steady state: the median over rounds 1..,
    as a long-running node keeps its connections open from round to round (round 0 itself if
    ``--rounds 1``; ``seconds_statistic`` says which). Round 0 also opens every connection and warms
    the allocators: it is reported on its own as ``first_round_seconds`` (and
    ``first_round_link_efficiency``). ``hivemind_seconds`` is the minimum over peers of hivemind's
    all-reduce phase in its single step (``allreduce_seconds``: from RUNNING_ALLREDUCE, after
    matchmaking has gathered the group, to the end of the step).
cpu_seconds_per_peer: CPU time of a peer process (all its threads) during its ``allreduce()`` call,
    mean over peers and timed rounds; with ``cpu_cores`` it shows how close the peers, which share
    this machine's cores, come to being limited by the CPU rather than the links:
    ``cpu_bound_seconds`` = N * cpu_seconds_per_peer / cpu_cores, the least wall time the peers' own
    work takes on these cores if nothing else ran (a round above its link bound but near this one was
    held back by the CPU, not the link).
wire_bytes = codec.encoded_num_bytes(E), the full vector as the codec encodes it (int8: E bytes and
    one fp32 scale per 256 numbers). ``wire_bytes_per_peer``: gRPC bytes each peer sent in a round,
    mean over peers and timed rounds, as counted when its ``allreduce()`` returned (a peer that is done
    early still serves its part afterwards, so this can undercount; ``wire_bytes_received_per_peer``,
    the same for the bytes received, is complete: a peer's call returns once it holds every part);
    ``interface_tx_bytes_per_peer``
    (emulator only): all bytes that left each eth0 per round, TCP/IP headers included.
link_bound_seconds = busiest_link_bytes / (M * 1e6 / 8): the bytes the busiest uplink must carry in a
    round (payloads only, equal parts; the emulator caps uplinks) over the cap. A dense codec:
    busiest_link_bytes = 2 * (N - 1) / N * wire_bytes, the bandwidth-optimal all-reduce, each peer
    uploading (N - 1) / N of the encoded vector in reduce-scatter and again in all-gather (Patarasuk &
    Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009). topk, the
    sparse round (design (a) as built, protocol/allreduce/sparse.py and ARCHITECTURE.md "Sparse
    contributions"): member i pushes its payload for every other part to its owner, then serves its own
    part's bundle, all N members' payloads for it, to the N - 1 others:
        up_i = sum_{j != i} k_j + (N - 1) * N * k_i,   busiest_link_bytes = max_i up_i
    with k_j one member's top-k payload for part j (encoded chunk by chunk from the part's start);
    with equal parts that is about (N - 1)(N + 1) / N * k, k = wire_bytes (3.75 k at N = 4, 7.875 k at
    N = 8). link_efficiency = link_bound_seconds / seconds. ``wire_bytes_ideal_per_peer``: the mean of
    the up_i (of the dense formula for a dense codec).
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
--kill-member POINT[:CHUNK]: after the timed rounds the peers run one more, in which the last member
    SIGKILLs itself at that fault point of ``protocol/allreduce/faults.py`` (e.g. ``serve_chunk:2``: an
    owner dead after serving its third average chunk, mid all-gather); the survivors stop waiting for
    it at the lock-step barriers once it refuses connections. ``survivors_bit_identical``: every
    survivor's result of that round has the same sha256 and none fell back; ``killed_round_seconds``,
    ``killed_round_max_abs_error`` (against the mean over the contributors each part reports),
    ``killed_round_contributors``, ``killed_round_failures``. The timed fields cover the other rounds.

Targets (``targets``; PASS / FAIL in the summary; only those that apply to the configuration):
    link_efficiency >= 0.85 for int8 at N = 4 and 8 under a 100 Mbit/s cap, 25M-100M numbers;
    link_efficiency >= 0.8 (round time <= 1.25 x its own link bound) for topk at N = 4 and 8 under a
    100 Mbit/s cap, any size;
    survivors_bit_identical with --kill-member;
    speedup_vs_hivemind >= 2 for int8 at N = 2 and 4 on loopback, 25M-100M numbers;
    peak RSS per peer above the baseline <= 3 x the fp32 vector (the raw ratio is printed too).

    python scripts/bench/bench_allreduce.py --peers 2,4 --elements 25000000 --codec int8,none --rounds 3
    python scripts/bench/bench_allreduce.py --peers 4,8 --elements 25000000 --codec int8 --link-mbit 100
    python scripts/bench/bench_allreduce.py --peers 4,8 --elements 25000000 --codec topk --link-mbit 100 \
        --no-hivemind --kill-member serve_chunk:2

Exit code: 0 if every run completed (the verdicts are in the output), 1 if a run failed, 2 if the
setup is impossible (no root for the emulator, too little memory), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import sys
from pathlib import Path

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.allreduce.faults import FaultPlan
from protocol.codecs import CODEC_NAMES, DEFAULT_TOPK_DENSITY, TopKCodec, takes_density
from scripts.bench.allreduce_summary import (
    HIVEMIND_CODECS,
    Setup,
    evaluate_targets,
    summarize_dtnode,
    summarize_hivemind,
    summary_line,
)
from scripts.bench.peer_hosts import PeerHosts, run_peers
from scripts.common import add_output_flags, exit_on_sigterm, print_json, scratch_dir, write_json
from scripts.tools.wan_emulator import unavailable_reason

WORKERS_DIR = Path(__file__).resolve().parents[1] / "workers"
MEMORY_BUDGET_BYTES = 24 << 30
# Planning estimate of one peer's footprint: interpreter + hivemind (~1 GiB) and up to six fp32
# copies of the vector (hivemind's own, averaged and reference vectors plus check temporaries).
PEER_FIXED_BYTES = 1 << 30
PEER_VECTOR_COPIES = 6
RENDEZVOUS_SECONDS = 120.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--peers", default="4", help="peer counts, comma-separated (e.g. 2,4)")
    parser.add_argument("--elements", default="25000000", help="vector lengths, comma-separated")
    parser.add_argument("--codec", default="int8", help=f"codecs, comma-separated: {', '.join(CODEC_NAMES)}")
    parser.add_argument("--link-mbit", type=float, default=None, help="uplink cap; omit for loopback")
    parser.add_argument("--rounds", type=int, default=3, help="dtnode rounds (the first warms up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the vectors (both implementations)")
    parser.add_argument(
        "--chunk-elements", type=int, default=None, help="numbers per streamed chunk (default: per codec)"
    )
    parser.add_argument(
        "--result",
        choices=("in-place", "copy"),
        default="in-place",
        help="dtnode writes the average into each peer's vector (default; as torch.distributed's all_reduce)"
        " or into a new tensor, which costs one more vector of memory",
    )
    parser.add_argument(
        "--topk-density",
        type=float,
        default=None,
        help=f"topk, topk4: fraction of each block's numbers sent (default {DEFAULT_TOPK_DENSITY})",
    )
    parser.add_argument(
        "--kill-member",
        default=None,
        metavar="POINT[:CHUNK]",
        help="one more round in which the last member is SIGKILLed at this fault point (e.g. serve_chunk:2)",
    )
    parser.add_argument("--no-hivemind", action="store_true", help="skip the hivemind baseline")
    add_output_flags(parser, keep_logs=True)  # --keep-logs: every peer's stdout/stderr
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
    if args.topk_density is not None and not any(takes_density(codec) for codec in args.codec):
        parser.error("--topk-density applies only to a top-k codec (--codec topk or topk4)")
    if args.topk_density is not None and not 0 < args.topk_density <= 1:
        parser.error("--topk-density must be in (0, 1]")
    if args.kill_member is not None:
        point, _, chunk = args.kill_member.partition(":")
        try:
            FaultPlan.parse(f"{point}:0:{chunk or 0}:kill")
        except ValueError as error:
            parser.error(f"--kill-member: {error}")
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


def dtnode_argv(setup: Setup, index: int, address: str, rendezvous: Path) -> list[str]:
    return [
        sys.executable,
        str(WORKERS_DIR / "allreduce_worker.py"),
        *["--index", str(index), "--num-peers", str(setup.num_peers), "--rendezvous", str(rendezvous)],
        *["--host", address, "--elements", str(setup.num_elements), "--codec", setup.codec],
        *["--rounds", str(setup.num_worker_rounds), "--seed", str(setup.seed)],
        *["--deadline-seconds", str(setup.round_deadline_seconds)],
        *["--rendezvous-timeout-seconds", str(RENDEZVOUS_SECONDS)],
        "--lockstep",
        *([] if setup.chunk_num_elements is None else ["--chunk-elements", str(setup.chunk_num_elements)]),
        *(["--in-place"] if setup.in_place else []),
        *([] if setup.topk_density is None else ["--topk-density", str(setup.topk_density)]),
        *(["--fault", setup.fault_plan()] if index == setup.killed_member else []),
    ]


def hivemind_argv(setup: Setup, index: int, address: str, rendezvous: Path, timeout: float) -> list[str]:
    return [
        sys.executable,
        str(WORKERS_DIR / "hivemind_worker.py"),
        *["--index", str(index), "--num-peers", str(setup.num_peers), "--rendezvous", str(rendezvous)],
        *["--host", address, "--elements", str(setup.num_elements), "--codec", HIVEMIND_CODECS[setup.codec]],
        *["--seed", str(setup.seed), "--vector-round", "0"],
        *["--rendezvous-seconds", str(RENDEZVOUS_SECONDS), "--timeout", str(timeout)],
        *["--step-timeout", str(setup.round_deadline_seconds)],
    ]


def run_setup(setup: Setup, with_hivemind: bool, workdir: Path) -> dict[str, object]:
    """Run dtnode then hivemind on the same hosts; one record (see the module docstring)."""
    codec = setup.codec_object
    record: dict[str, object] = {
        "peers": setup.num_peers,
        "codec": setup.codec,
        "topk_density": codec.density if isinstance(codec, TopKCodec) else None,
        "elements": setup.num_elements,
        "link_mbit": setup.link_mbit,
        "rounds": setup.num_rounds,
        "result": "in-place" if setup.in_place else "copy",
        "load_avg_1min_before": round(os.getloadavg()[0], 2),
    }
    with PeerHosts(setup.num_peers, setup.link_mbit) as hosts:
        rendezvous = workdir / "dtnode"
        dtnode_timeout = (
            RENDEZVOUS_SECONDS
            + 60
            + setup.num_worker_rounds * (setup.round_deadline_seconds + setup.check_seconds)
        )
        run = run_peers(
            hosts,
            [dtnode_argv(setup, i, hosts.address(i), rendezvous) for i in range(setup.num_peers)],
            workdir / "dtnode-logs",
            datetime.timedelta(seconds=dtnode_timeout),
            killed=setup.killed_member,
        )
        record.update(summarize_dtnode(setup, run))
        if with_hivemind and setup.codec not in HIVEMIND_CODECS:
            record["hivemind_seconds"] = None
            record["hivemind_skipped"] = f"hivemind has no codec like {setup.codec!r} (no sparse codec)"
        elif with_hivemind:
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    exit_on_sigterm()  # unwinds the `with PeerHosts` blocks, which stop every peer
    common = {
        "link_mbit": args.link_mbit,
        "num_rounds": args.rounds,
        "seed": args.seed,
        "chunk_num_elements": args.chunk_elements,
        "in_place": args.result == "in-place",
        "kill_fault": args.kill_member,
    }
    setups = [
        Setup(
            num_peers=n,
            num_elements=e,
            codec=c,
            topk_density=args.topk_density if takes_density(c) else None,
            **common,  # type: ignore[arg-type]
        )
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
            name = f"n{setup.num_peers}-e{setup.num_elements}-{setup.codec}"
            with scratch_dir(args.keep_logs, name, prefix="bench_allreduce-") as workdir:
                record = run_setup(setup, not args.no_hivemind, workdir)
            records.append(record)
            print_json(record)
            print(summary_line(record), flush=True)
    except KeyboardInterrupt:
        print("bench_allreduce: interrupted; every peer and namespace was stopped", file=sys.stderr)
        return 130
    finally:
        write_json(args.json_out, records)
    failed = any("error" in r or r.get("hivemind_ok") is False for r in records)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
