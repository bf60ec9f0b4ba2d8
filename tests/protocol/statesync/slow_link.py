"""A slow uplink in user space: a TCP proxy on loopback that lets a server's bytes out at a fixed rate.

    async with SlowLink(server.address, bytes_per_second=1_875_000) as link:
        await fetch_state([link.address], ...)        # every byte the server sends crosses the link

Like a home uplink, one rate is shared by every connection through the link, and the server feels
it: the proxy reads the server's bytes only as fast as it lets them out, so the server's writes back
up (TCP and HTTP/2 flow control) instead of vanishing into a buffer. Bytes towards the server are
not slowed (requests, window updates and pings are small). No latency and no loss are emulated.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType

READ_BYTES = 16 * 1024
"""The proxy moves at most this many bytes per step (at 1.9 MB/s, one step per ~9 ms)."""


class SlowLink:
    """A listening proxy on 127.0.0.1 (port 0) in front of `target` ("host:port")."""

    def __init__(self, target: str, *, bytes_per_second: float) -> None:
        if bytes_per_second <= 0:
            raise ValueError(f"bytes_per_second must be positive, got {bytes_per_second}")
        self.target_host, port = target.rsplit(":", 1)
        self.target_port = int(port)
        self.bytes_per_second = bytes_per_second
        self.num_bytes_sent = 0
        """Bytes of the server's that crossed the link so far."""
        self._free_at = 0.0  # time.monotonic() when the link has sent everything handed to it
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []

    @property
    def address(self) -> str:
        assert self._server is not None, "enter the link first"
        port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{port}"

    async def __aenter__(self) -> SlowLink:
        self._server = await asyncio.start_server(self._connect, host="127.0.0.1", port=0)
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _connect(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        server_reader, server_writer = await asyncio.open_connection(self.target_host, self.target_port)
        self._writers += [client_writer, server_writer]
        for task in (
            asyncio.create_task(self._pump(client_reader, server_writer, slow=False)),
            asyncio.create_task(self._pump(server_reader, client_writer, slow=True)),
        ):
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, slow: bool) -> None:
        """Copy until EOF; on the slow side, hand each piece on once the link would have sent it."""
        try:
            # One side hung up (ConnectionError): close the other, as a router would.
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(READ_BYTES):
                    if slow:
                        now = time.monotonic()
                        self._free_at = max(now, self._free_at) + len(data) / self.bytes_per_second
                        await asyncio.sleep(self._free_at - now)
                        self.num_bytes_sent += len(data)
                    writer.write(data)
                    await writer.drain()
        finally:
            writer.close()
