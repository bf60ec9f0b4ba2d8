"""A node's view of the swarm, for operators: the ``dtnode.v1.Status`` service (``status.proto``).

The node answers ``GetStatus`` from memory, on its event loop, without a DHT read or a peer call:

- *itself*: the record it last published (``round``, ``param_hash``) and its phase, which
  :class:`~protocol.swarm.node.SwarmNode` tracks as it moves through a round::

      STARTING --publish--> TRAINING --run_round--> FORMING --group locked--> ALLREDUCE --done--> TRAINING
      any phase --fetch_state--> SYNCING --done--> the phase it interrupted

- *its last group* (the members of the round it averaged last, or averages now);
- *the peers of its last DHT view* (refreshed every ``view_refresh`` while a round forms and every
  few seconds otherwise), each with the age of its last heartbeat. A record holds only its
  expiration, and a peer stores each heartbeat with ``expires_at = now + record_ttl``, so the
  heartbeat was at ``expires_at - record_ttl`` (exact when peers share the TTL, as the daemon's
  defaults do);
- *lost peers*: listed by an earlier view, missing from the last one.

:func:`build_status` is a pure function of that state and two clocks; :class:`StatusServicer`
only translates its result to the wire, and :func:`get_status` is the client ``dtnode status`` uses.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Final

import grpc
import grpc.aio

from protocol.auth.channels import SwarmAuth, operator_channel
from protocol.gen.dtnode.v1 import status_pb2 as pb
from protocol.gen.dtnode.v1 import status_pb2_grpc as pb_grpc
from protocol.lenient import Malformed, lenient
from protocol.membership.messages import GroupSpec
from protocol.membership.records import PeerRecord, SwarmView

logger = logging.getLogger(__name__)

SERVICE_NAME: Final = "dtnode.v1.Status"
MAX_REPLY_BYTES: Final = 4 * 1024 * 1024
"""Largest reply the client accepts: about 10,000 peers of ~400 bytes each."""


class NodePhase(StrEnum):
    """What a node's swarm side is doing in its current outer round (``NodePhase`` in the proto)."""

    STARTING = "starting"  # nothing published yet: building the model, joining the DHT
    TRAINING = "training"  # inner steps toward the next round
    FORMING = "forming"  # ready; forming the next round's group
    ALLREDUCE = "allreduce"  # locked into a group, averaging with it
    SYNCING = "syncing"  # fetching the swarm's canonical state


@dataclass(frozen=True)
class PhaseState:
    """The node's phase, the outer round it works toward, and when it began (``time.monotonic``)."""

    phase: NodePhase
    round: int
    """FORMING/ALLREDUCE: the round formed; SYNCING: the canonical round fetched; else unused (0)."""
    since: float


@dataclass(frozen=True, kw_only=True)
class PeerStatus:
    """One peer of the last DHT view (``PeerStatus`` in the proto; fields documented there)."""

    peer_id: str
    grpc_address: str
    round: int
    param_hash: str
    ready_for_round: int | None
    tokens_per_s: float
    bandwidth_bytes_per_s: float
    seconds_since_heartbeat: float
    seconds_until_expiry: float
    in_group: bool
    is_self: bool


@dataclass(frozen=True, kw_only=True)
class LostPeer:
    """A peer an earlier view listed and the last one does not."""

    peer_id: str
    seconds_since_seen: float


@dataclass(frozen=True, kw_only=True)
class SyncingPeer:
    """A peer of the last view that fetches the swarm's state to join it (``SyncingPeer`` in the proto)."""

    peer_id: str
    grpc_address: str
    round: int
    param_hash: str
    seconds_until_ready: float | None
    """None: it gave no estimate yet; negative once the time it gave has passed."""


@dataclass(frozen=True, kw_only=True)
class GroupStatus:
    """The group of the node's last round."""

    round: int
    group_id: str
    leader_id: str
    member_ids: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class NodeStatus:
    """A node's answer to ``GetStatus`` (``NodeStatus`` in the proto; fields documented there)."""

    run_name: str
    protocol_version: int
    peer_id: str
    grpc_address: str
    published: bool
    round: int
    param_hash: str
    phase: NodePhase
    phase_round: int
    seconds_in_phase: float
    rounds_formed: int
    group: GroupStatus | None
    peers: tuple[PeerStatus, ...]
    lost_peers: tuple[LostPeer, ...]
    view_age_seconds: float
    record_ttl_seconds: float
    syncing_peers: tuple[SyncingPeer, ...] = ()
    round_vector: str = ""


