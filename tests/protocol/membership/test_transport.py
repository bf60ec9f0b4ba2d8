"""The membership transport on loopback: messages arrive with their sender, bad envelopes get the status
the proto promises (and the server keeps serving), and a send never raises or outlives its timeout."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import grpc
import grpc.aio
import pytest
import uvloop

from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.gen.dtnode.v1 import membership_pb2_grpc as pb_grpc
from protocol.membership.messages import (
    MAX_GROUP_SIZE,
    Accept,
    Begin,
    Cancel,
    GroupMember,
    GroupSpec,
    JoinRequest,
    Message,
    Proposal,
    Reason,
    Reject,
    Withdraw,
)
from protocol.membership.records import MAX_ADDRESS_CHARS, MAX_PEER_ID_CHARS
from protocol.membership.transport import (
    MAX_MESSAGE_BYTES,
    SERVICE_NAME,
    MembershipClient,
    MembershipServicer,
    add_membership_to_server,
)
from protocol.membership.wire import to_envelope
from tests.machine_load import stretched
from tests.protocol.membership.fake_swarm import H0

VERSION = 5
TIMEOUT = timedelta(seconds=5)
LOGGER = "protocol.membership.transport"


def _group(ids: list[str], *, address: str = "10.0.0.1:5000", vector_length: int = 1 << 20) -> GroupSpec:
    members = tuple(
        GroupMember(peer_id=peer_id, grpc_address=address, num_tokens=i, bandwidth_bytes_per_s=1e6 + i)
        for i, peer_id in enumerate(ids)
    )
    bounds = tuple(vector_length * i // len(ids) for i in range(len(ids) + 1))
    return GroupSpec(
        round=9,
        group_id=f"{ids[0]}/9/1",
        leader_id=ids[0],
        param_hash=H0,
        vector_length=vector_length,
        members=members,
        part_boundaries=bounds,
    )


MESSAGES: list[Message] = [
    JoinRequest(round=9, param_hash=H0),
    Proposal(round=9, proposal_id="a/9/1", param_hash=H0, members=("a", "b", "c")),
    Accept(
        round=9,
        proposal_id="a/9/1",
        grpc_address="127.0.0.1:1234",
        num_tokens=4096,
        bandwidth_bytes_per_s=2e6,
    ),
    Reject(round=9, proposal_id="a/9/1", reason=Reason.ALREADY_IN_GROUP),
    Withdraw(round=9, proposal_id="a/9/1", reason=Reason.BEGIN_TIMEOUT),
    Cancel(round=9, proposal_id="a/9/1", reason=Reason.STALE_PROPOSAL),
    Begin(group=_group(["a", "b", "c"])),
]


@dataclass
class Served:
    address: str
    servicer: MembershipServicer
    received: list[tuple[str, Message]] = field(default_factory=list)


@asynccontextmanager
async def serving(
    on_message: Callable[[str, Message], None] | None = None, *, protocol_version: int = VERSION
) -> AsyncIterator[Served]:
    """A grpc.aio server on 127.0.0.1 (port 0) with a servicer that records what it is handed."""
    received: list[tuple[str, Message]] = []

    def record(sender_id: str, message: Message) -> None:
        received.append((sender_id, message))

    servicer = MembershipServicer(on_message or record, protocol_version=protocol_version)
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    add_membership_to_server(server, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Served(f"127.0.0.1:{port}", servicer, received)
    finally:
        await server.stop(0.1)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def _silent_peer() -> Iterator[str]:
    """An address whose kernel completes the TCP handshake but that never says a word of HTTP/2."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.timeout(20)
