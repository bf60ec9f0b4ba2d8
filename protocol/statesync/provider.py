"""StateProvider: the answering side of state sync, a grpc.aio servicer over the snapshots a node keeps.

The daemon calls `publish(snapshot)` after every outer round. The provider keeps the newest
`num_snapshots_kept` snapshots (by default the current and the previous one): a fetcher that started
on the previous snapshot can still ask for its remaining ranges, and a stream already under way keeps
its own reference to its snapshot, so it always finishes. One older snapshot stays served while a
fetcher still takes it (a transfer of it runs, or one ended within the stall timeout): on a slow link a
fetch can outlast two rounds, and dropping its snapshot at 98% made the fetcher start again on a newer
one. Other older snapshots get NOT_FOUND and the fetcher moves on to another source. A snapshot's companions (the daemon's round means) may outlive it:
those of the newest `num_companions_kept` publishes are served.

Serving is bounded: at most `max_concurrent_transfers` FetchRange streams at once (one more gets
RESOURCE_EXHAUSTED at once rather than queueing behind the others), ranges of at most
`max_range_bytes`, chunks of at most `max_chunk_bytes`, and a fetcher that stops reading for
`stall_timeout` is dropped. Every refusal is one gRPC status and one log line; the provider goes on
serving everyone else.

Host it on any grpc.aio server with `add_state_sync_to_server(server, provider)` (the daemon puts it
next to the all-reduce) or on its own with `protocol.statesync.server.StateSyncServer`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence

import grpc
import grpc.aio

from protocol.errors import ProtocolError
from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.gen.dtnode.v1 import statesync_pb2_grpc as pb_grpc
from protocol.lenient import Malformed, lenient
from protocol.statesync.config import MAX_CHUNKS_PER_RANGE, MESSAGE_OVERHEAD_BYTES, StateSyncConfig
from protocol.statesync.faults import ServeFaultPlan, flip_first_byte
from protocol.statesync.manifest import to_manifest
from protocol.statesync.snapshot import Snapshot, byte_view

logger = logging.getLogger(__name__)

_Publishes = tuple[tuple[tuple[Snapshot, pb.StateManifest], ...], ...]
"""Per publish, (snapshot, its manifest) then its companions' (or its companions' only)."""

SERVICE_NAME = "dtnode.v1.StateSync"
# Refusals that are normal traffic (a fetcher will just ask someone else or retry); the rest mean a
# fetcher misbehaved.
_ROUTINE_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class StateProvider(pb_grpc.StateSyncServicer):
    """Serves GetManifest and FetchRange for the snapshots published to it.

    `publish` may be called from any thread (it swaps one immutable tuple); everything else runs on
    the event loop of the server hosting the provider.
    """

    def __init__(
        self, config: StateSyncConfig | None = None, *, fault_plan: ServeFaultPlan | None = None
    ) -> None:
        self.config = config or StateSyncConfig()
        self.fault_plan = fault_plan
        # Newest first: per publish, (snapshot, its manifest) then its companions'. Replaced as a
        # whole, never mutated.
        # (the publishes kept whole, the companions of older ones (num_companions_kept), at most one
        # older snapshot still being fetched), each newest first. One tuple replaced as a whole, never
        # mutated: a reader on another thread sees one publish's view of all three.
        self._held: tuple[_Publishes, _Publishes, _Publishes] = ((), (), ())
        self._num_active_transfers = 0
        self._closed = asyncio.Event()
        self._resumed = asyncio.Event()
        self.fault_fired = asyncio.Event()
        """Set when the fault plan fires (tests await it to act at exactly that point)."""
        self._fault_state = ""  # the persistent fault action once fired, "" before
        self._num_reached = {"manifest": 0, "chunk": 0}
        self.num_chunks_served = 0
        self.num_bytes_served = 0
        self.num_ranges_served = 0
        """Completed FetchRange streams."""
        self.last_served: dict[str, float] = {}
        """State id -> ``time.monotonic()`` when our last transfer of it ended: with the transfers
        running (``_transfers_of``), a peer fetching our state (to join our lineage) is seen at once,
        whatever the DHT shows."""
        self._transfers_of: Counter[str] = Counter()
        """State id -> its transfers running now: a fetcher streams several ranges at once, and the
        first to end must not mark the state idle while the others run."""
        self.num_refusals: Counter[str] = Counter()
        """Calls ended with a status other than OK, by status name."""

    # --- the daemon's side ---------------------------------------------------------------------------

    def publish(self, snapshot: Snapshot, *, companions: Sequence[Snapshot] = ()) -> None:
        """Serve `snapshot` from now on; keep the previous ones up to `num_snapshots_kept` in all.

        `companions`: other snapshots served beside this one (the daemon's round mean, for a member
        rounds behind), kept for `num_companions_kept` publishes; never the newest, so a fetcher that
        asks for no particular state still gets `snapshot`.
        """
        served = [(one, self._manifest_of(one)) for one in (snapshot, *companions)]
        if len({one.state_id for one in (snapshot, *companions)}) != len(served):
            raise ValueError("a snapshot and its companions need distinct state ids")
        kept, older_companions, fetched = self._held
        older = tuple(one for one in kept if one[0][0].state_id != snapshot.state_id)
        publishes, num_kept = (tuple(served), *older), self.config.num_snapshots_kept
        dropped = tuple(publish[1:] for publish in publishes[num_kept:] if len(publish) > 1)
        num_older = self.config.num_companions_kept - num_kept
        still_fetched = [
            (one,)
            for one in (
                *(publish[0] for publish in publishes[num_kept:]),
                *(publish[0] for publish in fetched),
            )
            if self._being_fetched(one[0].state_id)
            and all(one[0].state_id != publish[0][0].state_id for publish in publishes[:num_kept])
        ]
        self._held = (
            publishes[:num_kept],
            (*dropped, *older_companions)[:num_older],
            tuple(still_fetched[:1]),
        )
        logger.debug("serving %r (keeping %s)", snapshot, self.kept_state_ids)

    def served_lately(self, within: float) -> bool:
        """Whether we sent a chunk of a snapshot we keep (our newest state, the ones before it, the
        rounds' means beside them) in the last ``within`` seconds: a peer is fetching our lineage's
        state to join it (one a round old catches up with the newest round's mean). Any thread."""
        return any(self._sent_within(one.state_id, within) for served in self._served() for one, _ in served)

    def _sent_within(self, state_id: str, within: float) -> bool:
        """Whether a transfer of this state runs, or one ended in the last ``within`` seconds. Any
        thread (a rough read)."""
        if self._transfers_of.get(state_id, 0) > 0:
            return True
        return time.monotonic() - self.last_served.get(state_id, -math.inf) < within

    def _being_fetched(self, state_id: str) -> bool:
        """Whether a fetcher is taking this state now: a transfer of it ran within the stall timeout
        (the fetcher may be between two of its ranges)."""
        return self._sent_within(state_id, self.config.stall_timeout.total_seconds())

    def _manifest_of(self, snapshot: Snapshot) -> pb.StateManifest:
        manifest = to_manifest(
            snapshot, max_range_bytes=self.config.max_range_bytes, max_chunk_bytes=self.config.max_chunk_bytes
        )
        if manifest.ByteSize() + MESSAGE_OVERHEAD_BYTES > self.config.max_message_bytes:
            raise ValueError(
                f"the manifest of {snapshot!r} takes {manifest.ByteSize()} bytes, more than max_message_bytes="
                f"{self.config.max_message_bytes} allows; raise it or the snapshot's block_bytes"
            )
        return manifest

    @property
    def current(self) -> Snapshot | None:
        """The newest published snapshot, None before the first publish."""
        kept = self._held[0]
        return kept[0][0][0] if kept else None

    @property
    def kept_state_ids(self) -> list[str]:
        """Ids of the snapshots served, newest first."""
        return [snapshot.state_id for served in self._served() for snapshot, _ in served]

    def _served(self) -> _Publishes:
        """Everything served, newest first: the publishes kept whole, then older ones' companions,
        then an older snapshot kept while a fetcher takes it (``publish``)."""
        kept, older_companions, fetched = self._held
        return (*kept, *older_companions, *fetched)

    def close(self) -> None:
        """Release calls hung by a "stall" or "pause" fault (call on the server's loop before stopping it)."""
        self._closed.set()
        self._resumed.set()

    def resume(self) -> None:
        """Let the call held by a "pause" fault go on (call on the server's loop)."""
        self._resumed.set()

    # --- fault injection ------------------------------------------------------------------------------

    def _fault_at(self, point: str) -> str:
        """The fault action to apply at this point now ("" for none); counts the point."""
        plan = self.fault_plan
        number = self._num_reached[point]
        self._num_reached[point] = number + 1
        if self._fault_state in ("die", "stall"):
            return self._fault_state
        if plan is None or plan.point != point:
            return ""
        if self._fault_state == "corrupt" or number == plan.after:
            if not self.fault_fired.is_set():
                logger.warning("injected fault %s at %s %d", plan.action, point, number)
                self.fault_fired.set()
            if plan.persistent:
                self._fault_state = plan.action
            return plan.action
        return ""

    async def _act(self, action: str) -> None:
        """Carry out "abort", "die", "stall" or "pause" (the caller handles "corrupt")."""
        if action == "pause":
            await self._resumed.wait()
        elif action == "stall":
            await self._closed.wait()  # until close(), or the fetcher cancels the call
            raise ProtocolError(grpc.StatusCode.UNAVAILABLE, "shutting down")
        elif action in ("abort", "die"):
            raise ProtocolError(grpc.StatusCode.UNAVAILABLE, f"injected fault: {action}")

    async def _check_alive(self) -> None:
        """A provider that "died" or "stalled" does so for every call, not only at its fault point."""
        if self._fault_state in ("die", "stall"):
            await self._act(self._fault_state)

    # --- RPCs ----------------------------------------------------------------------------------------

    def _find(self, state_id: str) -> tuple[Snapshot, pb.StateManifest]:
        served_now = self._served()
        if not served_now:
            raise ProtocolError(grpc.StatusCode.NOT_FOUND, "I have no snapshot yet")
        if not state_id:
            return served_now[0][0]
        for served in served_now:
            for snapshot, manifest in served:
                if snapshot.state_id == state_id:
                    return snapshot, manifest
        raise ProtocolError(
            grpc.StatusCode.NOT_FOUND,
            f"I no longer keep snapshot {state_id!r}; I serve {self.kept_state_ids}",
        )

    async def _refuse(self, context: grpc.aio.ServicerContext, rpc: str, refusal: ProtocolError) -> None:
        self.num_refusals[refusal.code.name] += 1
        level = logging.INFO if refusal.code in _ROUTINE_CODES else logging.WARNING
        logger.log(level, "refused %s from %s: %s", rpc, context.peer(), refusal)
        await context.abort(refusal.code, refusal.message)

    async def GetManifest(
        self, request: pb.GetManifestRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.StateManifest:
        try:
            if isinstance(request, Malformed):
                raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            await self._check_alive()
            _, manifest = self._find(request.state_id)
            action = self._fault_at("manifest")
            await self._act(action)
            if action == "corrupt" and manifest.tensors:
                lying = pb.StateManifest()
                lying.CopyFrom(manifest)
                lying.tensors[0].sha256 = flip_first_byte(lying.tensors[0].sha256)
                return lying
            return manifest
        except ProtocolError as refusal:
            await self._refuse(context, "GetManifest", refusal)
            raise AssertionError("context.abort returned") from refusal

    def _check_range(self, request: pb.FetchRangeRequest) -> Snapshot:
        snapshot, _ = self._find(request.state_id)
        entry = snapshot.entries.get(request.tensor_name)
        if entry is None:
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"snapshot {request.state_id!r} has no tensor {request.tensor_name!r}",
            )
        if request.length == 0:
            raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, "you asked for an empty range")
        if request.length > self.config.max_range_bytes:
            raise ProtocolError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"you asked for {request.length} bytes; I serve at most {self.config.max_range_bytes} per request",
            )
        chunk_bytes = min(request.max_chunk_bytes or self.config.max_chunk_bytes, self.config.max_chunk_bytes)
        if -(-request.length // chunk_bytes) > MAX_CHUNKS_PER_RANGE:
            # Tiny chunks cost a gRPC message each: 1-byte chunks of a 256 MiB range would hold a
            # transfer slot for 256M writes (found by scripts/tools/fuzz_rpcs.py).
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{request.length} bytes in chunks of {chunk_bytes} take more than {MAX_CHUNKS_PER_RANGE} "
                "chunks; ask for larger chunks",
            )
        if request.offset + request.length > entry.num_bytes:
            raise ProtocolError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"bytes [{request.offset}, {request.offset + request.length}) pass the end of "
                f"{request.tensor_name!r} ({entry.num_bytes} bytes)",
            )
        return snapshot

    async def FetchRange(
        self, request: pb.FetchRangeRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> None:
        try:
            if isinstance(request, Malformed):
                raise ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, request.error)
            await self._check_alive()
            snapshot = self._check_range(request)
            if self._num_active_transfers >= self.config.max_concurrent_transfers:
                raise ProtocolError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"I am serving {self._num_active_transfers} transfers already; try again shortly",
                )
            self._num_active_transfers += 1
            self._transfers_of[request.state_id] += 1  # in flight (a chunk may take seconds to drain)
            try:
                await self._stream(snapshot, request, context)
            finally:
                self._num_active_transfers -= 1
                self._transfers_of[request.state_id] -= 1
                if not self._transfers_of[request.state_id]:  # its last transfer running ended
                    del self._transfers_of[request.state_id]
                    self.last_served[request.state_id] = time.monotonic()
                kept = set(self.kept_state_ids)  # (on the loop: no race with the writes above)
                for state_id in [key for key in self.last_served if key not in kept]:
                    del self.last_served[state_id]
        except ProtocolError as refusal:
            await self._refuse(context, "FetchRange", refusal)

    async def _stream(
        self, snapshot: Snapshot, request: pb.FetchRangeRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """Write the range in chunks; a fetcher that blocks a write for the stall timeout is dropped."""
        data = byte_view(snapshot.tensors[request.tensor_name])  # (num_bytes,) uint8, shares memory
        chunk_bytes = min(request.max_chunk_bytes or self.config.max_chunk_bytes, self.config.max_chunk_bytes)
        stall = self.config.stall_timeout.total_seconds()
        end = request.offset + request.length
        for start in range(request.offset, end, chunk_bytes):
            payload = data[start : min(start + chunk_bytes, end)].tobytes()
            action = self._fault_at("chunk")
            await self._act(action)
            if action == "corrupt":
                payload = flip_first_byte(payload)
            try:
                async with asyncio.timeout(stall):
                    await context.write(pb.StateChunk(offset=start, data=payload))
            except TimeoutError as error:
                raise ProtocolError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"you read nothing for {stall:.1f}s"
                ) from error
            self.num_chunks_served += 1
            self.num_bytes_served += len(payload)
        self.num_ranges_served += 1


def add_state_sync_to_server(server: grpc.aio.Server, provider: StateProvider) -> None:
    """Serve `provider` on `server` (call before `server.start()`), e.g. next to the all-reduce; like
    the generated helper, but bytes that do not parse get INVALID_ARGUMENT.

    The server's message limits must hold the provider's chunks and manifests (see
    `StateSyncConfig.max_message_bytes`); mark "dtnode.v1.StateSync" SERVING in its health service.
    """
    handlers = {
        "GetManifest": grpc.unary_unary_rpc_method_handler(
            provider.GetManifest,
            request_deserializer=lenient(pb.GetManifestRequest),
            response_serializer=pb.StateManifest.SerializeToString,
        ),
        "FetchRange": grpc.unary_stream_rpc_method_handler(
            provider.FetchRange,
            request_deserializer=lenient(pb.FetchRangeRequest),
            response_serializer=pb.StateChunk.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
