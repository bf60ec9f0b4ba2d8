"""Step 2 of a fetch: stream every range of the chosen snapshot from several sources at once.

Every tensor is cut into block-aligned ranges, all in one queue. `max_parallel` workers each take
the next range and the least-loaded usable source and stream the range into the preallocated
buffer, checking each block against the manifest's SHA-256 as soon as it is complete (in a thread,
so the event loop keeps moving bytes). Faster sources come back for more sooner, so they serve more
ranges. Verified blocks are fed in order to each tensor's whole SHA-256 while the transfer goes on.

When a stream fails, the rest of its range from the first unverified block goes back to the front
of the queue for another source, and the source is dropped for the rest of the fetch, because:
  - it sent nothing for `stall_timeout` (stalled), or its stream broke (died),
  - a block did not match its hash, or the stream was malformed (corrupt: blacklisted),
  - it answered NOT_FOUND (it moved on to a newer snapshot) or any other error.
RESOURCE_EXHAUSTED only means "busy": the range is re-queued; if our own other streams to that source
fill it, we open no more than that many to it (plus one more after each success, to probe), and
otherwise we ask it again after a growing backoff.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio

from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.statesync.assembly import Assembly, ByteRange, range_bytes_for, split_ranges
from protocol.statesync.config import MAX_CHUNKS_PER_RANGE
from protocol.statesync.errors import StateSyncError
from protocol.statesync.manifest import Manifest
from protocol.statesync.sources import Source, describe_exclusions

logger = logging.getLogger(__name__)


class RangeFailed(Exception):
    """A range stream ended before the range was verified; `busy` means the source only said "later"."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.busy = busy


