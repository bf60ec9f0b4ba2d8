"""The gRPC transport of round formation: a servicer that receives membership messages, a client that sends them.

Round formation (``rounds.py``) is a pure state machine: it consumes ``(sender, message)`` pairs and
returns actions, some of which are ``Send(peer, message)``. This module only moves those messages
between peers, one unary ``Membership.Deliver`` call per message (``membership.proto``):

- :class:`MembershipServicer` checks the envelope's protocol version (FAILED_PRECONDITION if it is
  not ours, before reading anything else), parses it with :func:`~protocol.membership.wire.from_envelope`
  (INVALID_ARGUMENT if malformed), and hands ``(sender_id, message)`` to the daemon's ``on_message``
  synchronously, on the server's event loop: the handler only feeds the state machine and queues
  its actions, so it never blocks. The reply is always empty; an answer is a Deliver the other way.
  Every refusal is one gRPC status, one log line and one count in ``num_refusals``; a handler that
  raises ``ValueError`` refuses the message (INVALID_ARGUMENT: the driver does for a sender that
  claims to be the receiving node, found by ``scripts/tools/fuzz_rpcs.py``), one that raises anything else
  is logged with its traceback and answered INTERNAL, and the server goes on serving.
- :class:`MembershipClient` sends one message per call, with a deadline, over one cached insecure
  channel per peer address. A failed call (peer gone, refused, deadline passed) is logged at INFO
  and returned as ``False``, never raised: a lost message looks like a slow peer, and round
  formation already handles those with its own deadlines.

- ``Membership.Collect`` is the way back to a peer nobody can dial (client mode): messages for it
  wait in the sender's :class:`~protocol.membership.outbox.Outbox`, and the client fetches them with
  :meth:`MembershipClient.collect`, a long poll over a connection it opens itself.

Both sides set explicit message limits, ``MAX_MESSAGE_BYTES``; the daemon's server must allow at
least as much (the largest legal Begin, 1024 members with the longest ids and addresses, is well
under half a MiB).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Final, NoReturn

import grpc
import grpc.aio

from protocol.auth.channels import SwarmAuth, open_channel
from protocol.gen.dtnode.v1 import membership_pb2 as pb
from protocol.gen.dtnode.v1 import membership_pb2_grpc as pb_grpc
from protocol.lenient import Malformed, lenient
from protocol.membership.messages import Message
from protocol.membership.outbox import MAX_WAIT, Outbox
from protocol.membership.records import MAX_PEER_ID_CHARS, MAX_PROTOCOL_VERSION, check_int, check_peer_id
from protocol.membership.wire import from_envelope, to_envelope

logger = logging.getLogger(__name__)

SERVICE_NAME: Final = "dtnode.v1.Membership"
MAX_MESSAGE_BYTES: Final = 4 * 1024 * 1024
"""Largest envelope either side sends or accepts; set the same (or more) on the daemon's server."""
COLLECT_MARGIN: Final = timedelta(seconds=5)
"""How much longer than its wait a Collect call may take (a reply on a slow link)."""
MAX_CACHED_CHANNELS: Final = 256
"""Channels a client keeps open by default; past that, the least recently used idle one is closed."""
# Status details and log lines quote the validation error, which can list a whole group's ids;
# a long status would not even fit the peer's metadata limit.
_MAX_DETAILS_CHARS: Final = 400


def channel_options() -> list[tuple[str, int]]:
    """The client's default channel options: explicit message limits, no hidden retries, and a short
    reconnect backoff, so a peer that restarts is reachable again within about two seconds rather
    than after gRPC's default backoff of up to two minutes.

    ``grpc.min_reconnect_backoff_ms`` stays at its default on purpose: gRPC also uses it as the
    minimum time a connection attempt may take, and a TCP + HTTP/2 handshake over a slow link can
    take longer than a short backoff. Each call's own deadline bounds the wait anyway.
    """
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2000),
    ]


def _shorten(text: str) -> str:
    return text if len(text) <= _MAX_DETAILS_CHARS else text[:_MAX_DETAILS_CHARS] + "..."