def build_status(
    *,
    run_name: str,
    protocol_version: int,
    peer_id: str,
    grpc_address: str,
    local: PeerRecord | None,
    phase: PhaseState,
    group: GroupSpec | None,
    rounds_formed: int,
    view: SwarmView,
    last_seen: Mapping[str, float],
    record_ttl: timedelta,
    now: float,
    monotonic_now: float,
    round_vector: str = "",
) -> NodeStatus:
    """The node's status from its in-memory state.

    ``now`` is on the DHT clock (that of ``view.now``, ``last_seen`` and the records' ``expires_at``),
    ``monotonic_now`` on ``time.monotonic`` (that of ``phase.since``). ``local`` is the record the
    node last published (None before the first publish). ``round_vector``: what part of its state
    the round under way carries (``SwarmNode.run_round``'s ``vector_name``), said while it forms or
    averages that round.
    """
    ttl = record_ttl.total_seconds()
    members = frozenset(group.member_ids) if group is not None else frozenset()
    peers = tuple(
        PeerStatus(
            peer_id=record.peer_id,
            grpc_address=record.grpc_address,
            round=record.round,
            param_hash=record.param_hash,
            ready_for_round=record.ready_for_round,
            tokens_per_s=record.tokens_per_s,
            bandwidth_bytes_per_s=record.bandwidth_bytes_per_s,
            # A heartbeat stores the record with expires_at = its time + ttl.
            seconds_since_heartbeat=max(now - (record.expires_at - ttl), 0.0),
            seconds_until_expiry=max(record.expires_at - now, 0.0),
            in_group=record.peer_id in members,
            is_self=record.peer_id == peer_id,
        )
        for record in view
    )
    lost = tuple(
        LostPeer(peer_id=lost_id, seconds_since_seen=max(now - seen, 0.0))
        for lost_id, seen in last_seen.items()
        if lost_id not in view and lost_id != peer_id
    )
    syncing = tuple(
        SyncingPeer(
            peer_id=record.peer_id,
            grpc_address=record.grpc_address,
            round=record.round,
            param_hash=record.param_hash,
            seconds_until_ready=None if record.ready_at is None else record.ready_at - now,
        )
        for record in view.syncing
    )
    if local is not None and local.status != "active":
        local = None  # a joiner's record names the state it fetches, not params it holds
    if phase.phase is NodePhase.STARTING:
        phase_round = 0
    elif phase.phase is NodePhase.TRAINING:
        phase_round = local.round + 1 if local is not None else 0  # the inner steps lead to the next round
    else:
        phase_round = phase.round
    group_status = None
    if group is not None:
        group_status = GroupStatus(
            round=group.round, group_id=group.group_id, leader_id=group.leader_id, member_ids=group.member_ids
        )
    return NodeStatus(
        run_name=run_name,
        protocol_version=protocol_version,
        peer_id=peer_id,
        grpc_address=grpc_address,
        published=local is not None,
        round=local.round if local is not None else 0,
        param_hash=local.param_hash if local is not None else "",
        phase=phase.phase,
        phase_round=phase_round,
        seconds_in_phase=max(monotonic_now - phase.since, 0.0),
        rounds_formed=rounds_formed,
        group=group_status,
        peers=peers,
        lost_peers=lost,
        view_age_seconds=max(now - view.now, 0.0),
        record_ttl_seconds=ttl,
        syncing_peers=syncing,
        round_vector=round_vector if phase.phase in (NodePhase.FORMING, NodePhase.ALLREDUCE) else "",
    )


# --- the wire ---


def _phase_to_proto(phase: NodePhase) -> str:
    """The proto enum's name (the message constructors take names as well as numbers)."""
    return f"NODE_PHASE_{phase.name}"


def _phase_from_proto(value: int) -> NodePhase:
    name = pb.NodePhase.Name(value) if value in pb.NodePhase.values() else "an unknown phase"
    try:
        return NodePhase[name.removeprefix("NODE_PHASE_")]
    except KeyError:
        raise ValueError(f"the node reported {name} ({value})") from None


# NodeStatus fields that are the same plain value in the message.
_SCALAR_FIELDS = (
    "run_name", "protocol_version", "peer_id", "grpc_address", "published", "round", "param_hash",
    "phase_round", "seconds_in_phase", "rounds_formed", "view_age_seconds", "record_ttl_seconds",
    "round_vector",
)  # fmt: skip
_PEER_SCALAR_FIELDS = (
    "peer_id", "grpc_address", "round", "param_hash", "tokens_per_s", "bandwidth_bytes_per_s",
    "seconds_since_heartbeat", "seconds_until_expiry", "in_group", "is_self",
)  # fmt: skip


_SYNCING_SCALAR_FIELDS = ("peer_id", "grpc_address", "round", "param_hash")


