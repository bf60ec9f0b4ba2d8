"""StateSyncServer: a grpc.aio server of its own for a StateProvider, with the stock health service.

The daemon normally hosts the provider on the all-reduce server (`add_state_sync_to_server`); this
server is for a node that only serves state, for tools and for tests:

    server = await StateSyncServer.start(host="127.0.0.1", port=0)   # port 0: any free port
    server.provider.publish(snapshot)
    ... fetch_state([server.address], ...) elsewhere ...
    await server.stop()
"""

from __future__ import annotations

import logging
from datetime import timedelta

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from protocol.discovery.addresses import local_dial_address
from protocol.statesync.config import StateSyncConfig
from protocol.statesync.faults import ServeFaultPlan
from protocol.statesync.provider import SERVICE_NAME, StateProvider, add_state_sync_to_server

logger = logging.getLogger(__name__)


class StateSyncServer:
    """A bound, started grpc.aio server serving one StateProvider and the health service."""

    def __init__(
        self, server: grpc.aio.Server, provider: StateProvider, health: HealthServicer, host: str, port: int
    ):
        self._server: grpc.aio.Server | None = server
        self.provider = provider
        self._health = health
        self.host = host
        self.port = port

    @classmethod
    async def start(
        cls,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        config: StateSyncConfig | None = None,
        fault_plan: ServeFaultPlan | None = None,
    ) -> StateSyncServer:
        """Bind host:port (port 0 picks a free port, see `.port`) and start serving an empty provider."""
        provider = StateProvider(config, fault_plan=fault_plan)
        server = grpc.aio.server(options=provider.config.server_options())
        add_state_sync_to_server(server, provider)
        health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        bound = server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        await server.start()
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        logger.info("state sync serving on %s:%d", host, bound)
        return cls(server, provider, health, host, bound)

    @property
    def address(self) -> str:
        """host:port fetchers should dial (loopback if we bound a wildcard host)."""
        return local_dial_address(self.host, self.port)

    async def stop(self, grace: timedelta | None = None) -> None:
        """Graceful stop: refuse new RPCs, let in-flight transfers finish for `grace`, then cancel them."""
        if self._server is None:
            return
        server, self._server = self._server, None
        await self._health.enter_graceful_shutdown()
        self.provider.close()
        await server.stop((grace if grace is not None else self.provider.config.server_grace).total_seconds())
