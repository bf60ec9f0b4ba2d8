"""fetch_state: assemble a verified snapshot from several sources in parallel, surviving their failures.

    snapshot = await fetch_state(["10.0.0.2:7000", "10.0.0.3:7000"], expected_state_id=param_hash,
                                 deadline=timedelta(minutes=10),
                                 options=FetchOptions(max_parallel=4, chunk_bytes=64 << 10))

Step 1, manifests (sources.py): ask every source which snapshot it serves; keep those that agree on
        the one we want (`expected_state_id`, or the newest offered when None).
Step 2, ranges (transfer.py): cut every tensor into block-aligned ranges; `options.max_parallel` streams
        fetch them from the least-loaded sources into preallocated buffers, checking every block
        against the manifest's SHA-256 as it completes. The rest of a range whose source died,
        stalled, lied or moved on to a newer snapshot goes to another source.
Step 3, check: every tensor's whole SHA-256 (fed block by block during step 2) must match the
        manifest. The caller (the daemon) can compare `snapshot.sha256("global_params")` with the
        swarm's param_hash.

The fetch raises StateSyncError when no usable source is left or the deadline passes, with a line per
source saying why it was dropped. A node that fell behind re-syncs with the same call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

from protocol.auth.channels import SwarmAuth, open_channel
from protocol.gen.dtnode.v1 import statesync_pb2_grpc as pb_grpc
from protocol.statesync.assembly import Assembly
from protocol.statesync.config import DEFAULT_FETCH_OPTIONS, FetchOptions, fetcher_options
from protocol.statesync.errors import StateSyncError
from protocol.statesync.snapshot import Snapshot
from protocol.statesync.sources import Source, choose_snapshot, describe_exclusions, get_manifests
from protocol.statesync.transfer import RangeTransfer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class FetchReport:
    """A finished fetch: the snapshot, and who delivered what."""

    snapshot: Snapshot
    bytes_by_source: dict[str, int]
    """Verified bytes each source delivered (0 for sources never used or dropped at once)."""
    excluded: dict[str, str]
    """Sources dropped before or during the fetch, and why."""
    elapsed: timedelta


def _verify_tensors(assembly: Assembly) -> None:
    """Step 3: every tensor's whole SHA-256 (fed during the transfer) must match the manifest."""
    for name, entry in assembly.manifest.entries.items():
        if assembly.tensor_sha256(name) != entry.sha256:
            raise StateSyncError(
                f"tensor {name!r} matches every block hash of the manifest but not its whole SHA-256: "
                "the sources advertised an inconsistent manifest"
            )


def _check_sources(sources: list[str], deadline: timedelta) -> None:
    if not sources:
        raise ValueError("fetch_state needs at least one source")
    if len(set(sources)) != len(sources):
        raise ValueError(f"sources are repeated: {sources}")
    if deadline <= timedelta(0):
        raise ValueError(f"deadline must be positive, got {deadline}")


async def fetch_state_with_report(
    sources: list[str],
    *,
    expected_state_id: str | None,
    deadline: timedelta,
    options: FetchOptions = DEFAULT_FETCH_OPTIONS,
    auth: SwarmAuth | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> FetchReport:
    """`fetch_state`, also saying which source delivered how many bytes and which were dropped;
    ``on_progress(bytes verified, bytes in all)`` is called on the loop as blocks are verified."""
    _check_sources(sources, deadline)
    started = time.monotonic()
    stall_timeout = options.stall_timeout
    channel_options = fetcher_options(chunk_bytes=options.chunk_bytes, stall_timeout=stall_timeout)
    channels = [open_channel(address, options=channel_options, auth=auth) for address in sources]
    states = [
        Source(address, pb_grpc.StateSyncStub(channel))
        for address, channel in zip(sources, channels, strict=True)
    ]
    executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="statesync-hash")
    transfer: RangeTransfer | None = None
    try:
        async with asyncio.timeout(deadline.total_seconds()):
            await get_manifests(
                states, expected_state_id or "", stall_timeout, started + deadline.total_seconds()
            )
            manifest = choose_snapshot(states, expected_state_id)
            serving = [source for source in states if not source.excluded]
            transfer = RangeTransfer(
                manifest,
                serving,
                max_parallel=options.max_parallel,
                chunk_bytes=options.chunk_bytes,
                range_bytes=options.range_bytes,
                stall_timeout=stall_timeout,
                executor=executor,
                deadline=started + deadline.total_seconds(),
                on_progress=on_progress,
            )
            await transfer.run()
            _verify_tensors(transfer.assembly)
    except TimeoutError as error:
        progress = transfer.progress() if transfer is not None else "no manifest chosen"
        raise StateSyncError(
            f"state sync did not finish within {deadline} ({progress}); {describe_exclusions(states)}"
        ) from error
    finally:
        await asyncio.gather(*(channel.close(grace=None) for channel in channels))
        executor.shutdown(wait=False, cancel_futures=True)
    snapshot = Snapshot.from_verified(
        round_id=manifest.round_id,
        state_id=manifest.state_id,
        tensors=transfer.assembly.tensors(),
        metadata=manifest.metadata,
        block_bytes=manifest.block_bytes,
        entries=dict(manifest.entries),
    )
    elapsed = timedelta(seconds=time.monotonic() - started)
    report = FetchReport(
        snapshot=snapshot,
        bytes_by_source={source.address: source.num_bytes_verified for source in states},
        excluded={source.address: source.excluded for source in states if source.excluded},
        elapsed=elapsed,
    )
    megabytes = snapshot.num_bytes / 1e6
    logger.info(
        "fetched %r: %.1f MB in %.2fs (%.1f MB/s) from %s; dropped %s",
        snapshot, megabytes, elapsed.total_seconds(), megabytes / max(elapsed.total_seconds(), 1e-9),
        report.bytes_by_source, report.excluded or "none",
    )  # fmt: skip
    return report


async def fetch_state(
    sources: list[str],
    *,
    expected_state_id: str | None,
    deadline: timedelta,
    options: FetchOptions = DEFAULT_FETCH_OPTIONS,
    auth: SwarmAuth | None = None,
) -> Snapshot:
    """Fetch the snapshot `expected_state_id` (None: the newest the sources agree on) from `sources`
    (host:port), verified block by block and tensor by tensor; StateSyncError if that cannot be done
    within `deadline`.

    options: how the snapshot moves (streams, chunk and range sizes, stall timeout: ``FetchOptions``).
    auth:    presented on every call, as a closed swarm's sources require (``protocol.auth``).
    """
    report = await fetch_state_with_report(
        sources, expected_state_id=expected_state_id, deadline=deadline, options=options, auth=auth
    )
    return report.snapshot
