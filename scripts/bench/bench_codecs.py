"""Measure each codec's encode and decode throughput on one core, the way the all-reduce uses them.

The vector is processed in chunks of --chunk-elements numbers (the all-reduce streams chunks of this
size): encoding includes turning the payload into the `bytes` a protobuf message carries, decoding
reads such bytes into a preallocated output. Throughput is fp32 input bytes per second; the best of
--repeats runs is reported (other processes on the machine only ever make a run slower), by wall time
and, beside it, by this thread's CPU time (what a run costs when the machine's cores are shared).
Prints one JSON object per codec, then a one-line summary, e.g.:

    python scripts/bench/bench_codecs.py --elements 25000000
    python scripts/bench/bench_codecs.py --elements 10000000 --codecs topk --topk-density 0.015 --min-gbps 1

--min-gbps makes it a verdict: exit 1 if any codec's encode+decode (wall) is slower.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from protocol.allreduce import AllReduceConfig
from protocol.codecs import CODEC_NAMES, DEFAULT_BLOCK_SIZES, Codec, get_codec, takes_density


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--elements", type=int, default=25_000_000, help="numbers in the vector")
    parser.add_argument(
        "--chunk-elements", type=int, default=AllReduceConfig.chunk_num_elements, help="numbers per chunk"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per codec (best is kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 = per core)")
    parser.add_argument("--codecs", nargs="+", default=list(CODEC_NAMES), choices=CODEC_NAMES)
    parser.add_argument("--block-size", type=int, default=None, help="int8/int4/topk/topk4 block size")
    parser.add_argument(
        "--topk-density",
        type=float,
        default=None,
        help="topk, topk4: fraction of each block sent (default: the codec's)",
    )
    parser.add_argument(
        "--min-gbps",
        type=float,
        default=None,
        help="exit 1 if a codec's encode+decode GB/s (wall) is below this",
    )
    return parser.parse_args()


def time_codec(codec: Codec, vector: torch.Tensor, chunk: int, repeats: int) -> dict[str, float]:
    """Best encode and decode seconds over `repeats` passes of the whole vector, chunk by chunk."""
    output = torch.empty_like(vector)
    starts = range(0, vector.numel(), chunk)
    payloads = [codec.encode(vector[s : s + chunk]).numpy().tobytes() for s in starts]  # decode inputs
    best_encode = best_decode = best_encode_cpu = best_decode_cpu = float("inf")
    for _ in range(repeats):
        began, began_cpu = time.perf_counter(), time.thread_time()
        for s in starts:
            codec.encode(vector[s : s + chunk]).numpy().tobytes()
        best_encode = min(best_encode, time.perf_counter() - began)
        best_encode_cpu = min(best_encode_cpu, time.thread_time() - began_cpu)
        began, began_cpu = time.perf_counter(), time.thread_time()
        for s, payload in zip(starts, payloads, strict=True):
            codec.decode_into(payload, output[s : s + chunk])
        best_decode = min(best_decode, time.perf_counter() - began)
        best_decode_cpu = min(best_decode_cpu, time.thread_time() - began_cpu)
    error = (output - vector).abs()
    bound = torch.cat([codec.error_bound(vector[s : s + chunk]) for s in starts])
    encoded_bytes = sum(len(p) for p in payloads)
    input_gb = 4 * vector.numel() / 1e9
    return {
        "encode_gbps": input_gb / best_encode,
        "decode_gbps": input_gb / best_decode,
        "encode_decode_gbps": input_gb / (best_encode + best_decode),
        "encode_decode_cpu_gbps": input_gb / (best_encode_cpu + best_decode_cpu),
        "compression": 4 * vector.numel() / encoded_bytes,
        "max_abs_error": float(error.max()),
        "within_bound": bool(torch.all(error <= bound)),
    }


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    vector = torch.randn(args.elements, generator=torch.Generator().manual_seed(0))
    summary, slow = [], []
    for name in args.codecs:
        codec = get_codec(
            name,
            args.block_size if name in DEFAULT_BLOCK_SIZES else None,
            args.topk_density if takes_density(name) else None,
        )
        stats = time_codec(codec, vector, args.chunk_elements, args.repeats)
        density = {"density": codec.density} if hasattr(codec, "density") else {}
        record = {"codec": name, "block_size": codec.block_size, **density, "elements": args.elements,
                  "threads": args.threads, **{k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}}  # fmt: skip
        print(json.dumps(record), flush=True)
        summary.append(
            f"{name} {stats['encode_decode_gbps']:.2f} (cpu {stats['encode_decode_cpu_gbps']:.2f})"
        )
        if args.min_gbps is not None and stats["encode_decode_gbps"] < args.min_gbps:
            slow.append(name)
    verdict = "" if args.min_gbps is None else f"; below {args.min_gbps} GB/s: {', '.join(slow) or 'none'}"
    print(f"encode+decode GB/s of fp32 input, {args.threads} thread(s): " + ", ".join(summary) + verdict)
    if slow:
        sys.exit(1)


if __name__ == "__main__":
    main()
