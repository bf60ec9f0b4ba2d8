"""Run ONE all-reduce peer as a process, for tests and benchmarks (loopback or WAN emulator namespaces).

Each worker binds --host/--port (port 0: any free port), publishes its address in
DIR/peer-<index>.json, waits (bounded) until all --num-peers files exist, then runs --rounds rounds.
Its vector is regenerated from (seed, index, round) in 1M-number blocks, so any process can recompute
every peer's vector and the exact mean without holding them all. After each round it prints one JSON
line:

    {"round", "index", "peer_id", "elements", "codec", "seconds", "cpu_seconds", "bytes_sent",
     "bytes_recv", "max_abs_error", "sha256", "peak_rss_bytes", "baseline_rss_bytes",
     "round_start_rss_bytes", "round_peak_rss_bytes", "vector_bytes", "fell_back", "failures",
     "contributors", "producers"}

cpu_seconds is the CPU time of the whole process (every thread: the event loop, the compute thread,
gRPC's threads) during the allreduce() call. max_abs_error compares with the exact float32 weighted
mean over each part's contributors (computed after the round, block by block; with a sparse codec and
no error feedback, the weighted mean of their decoded payloads instead); sha256 of the result
lets a harness check that survivors agree bit for bit. Memory: peak_rss_bytes is ru_maxrss (the
process's high-water mark) sampled right after the round, before that reference check;
baseline_rss_bytes is the resident size just before the first round's vector was built (interpreter,
torch, gRPC, the server and its threads: everything but the all-reduce's own data), so
peak_rss_bytes - baseline_rss_bytes is what the rounds added, our input vector included;
round_start_rss_bytes is the resident size before this round's vector was built; round_peak_rss_bytes
is the high-water mark from just after this round's vector was built to the end of the round (VmHWM,
reset through /proc/self/clear_refs; equal to peak_rss_bytes where the kernel does not allow the
reset). Before exiting, a worker waits (bounded) for the others to finish so it can still serve its part.

Example (4 peers, 25M numbers, int8):
    for i in 0 1 2 3; do python scripts/workers/allreduce_worker.py --index $i --num-peers 4 \\
        --rendezvous /tmp/rv --elements 25000000 --codec int8 --rounds 3 & done; wait
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import resource
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

from protocol.allreduce import (
    AllReduceConfig,
    AllReduceResult,
    FaultPlan,
    GroupSpec,
    Member,
    SyncAllReducePeer,
)
from protocol.allreduce.memory import release_free_memory
from protocol.allreduce.sparse import is_sparse
from protocol.codecs import CODEC_NAMES, DEFAULT_TOPK_DENSITY, Codec, get_codec, takes_density
from protocol.error_feedback import ErrorFeedback

GENERATION_BLOCK = 1 << 20
LIVENESS_PERIOD_SECONDS = 0.25
logger = logging.getLogger("allreduce_worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--index", type=int, required=True, help="this peer's position in the group (0-based)"
    )
    parser.add_argument("--num-peers", type=int, required=True, help="number of peers in the group")
    parser.add_argument(
        "--rendezvous", type=Path, required=True, help="shared directory for peer-<i>.json files"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind and advertise")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: any free port)")
    parser.add_argument("--elements", type=int, default=1_000_000, help="numbers in the vector")
    parser.add_argument("--codec", choices=CODEC_NAMES, default="int8", help="wire codec")
    parser.add_argument(
        "--block-size", type=int, default=None, help="int8/int4/topk/topk4 block size (default: codec's)"
    )
    parser.add_argument(
        "--topk-density",
        type=float,
        default=None,
        help=f"topk, topk4: fraction of each block's numbers sent (default {DEFAULT_TOPK_DENSITY})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the vectors")
    parser.add_argument("--rounds", type=int, default=1, help="number of rounds")
    parser.add_argument("--deadline-seconds", type=float, default=60.0, help="deadline of each round")
    parser.add_argument(
        "--fault", default=None, help="fault plan POINT:ROUND[:CHUNK][:ACTION] (see faults.py)"
    )
    parser.add_argument("--weighted", action="store_true", help="weight peer i by i + 1 instead of 1")
    parser.add_argument("--bandwidth", type=float, default=1.0, help="relative bandwidth: sizes our part")
    parser.add_argument("--error-feedback", action="store_true", help="keep quantization residuals")
    parser.add_argument("--fixed-vectors", action="store_true", help="same vector every round (for feedback)")
    parser.add_argument(
        "--chunk-elements",
        type=int,
        default=AllReduceConfig.chunk_num_elements,
        help="numbers per streamed chunk",
    )
    parser.add_argument("--stall-seconds", type=float, default=30.0, help="no progress this long = stalled")
    parser.add_argument("--heartbeat-seconds", type=float, default=None, help="default: stall / 5")
    parser.add_argument("--rendezvous-timeout-seconds", type=float, default=120.0, help="wait for peers")
    parser.add_argument("--save-dir", type=Path, default=None, help="save each round's result as .pt here")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--log-level", default="WARNING", help="logging level (stderr)")
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="every peer enters each round together, and checks its result only once all are done",
    )
    parser.add_argument(
        "--keep-payloads",
        action="store_true",
        help="keep the result's encoded bytes and report the SHA-256 of the result rebuilt from them",
    )
    parser.add_argument(
        "--in-place",
        action="store_true",
        help="write the average into the vector itself (saves the result's memory: one vector)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.index < args.num_peers:
        parser.error("--index must be in [0, --num-peers)")
    if args.topk_density is not None and not takes_density(args.codec):
        parser.error(f"--topk-density applies only to a top-k codec, not {args.codec!r}")
    return args


def block_seed(seed: int, index: int, round_id: int, block: int) -> int:
    digest = hashlib.sha256(f"{seed}:{index}:{round_id}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def vector_block(seed: int, index: int, round_id: int, block: int, num_elements: int) -> torch.Tensor:
    """Block `block` of peer `index`'s vector in a round: GENERATION_BLOCK normal numbers (fewer at the end)."""
    start = block * GENERATION_BLOCK
    size = min(GENERATION_BLOCK, num_elements - start)
    generator = torch.Generator().manual_seed(block_seed(seed, index, round_id, block))
    return torch.randn(size, generator=generator)


