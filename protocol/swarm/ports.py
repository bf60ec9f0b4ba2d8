"""Can a node listen where it is told to? Asked before any of its servers binds.

A node listens on up to three TCP addresses (its gRPC server, its DHT peer, its metrics endpoint),
and each server binds at a different moment of the start: the DHT first, then gRPC, the metrics
endpoint once the model is built. :func:`bind_problem` tries the address with a socket that binds
and closes, never listens (no peer can reach it), the way the servers will bind it (with
``SO_REUSEADDR``, as gRPC, the p2p daemon and Python's HTTP server do, so a port held only by
connections in TIME_WAIT is free): the answer is the reason it cannot be bound, as a phrase, or
None. :func:`shared_port` finds two of the node's own addresses on one port.

A probe is a question, not a reservation: another process may take the port between the probe
and the bind. The servers' own bind errors therefore stay one-line errors too (the daemon asks
:func:`bind_problem` again when a server failed to start, to say why).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Sequence

from protocol.discovery.addresses import WILDCARD_HOSTS


def bind_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be bound for listening now, as a phrase; None if it can."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
        )
    except socket.gaierror as error:
        return f"cannot resolve {host!r} ({error.strerror})"
    family, kind, protocol, _, address = infos[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            return _reason(error, host, port)
    return None


def _reason(error: OSError, host: str, port: int) -> str:
    if error.errno == errno.EADDRINUSE:
        return f"port {port} is in use (another process listens on it); pick another port"
    if error.errno == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine (listen on one of its own, or 0.0.0.0)"
    if error.errno == errno.EACCES:
        return f"no permission to listen on port {port} (ports below 1024 need privileges)"
    return f"cannot bind it: {error.strerror}"


def _overlap(first: str, second: str) -> bool:
    """Two hosts whose sockets on one port would clash: the same, or either a wildcard."""
    return first == second or first in WILDCARD_HOSTS or second in WILDCARD_HOSTS


def shared_port(addresses: Sequence[tuple[str, str, int]]) -> tuple[str, str] | None:
    """The first two of ``(name, host, port)`` on one fixed port (port 0 is any free one, never
    shared), as their names; None if every fixed port is its own."""
    for i, (name, host, port) in enumerate(addresses):
        for other_name, other_host, other_port in addresses[:i]:
            if port and port == other_port and _overlap(host, other_host):
                return other_name, name
    return None
