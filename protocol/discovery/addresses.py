"""``HOST:PORT`` flags and libp2p multiaddrs: what ``--listen``, ``--announce`` and ``--peers`` accept.

A hivemind DHT peer is reached through its p2p daemon at a *multiaddr* such as
``/ip4/10.0.0.2/tcp/4100/p2p/12D3KooW...``: transport address, then the peer's identity. Users
type ``HOST:PORT`` for the local side and paste multiaddrs printed by a running peer for the
remote side; these functions turn the former into the latter and reject anything malformed with
a ``ValueError`` naming the flag, before any process is started.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

from hivemind.utils.multiaddr import Multiaddr

MAX_PORT: Final = 65535
MAX_DNS_NAME_CHARS: Final = 253
# Dot-separated labels of letters, digits, '-' and '_' (container runtimes allow '_' in service names).
_DNS_NAME_RE: Final = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*"
)


def parse_host_port(text: str, *, flag: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[V6]:PORT`` for IPv6) into a host and a port in ``[0, 65535]``."""
    host, colon, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not colon or not host or not port.isdigit() or int(port) > MAX_PORT:
        raise ValueError(
            f"{flag} must be HOST:PORT (or [IPV6]:PORT) with a port in 0..{MAX_PORT}, got {text!r}"
        )
    return host, int(port)


def _ip_multiaddr(host: str, port: int, *, flag: str) -> str | None:
    """``/ip4/…/tcp/…`` or ``/ip6/…/tcp/…`` for an IP literal, None for anything else."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        raise ValueError(f"{flag}: write the IPv4 address {address.ipv4_mapped} instead of {host}")
    return f"/ip{address.version}/{address}/tcp/{port}"


def listen_multiaddr(host_port: str) -> str:
    """The multiaddr the p2p daemon binds to for ``--listen HOST:PORT``; port 0 picks a free port.

    HOST must be an IP address of a local interface: ``127.0.0.1`` (loopback only), ``0.0.0.0``
    (every interface), or the address of one network namespace.
    """
    host, port = parse_host_port(host_port, flag="--listen")
    multiaddr = _ip_multiaddr(host, port, flag="--listen")
    if multiaddr is None:
        raise ValueError(f"--listen needs an IP address to bind to, got host {host!r}")
    return multiaddr


def announce_multiaddr(host_port: str) -> str:
    """The multiaddr other peers are told to dial for ``--announce HOST:PORT``.

    Needed when the listen address is not what others see (``0.0.0.0``, a port forward, a
    container). The port must be explicit: the p2p daemon cannot announce "port 0". A host
    name becomes ``/dns/NAME/tcp/PORT`` and is resolved by each dialing peer.
    """
    host, port = parse_host_port(host_port, flag="--announce")
    if port == 0:
        raise ValueError(f"--announce needs the real port others dial, not 0: {host_port!r}")
    multiaddr = _ip_multiaddr(host, port, flag="--announce")
    if multiaddr is not None:
        return multiaddr
    if len(host) > MAX_DNS_NAME_CHARS or _DNS_NAME_RE.fullmatch(host) is None:
        raise ValueError(f"--announce host must be an IP address or a DNS name, got {host!r}")
    return f"/dns/{host}/tcp/{port}"


def check_peer_multiaddr(text: str) -> str:
    """Validate one ``--peers`` entry: a multiaddr that ends in ``/p2p/<peer id>``.

    The peer id is required: the p2p daemon authenticates the remote end against it, and the
    DHT pings the initial peers by id.
    """
    try:
        multiaddr = Multiaddr(text)
    except ValueError as error:
        raise ValueError(f"--peers entry {text!r} is not a multiaddr: {error}") from None
    if "p2p" not in multiaddr:
        raise ValueError(
            f"--peers entry {text!r} lacks /p2p/<peer id>; copy a full address a running peer prints"
        )
    return text