def make_vector(seed: int, index: int, round_id: int, num_elements: int) -> torch.Tensor:
    """Peer `index`'s whole vector (E,), deterministic in (seed, index, round_id)."""
    return vector_slice(seed, index, round_id, 0, num_elements, num_elements)


def vector_slice(
    seed: int, index: int, round_id: int, low: int, high: int, num_elements: int
) -> torch.Tensor:
    """make_vector(...)[low:high] (high - low,), built from the blocks it overlaps only."""
    piece = torch.empty(high - low)
    for block in range(low // GENERATION_BLOCK, (high + GENERATION_BLOCK - 1) // GENERATION_BLOCK):
        start = block * GENERATION_BLOCK
        values = vector_block(seed, index, round_id, block, num_elements)
        overlap_low, overlap_high = max(low, start), min(high, start + values.numel())
        piece[overlap_low - low : overlap_high - low] = values[overlap_low - start : overlap_high - start]
    return piece


def peer_weight(index: int, weighted: bool) -> float:
    return float(index + 1) if weighted else 1.0


def sparse_mean_error(
    result: AllReduceResult, group: GroupSpec, args: argparse.Namespace, vector_round: int, codec: Codec
) -> float:
    """Sparse codec: max |result - the weighted mean of the contributors' decoded payloads| per part.

    A member's payload for a part is its numbers there encoded chunk by chunk (chunks of
    --chunk-elements from the part's start; no error feedback); the mean sums them in member order
    in float32 and divides by the float32 sum of the weights, as protocol/allreduce/sparse.py says.
    One part at a time, one contributor's slice at a time: about two parts of memory, not N vectors.
    """
    peer_index = {m.peer_id: i for i, m in enumerate(group.members)}
    worst = 0.0
    for part_index, contributors in enumerate(result.contributors):
        start, stop = group.part_bounds[part_index], group.part_bounds[part_index + 1]
        if start == stop or not contributors:
            continue
        total = torch.zeros(stop - start)  # (part,)
        weight_sum = torch.zeros(())
        for i in sorted(peer_index[p] for p in contributors):
            weight = peer_weight(i, args.weighted)
            values = vector_slice(args.seed, i, vector_round, start, stop, group.num_elements)
            for low in range(0, stop - start, args.chunk_elements):
                high = min(stop - start, low + args.chunk_elements)
                decoded = codec.decode(codec.encode(values[low:high]), high - low)
                total[low:high] += decoded * weight
            weight_sum += weight
        error = (result.averaged[start:stop] - total / weight_sum).abs().max()
        worst = max(worst, float(error))
    return worst


def exact_mean_error(
    result: AllReduceResult, group: GroupSpec, args: argparse.Namespace, vector_round: int
) -> float:
    """max |result - exact weighted mean over each part's contributors|, in blocks of GENERATION_BLOCK."""
    peer_index = {m.peer_id: i for i, m in enumerate(group.members)}
    worst = 0.0
    num_blocks = (group.num_elements + GENERATION_BLOCK - 1) // GENERATION_BLOCK
    for block in range(num_blocks):
        start = block * GENERATION_BLOCK
        pieces = {
            i: vector_block(args.seed, i, vector_round, block, group.num_elements)
            for i in range(group.num_members)
        }
        stop = start + next(iter(pieces.values())).numel()
        for part_index, contributors in enumerate(result.contributors):
            low, high = (
                max(start, group.part_bounds[part_index]),
                min(stop, group.part_bounds[part_index + 1]),
            )
            if low >= high or not contributors:
                continue
            total = torch.zeros(high - low)
            weight_sum = torch.zeros(())
            for i in sorted(peer_index[p] for p in contributors):
                weight = peer_weight(i, args.weighted)
                total += pieces[i][low - start : high - start] * weight
                weight_sum += weight
            error = (result.averaged[low:high] - total / weight_sum).abs().max()
            worst = max(worst, float(error))
    return worst


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def current_rss_bytes() -> int:
    """Resident set size now (0 where /proc is unavailable)."""
    try:
        return _proc_status_bytes("VmRSS")
    except (OSError, KeyError):
        return 0


def reset_peak_rss() -> bool:
    """Reset the kernel's resident high-water mark (VmHWM) so a round's own peak can be read; False if
    the kernel does not allow it (then only the process-wide ru_maxrss is reported)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def peak_rss_since_reset() -> int:
    return _proc_status_bytes("VmHWM")


def rendezvous(args: argparse.Namespace, address: str) -> list[dict[str, object]]:
    """Publish our address and wait (bounded) for every peer's."""
    args.rendezvous.mkdir(parents=True, exist_ok=True)
    mine = {
        "index": args.index,
        "peer_id": f"peer-{args.index}",
        "address": address,
        "bandwidth": args.bandwidth,
    }
    tmp = args.rendezvous / f".peer-{args.index}.json.tmp"
    tmp.write_text(json.dumps(mine))
    os.replace(tmp, args.rendezvous / f"peer-{args.index}.json")
    give_up = time.monotonic() + args.rendezvous_timeout_seconds
    paths = [args.rendezvous / f"peer-{i}.json" for i in range(args.num_peers)]
    while not all(p.exists() for p in paths):
        if time.monotonic() > give_up:
            missing = [p.name for p in paths if not p.exists()]
            raise TimeoutError(f"rendezvous timed out; missing {missing}")
        time.sleep(0.05)
    return [json.loads(p.read_text()) for p in paths]


def rebuilt_sha256(result: AllReduceResult, codec: Codec) -> str | None:
    """SHA-256 of the result decoded from its kept payloads alone (None if none were kept)."""
    if result.payloads is None:
        return None
    rebuilt = torch.full_like(result.averaged, float("nan"))
    for chunk in result.payloads:
        codec.decode_into(chunk.payload, rebuilt[chunk.offset : chunk.offset + chunk.num_elements])
    return hashlib.sha256(rebuilt.numpy().data).hexdigest()


def is_listening(address: str) -> bool:
    """Whether something accepts TCP connections at host:port (a killed peer refuses them)."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def barrier(args: argparse.Namespace, name: str, peers: list[dict[str, object]]) -> bool:
    """Wait (bounded by the round deadline) until every live peer reached `name`; False if one never did.

    With --lockstep the benchmark times the all-reduce alone: no peer is still generating its vector
    or checking the previous result (CPU-heavy work of the benchmark, not of the all-reduce) while
    the others run the round on the same cores. A peer killed mid-round (--fault) never arrives: once
    it refuses connections (checked every LIVENESS_PERIOD_SECONDS) it is no longer waited for.
    """
    (args.rendezvous / f"{name}-{args.index}").touch()
    give_up = time.monotonic() + args.deadline_seconds
    waiting = {int(p["index"]): str(p["address"]) for p in peers}  # type: ignore[call-overload]
    next_liveness_check = time.monotonic() + LIVENESS_PERIOD_SECONDS
    while waiting:
        waiting = {i: a for i, a in waiting.items() if not (args.rendezvous / f"{name}-{i}").exists()}
        if waiting and time.monotonic() > next_liveness_check:
            waiting = {i: a for i, a in waiting.items() if is_listening(a)}
            next_liveness_check = time.monotonic() + LIVENESS_PERIOD_SECONDS
        if waiting and time.monotonic() > give_up:
            logging.warning("barrier %s: gave up waiting for peers %s", name, sorted(waiting))
            return False
        time.sleep(0.002)
    return True


def wait_for_others(args: argparse.Namespace, peers: list[dict[str, object]]) -> None:
    """Say we are done; until the others are done or gone (bounded), keep serving our parts to them."""
    (args.rendezvous / f"done-{args.index}").touch()
    give_up = time.monotonic() + args.deadline_seconds
    waiting = {int(p["index"]): str(p["address"]) for p in peers if p["index"] != args.index}  # type: ignore[call-overload]
    while waiting and time.monotonic() < give_up:
        for index, address in list(waiting.items()):
            if (args.rendezvous / f"done-{index}").exists() or not is_listening(address):
                del waiting[index]
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format=f"[peer {args.index}] %(message)s")
    torch.set_num_threads(args.torch_threads)
    stall = timedelta(seconds=args.stall_seconds)
    heartbeat = timedelta(seconds=args.heartbeat_seconds) if args.heartbeat_seconds else stall / 5
    config = AllReduceConfig(
        chunk_num_elements=args.chunk_elements,
        stall_timeout=stall,
        heartbeat_interval=heartbeat,
        keep_payloads=args.keep_payloads,
    )
    fault_plan = FaultPlan.parse(args.fault) if args.fault else None
    codec = get_codec(args.codec, args.block_size, args.topk_density)
    error_feedback = ErrorFeedback(args.elements) if args.error_feedback else None
    peer = SyncAllReducePeer(host=args.host, port=args.port, config=config, fault_plan=fault_plan)
    try:
        peers = rendezvous(args, f"{args.host}:{peer.port}")
        baseline_rss_bytes = current_rss_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        members = [Member(peer_id=str(p["peer_id"]), address=str(p["address"])) for p in peers]
        bandwidths = [float(p["bandwidth"]) for p in peers]  # type: ignore[arg-type]
        for round_id in range(args.rounds):
            vector_round = 0 if args.fixed_vectors else round_id
            round_start_rss_bytes = current_rss_bytes()
            vector = make_vector(args.seed, args.index, vector_round, args.elements)
            round_hwm_reset = reset_peak_rss()
            group = GroupSpec.build(
                round_id=round_id, members=members, num_elements=args.elements, bandwidths=bandwidths
            )
            if args.lockstep:
                barrier(args, f"start-r{round_id}", peers)
            cpu_start = time.process_time()
            result = peer.allreduce(
                vector,
                group=group,
                my_peer_id=members[args.index].peer_id,
                weight=peer_weight(args.index, args.weighted),
                codec=codec,
                error_feedback=error_feedback,
                deadline=timedelta(seconds=args.deadline_seconds),
                in_place=args.in_place,
            )
            cpu_seconds = time.process_time() - cpu_start
            if args.lockstep:
                barrier(args, f"end-r{round_id}", peers)
            peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            round_peak_rss_bytes = peak_rss_since_reset() if round_hwm_reset else peak_rss_bytes
            if args.save_dir is not None:
                args.save_dir.mkdir(parents=True, exist_ok=True)
                torch.save(result.averaged, args.save_dir / f"result-r{round_id}-i{args.index}.pt")
            del vector
            record = {
                "round": round_id,
                "index": args.index,
                "peer_id": members[args.index].peer_id,
                "elements": args.elements,
                "codec": args.codec,
                "seconds": round(result.seconds, 4),
                "cpu_seconds": round(cpu_seconds, 4),
                "bytes_sent": result.bytes_sent,
                "bytes_recv": result.bytes_recv,
                "max_abs_error": sparse_mean_error(result, group, args, vector_round, codec)
                if is_sparse(codec) and error_feedback is None
                else exact_mean_error(result, group, args, vector_round),
                "sha256": hashlib.sha256(result.averaged.numpy().data).hexdigest(),
                "peak_rss_bytes": peak_rss_bytes,
                "baseline_rss_bytes": baseline_rss_bytes,
                "round_start_rss_bytes": round_start_rss_bytes,
                "round_peak_rss_bytes": round_peak_rss_bytes,
                "vector_bytes": 4 * args.elements,
                "fell_back": result.fell_back,
                "failures": result.failures,
                "contributors": result.contributors,
                "producers": result.producers,
                "payloads_sha256": rebuilt_sha256(result, codec),
            }
            print(json.dumps(record), flush=True)
            del result  # the next round's vectors must not stack on this one's result
            release_free_memory()
        wait_for_others(args, peers)
    finally:
        peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
