"""``HOST:PORT`` flags and libp2p multiaddrs: what ``--listen``, ``--announce``, ``--dht-announce`` and
``--peers`` accept.

A hivemind DHT peer is reached through its p2p daemon at a *multiaddr* such as
``/ip4/10.0.0.2/tcp/4100/p2p/12D3KooW...``: transport address, then the peer's identity. Users
type ``HOST:PORT`` for the local side and paste multiaddrs printed by a running peer for the
remote side; these functions turn the former into the latter and reject anything malformed with
a ``ValueError`` naming the flag, before any process is started.

This module is the one place that splits ``HOST:PORT``: the daemon's flags, the swarm's settings and
the addresses in peer records all read it here. It imports no networking library (hivemind's
multiaddr parser is loaded by the two functions that read multiaddrs), so the node's configuration
and ``dtnode health`` can use it without loading the DHT.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

MAX_PORT: Final = 65535
MAX_DNS_NAME_CHARS: Final = 253
# Dot-separated labels of letters, digits, '-' and '_' (container runtimes allow '_' in service names).
_DNS_NAME_RE: Final = re.compile(
    r"[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*"
)


def split_host_port(text: str) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) as the host, without brackets (empty for ``:PORT``), and
    a port in ``[0, 65535]``; None if ``text`` is not one. For callers with a message of their own."""
    host, colon, port = text.rpartition(":")
    # isdecimal, not isdigit: int() refuses digits such as '²'
    if not colon or not port.isdecimal() or int(port) > MAX_PORT:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def parse_host_port(text: str, *, flag: str, empty_host: str | None = None) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[V6]:PORT`` for IPv6) into a host and a port in ``[0, 65535]``.

    An empty host (``:PORT``) is refused, unless ``empty_host`` says what it means: a listen address's
    empty host is every interface (``0.0.0.0``, or ``""`` where the caller binds it as given).
    """
    host_port = split_host_port(text)
    if host_port is None or (not host_port[0] and empty_host is None):
        raise ValueError(
            f"{flag} must be HOST:PORT (or [IPV6]:PORT) with a port in 0..{MAX_PORT}, got {text!r}"
        )
    host, port = host_port
    if not host and empty_host is not None:
        host = empty_host
    return host, port


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


def _check_dial_host(host: str, *, flag: str) -> None:
    """``host`` is an IP literal or a DNS name a dialing peer can resolve."""
    if _ip_multiaddr(host, 1, flag=flag) is not None:
        return
    if len(host) > MAX_DNS_NAME_CHARS or _DNS_NAME_RE.fullmatch(host) is None:
        raise ValueError(f"{flag} host must be an IP address or a DNS name, got {host!r}")


def split_announce(text: str, *, flag: str = "--announce") -> tuple[str, int | None]:
    """``--announce HOST[:PORT]`` (``[V6]`` or ``[V6]:PORT`` for IPv6) as the host others dial and the
    outside port, None when only a host is given (then others dial the listen port).

    The outside port differs from the listen port behind a port forward (a rented GPU whose provider
    maps public port 40123 to the container's 8000): others dial the outside one.
    """
    port_text: str | None
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError(f"{flag} must be HOST, HOST:PORT, [IPV6] or [IPV6]:PORT, got {text!r}")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:  # a name, an IPv4 address, or a bare IPv6 address (several colons, no port)
        host, port_text = text, None
    if not host:
        raise ValueError(f"{flag} needs a host, got {text!r}")
    _check_dial_host(host, flag=flag)
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 1 <= int(port_text) <= MAX_PORT:
        raise ValueError(f"{flag} port must be in 1..{MAX_PORT} (the port others dial), got {text!r}")
    return host, int(port_text)


def bracket_host(host: str) -> str:
    """``host`` as written before ``:PORT``: an IPv6 host in brackets (once)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def join_host_port(host: str, port: int) -> str:
    """``HOST:PORT``, with an IPv6 host in brackets."""
    return f"{bracket_host(host)}:{port}"


WILDCARD_HOSTS: Final = frozenset({"", "0.0.0.0", "::", "[::]"})
"""Listen hosts that bind every interface (the empty host too): no one dials them as such."""


def local_dial_address(host: str, port: int) -> str:
    """``HOST:PORT`` at which a process on this machine reaches a server bound to ``host``: the host
    itself, or loopback for a wildcard one."""
    return join_host_port("127.0.0.1" if host in WILDCARD_HOSTS else host, port)


def announce_multiaddr(address: str, *, flag: str = "--dht-announce") -> str:
    """The multiaddr other peers are told to dial for the DHT: ``HOST:PORT`` or a multiaddr.

    Needed when the listen address is not what others see (``0.0.0.0``, a port forward, a
    container). The port must be explicit: the p2p daemon cannot announce "port 0". A host
    name becomes ``/dns/NAME/tcp/PORT`` and is resolved by each dialing peer. A multiaddr is
    taken as given (``/ip4/…/tcp/PORT`` or ``/dns/…/tcp/PORT``), without ``/p2p/…``: the daemon
    appends its own peer id.
    """
    if address.startswith("/"):
        from hivemind.utils.multiaddr import Multiaddr  # imports hivemind: only when reading a multiaddr

        try:
            multiaddr = Multiaddr(address)
        except ValueError as error:
            raise ValueError(f"{flag} {address!r} is not a multiaddr: {error}") from None
        if "tcp" not in multiaddr or multiaddr["tcp"] == "0":
            raise ValueError(f"{flag} multiaddr needs /tcp/PORT with the real port others dial: {address!r}")
        if "p2p" in multiaddr:
            raise ValueError(f"{flag} multiaddr must not name a peer id (/p2p/...): {address!r}")
        return address
    host, port = parse_host_port(address, flag=flag)
    if port == 0:
        raise ValueError(f"{flag} needs the real port others dial, not 0: {address!r}")
    multiaddr_text = _ip_multiaddr(host, port, flag=flag)
    if multiaddr_text is not None:
        return multiaddr_text
    _check_dial_host(host, flag=flag)
    return f"/dns/{host}/tcp/{port}"


def check_peer_multiaddr(text: str) -> str:
    """Validate one ``--peers`` entry: a multiaddr that ends in ``/p2p/<peer id>``.

    The peer id is required: the p2p daemon authenticates the remote end against it, and the
    DHT pings the initial peers by id.
    """
    from hivemind.utils.multiaddr import Multiaddr  # imports hivemind: only when reading a multiaddr

    try:
        multiaddr = Multiaddr(text)
    except ValueError as error:
        raise ValueError(f"--peers entry {text!r} is not a multiaddr: {error}") from None
    if "p2p" not in multiaddr:
        raise ValueError(
            f"--peers entry {text!r} lacks /p2p/<peer id>; copy a full address a running peer prints"
        )
    return text