class RangeTransfer:
    """Step 2 of one fetch: the range queue, the workers, and the bookkeeping of sources."""

    def __init__(
        self,
        manifest: Manifest,
        sources: list[Source],
        *,
        max_parallel: int,
        chunk_bytes: int,
        range_bytes: int,
        stall_timeout: timedelta,
        executor: ThreadPoolExecutor,
        deadline: float,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.manifest = manifest
        self.on_progress = on_progress
        """Called on the loop with (bytes verified, bytes in all) each time a block is verified."""
        self.sources = sources
        self.assembly = Assembly(manifest)
        # Ranges every source serves, in no more chunks than a provider accepts (the smallest chunks
        # any source sends make the most).
        served = [source.manifest for source in sources if source.manifest]
        smallest_chunk = min(min(chunk_bytes, manifest.max_chunk_bytes) for manifest in served)
        max_range_bytes = min(
            smallest_chunk * MAX_CHUNKS_PER_RANGE, *(manifest.max_range_bytes for manifest in served)
        )
        range_bytes = range_bytes_for(
            range_bytes,
            block_bytes=manifest.block_bytes,
            max_range_bytes=max_range_bytes,
            num_bytes=manifest.num_bytes,
            # Streams, not sources, fetch at once: more ranges than that per stream only add round trips.
            num_sources=min(len(served), max_parallel),
        )
        self.queue = collections.deque(split_ranges(manifest, range_bytes))
        self.max_parallel = max_parallel
        self.chunk_bytes = chunk_bytes
        self.stall_seconds = stall_timeout.total_seconds()
        self.executor = executor
        self.deadline = deadline
        """time.monotonic() by which the whole fetch must be done."""
        self.num_in_flight = 0
        self.changed = asyncio.Condition()
        self.hash_tasks: dict[str, asyncio.Task[None]] = {}
        """Per tensor, the task feeding its verified bytes, in order, to its whole-tensor SHA-256."""

    async def run(self) -> None:
        """Fetch and verify every range; StateSyncError once no usable source is left."""
        workers = [
            asyncio.create_task(self._worker()) for _ in range(min(self.max_parallel, len(self.queue)))
        ]
        try:
            await asyncio.gather(*workers)
            await asyncio.gather(*self.hash_tasks.values())
        finally:
            tasks = [*workers, *self.hash_tasks.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        assert self.assembly.num_bytes_verified == self.assembly.num_bytes

    def _feed_tensor_hash(self, name: str) -> None:
        """Make sure a task is feeding tensor `name`'s newly verified bytes to its whole-tensor hash."""
        task = self.hash_tasks.get(name)
        if task is None or task.done():
            self.hash_tasks[name] = asyncio.create_task(self._hash_forward(name))

    async def _hash_forward(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        while (span := self.assembly.take_hash_span(name)) is not None:
            await loop.run_in_executor(self.executor, self.assembly.hash_span, name, *span)

    def _pick_source(self, now: float) -> Source | None:
        """The usable source with the fewest open streams (then the fewest ranges so far)."""
        usable = [source for source in self.sources if source.usable(now)]
        return min(usable, key=lambda s: (s.num_in_flight, s.num_ranges_started), default=None)

    async def _next_job(self) -> tuple[ByteRange, Source] | None:
        """The next range and who to ask for it; None once everything is verified."""
        async with self.changed:
            while True:
                now = time.monotonic()
                if not self.queue and self.num_in_flight == 0:
                    return None
                if self.queue and (source := self._pick_source(now)) is not None:
                    source.num_in_flight += 1
                    source.num_ranges_started += 1
                    self.num_in_flight += 1
                    return self.queue.popleft(), source
                alive = [source for source in self.sources if not source.excluded]
                if self.queue and not alive:
                    raise StateSyncError(
                        f"every source failed with {self.progress()}: {describe_exclusions(self.sources)}"
                    )
                # Wait for a stream to end, or for the first busy source's backoff to pass.
                wake = min((s.busy_until for s in alive if s.busy_until > now), default=None)
                try:
                    async with asyncio.timeout(None if wake is None else wake - now):
                        await self.changed.wait()
                except TimeoutError:
                    pass  # a busy source may be asked again now

    async def _worker(self) -> None:
        while (job := await self._next_job()) is not None:
            byte_range, source = job
            verified_end, failure = await self._fetch(byte_range, source)
            async with self.changed:
                source.num_in_flight -= 1
                self.num_in_flight -= 1
                if failure is None:
                    source.mark_served()
                else:
                    if (rest := byte_range.remaining_after(verified_end)) is not None:
                        self.queue.appendleft(rest)
                    if failure.busy:
                        source.mark_busy(time.monotonic())
                    elif not source.excluded:
                        source.excluded = str(failure)
                        logger.warning("dropping state source %s: %s", source.address, failure)
                self.changed.notify_all()

    async def _fetch(self, byte_range: ByteRange, source: Source) -> tuple[int, RangeFailed | None]:
        """Stream one range from one source into place, checking each block as it completes.

        Returns the end of the last verified block (the range's end on success) and what went wrong.
        """
        name = byte_range.tensor
        assert source.manifest is not None
        chunk_limit = min(self.chunk_bytes, source.manifest.max_chunk_bytes)
        request = pb.FetchRangeRequest(
            state_id=self.manifest.state_id,
            tensor_name=name,
            offset=byte_range.start,
            length=byte_range.num_bytes,
            max_chunk_bytes=chunk_limit,
        )
        call = source.stub.FetchRange(request, timeout=max(0.001, self.deadline - time.monotonic()))
        position = verified_end = byte_range.start
        loop = asyncio.get_running_loop()
        read: asyncio.Future[Any] | None = None
        try:
            while True:
                read = asyncio.ensure_future(call.read())
                if not await self._arrives(read, source):
                    return verified_end, RangeFailed(f"stalled: sent nothing for {self.stall_seconds:.1f}s")
                message = read.result()
                source.last_message_at = time.monotonic()
                if message is grpc.aio.EOF:
                    break
                data = message.data
                if message.offset != position or not data or len(data) > chunk_limit:
                    return verified_end, RangeFailed(
                        f"malformed stream: chunk of {len(data)} bytes at {message.offset}, expected {position}"
                    )
                if position + len(data) > byte_range.end:
                    return verified_end, RangeFailed("malformed stream: more bytes than the range holds")
                self.assembly.write(name, position, data)
                position += len(data)
                # Check every block this chunk completed, in a thread so the loop keeps moving bytes.
                while (
                    verified_end < byte_range.end
                    and (end := self.assembly.block_end(name, verified_end)) <= position
                ):
                    if not await loop.run_in_executor(
                        self.executor, self.assembly.block_matches, name, verified_end
                    ):
                        block_index = verified_end // self.manifest.block_bytes
                        return verified_end, RangeFailed(
                            f"corrupt: block {block_index} of {name!r} fails its SHA-256"
                        )
                    source.num_bytes_verified += end - verified_end
                    self.assembly.mark_verified(name, verified_end, end)
                    self._feed_tensor_hash(name)
                    if self.on_progress is not None:
                        self.on_progress(self.assembly.num_bytes_verified, self.assembly.num_bytes)
                    verified_end = end
        except grpc.aio.AioRpcError as error:
            code = error.code()
            busy = code is grpc.StatusCode.RESOURCE_EXHAUSTED
            return verified_end, RangeFailed(f"FetchRange: {code.name}: {error.details()}", busy=busy)
        finally:
            if not call.done():
                call.cancel()
            if read is not None and not read.done():
                read.cancel()
                await asyncio.gather(read, return_exceptions=True)
        if position != byte_range.end:
            return verified_end, RangeFailed(f"stream ended early at byte {position} of {byte_range}")
        return verified_end, None

    async def _arrives(self, read: asyncio.Future[Any], source: Source) -> bool:
        """Wait for a stream's next message; False once its source sent nothing, on any of our
        streams, for the stall window. A stream of a live source may wait longer, up to one window
        per stream of ours open to it: the source's bytes share one link, and a stream opened behind
        bytes the source already wrote for our other streams (a slow link's queue) waits for them,
        while they prove the source alive (found with many ranges per source on a slow link: the live
        source of two was dropped as stalled, and the fetch failed)."""
        started = time.monotonic()
        give_up = started + self.stall_seconds * max(1, source.num_in_flight)
        while True:
            heard = max(started, source.last_message_at)
            wait = min(heard + self.stall_seconds, give_up) - time.monotonic()
            if wait <= 0:
                return False
            done, _ = await asyncio.wait({read}, timeout=wait)
            if done:
                return True

    def progress(self) -> str:
        return f"{self.assembly.num_bytes_verified} of {self.assembly.num_bytes} bytes verified"
