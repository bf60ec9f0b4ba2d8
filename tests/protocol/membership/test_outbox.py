"""Messages for client-mode peers: held in an Outbox (bounded, expiring) and fetched by the client
with Membership.Collect, a long poll over a connection the client opens."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import grpc.aio
import pytest
import uvloop

from protocol.auth import SwarmKey
from protocol.auth.channels import SwarmAuth
from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.gen.dtnode.v1 import membership_pb2_grpc as pb_grpc
from protocol.membership.messages import Cancel, JoinRequest, Message, Reason
from protocol.membership.outbox import Outbox
from protocol.membership.transport import MembershipClient, MembershipServicer, add_membership_to_server
from protocol.membership.wire import to_envelope
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig
from protocol.swarm.server import NodeServer
from tests.machine_load import stretched
from tests.protocol.membership.fake_swarm import H0

VERSION = 5


def envelope(message: Message, sender: str = "leader") -> pb.MembershipEnvelope:
    return to_envelope(message, sender_id=sender, protocol_version=VERSION)


def cancel(n: int) -> Cancel:
    return Cancel(round=n, proposal_id=f"leader/{n}/1", reason=Reason.STALE_PROPOSAL)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_held_messages_are_bounded_expire_and_go_to_their_receiver_only() -> None:
    clock = FakeClock()
    outbox = Outbox(hold=timedelta(seconds=10), max_per_peer=3, max_peers=2, clock=clock)

    async def scenario() -> None:
        for n in range(1, 6):
            outbox.put("c1", envelope(cancel(n)))
        assert outbox.num_held("c1") == 3 and outbox.num_dropped == 2  # the oldest two went
        taken = await outbox.take("c1", timedelta(seconds=1))
        assert [e.cancel.round for e in taken] == [3, 4, 5]
        assert await outbox.take("c2", timedelta(0)) == []  # nothing for another peer
        outbox.put("c1", envelope(cancel(6)))
        clock.now += 11  # older than a proposal lives
        assert await outbox.take("c1", timedelta(0)) == []
        outbox.put("c1", envelope(cancel(7)))
        outbox.put("c2", envelope(cancel(8)))
        outbox.put("c3", envelope(cancel(9)))  # a third receiver: the least recently served goes
        assert outbox.num_held("c1") == 0 and outbox.num_held("c3") == 1

    uvloop.run(scenario())


def test_a_waiting_collect_returns_as_soon_as_a_message_is_put() -> None:
    outbox = Outbox(hold=timedelta(seconds=10))

    async def scenario() -> float:
        started = time.monotonic()
        waiting = asyncio.ensure_future(outbox.take("c1", timedelta(seconds=20)))
        await asyncio.sleep(0.2)
        outbox.put("c1", envelope(JoinRequest(round=2, param_hash=H0)))
        taken = await asyncio.wait_for(waiting, 5)
        assert [e.WhichOneof("message") for e in taken] == ["join_request"]
        return time.monotonic() - started

    # Returned when the message came (0.2 s), not at the end of its 20 s wait.
    assert uvloop.run(scenario()) < 0.2 + stretched(1.8)


@pytest.mark.timeout(30)
def test_a_client_collects_over_grpc_what_a_peer_held_for_it() -> None:
    async def scenario() -> None:
        outbox = Outbox(hold=timedelta(seconds=10))
        servicer = MembershipServicer(lambda sender, message: None, protocol_version=VERSION, outbox=outbox)
        server = grpc.aio.server()
        add_membership_to_server(server, servicer)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        address = f"127.0.0.1:{port}"
        client = MembershipClient(sender_id="c1", protocol_version=VERSION)
        other = MembershipClient(sender_id="c2", protocol_version=VERSION)
        try:
            outbox.put("c1", envelope(cancel(4)))
            assert await client.collect(address, wait=timedelta(seconds=5)) == [("leader", cancel(4))]
            # A long poll: it waits, and returns with the next message meant for us.
            polling = asyncio.ensure_future(client.collect(address, wait=timedelta(seconds=10)))
            await asyncio.sleep(0.3)
            assert not polling.done()
            outbox.put("c1", envelope(cancel(5)))
            assert await asyncio.wait_for(polling, 5) == [("leader", cancel(5))]
            assert await other.collect(address, wait=timedelta(milliseconds=100)) == []
            # Another protocol version is refused, as Deliver refuses it.
            stub = pb_grpc.MembershipStub(grpc.aio.insecure_channel(address))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Collect(
                    pb.CollectRequest(receiver_id="c1", protocol_version=VERSION + 1), timeout=5
                )
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.aio.AioRpcError) as bad_id:
                await stub.Collect(pb.CollectRequest(receiver_id="", protocol_version=VERSION), timeout=5)
            assert bad_id.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            # A wait longer than the call's own deadline ends (empty) before that deadline: a reply at
            # all says so (past its deadline the call ends DEADLINE_EXCEEDED on this side, whenever the
            # server answers). The server answers at 90% of the deadline less 50 ms: 0.35 s early at 3 s.
            reply = await stub.Collect(
                pb.CollectRequest(receiver_id="c1", protocol_version=VERSION, wait_ms=30_000), timeout=3.0
            )
            assert list(reply.envelopes) == []
        finally:
            await asyncio.gather(client.close(), other.close())
            await server.stop(0.1)

    uvloop.run(scenario())


@pytest.mark.timeout(30)
def test_a_closed_swarms_node_hands_held_messages_to_key_holders_only(tmp_path: Path) -> None:
    path = tmp_path / "swarm.key"
    SwarmKey.generate().write(path)
    key = SwarmKey.from_file(path)
    config = SwarmConfig(run_name="closed", listen="127.0.0.1:0", auth=SwarmAuth(key))

    async def scenario() -> None:
        outbox = Outbox(hold=timedelta(seconds=10))
        server = await NodeServer.start(config, lambda sender, message: None, outbox=outbox)
        keyless = MembershipClient(sender_id="c1", protocol_version=PROTOCOL_VERSION)
        member = MembershipClient(sender_id="c1", protocol_version=PROTOCOL_VERSION, auth=SwarmAuth(key))
        try:
            held = to_envelope(cancel(3), sender_id="leader", protocol_version=PROTOCOL_VERSION)
            outbox.put("c1", held)
            assert await keyless.collect(server.address, wait=timedelta(seconds=1)) is None  # refused
            assert outbox.num_held("c1") == 1  # and it took nothing
            assert await member.collect(server.address, wait=timedelta(seconds=1)) == [("leader", cancel(3))]
        finally:
            await asyncio.gather(keyless.close(), member.close())
            await server.stop(timedelta(seconds=0.1))

    uvloop.run(scenario())