class MembershipServicer(pb_grpc.MembershipServicer):
    """Receives membership messages and hands each valid one to ``on_message(sender_id, message)``.

    ``on_message`` runs on the server's event loop and must not block. The sender id is the one the
    envelope claims; nothing authenticates it yet.
    """

    def __init__(
        self,
        on_message: Callable[[str, Message], None],
        *,
        protocol_version: int,
        outbox: Outbox | None = None,
    ) -> None:
        """``outbox``: the messages we hold for client-mode peers, served by ``Collect`` (None: we
        hold none, and ``Collect`` is refused UNIMPLEMENTED)."""
        self._on_message = on_message
        self._outbox = outbox
        self.protocol_version = check_int("protocol_version", protocol_version, maximum=MAX_PROTOCOL_VERSION)
        self.num_delivered = 0
        """Messages handed to ``on_message`` that it handled without raising."""
        self.num_refusals: Counter[str] = Counter()
        """Calls ended with a status other than OK, by status name."""

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        code: grpc.StatusCode,
        message: str,
        *,
        level: int,
        rpc: str = "Deliver",
    ) -> NoReturn:
        message = _shorten(message)
        self.num_refusals[code.name] += 1
        logger.log(level, "refused %s from %s: %s: %s", rpc, context.peer(), code.name, message)
        await context.abort(code, message)
        raise AssertionError("context.abort returned")

    async def _check_request(
        self,
        request: pb.MembershipEnvelope | pb.CollectRequest | Malformed,
        context: grpc.aio.ServicerContext,
        *,
        rpc: str,
        who: str,
    ) -> None:
        """Refuse bytes that do not parse (INVALID_ARGUMENT) and another protocol version
        (FAILED_PRECONDITION, routine while a swarm upgrades); ``who`` names the caller in the latter."""
        if isinstance(request, Malformed):
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, request.error, level=logging.WARNING, rpc=rpc
            )
        if request.protocol_version != self.protocol_version:
            await self._refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{who} speak{'' if who == 'you' else 's'} protocol version {request.protocol_version}; "
                f"I speak {self.protocol_version}",
                level=logging.INFO,
                rpc=rpc,
            )

    async def Deliver(
        self, request: pb.MembershipEnvelope | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.DeliverReply:
        who = "" if isinstance(request, Malformed) else repr(request.sender_id[:MAX_PEER_ID_CHARS])
        await self._check_request(request, context, rpc="Deliver", who=who)
        assert not isinstance(request, Malformed)
        try:
            sender_id, message = from_envelope(request)
        except ValueError as error:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(error), level=logging.WARNING)
        try:
            self._on_message(sender_id, message)
        except ValueError as error:  # the handler refused the message itself, e.g. a sender claiming our id
            await self._refuse(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{type(message).__name__} refused: {error}",
                level=logging.WARNING,
            )
        except Exception as error:  # a bug in the handler must cost one message, not the server
            self.num_refusals[grpc.StatusCode.INTERNAL.name] += 1
            logger.exception("handling %s from %r failed", type(message).__name__, sender_id)
            # The details stay in our log: a peer learns only that the fault was ours, not its.
            await context.abort(grpc.StatusCode.INTERNAL, "handling your message failed on my side")
            raise AssertionError("context.abort returned") from error
        self.num_delivered += 1
        return pb.DeliverReply()

    async def Collect(
        self, request: pb.CollectRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.CollectReply:
        await self._check_request(request, context, rpc="Collect", who="you")
        assert not isinstance(request, Malformed)
        try:
            receiver_id = check_peer_id(request.receiver_id, "receiver_id")
        except ValueError as error:
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, str(error), level=logging.WARNING, rpc="Collect"
            )
        if self._outbox is None:
            await self._refuse(
                context,
                grpc.StatusCode.UNIMPLEMENTED,
                "I hold no messages for clients",
                level=logging.INFO,
                rpc="Collect",
            )
        wait = min(timedelta(milliseconds=request.wait_ms), MAX_WAIT)
        remaining = context.time_remaining()  # answer (empty) before the caller's own deadline
        if remaining is not None:
            wait = min(wait, timedelta(seconds=max(0.0, 0.9 * remaining - 0.05)))
        return pb.CollectReply(envelopes=await self._outbox.take(receiver_id, wait))


def add_membership_to_server(server: grpc.aio.Server, servicer: MembershipServicer) -> None:
    """Serve ``servicer`` on ``server`` (call before ``server.start()``), like the generated helper but
    with a deserializer that turns bytes that do not parse into an INVALID_ARGUMENT refusal.

    The server's message limits must be at least ``MAX_MESSAGE_BYTES``; mark ``SERVICE_NAME``
    SERVING in its health service.
    """
    deliver = grpc.unary_unary_rpc_method_handler(
        servicer.Deliver,
        request_deserializer=lenient(pb.MembershipEnvelope),
        response_serializer=pb.DeliverReply.SerializeToString,
    )
    collect = grpc.unary_unary_rpc_method_handler(
        servicer.Collect,
        request_deserializer=lenient(pb.CollectRequest),
        response_serializer=pb.CollectReply.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"Deliver": deliver, "Collect": collect}),)
    )


