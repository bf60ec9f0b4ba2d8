"""Knobs of the all-reduce: chunking, message limits, timeouts, memory bounds and the aggregation rule."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from protocol.allreduce.robust import Aggregation, AggregationRule

MESSAGE_OVERHEAD_BYTES = 64 * 1024
"""Room for a chunk's protobuf framing on top of its payload."""


@dataclass(frozen=True, kw_only=True)
class AllReduceConfig:
    """How a peer runs all-reduce rounds. Every field has a default that suits WAN links."""

    chunk_num_elements: int = 1 << 18
    """Numbers per streamed chunk (256K: 1 MiB as fp32, 256 KiB as int8). Smaller chunks pipeline finer
    and keep fewer bytes in flight; every in-flight chunk exists in a few copies (payload, protobuf
    message, gRPC buffers), so 4x larger chunks cost ~0.5x the vector more peak memory for fp32."""
    max_message_bytes: int = 8 * 1024 * 1024
    """gRPC send/receive limit on both server and channels; larger messages get RESOURCE_EXHAUSTED."""
    max_chunks_ahead: int = 4
    """Chunks of one contribution an owner holds received but not yet summed before it stops reading
    that sender for a while. Chunks are summed in member order, so a sender's chunks wait while a
    lower member lags behind (it started late, or its link is slower); unbounded, whole contributions
    would wait in memory. A sender is never held longer than half the stall timeout at a time, so it
    never takes the owner for stalled."""
    stall_timeout: timedelta = timedelta(seconds=30)
    """A stream that makes no progress for this long counts as a stalled peer and is dropped."""
    heartbeat_interval: timedelta = timedelta(seconds=2)
    """An owner still reducing tells each waiting puller so this often (must be < stall_timeout)."""
    reduce_scatter_fraction: float = 0.5
    """Contributions must reach their owner within this fraction of the round's deadline."""
    takeover_fraction: float = 0.5
    """A backup that takes a part over waits this fraction of the time left for resent contributions."""
    max_early_wait: timedelta = timedelta(seconds=60)
    """How long a message for a round this peer has not opened yet waits for it to open."""
    linger: timedelta = timedelta(seconds=30)
    """A finished round keeps serving its parts this long after its deadline, for slower members."""
    max_rounds_kept: int = 2
    """Rounds kept at once (the current one and the previous, which slower members may still pull
    from); opening one more forgets the oldest finished round and its buffers."""
    max_waiting_requests: int = 256
    """Requests that may wait at once for a round to open; more get RESOURCE_EXHAUSTED."""
    max_slices_held: int = 8
    """Slices of tiered rounds' means this peer holds at once for other members to pull (stage C,
    `slices.py`); holding one more drops the oldest. A member holds one slice a tiered round (its
    column's), so 8 covers the rounds kept (max_rounds_kept) several times over; each costs its
    slice's encoded bytes."""
    max_slice_wait: timedelta = timedelta(minutes=10)
    """Longest a pull waits for a slice not held here yet (it comes once this member's column has
    averaged it, which may take a whole stage of the round); the puller's own deadline is shorter
    in practice. Waiting pulls count against max_waiting_requests."""
    reconnect_backoff: timedelta = timedelta(seconds=1)
    """Longest gRPC reconnect backoff, so a peer that comes back is reachable in the next round."""
    connect_timeout: timedelta = timedelta(seconds=20)
    """How long one attempt to connect to a member may take (TCP and HTTP/2 handshakes). On a
    saturated uplink every handshake packet queues behind bulk data (a 100 ms buffer per hop at
    100 Mbit/s), so a short attempt deadline fails connections to live members; a refused connection
    (a dead member) still fails at once. A round opens its connections to every member when it
    starts and sends a member nothing until its connection is up or has failed, at most this long."""
    server_grace: timedelta = timedelta(seconds=2)
    """On stop, in-flight RPCs get this long to finish."""
    memory_trim_interval: timedelta | None = timedelta(milliseconds=250)
    """While a round runs, give freed heap memory back to the OS this often (`memory.py`); None: only
    between rounds. A round frees chunk-sized buffers on several threads, which glibc keeps in its
    arenas rather than reuse, so without it the peak grows by ~0.3-0.5x the vector (fp32, 4 members);
    every 250 ms costs no measurable time, every 20 ms about a third of the round's speed."""
    keep_payloads: bool = False
    """Return the encoded bytes every part of the result was decoded from (``AllReduceResult.payloads``),
    so the round's mean can be served on compressed (the daemon's catch-up); costs the result's
    encoded size in memory until the result is dropped."""
    aggregation: Aggregation = "mean"
    """How an owner combines the contributions to its part: "mean" (weighted mean), "clipped" (each
    contribution's norm clipped to clip_factor x the median norm) or "trimmed" (coordinate-wise trimmed
    mean); see protocol/allreduce/robust.py. Every member of a swarm must use the same rule and the
    same chunk_num_elements. The robust rules hold every contribution to a part, encoded, until all
    arrived (about the whole vector's encoded size per owner instead of max_chunks_ahead chunks per
    sender) and refuse chunks off the owner's chunk grid. With a sparse codec (top-k) "clipped"
    applies and "trimmed" is refused (`sparse.py` says why)."""
    clip_factor: float = 2.0
    """aggregation="clipped": a contribution's norm is clipped to this many times the median norm."""
    trim_per_side: int = 1
    """aggregation="trimmed": values dropped per element on each side (the b largest and b smallest)."""

    def __post_init__(self) -> None:
        if self.chunk_num_elements <= 0:
            raise ValueError(f"chunk_num_elements must be positive, got {self.chunk_num_elements}")
        if self.max_message_bytes < 4 * self.chunk_num_elements + MESSAGE_OVERHEAD_BYTES:
            raise ValueError(
                f"max_message_bytes={self.max_message_bytes} cannot hold an fp32 chunk of "
                f"{self.chunk_num_elements} numbers; raise it or lower chunk_num_elements"
            )
        for name in (
            "stall_timeout",
            "heartbeat_interval",
            "max_early_wait",
            "max_slice_wait",
            "reconnect_backoff",
            "connect_timeout",
        ):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.heartbeat_interval >= self.stall_timeout:
            raise ValueError("heartbeat_interval must be shorter than stall_timeout")
        for name in ("reduce_scatter_fraction", "takeover_fraction"):
            if not 0.0 < getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in (0, 1)")
        if self.memory_trim_interval is not None and self.memory_trim_interval <= timedelta(0):
            raise ValueError(
                f"memory_trim_interval must be positive or None, got {self.memory_trim_interval}"
            )
        if (
            min(self.max_rounds_kept, self.max_waiting_requests, self.max_chunks_ahead, self.max_slices_held)
            < 1
        ):
            raise ValueError(
                "max_rounds_kept, max_waiting_requests, max_chunks_ahead and max_slices_held must be >= 1"
            )
        _ = self.aggregation_rule  # raises ValueError for a bad rule

    @property
    def aggregation_rule(self) -> AggregationRule:
        return AggregationRule(
            kind=self.aggregation, clip_factor=self.clip_factor, trim_per_side=self.trim_per_side
        )

    def grpc_options(self, *, server: bool) -> list[tuple[str, int]]:
        """Explicit message limits on both sides, keepalive that catches frozen peers, no hidden retries.

        A frozen peer (e.g. SIGSTOP) keeps its TCP connection open, so a write to it would just block;
        keepalive pings that go unanswered for half the stall timeout close the connection instead.
        gRPC gives each connection attempt max(the current backoff, `grpc.min_reconnect_backoff_ms`),
        so that option is our connect timeout (not a backoff: the backoff starts at the initial value).
        """
        keepalive_ms = max(500, int(self.stall_timeout.total_seconds() * 500))
        options = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if server:
            return options + [
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", keepalive_ms // 2),
                ("grpc.http2.max_ping_strikes", 0),
            ]
        backoff_ms = int(self.reconnect_backoff.total_seconds() * 1000)
        return options + [
            ("grpc.enable_retries", 0),
            ("grpc.keepalive_time_ms", keepalive_ms),
            ("grpc.keepalive_timeout_ms", keepalive_ms),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 200)),
            ("grpc.min_reconnect_backoff_ms", int(self.connect_timeout.total_seconds() * 1000)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
        ]