def to_proto(status: NodeStatus) -> pb.NodeStatus:
    reply = pb.NodeStatus(
        **{name: getattr(status, name) for name in _SCALAR_FIELDS},
        phase=_phase_to_proto(status.phase),
        lost_peers=[
            pb.LostPeer(peer_id=p.peer_id, seconds_since_seen=p.seconds_since_seen) for p in status.lost_peers
        ],
    )
    for peer in status.peers:
        reply.peers.add(
            **{name: getattr(peer, name) for name in _PEER_SCALAR_FIELDS},
            ready_for_round=peer.ready_for_round or 0,
        )
    for syncing in status.syncing_peers:
        reply.syncing_peers.add(
            **{name: getattr(syncing, name) for name in _SYNCING_SCALAR_FIELDS},
            has_estimate=syncing.seconds_until_ready is not None,
            seconds_until_ready=syncing.seconds_until_ready or 0.0,
        )
    if status.group is not None:
        group = status.group
        reply.group.CopyFrom(
            pb.GroupStatus(
                round=group.round,
                group_id=group.group_id,
                leader_id=group.leader_id,
                member_ids=group.member_ids,
            )
        )
    return reply


def from_proto(reply: pb.NodeStatus) -> NodeStatus:
    """The status a node sent; ``ValueError`` if its phase is not one this code knows."""
    group = None
    if reply.HasField("group"):
        group = GroupStatus(
            round=reply.group.round,
            group_id=reply.group.group_id,
            leader_id=reply.group.leader_id,
            member_ids=tuple(reply.group.member_ids),
        )
    peers = tuple(
        PeerStatus(
            **{name: getattr(p, name) for name in _PEER_SCALAR_FIELDS},
            ready_for_round=p.ready_for_round or None,
        )
        for p in reply.peers
    )
    syncing = tuple(
        SyncingPeer(
            **{name: getattr(p, name) for name in _SYNCING_SCALAR_FIELDS},
            seconds_until_ready=p.seconds_until_ready if p.has_estimate else None,
        )
        for p in reply.syncing_peers
    )
    return NodeStatus(
        **{name: getattr(reply, name) for name in _SCALAR_FIELDS},
        phase=_phase_from_proto(reply.phase),
        group=group,
        peers=peers,
        syncing_peers=syncing,
        lost_peers=tuple(
            LostPeer(peer_id=p.peer_id, seconds_since_seen=p.seconds_since_seen) for p in reply.lost_peers
        ),
    )


class StatusServicer(pb_grpc.StatusServicer):
    """Answers ``GetStatus`` with ``snapshot()``, which runs on the server's loop and must not block."""

    def __init__(self, snapshot: Callable[[], NodeStatus]) -> None:
        self._snapshot = snapshot
        self.num_answered = 0

    async def GetStatus(
        self, request: pb.GetStatusRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.NodeStatus:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        try:
            reply = to_proto(self._snapshot())
        except Exception as error:  # a bug in building the answer must cost this call, not the server
            logger.exception("building the status for %s failed", context.peer())
            await context.abort(grpc.StatusCode.INTERNAL, "building the status failed on my side")
            raise AssertionError("context.abort returned") from error
        self.num_answered += 1
        return reply


def add_status_to_server(server: grpc.aio.Server, servicer: StatusServicer) -> None:
    """Serve ``servicer`` on ``server`` (call before ``server.start()``); like the generated helper,
    but bytes that do not parse get INVALID_ARGUMENT."""
    handler = grpc.unary_unary_rpc_method_handler(
        servicer.GetStatus,
        request_deserializer=lenient(pb.GetStatusRequest),
        response_serializer=pb.NodeStatus.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("dtnode.v1.Status", {"GetStatus": handler}),)
    )


class StatusUnavailable(Exception):
    """The node did not answer ``GetStatus`` within the deadline, or refused it."""

    def __init__(self, address: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{address}: {code.name}: {details}")
        self.address, self.code, self.details = address, code, details


def get_status(address: str, *, timeout: timedelta, auth: SwarmAuth | None = None) -> NodeStatus:
    """Ask the node at ``address`` (``host:port``) for its status; blocks for at most ``timeout``.

    ``auth`` with ``tls`` speaks mutual TLS with the swarm's certificates, as a ``--tls`` node needs.
    Raises :class:`StatusUnavailable` if it cannot be reached, refuses, or does not answer in time
    (a refused connection fails at once rather than waiting out the deadline), and ``ValueError``
    if the answer is not one this code understands.
    """
    options: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", MAX_REPLY_BYTES),
        ("grpc.enable_retries", 0),
    ]
    with operator_channel(address, options=options, auth=auth) as channel:
        try:
            reply = pb_grpc.StatusStub(channel).GetStatus(
                pb.GetStatusRequest(), timeout=timeout.total_seconds()
            )
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
            raise StatusUnavailable(address, code, details) from None
    return from_proto(reply)
