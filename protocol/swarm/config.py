"""Settings of a node's swarm side: where it listens, whom it joins, how rounds form and run."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final

from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.sparse import check_sparse_aggregation
from protocol.auth.channels import SwarmAuth
from protocol.codecs import DEFAULT_TOPK_DENSITY, Codec, get_codec, takes_density
from protocol.discovery.addresses import WILDCARD_HOSTS, bracket_host, parse_host_port, split_host_port
from protocol.discovery.dht_node import DhtConfig
from protocol.error_feedback import check_decay
from protocol.membership.config import RoundConfig
from protocol.membership.records import check_address, check_rate, check_token
from protocol.statesync.config import StateSyncConfig

PROTOCOL_VERSION: Final = 2
"""The membership / all-reduce / state-sync protocol this code speaks; peers of other versions are ignored.
2: a group's members are in the member order (by rank, then peer id), no longer by peer id alone, and
records carry the node's identity digest (issue 31)."""


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    """Everything the swarm side of a node needs (the node builds it from its ``NodeConfig``)."""

    run_name: str
    """Peers of one run share the DHT key ``dtnode/<run_name>/peers``."""
    listen: str = "0.0.0.0:0"
    """gRPC bind address ``host:port`` (all-reduce, state sync, membership, health); port 0 = any."""
    announce_host: str | None = None
    """The host other peers dial for our gRPC server; None: the listen host, or 127.0.0.1 for a wildcard."""
    announce_port: int | None = None
    """The port other peers dial for our gRPC server, the outside port of a port forward to the listen
    port (``--announce HOST:PORT``); None: the port we are bound to. Needs ``announce_host``."""
    dht: DhtConfig = field(default_factory=DhtConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    statesync: StateSyncConfig = field(default_factory=StateSyncConfig)
    codec: str = "int8"
    """Wire codec of the pseudo-gradient (``protocol.codecs``)."""
    topk_density: float = DEFAULT_TOPK_DENSITY
    """Codecs ``topk`` and ``topk4``: the fraction of each block's numbers sent; every member of a round
    must use the same (the codec's spec, which every contribution's header carries, says it as
    ``kept_per_block``)."""
    error_feedback_decay: float = 1.0
    """β of the codec's error feedback: each round sends Δ + β · residual (``protocol.error_feedback``);
    1 keeps the whole residual, SparseLoCo (arXiv:2508.15706) uses 0.95 with top-k."""
    round_deadline: timedelta = timedelta(minutes=5)
    """The all-reduce of a round returns within this, whatever the peers do."""
    sync_deadline: timedelta = timedelta(minutes=10)
    """A state fetch (joining, or re-syncing to the canonical lineage) gives up after this."""
    bandwidth_bytes_per_s: float = 12.5e6
    """Our uplink estimate, advertised so faster peers own larger parts of the all-reduce."""
    heartbeat: timedelta = timedelta(seconds=2)
    """Our DHT record is re-stored this often."""
    record_ttl: timedelta = timedelta(seconds=20)
    """A crashed peer's record disappears this long after its last heartbeat."""
    dht_call_timeout: timedelta = timedelta(seconds=5)
    view_refresh: timedelta = timedelta(seconds=1)
    """While a round forms, the DHT view is read again this often."""
    message_timeout: timedelta = timedelta(seconds=3)
    """Deadline of one membership message."""
    client_mode: bool = False
    """We accept no connections (``--client-mode``, e.g. behind NAT): no gRPC server is bound (``listen``
    is unused) and our record names no address (``CLIENT_ADDRESS``), so peers never dial us, give us no
    part, never fetch state from us nor follow us as a leader; messages for us wait at their senders
    until we collect them (``collect.py``). Needs ``dht.client_mode`` (whose daemon listens on nothing)."""
    auth: SwarmAuth | None = None
    """A closed swarm's credential (``protocol.auth``): our calls and DHT records are signed with its
    key, and peers that do not sign with it are refused; with ``auth.tls`` every gRPC connection is
    also mutual TLS. None: an open swarm (a warning says so)."""

    def __post_init__(self) -> None:
        check_token("run_name", self.run_name, max_chars=128)
        if split_host_port(self.listen) is None:
            raise ValueError(f"listen must be HOST:PORT (port 0 = any free port), got {self.listen!r}")
        if self.announce_host is not None:
            check_address(f"{self.announce_host}:1", "announce_host")
        if self.announce_port is not None:
            if self.announce_host is None:
                raise ValueError("announce_port needs announce_host (an outside port is dialled at a host)")
            if not 1 <= self.announce_port <= 65535:
                raise ValueError(f"announce_port must be in 1..65535, got {self.announce_port}")
        if self.client_mode and self.announce_host is not None:
            raise ValueError("a client (client_mode) serves nothing: it has no address to announce")
        if self.client_mode and not self.dht.client_mode:
            raise ValueError("client_mode needs dht.client_mode: a client answers no DHT request either")
        # ValueError for an unknown codec, a bad density, or a rule that does not apply to the codec
        check_sparse_aggregation(self.wire_codec(), self.allreduce)
        check_decay(self.error_feedback_decay)
        check_rate("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError("bandwidth_bytes_per_s must be positive")
        for name in (
            "round_deadline", "sync_deadline", "heartbeat", "record_ttl", "view_refresh", "dht_call_timeout",
            "message_timeout",
        ):  # fmt: skip
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        if self.record_ttl < 3 * self.heartbeat + 2 * self.dht_call_timeout:
            raise ValueError(
                f"record_ttl={self.record_ttl} must be at least 3 x heartbeat + 2 x dht_call_timeout "
                f"= {3 * self.heartbeat + 2 * self.dht_call_timeout}"
            )

    def wire_codec(self) -> Codec:
        """The codec rounds encode with, built from ``codec`` (and ``topk_density`` where it applies)."""
        return get_codec(self.codec, density=self.topk_density if takes_density(self.codec) else None)

    @property
    def listen_host(self) -> str:
        """The host of ``listen`` as a server binds it before ``:PORT`` (an IPv6 one in brackets);
        ``0.0.0.0`` for an empty one."""
        host, _ = parse_host_port(self.listen, flag="listen", empty_host="0.0.0.0")
        return bracket_host(host)

    @property
    def listen_port(self) -> int:
        return parse_host_port(self.listen, flag="listen", empty_host="0.0.0.0")[1]


def routable_host(multiaddrs: list[str]) -> str | None:
    """The first non-loopback IPv4 host in ``/ip4/<host>/tcp/...`` multiaddrs, if any."""
    for multiaddr in multiaddrs:
        parts = multiaddr.split("/")
        if (
            len(parts) > 2
            and parts[1] == "ip4"
            and not parts[2].startswith("127.")
            and parts[2] not in WILDCARD_HOSTS
        ):
            return parts[2]
    return None
