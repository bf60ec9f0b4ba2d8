"""AllReducePeer: the gRPC server a member hosts, plus the `allreduce()` call that runs one round.

Async API (for code already running in an event loop):

    peer = await AllReducePeer.start(host="0.0.0.0", port=0)        # port 0: any free port
    result = await peer.allreduce(vector, group=group, my_peer_id="a", weight=1.0,
                                  codec=get_codec("int8"), error_feedback=None,
                                  deadline=timedelta(seconds=60))
    await peer.stop()

The server keeps serving a round after `allreduce()` returned (slower members may still pull our part),
so one peer object should live as long as the node takes part in rounds. For synchronous callers
(the training loop) see `protocol.allreduce.loop.SyncAllReducePeer`.

A daemon that hosts several services on one server builds the peer without a server and adds it:

    peer = AllReducePeer(config=AllReduceConfig(), fault_plan=None)
    peer.add_to_server(server)              # before server.start()
    ...                                     # peer.allreduce(...) once the server is serving
    await server.stop(grace); await peer.close()
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc.aio
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from protocol.allreduce.allreduce import AllReduceResult, run_allreduce
from protocol.allreduce.client import PeerClient, pull_slice, tell_finished
from protocol.allreduce.config import MESSAGE_OVERHEAD_BYTES, AllReduceConfig
from protocol.allreduce.faults import FaultPlan
from protocol.allreduce.group import GroupSpec
from protocol.allreduce.pace import SendPace
from protocol.allreduce.registry import RoundRegistry
from protocol.allreduce.round import RoundState
from protocol.allreduce.servicer import AllReduceServicer, add_servicer_to_server
from protocol.allreduce.slices import HeldSlice, PulledSlice, SliceKey, SliceStore
from protocol.auth.channels import SwarmAuth, add_port, new_server
from protocol.codecs import Codec
from protocol.discovery.addresses import local_dial_address
from protocol.error_feedback import ErrorFeedback

logger = logging.getLogger(__name__)

SERVICE_NAME = "dtnode.v1.AllReduce"
FINISH_ROUND_TIMEOUT = timedelta(seconds=5)


class AllReducePeer:
    """One member's all-reduce endpoint: a grpc.aio server, its rounds, and channels to other members."""

    def __init__(
        self, *, config: AllReduceConfig, fault_plan: FaultPlan | None, auth: SwarmAuth | None = None
    ) -> None:
        """``auth`` is presented on our calls to other members (``protocol.auth``; None: open swarm)."""
        self.config = config
        self.fault_plan = fault_plan
        self.registry = RoundRegistry(config)
        # The slices of tiered rounds' means we hold for other members to pull (PullSlice).
        self.slices = SliceStore(max_held=config.max_slices_held, max_waiting=config.max_waiting_requests)
        self.client = PeerClient(config.grpc_options(server=False), auth=auth)
        # Encoding, folding and decoding run here so the event loop keeps moving bytes meanwhile.
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="allreduce-compute")
        self._server: grpc.aio.Server | None = None  # only when start() built our own server
        self._health = health.HealthServicer()
        self._attached = False
        self._closed = False
        self._telling: set[asyncio.Task[None]] = set()  # RoundFinished calls in flight
        self._paces: set[SendPace] = set()  # the send paces of our rounds under way (lift_paces)
        self.host = ""
        self.port = 0

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve this peer's rounds on `server` (someone else's, not started yet; its options must
        allow `config.max_message_bytes`, see `AllReduceConfig.grpc_options(server=True)`)."""
        if self._attached:
            raise RuntimeError("the all-reduce servicer is already on a server")
        add_servicer_to_server(AllReduceServicer(self.registry, self.config, self.slices), server)
        self._attached = True

    def dial_only(self) -> None:
        """Run rounds on no server: a client's peer (``--client-mode``) accepts no connections, so it
        only calls the other members (it pushes its contribution and pulls the averages)."""
        if self._attached:
            raise RuntimeError("the all-reduce servicer is already on a server")
        self._attached = True

    @classmethod
    async def start(
        cls,
        *,
        host: str = "0.0.0.0",
        port: int = 0,
        config: AllReduceConfig | None = None,
        fault_plan: FaultPlan | None = None,
        auth: SwarmAuth | None = None,
    ) -> AllReducePeer:
        """Bind host:port (port 0 picks a free port, see `.port`) and start serving; with ``auth``
        only members of its swarm are served (``protocol.auth``) and our calls present it."""
        peer = cls(config=config or AllReduceConfig(), fault_plan=fault_plan, auth=auth)
        server = new_server(options=peer.config.grpc_options(server=True), auth=auth)
        peer.add_to_server(server)
        health_pb2_grpc.add_HealthServicer_to_server(peer._health, server)
        bound = add_port(server, f"{host}:{port}", auth=auth)
        if bound == 0:
            raise OSError(f"could not bind {host}:{port}")
        await server.start()
        peer._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        peer._server, peer.host, peer.port = server, host, bound
        logger.info("all-reduce peer serving on %s:%d", host, bound)
        return peer

    @property
    def address(self) -> str:
        """host:port other members should dial (loopback if we bound a wildcard host)."""
        return local_dial_address(self.host, self.port)

    def rewind(self) -> None:
        """Forget every round and held slice and accept lower round ids again (the daemon moved to a
        lineage whose rounds are numbered lower; ``RoundRegistry.rewind``). On the peer's loop."""
        self.registry.rewind()
        self.slices.rewind()

    async def allreduce(
        self,
        vector: torch.Tensor,
        *,
        group: GroupSpec,
        my_peer_id: str,
        weight: float,
        codec: Codec,
        error_feedback: ErrorFeedback | None,
        deadline: timedelta,
        in_place: bool = False,
        send_rate: float | None = None,
        keep_payloads: bool = False,
    ) -> AllReduceResult:
        """Average `vector` with the group: per part, sum(w_i x_i) / sum(w_i) over the members that delivered.

        `vector` (E,) fp32 is read, never written, unless `in_place`: then the average is written into
        `vector` itself (as torch.distributed's all_reduce does), which saves the result's memory (one
        vector), and `averaged` is `vector`. Returns within `deadline`; if some part cannot be had, the
        result falls back to a copy of `vector` (in place: `vector` with our own numbers in the parts we
        could not get) and says so. Every member that does not fall back gets a bit-identical `averaged`.

        `send_rate` (bytes per second; None: full rate) caps what this member writes in the round,
        contributions, replicas and served averages together (a token bucket, `pace.py`), for a
        caller that has time to spare before it needs the mean and would rather not fill its link
        in one burst. The cap is relaxed wherever the bytes still to go would not be sent well
        before the reduce-scatter deadline at it, so the round's deadlines hold as unpaced, and
        `lift_paces()` ends it. Pacing changes when bytes go, never which: the result is the same.

        ``keep_payloads``: return the codec bytes of the mean (``AllReduceResult.payloads``) for this
        round even if the peer's config does not keep them for every round.
        """
        if not self._attached or self._closed:
            raise RuntimeError(
                "start() the peer (or add it to a started server, or make it dial_only()) before calling allreduce()"
            )
        if vector.dtype != torch.float32 or vector.dim() != 1 or vector.device.type != "cpu":
            raise ValueError(
                f"vector must be a 1-D fp32 CPU tensor, got {vector.dtype} {tuple(vector.shape)}"
            )
        if in_place and not vector.is_contiguous():
            raise ValueError("an in-place all-reduce needs a contiguous vector")
        if vector.numel() != group.num_elements:
            raise ValueError(f"vector has {vector.numel()} numbers, the group spec {group.num_elements}")
        if error_feedback is not None and error_feedback.num_elements != vector.numel():
            raise ValueError("error_feedback was built for a vector of another size")
        if deadline <= timedelta(0):
            raise ValueError(f"deadline must be positive, got {deadline}")
        # The weight travels as float32 and is summed as float32: round it once, here.
        weight32 = float(torch.tensor(weight, dtype=torch.float32))
        if not (math.isfinite(weight32) and weight32 > 0):
            raise ValueError(f"weight must be finite and positive in float32, got {weight}")
        state = RoundState(
            group=group,
            my_index=group.index_of(my_peer_id),
            codec=codec,
            weight=weight32,
            vector=vector.contiguous(),
            error_feedback=error_feedback,
            config=dataclasses.replace(self.config, keep_payloads=True) if keep_payloads else self.config,
            deadline=deadline,
            executor=self.executor,
            client=self.client,
            fault_plan=self.fault_plan,
            in_place=in_place,
            send_rate=send_rate,
        )
        if state.pace is not None:
            self._paces.add(state.pace)
        try:
            result = await run_allreduce(state, self.registry)
        finally:
            if state.pace is not None:
                self._paces.discard(state.pace)
        # Best effort: a member that misses it keeps the round until its linger ends.
        others = [
            i
            for i, member in enumerate(group.members)
            if i not in (state.my_index, *state.failed) and not member.client  # a client cannot be dialled
        ]
        if others and not self._closed:
            task = asyncio.ensure_future(tell_finished(state, others, FINISH_ROUND_TIMEOUT))
            self._telling.add(task)
            task.add_done_callback(self._telling.discard)
        return result

    def hold_slice(
        self, key: SliceKey, held: HeldSlice, *, pullers: frozenset[str], linger: timedelta
    ) -> None:
        """Serve `held` as slice `key` of a tiered round's mean to the members `pullers` (peer ids)
        for `linger` from now (PullSlice; call on the peer's loop). Pulls that came before wait for
        it; at most `config.max_slices_held` slices are held, the oldest dropped first. `held` must
        not change while held (with the fp32 codec its payloads may be views of a result)."""
        largest = max((len(payload) for payload in held.payloads), default=0)
        if largest + MESSAGE_OVERHEAD_BYTES > self.config.max_message_bytes:
            raise ValueError(
                f"a chunk of {largest} bytes does not fit a message (max_message_bytes="
                f"{self.config.max_message_bytes}); chunk the slice by config.chunk_num_elements"
            )
        self.slices.hold(key, held, pullers=pullers, until=time.monotonic() + linger.total_seconds())
        asyncio.get_running_loop().call_later(linger.total_seconds(), self.slices.evict)

    async def pull_slice(
        self,
        address: str,
        key: SliceKey,
        *,
        my_peer_id: str,
        deadline: float,
        out: torch.Tensor,
        codec: Codec | None = None,
    ) -> PulledSlice:
        """Pull slice `key` from the member at `address` and decode it into `out` ((E,) fp32, the
        slice's numbers), by `deadline` (time.monotonic()), refusing a slice not encoded with
        `codec` (None: any codec); raises
        `protocol.allreduce.client.PeerFailed` on any failure (`client.pull_slice`)."""
        return await pull_slice(
            self.client,
            self.config,
            address,
            key,
            my_peer_id=my_peer_id,
            codec=codec,
            deadline=deadline,
            out=out,
            executor=self.executor,
        )

    def lift_paces(self) -> None:
        """Send the rest of every paced round under way at full rate (call on the peer's loop): its
        caller now waits on the mean, so spreading the bytes would only make it wait longer."""
        for pace in self._paces:
            pace.lift()

    async def stop(self, grace: timedelta | None = None) -> None:
        """Graceful stop of the server start() built: refuse new RPCs, let in-flight ones finish for
        `grace`, then close everything."""
        if self._server is not None:
            self._health.enter_graceful_shutdown()
            self.slices.close()  # (pulls waiting for a slice would hold the server for all of `grace`)
            grace_seconds = (grace or self.config.server_grace).total_seconds()
            await self._server.stop(grace_seconds)
            self._server = None
        await self.close()

    async def close(self) -> None:
        """Forget every round, close the channels and the compute thread (stop the server first)."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._telling):
            task.cancel()
        self.registry.close()
        self.slices.close()
        await self.client.close()
        self.executor.shutdown(wait=True, cancel_futures=True)
