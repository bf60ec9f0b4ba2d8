"""One gRPC server per node: all-reduce, state sync, membership, status and the standard health service.

Every protocol piece is a servicer that can live on any ``grpc.aio`` server; the daemon puts them
all on one port, so a peer needs one address per node (the ``grpc_address`` of its DHT record),
one firewall rule, and one channel to each other peer per service. The server's message limit is
the largest any service needs (state-sync chunks, all-reduce chunks); each service still checks
its own, smaller limits on what it accepts. The status service (``status.py``) is for operators
(``dtnode status``), not peers, so it is listed apart from ``SERVICES``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protocol.allreduce.peer import SERVICE_NAME as ALLREDUCE_SERVICE
from protocol.allreduce.peer import AllReducePeer
from protocol.auth.channels import add_port, new_server
from protocol.discovery.addresses import local_dial_address
from protocol.membership.messages import Message
from protocol.membership.outbox import Outbox
from protocol.membership.records import CLIENT_ADDRESS
from protocol.membership.transport import SERVICE_NAME as MEMBERSHIP_SERVICE
from protocol.membership.transport import MembershipServicer, add_membership_to_server
from protocol.statesync.provider import SERVICE_NAME as STATESYNC_SERVICE
from protocol.statesync.provider import StateProvider, add_state_sync_to_server
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig
from protocol.swarm.status import SERVICE_NAME as STATUS_SERVICE
from protocol.swarm.status import NodeStatus, StatusServicer, add_status_to_server

logger = logging.getLogger(__name__)

SERVICES = (ALLREDUCE_SERVICE, STATESYNC_SERVICE, MEMBERSHIP_SERVICE)
OPERATOR_SERVICES = (STATUS_SERVICE,)


_MESSAGE_LIMITS = frozenset({"grpc.max_send_message_length", "grpc.max_receive_message_length"})


def _merged_options(*option_lists: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """One option list: message limits take the largest value, other options the first given."""
    merged: dict[str, int] = {}
    for options in option_lists:
        for key, value in options:
            if key in merged and key in _MESSAGE_LIMITS:
                merged[key] = max(merged[key], value)
            else:
                merged.setdefault(key, value)
    return list(merged.items())


class NodeServer:
    """The node's grpc.aio server and the services on it; build with :meth:`start` on an event loop."""

    def __init__(
        self,
        config: SwarmConfig,
        on_message: Callable[[str, Message], None],
        *,
        status: Callable[[], NodeStatus] | None = None,
        outbox: Outbox | None = None,
    ) -> None:
        self.config = config
        self.allreduce = AllReducePeer(config=config.allreduce, fault_plan=None, auth=config.auth)
        self.state_provider = StateProvider(config.statesync)
        self.membership = MembershipServicer(on_message, protocol_version=PROTOCOL_VERSION, outbox=outbox)
        self.status = StatusServicer(status) if status is not None else None
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._stopped = False
        self.port = 0

    @classmethod
    async def start(
        cls,
        config: SwarmConfig,
        on_message: Callable[[str, Message], None],
        *,
        status: Callable[[], NodeStatus] | None = None,
        outbox: Outbox | None = None,
    ) -> NodeServer:
        """Bind ``config.listen`` and serve every service; OSError if the address cannot be bound.

        A client (``config.client_mode``) binds nothing: it accepts no connections, so its services
        are built (its all-reduce peer dials out, its state provider and membership servicer hold what
        the node keeps) but no server runs them, and ``port`` stays 0.

        ``status`` builds the answer to ``Status.GetStatus`` on the loop (it must not block); without
        it the status service is not served. ``outbox``: the messages we hold for client-mode peers,
        which they fetch with ``Membership.Collect``.
        """
        node = cls(config, on_message, status=status, outbox=outbox)
        if config.client_mode:
            node.allreduce.dial_only()
            logger.info("client mode: no gRPC server (this node accepts no connections)")
            return node
        options = _merged_options(
            config.allreduce.grpc_options(server=True), config.statesync.server_options()
        )
        # A closed swarm: calls without a valid swarm-key token end with UNAUTHENTICATED (health and
        # status stay open, unless TLS closes the whole port to callers without a swarm certificate).
        server = new_server(options=options, auth=config.auth)
        node.allreduce.add_to_server(server)
        add_state_sync_to_server(server, node.state_provider)
        add_membership_to_server(server, node.membership)
        if node.status is not None:
            add_status_to_server(server, node.status)
        health_pb2_grpc.add_HealthServicer_to_server(node.health, server)
        port = add_port(server, config.listen, auth=config.auth)
        if port == 0:
            raise OSError(f"could not bind the gRPC server to {config.listen}")
        await server.start()
        served = (*SERVICES, *(OPERATOR_SERVICES if node.status is not None else ()))
        for service in ("", *served):
            await node.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        node._server, node.port = server, port
        logger.info("gRPC server on %s (port %d): %s", config.listen, port, ", ".join(served))
        return node

    @property
    def address(self) -> str:
        """``host:port`` other peers dial: the announced host and port (the port we are bound to unless
        a port forward's is announced), else the listen host (loopback for a wildcard); a client's
        ``CLIENT_ADDRESS``."""
        if self.config.client_mode:
            return CLIENT_ADDRESS
        host = self.config.announce_host or self.config.listen_host
        return local_dial_address(host, self.config.announce_port or self.port)

    async def stop(self, grace: timedelta) -> None:
        """Say NOT_SERVING, let in-flight calls finish for ``grace``, then close every service (a
        client's too: its all-reduce peer holds channels to its peers). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.health.enter_graceful_shutdown()
        server, self._server = self._server, None
        self.state_provider.close()
        if server is not None:
            await server.stop(grace.total_seconds())
        await self.allreduce.close()