def test_sent_messages_arrive_with_the_right_sender() -> None:
    async def scenario() -> Served:
        async with serving() as served:
            alice = MembershipClient(sender_id="alice", protocol_version=VERSION)
            bob = MembershipClient(sender_id="bob", protocol_version=VERSION)
            for message in MESSAGES:
                assert await alice.send(served.address, message, timeout=TIMEOUT)
                assert await bob.send(served.address, message, timeout=TIMEOUT)
            # Concurrent sends over the same channels all arrive too (in some order).
            results = await asyncio.gather(
                *(
                    client.send(served.address, m, timeout=TIMEOUT)
                    for client in (alice, bob)
                    for m in MESSAGES * 5
                )
            )
            assert all(results)
            await asyncio.gather(alice.close(), bob.close())
            return served

    served = uvloop.run(scenario())
    in_order = [(sender, message) for message in MESSAGES for sender in ("alice", "bob")]
    assert served.received[: len(in_order)] == in_order
    assert all(
        type(got) is type(sent)
        for (_, got), (_, sent) in zip(served.received[: len(in_order)], in_order, strict=True)
    )
    concurrent = Counter((sender, m) for sender in ("alice", "bob") for m in MESSAGES * 5)
    assert Counter(served.received[len(in_order) :]) == concurrent
    assert served.servicer.num_delivered == len(served.received) == 2 * len(MESSAGES) * 6
    assert not served.servicer.num_refusals


@pytest.mark.timeout(20)
def test_the_largest_legal_begin_is_delivered() -> None:
    """1024 members with the longest ids and addresses fit the message limit with room to spare."""
    ids = [f"{i:04d}".ljust(MAX_PEER_ID_CHARS, "x") for i in range(MAX_GROUP_SIZE)]
    address = "h" * (MAX_ADDRESS_CHARS - len(":65535")) + ":65535"
    begin = Begin(group=_group(ids, address=address))
    size = to_envelope(begin, sender_id=ids[0], protocol_version=VERSION).ByteSize()
    assert size < MAX_MESSAGE_BYTES / 4

    async def scenario() -> Served:
        async with serving() as served:
            client = MembershipClient(sender_id=ids[0], protocol_version=VERSION)
            assert await client.send(served.address, begin, timeout=TIMEOUT)
            await client.close()
            return served

    assert uvloop.run(scenario()).received == [(ids[0], begin)]


def _raw(message: Message, *, protocol_version: int = VERSION) -> pb.MembershipEnvelope:
    return to_envelope(message, sender_id="raw", protocol_version=protocol_version)


def _unspecified_reason() -> pb.MembershipEnvelope:
    envelope = _raw(MESSAGES[3])
    envelope.reject.reason = pb.REASON_UNSPECIFIED
    return envelope


def _huge_unsorted_group() -> pb.MembershipEnvelope:
    """The validation error lists all 1024 ids (~130 KB): far more than a status may carry."""
    ids = [f"{i:04d}".ljust(MAX_PEER_ID_CHARS, "x") for i in range(MAX_GROUP_SIZE)]
    envelope = _raw(Begin(group=_group(ids)))
    members = envelope.begin.group.members
    first, last = pb.GroupMember(), pb.GroupMember()
    first.CopyFrom(members[0])
    last.CopyFrom(members[-1])
    members[0].CopyFrom(last)
    members[-1].CopyFrom(first)
    envelope.begin.group.leader_id = last.peer_id
    return envelope


def _bad_hash(protocol_version: int = VERSION) -> pb.MembershipEnvelope:
    envelope = _raw(MESSAGES[0], protocol_version=protocol_version)
    envelope.join_request.param_hash = "not a hash"
    return envelope


