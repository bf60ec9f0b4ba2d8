"""Swarm-key authentication of gRPC calls: a MAC per call in metadata, checked by a server interceptor.

Each call a member makes carries ``x-dtnode-auth: v1.<timestamp>.<nonce>.<mac>`` where

    mac = HMAC-SHA256(k_grpc, "v1" | method | timestamp | nonce)

with ``k_grpc`` the key's gRPC subkey (``SwarmKey.derive("grpc")``), ``timestamp`` the caller's
wall-clock second and ``nonce`` 16 random bytes. The server interceptor accepts a call only if

1. the MAC is right for the method being called (a token for ``Deliver`` cannot open ``FetchRange``),
2. the timestamp is within ``max_skew`` of its own clock (peers' clocks are assumed NTP-synced), and
3. the nonce has not been seen in that window: a captured token cannot be replayed.

Anything else ends the call at once with ``UNAUTHENTICATED`` ("missing or invalid swarm key: …"),
before the servicer sees a byte of it, and the server serves on. The replay cache is bounded: when
full it forgets the oldest nonce and from then on refuses every token at least as old (a *floor*),
so a forgotten nonce can never be accepted twice; under normal load the cache covers the window.

What this does and does not give. Without the key one cannot start any call on the swarm's
services (the health and operator status services stay open). It authenticates the call, not its
messages: someone on the path can still read, cut or alter traffic of a running call, as with
any plaintext protocol; that needs transport encryption: mutual TLS (``tls.py``, ``--tls``).
Only key holders can fill the replay cache (a MAC is checked before the nonce is stored).
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any, Final

import grpc
import grpc.aio

from protocol.auth.key import SwarmKey

logger = logging.getLogger(__name__)

METADATA_KEY: Final = "x-dtnode-auth"
REFUSAL: Final = "missing or invalid swarm key"
"""The start of every refusal's details, so a caller can tell an auth refusal from other errors."""

OPEN_SERVICES: Final = ("grpc.health.v1.Health", "dtnode.v1.Status")
"""Services served without the key: liveness for load balancers and operators' read-only status."""

DEFAULT_MAX_SKEW: Final = timedelta(seconds=60)
DEFAULT_MAX_NONCES: Final = 100_000
_VERSION: Final = "v1"
_NONCE_BYTES: Final = 16


def _mac(subkey: bytes, method: str, timestamp: int, nonce: str) -> str:
    message = f"{_VERSION}\n{method}\n{timestamp}\n{nonce}".encode()
    return hmac.new(subkey, message, hashlib.sha256).hexdigest()