class MembershipClient:
    """Sends membership messages as ``sender_id``; one cached channel per address, all on one event loop.

    ``options`` adds to or overrides :func:`channel_options` key by key; ``auth`` is presented on
    every call (``protocol.auth``), as a closed swarm's servers require. The cache holds at most
    ``max_channels`` channels: opening one more closes the least recently used channel that carries
    no call (only if every cached channel is busy does the cache grow past the bound, until those
    calls end; closing a busy channel would cancel its call).
    """

    def __init__(
        self,
        *,
        sender_id: str,
        protocol_version: int,
        options: list[tuple[str, int]] | None = None,
        max_channels: int = MAX_CACHED_CHANNELS,
        auth: SwarmAuth | None = None,
    ) -> None:
        self.sender_id = check_peer_id(sender_id, "sender_id")
        self._auth = auth
        self.protocol_version = check_int("protocol_version", protocol_version, maximum=MAX_PROTOCOL_VERSION)
        self.max_channels = check_int("max_channels", max_channels, minimum=1)
        self._options = list({**dict(channel_options()), **dict(options or [])}.items())
        self._channels: OrderedDict[str, grpc.aio.Channel] = OrderedDict()  # least recently used first
        self._num_calls: Counter[str] = Counter()  # calls in flight per address
        self._closing: set[asyncio.Task[None]] = set()  # closes of evicted channels, awaited by close()
        self._closed = False

    @property
    def cached_addresses(self) -> tuple[str, ...]:
        """Addresses with an open channel, least recently used first."""
        return tuple(self._channels)

    async def send(self, address: str, message: Message, *, timeout: timedelta) -> bool:
        """Deliver ``message`` to the peer at ``address`` within ``timeout``; True iff it took it.

        False, with one INFO log line, if the call failed in any way: the peer is unreachable,
        refused the message, or did not answer in time, or this client was closed meanwhile.
        """
        kind = type(message).__name__
        envelope = to_envelope(message, sender_id=self.sender_id, protocol_version=self.protocol_version)
        if self._closed:
            logger.info("not sending %s to %s: the client is closed", kind, address)
            return False
        channel = self._acquire(address)
        try:
            await pb_grpc.MembershipStub(channel).Deliver(envelope, timeout=timeout.total_seconds())
        except grpc.aio.AioRpcError as error:
            logger.info("sending %s to %s failed: %s: %s", kind, address, error.code().name, error.details())
            return False
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our caller cancelled us
            # Otherwise close() closed the channel under the call, which grpc.aio reports as a cancellation.
            logger.info("sending %s to %s failed: the client was closed", kind, address)
            return False
        finally:
            self._release(address)
        return True

    async def collect(self, address: str, *, wait: timedelta) -> list[tuple[str, Message]] | None:
        """The messages the peer at ``address`` holds for us (we are a client: nobody dials us),
        waiting up to ``wait`` for one; None, with one INFO log line, if the call failed. An envelope
        that does not parse is left out with a warning (the others are still ours)."""
        if self._closed:
            return None
        request = pb.CollectRequest(
            receiver_id=self.sender_id,
            protocol_version=self.protocol_version,
            wait_ms=int(wait.total_seconds() * 1000),
        )
        channel = self._acquire(address)
        try:
            reply = await pb_grpc.MembershipStub(channel).Collect(
                request, timeout=(wait + COLLECT_MARGIN).total_seconds()
            )
        except grpc.aio.AioRpcError as error:
            logger.info("collecting from %s failed: %s: %s", address, error.code().name, error.details())
            return None
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            return None  # close() closed the channel under the call
        finally:
            self._release(address)
        messages = []
        for envelope in reply.envelopes:
            try:
                messages.append(from_envelope(envelope))
            except ValueError as error:
                logger.warning("a message collected from %s is malformed: %s", address, _shorten(str(error)))
        return messages

    def _acquire(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.pop(address, None)
        if channel is None:
            channel = open_channel(address, options=self._options, auth=self._auth)
        self._channels[address] = channel  # now the most recently used
        self._num_calls[address] += 1
        self._close_idle_beyond_bound()
        return channel

    def _release(self, address: str) -> None:
        self._num_calls[address] -= 1
        if self._num_calls[address] <= 0:
            del self._num_calls[address]
        self._close_idle_beyond_bound()

    def _close_idle_beyond_bound(self) -> None:
        while len(self._channels) > self.max_channels:
            idle = next((address for address in self._channels if not self._num_calls[address]), None)
            if idle is None:
                return  # every channel carries a call; _release comes back here when one ends
            # No call on it, so closing cancels nothing; the sender need not wait for it.
            task = asyncio.get_running_loop().create_task(self._channels.pop(idle).close(grace=None))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every channel; sends still in flight return False. Later sends return False at once."""
        self._closed = True
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(channel.close(grace=None) for channel in channels), *self._closing)