BAD_ENVELOPES = [
    ("no message", pb.MembershipEnvelope(sender_id="raw", protocol_version=VERSION), "INVALID_ARGUMENT"),
    (
        "no sender",
        pb.MembershipEnvelope(protocol_version=VERSION, join_request=_raw(MESSAGES[0]).join_request),
        "INVALID_ARGUMENT",
    ),
    ("unspecified reason", _unspecified_reason(), "INVALID_ARGUMENT"),
    ("bad param_hash", _bad_hash(), "INVALID_ARGUMENT"),
    ("huge unsorted group", _huge_unsorted_group(), "INVALID_ARGUMENT"),
    ("wrong version", _raw(MESSAGES[6], protocol_version=VERSION + 1), "FAILED_PRECONDITION"),
    ("version 0", _raw(MESSAGES[0], protocol_version=0), "FAILED_PRECONDITION"),
    # The version is checked first: a peer of another version may mean other things by the same bytes.
    ("wrong version, bad hash", _bad_hash(VERSION - 1), "FAILED_PRECONDITION"),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("envelope", "code"), [(e, c) for _, e, c in BAD_ENVELOPES], ids=[n for n, _, _ in BAD_ENVELOPES]
)
def test_a_bad_envelope_gets_its_status_and_the_server_keeps_serving(
    envelope: pb.MembershipEnvelope, code: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> tuple[grpc.StatusCode, str, Served]:
        async with serving() as served, grpc.aio.insecure_channel(served.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb_grpc.MembershipStub(channel).Deliver(envelope, timeout=5)
            client = MembershipClient(sender_id="good", protocol_version=VERSION)
            assert await client.send(served.address, MESSAGES[0], timeout=TIMEOUT)
            await client.close()
            return refused.value.code(), refused.value.details() or "", served

    with caplog.at_level(logging.INFO, logger=LOGGER):
        status, details, served = uvloop.run(scenario())
    assert status.name == code
    assert len(details) <= 410  # shortened, so it fits the caller's metadata limit
    assert served.servicer.num_refusals == Counter({code: 1})
    assert served.received == [("good", MESSAGES[0])]  # the bad envelope never reached the handler
    refusals = [r for r in caplog.records if r.name == LOGGER and "refused" in r.getMessage()]
    assert len(refusals) == 1 and code in refusals[0].getMessage()


@pytest.mark.timeout(20)
def test_a_failing_handler_costs_one_message_not_the_server(caplog: pytest.LogCaptureFixture) -> None:
    handled: list[Message] = []

    def on_message(sender_id: str, message: Message) -> None:
        if isinstance(message, Proposal):
            raise RuntimeError("bug in the handler")
        handled.append(message)

    async def scenario() -> tuple[list[bool], Served]:
        async with serving(on_message) as served:
            client = MembershipClient(sender_id="alice", protocol_version=VERSION)
            results = [await client.send(served.address, m, timeout=TIMEOUT) for m in MESSAGES]
            await client.close()
            return results, served

    with caplog.at_level(logging.INFO, logger=LOGGER):
        results, served = uvloop.run(scenario())
    assert results == [not isinstance(m, Proposal) for m in MESSAGES]
    assert handled == [m for m in MESSAGES if not isinstance(m, Proposal)]
    assert served.servicer.num_refusals == Counter({"INTERNAL": 1})
    failures = [r for r in caplog.records if r.name == LOGGER and r.exc_info is not None]
    assert len(failures) == 1 and "bug in the handler" in str(failures[0].exc_info[1])  # type: ignore[index]
    assert any("INTERNAL" in r.getMessage() for r in caplog.records if r.name == LOGGER)  # the sender's line


@pytest.mark.timeout(20)
def test_send_to_a_closed_port_returns_false_within_its_timeout(caplog: pytest.LogCaptureFixture) -> None:
    timeout = timedelta(seconds=3)

    async def scenario() -> tuple[bool, float]:
        client = MembershipClient(sender_id="alice", protocol_version=VERSION)
        start = time.monotonic()
        delivered = await client.send(f"127.0.0.1:{_free_port()}", MESSAGES[0], timeout=timeout)
        elapsed = time.monotonic() - start
        await client.close()
        return delivered, elapsed

    with caplog.at_level(logging.INFO, logger=LOGGER):
        delivered, elapsed = uvloop.run(scenario())
    assert delivered is False and elapsed < timeout.total_seconds()
    assert [r.levelno for r in caplog.records if r.name == LOGGER] == [logging.INFO]
    assert "UNAVAILABLE" in caplog.records[-1].getMessage()


@pytest.mark.timeout(20)
def test_send_to_a_silent_peer_returns_false_at_its_deadline(caplog: pytest.LogCaptureFixture) -> None:
    timeout = timedelta(milliseconds=700)

    async def scenario(address: str) -> tuple[bool, float]:
        client = MembershipClient(sender_id="alice", protocol_version=VERSION)
        start = time.monotonic()
        delivered = await client.send(address, MESSAGES[0], timeout=timeout)
        elapsed = time.monotonic() - start
        await client.close()
        return delivered, elapsed

    with _silent_peer() as address, caplog.at_level(logging.INFO, logger=LOGGER):
        delivered, elapsed = uvloop.run(scenario(address))
    assert delivered is False
    assert timeout.total_seconds() * 0.9 <= elapsed < timeout.total_seconds() + stretched(1.0)
    assert "DEADLINE_EXCEEDED" in caplog.records[-1].getMessage()


@pytest.mark.timeout(20)
def test_close_ends_sends_in_flight_and_refuses_later_ones() -> None:
    async def scenario(address: str) -> tuple[bool, float, bool, tuple[str, ...]]:
        client = MembershipClient(sender_id="alice", protocol_version=VERSION)
        start = time.monotonic()
        in_flight = asyncio.create_task(client.send(address, MESSAGES[0], timeout=timedelta(seconds=10)))
        await asyncio.sleep(0.2)
        await client.close()
        delivered = await in_flight
        elapsed = time.monotonic() - start
        later = await client.send(address, MESSAGES[0], timeout=TIMEOUT)
        return delivered, elapsed, later, client.cached_addresses

    with _silent_peer() as address:
        delivered, elapsed, later, cached = uvloop.run(scenario(address))
    assert delivered is False and elapsed < 5  # ended by close(), long before its 10 s deadline
    assert later is False and cached == ()


@pytest.mark.timeout(20)
def test_a_cancelled_send_stays_cancelled() -> None:
    """Cancelling the caller is not a network error: send re-raises it rather than returning False."""

    async def scenario(address: str) -> None:
        client = MembershipClient(sender_id="alice", protocol_version=VERSION)
        task = asyncio.create_task(client.send(address, MESSAGES[0], timeout=timedelta(seconds=10)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()

    with _silent_peer() as address:
        uvloop.run(scenario(address))


@pytest.mark.timeout(30)
def test_the_channel_cache_is_bounded_least_recently_used_first_and_spares_busy_channels() -> None:
    async def scenario(silent: str) -> None:
        async with serving() as a, serving() as b, serving() as c:
            client = MembershipClient(sender_id="alice", protocol_version=VERSION, max_channels=2)
            for served in (a, b, c, b, a):
                assert await client.send(served.address, MESSAGES[0], timeout=TIMEOUT)
            # a, b, c -> c evicts a; b is used again -> (c, b); a comes back and evicts c.
            assert client.cached_addresses == (b.address, a.address)
            assert [len(s.received) for s in (a, b, c)] == [2, 2, 1]

            # A call in flight keeps its channel open even when the cache must shrink.
            small = MembershipClient(sender_id="alice", protocol_version=VERSION, max_channels=1)
            start = time.monotonic()
            busy = asyncio.create_task(small.send(silent, MESSAGES[0], timeout=timedelta(seconds=1)))
            await asyncio.sleep(0.2)
            assert await small.send(a.address, MESSAGES[0], timeout=TIMEOUT)
            assert small.cached_addresses == (silent,)  # a's idle channel went, the busy one stayed
            assert await busy is False
            assert time.monotonic() - start >= 0.9  # it ran to its deadline: nothing cancelled it
            assert len(small.cached_addresses) == 1
            await asyncio.gather(client.close(), small.close())

    with _silent_peer() as silent:
        uvloop.run(scenario(silent))


@pytest.mark.timeout(10)
def test_names_and_argument_checks() -> None:
    assert pb.DESCRIPTOR.services_by_name["Membership"].full_name == SERVICE_NAME
    with pytest.raises(ValueError, match="sender_id"):
        MembershipClient(sender_id="two words", protocol_version=1)
    with pytest.raises(ValueError, match="protocol_version"):
        MembershipClient(sender_id="a", protocol_version=-1)
    with pytest.raises(ValueError, match="max_channels"):
        MembershipClient(sender_id="a", protocol_version=1, max_channels=0)
    with pytest.raises(ValueError, match="protocol_version"):
        MembershipServicer(lambda sender, message: None, protocol_version=2**31)