def call_token(key: SwarmKey, method: str, *, timestamp: int | None = None, nonce: str | None = None) -> str:
    """The ``x-dtnode-auth`` value for one call of ``method`` (``/package.Service/Method``)."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    nonce = secrets.token_hex(_NONCE_BYTES) if nonce is None else nonce
    return f"{_VERSION}.{timestamp}.{nonce}.{_mac(key.derive('grpc'), method, timestamp, nonce)}"


class ReplayCache:
    """Nonces seen within the skew window, at most ``max_nonces`` of them (see the module docstring)."""

    def __init__(self, *, max_nonces: int) -> None:
        if max_nonces < 1:
            raise ValueError(f"max_nonces must be at least 1, got {max_nonces}")
        self.max_nonces = max_nonces
        self._seen: set[str] = set()
        self._by_time: list[tuple[int, str]] = []  # a heap: the oldest token first
        self.floor = -1
        """Tokens at or before this timestamp are refused: their nonces may have been forgotten."""

    def __len__(self) -> int:
        return len(self._seen)

    def admit(self, nonce: str, timestamp: int, *, oldest_valid: int) -> str | None:
        """Record ``nonce``; the reason to refuse it (replayed, or older than what we remember) or None."""
        while self._by_time and self._by_time[0][0] < oldest_valid:  # out of the window: cannot come back
            self._seen.discard(heapq.heappop(self._by_time)[1])
        if timestamp <= self.floor:
            return "token older than the replay cache remembers"
        if nonce in self._seen:
            return "replayed token"
        if len(self._seen) >= self.max_nonces:
            evicted_time, evicted = heapq.heappop(self._by_time)
            self._seen.discard(evicted)
            self.floor = max(self.floor, evicted_time)
            if timestamp <= self.floor:
                return "token older than the replay cache remembers"
        self._seen.add(nonce)
        heapq.heappush(self._by_time, (timestamp, nonce))
        return None


class CallVerifier:
    """Checks one call's token: MAC, clock skew and replay; ``clock`` gives wall-clock seconds."""

    def __init__(
        self,
        key: SwarmKey,
        *,
        max_skew: timedelta = DEFAULT_MAX_SKEW,
        max_nonces: int = DEFAULT_MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_skew <= timedelta(0):
            raise ValueError(f"max_skew must be positive, got {max_skew}")
        self._subkey = key.derive("grpc")
        self.max_skew = max_skew
        self.clock = clock
        self.replay = ReplayCache(max_nonces=max_nonces)

    def check(self, method: str, token: str | None) -> str | None:
        """None if the call may go on, else why it may not (safe to log and to tell the caller)."""
        if token is None:
            return "no swarm key presented"
        version, _, rest = token.partition(".")
        timestamp_text, _, rest = rest.partition(".")
        nonce, _, mac = rest.partition(".")
        if version != _VERSION or not timestamp_text.isdigit() or not nonce or not mac:
            return "malformed token"
        timestamp = int(timestamp_text)
        if not hmac.compare_digest(mac, _mac(self._subkey, method, timestamp, nonce)):
            return "wrong swarm key"
        now = self.clock()
        skew = self.max_skew.total_seconds()
        if abs(timestamp - now) > skew:
            return f"token time is {timestamp - now:+.0f} s off our clock (allowed ±{skew:.0f} s)"
        return self.replay.admit(nonce, timestamp, oldest_valid=int(now - skew))


def _token_of(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for name, value in metadata or ():
        if name == METADATA_KEY:
            return value.decode("ascii", "replace") if isinstance(value, bytes) else value
    return None


def _refusing_handler(handler: grpc.RpcMethodHandler, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends the call with UNAUTHENTICATED."""

    async def refuse(_request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, details)

    # No deserializer: the request is never parsed, it arrives as bytes and is dropped.
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class SwarmKeyServerInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through to its servicer only with a valid token (services in ``open_services`` always)."""

    def __init__(self, verifier: CallVerifier, *, open_services: Sequence[str] = OPEN_SERVICES) -> None:
        self.verifier = verifier
        self._open_prefixes = tuple(f"/{service}/" for service in open_services)
        self.num_refused = 0

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(self._open_prefixes):
            return handler  # unknown methods get gRPC's own UNIMPLEMENTED
        reason = self.verifier.check(method, _token_of(handler_call_details.invocation_metadata))  # type: ignore[attr-defined]
        if reason is None:
            return handler
        self.num_refused += 1
        # The first refusals and then every 100th at WARNING: a stranger hammering us must not flood the log.
        level = logging.WARNING if self.num_refused <= 10 or self.num_refused % 100 == 0 else logging.DEBUG
        logger.log(level, "refused %s: %s (%d refused so far)", method, reason, self.num_refused)
        return _refusing_handler(handler, f"{REFUSAL}: {reason}")


def server_interceptors(key: SwarmKey | None, **verifier_kwargs: Any) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for a node's server: none for an open swarm (no key)."""
    return [] if key is None else [SwarmKeyServerInterceptor(CallVerifier(key, **verifier_kwargs))]


# --- the calling side ---


def _signed(key: SwarmKey, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    method = details.method.decode() if isinstance(details.method, bytes) else str(details.method)
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(METADATA_KEY, call_token(key, method))
    return details._replace(metadata=metadata)  # type: ignore[attr-defined, no-any-return]


class _UnaryUnarySigner(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, key: SwarmKey) -> None:
        self.key = key

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_signed(self.key, client_call_details), request)


class _UnaryStreamSigner(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: SwarmKey) -> None:
        self.key = key

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(_signed(self.key, client_call_details), request)


class _StreamUnarySigner(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, key: SwarmKey) -> None:
        self.key = key

    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: AsyncIterator[Any] | None
    ) -> Any:
        return await continuation(_signed(self.key, client_call_details), request_iterator)


class _StreamStreamSigner(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, key: SwarmKey) -> None:
        self.key = key

    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: AsyncIterator[Any] | None
    ) -> Any:
        return await continuation(_signed(self.key, client_call_details), request_iterator)


def client_interceptors(key: SwarmKey | None) -> list[grpc.aio.ClientInterceptor]:
    """Interceptors that sign every call of a ``grpc.aio`` channel with ``key``; none without a key."""
    if key is None:
        return []
    return [
        _UnaryUnarySigner(key),
        _UnaryStreamSigner(key),
        _StreamUnarySigner(key),
        _StreamStreamSigner(key),
    ]
