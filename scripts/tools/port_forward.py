"""A TCP port forward in user space, as a router's or a cloud provider's port mapping is.

    python scripts/tools/port_forward.py 10.213.0.1:40100=127.0.0.1:7000 10.213.0.1:40101=127.0.0.1:7001

Each ``LISTEN=TARGET`` pair accepts connections on LISTEN and opens one to TARGET for each, copying
bytes both ways until either side closes. It stands in for the port mapping of a rented GPU
(public port 40100 -> the container's 7000) where the kernel's NAT (iptables DNAT) is not at hand:
the node behind it is dialled at an outside port that differs from the one it listens on, which is
what ``--announce HOST:PORT`` and ``--dht-announce`` are for.

It prints ``forwarding LISTEN -> TARGET`` once per pair when it listens, and one line per connection
(``LISTEN: PEER -> TARGET``), so a test can tell that a peer's traffic came through it. Opening the
connection to TARGET has a deadline (``--connect-timeout``); an open connection lasts as long as its
two ends keep it. SIGINT or SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta

CHUNK_BYTES = 1 << 16


def parse_pair(text: str) -> tuple[tuple[str, int], tuple[str, int]]:
    """``LISTEN_HOST:PORT=TARGET_HOST:PORT`` as two (host, port) pairs; ValueError if malformed."""
    listen, equals, target = text.partition("=")
    if not equals:
        raise ValueError(f"a forward is LISTEN_HOST:PORT=TARGET_HOST:PORT, got {text!r}")
    addresses = []
    for address in (listen, target):
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"{address!r} in {text!r} is not HOST:PORT with a port in 1..65535")
        addresses.append((host.strip("[]"), int(port)))
    return addresses[0], addresses[1]


async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from ``reader`` to ``writer`` until EOF, then half-close ``writer``."""
    try:
        while chunk := await reader.read(CHUNK_BYTES):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass  # the other end went away: the connection ends, as a router's would


async def _serve_pair(
    listen: tuple[str, int], target: tuple[str, int], connect_timeout: timedelta
) -> asyncio.AbstractServer:
    label = f"{listen[0]}:{listen[1]}"

    async def on_connection(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        peer = client_writer.get_extra_info("peername")
        try:
            target_reader, target_writer = await asyncio.wait_for(
                asyncio.open_connection(*target), connect_timeout.total_seconds()
            )
        except (OSError, TimeoutError) as error:
            print(f"{label}: {peer[0]}:{peer[1]} -> {target[0]}:{target[1]} failed: {error}", flush=True)
            client_writer.close()
            return
        print(f"{label}: {peer[0]}:{peer[1]} -> {target[0]}:{target[1]}", flush=True)
        try:
            await asyncio.gather(_copy(client_reader, target_writer), _copy(target_reader, client_writer))
        finally:
            for writer in (client_writer, target_writer):
                writer.close()
                with contextlib.suppress(ConnectionError, OSError):
                    await writer.wait_closed()

    server = await asyncio.start_server(on_connection, *listen)
    print(f"forwarding {label} -> {target[0]}:{target[1]}", flush=True)
    return server


async def forward(
    pairs: Sequence[tuple[tuple[str, int], tuple[str, int]]], connect_timeout: timedelta, stop: asyncio.Event
) -> None:
    """Serve every pair until ``stop`` is set."""
    servers = [await _serve_pair(listen, target, connect_timeout) for listen, target in pairs]
    try:
        await stop.wait()
    finally:
        for server in servers:
            server.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pairs", nargs="+", metavar="LISTEN=TARGET", help="HOST:PORT=HOST:PORT to forward")
    parser.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to open TARGET")
    args = parser.parse_args(argv)
    try:
        pairs = [parse_pair(text) for text in args.pairs]
    except ValueError as error:
        parser.error(str(error))

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await forward(pairs, timedelta(seconds=args.connect_timeout), stop)

    try:
        asyncio.run(run())
    except OSError as error:  # a LISTEN address that cannot be bound
        print(f"port_forward: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
