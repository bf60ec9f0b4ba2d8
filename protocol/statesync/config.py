"""Knobs of a state-sync provider, the fetcher's defaults, and the gRPC channel options of both sides."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

MiB = 1 << 20

MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Room for a chunk's protobuf framing on top of its data."""
MAX_MANIFEST_BYTES = 8 * MiB
"""The largest manifest a fetcher accepts (32 bytes of hash per block: ~2M blocks, 8 TB at 4 MiB)."""
DEFAULT_BLOCK_BYTES = 4 * MiB
"""Snapshots of 128 MiB and more hash their tensors in blocks of this many bytes unless told otherwise."""
MIN_DEFAULT_BLOCK_BYTES = 64 * 1024
"""The smallest block a snapshot picks by itself (``default_block_bytes``)."""
BLOCKS_PER_SNAPSHOT = 32
"""A smaller snapshot picks blocks that cut it into about this many."""


def default_block_bytes(num_bytes: int) -> int:
    """The block size of a snapshot of ``num_bytes`` that names none: a power of two from 64 KiB to
    4 MiB, about 1/32 of it. A fetcher's ranges are whole blocks, so one block is the least one
    source is asked for: a 0.93 MB round mean in one 4 MiB block came from one of its sources whatever
    their number (8 s at 1 Mbit/s, a round's length). Every provider of a snapshot picks the same."""
    target = max(1, num_bytes // BLOCKS_PER_SNAPSHOT)
    return min(DEFAULT_BLOCK_BYTES, max(MIN_DEFAULT_BLOCK_BYTES, 1 << (target.bit_length() - 1)))


DEFAULT_RANGE_BYTES = 32 * MiB
"""A fetcher asks one source for at most this many bytes per FetchRange unless told otherwise."""
RANGES_PER_SOURCE = 4
"""A fetcher cuts a snapshot into at least this many ranges per source (whole blocks permitting; at
most `max_parallel` sources counted, the streams that fetch at once), so every source sends a share
and a fast one can take more."""
DEFAULT_FETCH_STALL_TIMEOUT = timedelta(seconds=15)
"""A fetcher drops a source that sends nothing for this long unless told otherwise."""
MAX_CHUNK_BYTES = 64 * MiB
"""The largest chunk a fetcher may ask for (it sizes the channel's receive limit)."""
MAX_CHUNKS_PER_RANGE = 4096
"""A provider refuses a FetchRange that would take more chunks than this (tiny chunks cost a gRPC
message each); a fetcher sizes its ranges to stay within it."""

# How big a chunk may be. A stream shows progress only when a whole chunk has arrived (gRPC hands
# over whole messages), so both sides' stall windows count chunks: a live source on a slow link
# must deliver one well inside the window, or every source looks stalled and no fetch can finish
# (found on 1 Mbit/s links with 4 MiB chunks: 33.6 s each against a 15 s window). The rule:
#
#   max_parallel streams x chunk bytes / SLOWEST_LINK_BYTES_PER_SECOND  <=  stall window / STALL_MARGIN
#
# (a fetcher's streams to one source share its uplink, so each stream's next chunk can wait for a
# chunk of every other). With 4 streams, 64 KiB chunks and 1 Mbit/s that is 2.1 s against 15 s / 4.
# Smaller chunks cost a message each; what that costs a fast link (loopback): BENCHMARKS.md, "A joiner
# whose state fetch outlasts a round, on 1 Mbit/s links".
SLOWEST_LINK_BYTES_PER_SECOND = 1_000_000 / 8
"""The slowest uplink state sync is sized for: 1 Mbit/s."""
STALL_MARGIN = 4
"""A chunk round of every stream crosses the slowest link within a quarter of the stall window: room
for other traffic on the uplink (an all-reduce, a second fetcher) and TCP's slow start."""
DEFAULT_CHUNK_BYTES = 64 * 1024
"""A fetcher asks for chunks of this many bytes unless told otherwise (the rule above)."""
DEFAULT_SERVED_CHUNK_BYTES = DEFAULT_CHUNK_BYTES
"""A provider sends chunks of at most this many bytes unless told otherwise: the rule above holds
for fetchers that ask for larger chunks too (a provider drops a fetcher that read nothing for its own
stall window, so a chunk that crawls would cost the transfer at both ends)."""


@dataclass(frozen=True, kw_only=True)
class FetchOptions:
    """How a fetcher moves a snapshot; every fetch entry point takes one (the defaults suit WAN links)."""

    max_parallel: int = 4
    """FetchRange streams open at once, over all sources."""
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    """The largest streamed message asked for (sources may cap it lower). Progress is seen chunk by
    chunk: keep `max_parallel` chunks crossing the slowest link well inside `stall_timeout`."""
    range_bytes: int = DEFAULT_RANGE_BYTES
    """Bytes asked of one source per FetchRange (rounded down to whole blocks, capped by every
    source's max_range_bytes); smaller ranges spread the work finer."""
    stall_timeout: timedelta = DEFAULT_FETCH_STALL_TIMEOUT
    """A source that sends nothing for this long is dropped and its range re-queued."""

    def __post_init__(self) -> None:
        if self.max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1, got {self.max_parallel}")
        if not 0 < self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in (0, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if self.range_bytes <= 0:
            raise ValueError(f"range_bytes must be positive, got {self.range_bytes}")
        if self.stall_timeout <= timedelta(0):
            raise ValueError(f"stall_timeout must be positive, got {self.stall_timeout}")


@dataclass(frozen=True, kw_only=True)
class StateSyncConfig:
    """How a provider serves snapshots. Every field has a default that suits WAN links."""

    max_chunk_bytes: int = DEFAULT_SERVED_CHUNK_BYTES
    """The longest chunk this provider sends, whatever a fetcher asks for (advertised in the manifest)."""
    max_range_bytes: int = 256 * MiB
    """The most bytes one FetchRange may ask for; more gets RESOURCE_EXHAUSTED (advertised in the manifest)."""
    max_message_bytes: int = 16 * MiB
    """gRPC send/receive limit of the server; must hold a chunk and the largest manifest served."""
    max_concurrent_transfers: int = 8
    """FetchRange streams served at once; one more gets RESOURCE_EXHAUSTED and the fetcher retries later."""
    num_snapshots_kept: int = 2
    """Snapshots kept at once: the current one and the previous, so transfers that began before a
    publish can still ask for their remaining ranges; and one older snapshot more while a fetcher
    still takes it (a transfer of it ran within the stall timeout)."""
    num_companions_kept: int = 2
    """Publishes whose companions (the daemon's round means) are served, >= num_snapshots_kept: a
    publish older than num_snapshots_kept keeps its companions only. A node that many rounds behind
    can step to the newest state with their means. With --fragments F the daemon keeps 2F: its means
    are 1/F of the model each, so as many bytes as two whole ones."""
    stall_timeout: timedelta = timedelta(seconds=30)
    """A fetcher that does not read a chunk for this long is dropped and its transfer slot freed."""
    server_grace: timedelta = timedelta(seconds=2)
    """On stop, in-flight RPCs get this long to finish."""

    def __post_init__(self) -> None:
        if self.max_chunk_bytes <= 0 or self.max_range_bytes <= 0:
            raise ValueError("max_chunk_bytes and max_range_bytes must be positive")
        if self.max_range_bytes > self.max_chunk_bytes * MAX_CHUNKS_PER_RANGE:
            raise ValueError(
                f"max_range_bytes={self.max_range_bytes} in chunks of max_chunk_bytes={self.max_chunk_bytes} "
                f"takes more than {MAX_CHUNKS_PER_RANGE} chunks; lower it or raise max_chunk_bytes"
            )
        if self.max_message_bytes < self.max_chunk_bytes + MESSAGE_OVERHEAD_BYTES:
            raise ValueError(
                f"max_message_bytes={self.max_message_bytes} cannot hold a chunk of {self.max_chunk_bytes} "
                "bytes plus framing; raise it or lower max_chunk_bytes"
            )
        if self.max_concurrent_transfers < 1 or self.num_snapshots_kept < 1:
            raise ValueError("max_concurrent_transfers and num_snapshots_kept must be >= 1")
        if self.num_companions_kept < self.num_snapshots_kept:
            raise ValueError(
                f"num_companions_kept ({self.num_companions_kept}) must be >= num_snapshots_kept "
                f"({self.num_snapshots_kept}): a snapshot kept keeps its companions"
            )
        if self.stall_timeout <= timedelta(0) or self.server_grace < timedelta(0):
            raise ValueError("stall_timeout must be positive and server_grace non-negative")

    def server_options(self) -> list[tuple[str, int]]:
        """Explicit message limits, and keepalive pings from fetchers allowed (they detect frozen peers)."""
        keepalive_ms = max(500, int(self.stall_timeout.total_seconds() * 500))
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.so_reuseport", 0),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
            ("grpc.http2.max_ping_strikes", 0),
        ]


def fetcher_options(*, chunk_bytes: int, stall_timeout: timedelta) -> list[tuple[str, int]]:
    """Channel options of a fetcher: room for a chunk or a manifest, keepalive, no hidden retries.

    A frozen source keeps its TCP connection open; keepalive pings unanswered for half the stall
    timeout close the connection, so its streams fail instead of hanging until the deadline.
    """
    max_message_bytes = max(chunk_bytes, MAX_MANIFEST_BYTES) + MESSAGE_OVERHEAD_BYTES
    keepalive_ms = max(500, int(stall_timeout.total_seconds() * 500))
    return [
        ("grpc.max_send_message_length", MESSAGE_OVERHEAD_BYTES),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.enable_retries", 0),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        ("grpc.http2.max_pings_without_data", 0),
    ]


DEFAULT_FETCH_OPTIONS = FetchOptions()
"""The options of a fetch that names none."""
