"""Loopback throughput of fetch_state: one fetcher, 1..N provider processes, a ~100 MB snapshot.

Not a test (pytest does not collect it). Every provider is its own process (own event loop, own
GIL) serving the same snapshot, regenerated from a seed; the fetcher runs in this process. Prints
one JSON line per configuration with the best and median of --repeats fetches, and the CPU time
the fetcher process spent (all its threads: gRPC, copies, hashing).

    python -m tests.protocol.statesync.bench_throughput --megabytes 100 --providers 1 3
    python -m tests.protocol.statesync.bench_throughput --chunk-kib 4096   # the chunks before 2026-11-28
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import statistics
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import uvloop

from protocol.statesync import (
    FetchOptions,
    Snapshot,
    StateSyncConfig,
    StateSyncServer,
    fetch_state_with_report,
)
from protocol.statesync.config import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_RANGE_BYTES,
    MAX_CHUNKS_PER_RANGE,
    MESSAGE_OVERHEAD_BYTES,
)

MiB = 1 << 20


def build_snapshot(megabytes: int) -> Snapshot:
    """fp32 params (80 %) and momentum (20 %), like the daemon's state; the same in every process."""
    generator = torch.Generator().manual_seed(0)
    num_numbers = megabytes * 1_000_000 // 4
    params = torch.randn(num_numbers * 4 // 5, generator=generator)
    momentum = torch.randn(num_numbers - params.numel(), generator=generator)
    return Snapshot(
        round_id=1,
        state_id="bench",
        tensors={"global_params": params, "outer_momentum": momentum},
        metadata=b'{"round": 1}',
        copy=False,
    )


def serve(megabytes: int, chunk_bytes: int, pipe: Connection) -> None:
    """A provider process: serve the snapshot, in chunks of up to `chunk_bytes`, until the parent
    sends anything on the pipe."""
    config = StateSyncConfig(
        max_chunk_bytes=chunk_bytes,
        max_range_bytes=min(256 * MiB, chunk_bytes * MAX_CHUNKS_PER_RANGE),
        max_message_bytes=max(16 * MiB, chunk_bytes + MESSAGE_OVERHEAD_BYTES),
    )

    async def main() -> None:
        server = await StateSyncServer.start(host="127.0.0.1", port=0, config=config)
        server.provider.publish(build_snapshot(megabytes))
        pipe.send(server.address)
        while not pipe.poll():
            await uvloop_sleep(0.1)
        await server.stop(timedelta(0))

    uvloop.run(main())


async def uvloop_sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)  # only the idle provider polls its pipe; nothing is synchronised by it


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--megabytes", type=int, default=100, help="snapshot size in MB (1e6 bytes)")
    parser.add_argument("--providers", type=int, nargs="+", default=[1, 3], help="provider counts to compare")
    parser.add_argument("--repeats", type=int, default=3, help="fetches per configuration")
    parser.add_argument("--max-parallel", type=int, default=4, help="fetch_state max_parallel")
    parser.add_argument(
        "--chunk-kib",
        type=int,
        default=DEFAULT_CHUNK_BYTES // 1024,
        help="chunk size in KiB (asked and served)",
    )
    parser.add_argument("--range-mib", type=int, default=DEFAULT_RANGE_BYTES // MiB, help="range size in MiB")
    args = parser.parse_args()

    context = multiprocessing.get_context("spawn")
    processes, pipes, addresses = [], [], []
    for _ in range(max(args.providers)):
        parent, child = context.Pipe()
        process = context.Process(
            target=serve, args=(args.megabytes, args.chunk_kib * 1024, child), daemon=True
        )
        process.start()
        processes.append(process)
        pipes.append(parent)
    try:
        for pipe in pipes:
            if not pipe.poll(120):
                raise TimeoutError("a provider did not start within 120 s")
            addresses.append(pipe.recv())
        for num_providers in args.providers:
            seconds, cpu_seconds = [], []
            for _ in range(args.repeats):
                usage = resource.getrusage(resource.RUSAGE_SELF)
                started = time.perf_counter()
                report = uvloop.run(
                    fetch_state_with_report(
                        addresses[:num_providers],
                        expected_state_id="bench",
                        deadline=timedelta(minutes=5),
                        options=FetchOptions(
                            max_parallel=args.max_parallel,
                            chunk_bytes=args.chunk_kib * 1024,
                            range_bytes=args.range_mib * MiB,
                        ),
                    )
                )
                seconds.append(time.perf_counter() - started)
                after = resource.getrusage(resource.RUSAGE_SELF)
                cpu_seconds.append(after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime)
                assert not report.excluded, report.excluded
            megabytes = report.snapshot.num_bytes / 1e6
            print(
                json.dumps(
                    {
                        "providers": num_providers,
                        "chunk_kib": args.chunk_kib,
                        "range_mib": args.range_mib,
                        "megabytes": round(megabytes, 1),
                        "best_seconds": round(min(seconds), 3),
                        "median_seconds": round(statistics.median(seconds), 3),
                        "best_mb_per_s": round(megabytes / min(seconds), 1),
                        "median_mb_per_s": round(megabytes / statistics.median(seconds), 1),
                        "fetcher_cpu_seconds_median": round(statistics.median(cpu_seconds), 3),
                        "bytes_by_source_last": list(report.bytes_by_source.values()),
                    }
                ),
                flush=True,
            )
    finally:
        for pipe in pipes:
            pipe.send("stop")
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()


if __name__ == "__main__":
    main()
