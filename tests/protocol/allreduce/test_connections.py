"""Connections to other members: an attempt may take as long as `connect_timeout`, and a round waits
for a member's connection (up or failed) before sending it anything.

On a saturated 100 Mbit/s uplink every handshake packet queues behind bulk data, so a TCP + HTTP/2
handshake takes hundreds of milliseconds. gRPC gives each attempt `grpc.min_reconnect_backoff_ms`
(our connect timeout); it used to be 200 ms, so connections to live members failed in the benchmark.
A listening socket that never speaks HTTP/2 stands in for such a handshake here: the kernel accepts the
TCP connection, and the gRPC client then waits for the server's HTTP/2 settings forever.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import grpc
import pytest
import uvloop

from protocol.allreduce import AllReduceConfig
from protocol.allreduce.client import PeerClient
from tests.protocol.allreduce.support import local_peers

State = grpc.ChannelConnectivity


@contextmanager
def silent_listener() -> Iterator[str]:
    """host:port of a socket that accepts TCP connections but never answers: a handshake that hangs."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


def closed_port_address() -> str:
    """host:port where nothing listens (a dead member): connecting is refused at once."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


async def states_seen(client: PeerClient, address: str, seconds: float) -> list[State]:
    """Start connecting to `address`; record the states the channel goes through for `seconds`, or
    until the attempt failed."""
    channel = client.channel(address)
    state = channel.get_state(try_to_connect=True)
    seen = [state]
    give_up = time.monotonic() + seconds
    while state is not State.TRANSIENT_FAILURE and (time_left := give_up - time.monotonic()) > 0:
        try:
            await asyncio.wait_for(channel.wait_for_state_change(state), time_left)
        except TimeoutError:
            break
        state = channel.get_state()
        seen.append(state)
    return seen


@pytest.mark.timeout(30)
def test_a_slow_handshake_is_not_cut_short() -> None:
    async def scenario() -> list[State]:
        client = PeerClient(AllReduceConfig().grpc_options(server=False))
        try:
            with silent_listener() as address:
                return await states_seen(client, address, 1.5)
        finally:
            await client.close()

    seen = uvloop.run(scenario())
    # Still trying after 1.5 s, 7x the old 200 ms attempt deadline.
    assert State.TRANSIENT_FAILURE not in seen, seen
    assert seen[-1] is State.CONNECTING


@pytest.mark.timeout(30)
def test_an_attempt_fails_after_the_connect_timeout() -> None:
    config = AllReduceConfig(connect_timeout=timedelta(milliseconds=300))

    async def scenario() -> list[State]:
        client = PeerClient(config.grpc_options(server=False))
        try:
            with silent_listener() as address:
                return await states_seen(client, address, 3.0)
        finally:
            await client.close()

    assert State.TRANSIENT_FAILURE in uvloop.run(scenario())


@pytest.mark.timeout(30)
def test_wait_connected_returns_once_the_attempt_settles_or_times_out() -> None:
    async def scenario() -> dict[str, tuple[float, State]]:
        client = PeerClient(AllReduceConfig().grpc_options(server=False))
        outcomes: dict[str, tuple[float, State]] = {}

        async def wait(name: str, address: str, timeout: float) -> None:
            start = time.monotonic()
            await client.wait_connected(address, timeout)
            outcomes[name] = (time.monotonic() - start, client.channel(address).get_state())

        try:
            async with local_peers(1) as peers:
                with silent_listener() as hanging:
                    await asyncio.gather(
                        wait("live", peers[0].address, 10.0),
                        wait("dead", closed_port_address(), 10.0),
                        wait("hanging", hanging, 0.5),
                    )
        finally:
            await client.close()
        return outcomes

    outcomes = uvloop.run(scenario())
    live_seconds, live_state = outcomes["live"]
    assert live_state is State.READY and live_seconds < 5.0
    dead_seconds, dead_state = outcomes["dead"]
    assert dead_state is State.TRANSIENT_FAILURE and dead_seconds < 5.0
    hanging_seconds, hanging_state = outcomes["hanging"]
    assert hanging_state is State.CONNECTING and 0.4 < hanging_seconds < 5.0
