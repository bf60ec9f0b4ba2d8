"""How a node proves swarm membership on gRPC, and the channel and server factories that apply it.

:class:`SwarmAuth` is the node's membership credential: the swarm key, whose per-call MACs every
closed-swarm server checks (``grpc_auth.py``), and optionally mutual TLS with certificates from
the CA derived from that key (``tls.py``). Every gRPC channel and server of the swarm is made by
:func:`open_channel` / :func:`new_server` / :func:`add_port` (and an operator's one-off calls by
:func:`operator_channel`), so the choice is made in one place:
``auth=None`` is an open swarm (plaintext, no checks); a ``SwarmAuth`` signs every call and
refuses unsigned ones; ``tls=True`` also encrypts every connection and refuses handshakes from
anyone without a certificate of the swarm's CA.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import grpc
import grpc.aio

from protocol.auth.grpc_auth import client_interceptors, server_interceptors
from protocol.auth.key import SwarmKey
from protocol.auth.tls import (
    SERVER_NAME,
    TlsIdentity,
    channel_credentials,
    issue_identity,
    server_credentials,
)


class SwarmAuth:
    """A node's swarm-membership credential: ``key`` for per-call MACs, ``tls`` for mutual TLS too."""

    def __init__(self, key: SwarmKey, *, tls: bool = False) -> None:
        self.key = key
        self.tls = tls

    @functools.cached_property
    def identity(self) -> TlsIdentity:
        """This node's TLS key and certificate, issued on first use and kept for its lifetime."""
        return issue_identity(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmAuth) and (self.key, self.tls) == (other.key, other.tls)

    def __hash__(self) -> int:
        return hash((self.key, self.tls))

    def __repr__(self) -> str:
        return f"SwarmAuth({self.key!r}, tls={self.tls})"


def open_channel(
    address: str, *, options: Sequence[tuple[str, Any]], auth: SwarmAuth | None
) -> grpc.aio.Channel:
    """A channel to ``address`` that presents ``auth`` on every call (plaintext and unsigned if None)."""
    if auth is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    interceptors = client_interceptors(auth.key)
    if not auth.tls:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)
    # Peers are dialled by IP; their certificates name the swarm, so check that name instead.
    options = [*options, ("grpc.ssl_target_name_override", SERVER_NAME)]
    credentials = channel_credentials(auth.identity)
    return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)


def operator_channel(
    address: str, *, options: Sequence[tuple[str, Any]], auth: SwarmAuth | None
) -> grpc.Channel:
    """A blocking channel for an operator's one-off call (``dtnode status``, ``dtnode health``).

    Such calls need no swarm-key token, only the TLS handshake of a ``--tls`` node (a client
    certificate from the swarm's CA).
    """
    if auth is None or not auth.tls:
        return grpc.insecure_channel(address, options=list(options))
    options = [*options, ("grpc.ssl_target_name_override", SERVER_NAME)]
    return grpc.secure_channel(address, channel_credentials(auth.identity), options=options)


def new_server(*, options: Sequence[tuple[str, Any]], auth: SwarmAuth | None) -> grpc.aio.Server:
    """A grpc.aio server that refuses calls not signed with ``auth``'s key (serves anyone if None)."""
    return grpc.aio.server(
        options=list(options), interceptors=server_interceptors(None if auth is None else auth.key)
    )


def add_port(server: grpc.aio.Server, address: str, *, auth: SwarmAuth | None) -> int:
    """Bind ``address`` on ``server`` (with mutual TLS if ``auth.tls``); the bound port, 0 if it failed
    (gRPC returns 0 or, since 1.5x, raises "Failed to bind to address …": the caller says why, in
    one line, not a traceback)."""
    try:
        if auth is not None and auth.tls:
            return server.add_secure_port(address, server_credentials(auth.identity))
        return server.add_insecure_port(address)
    except RuntimeError as error:
        if "Failed to bind" not in str(error):
            raise
        return 0
