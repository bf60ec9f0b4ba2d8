"""All-reduce streams: one round's vector cut into S equal shards, each all-reduced on its own stream.

A member that opens S streams serves stream 0 on its node server and streams 1..S-1 on servers of
their own (``StreamServer``), typically one in each local rank's process, so a node with k ranks
encodes, sends, reduces and decodes k shards at once. Every member of a group opens the same number
of streams (the group says so); stream ``s`` of the round is an ordinary all-reduce of shard ``s``
among the members' stream-``s`` servers, with parts sized by the members' bandwidths as usual:

    bounds = stream_bounds(group.vector_length, group.num_streams)
    shard_s = vector[bounds[s]:bounds[s + 1]]  -- all-reduced with stream_group(group, s)

The whole round's result (``combine``) is the concatenation of the streams' results; if any stream
fell back, the round did (our own vector), as for a one-stream round.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch

from protocol.allreduce.allreduce import AllReduceResult, EncodedChunk
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.group import GroupSpec as AllReduceGroup
from protocol.allreduce.group import Member, split_by_weight
from protocol.allreduce.peer import AllReducePeer
from protocol.allreduce.tiers import TierPlan, stage_round_ids
from protocol.auth.channels import SwarmAuth
from protocol.codecs import Codec
from protocol.discovery.addresses import join_host_port
from protocol.error_feedback import ErrorFeedback
from protocol.loop import BackgroundLoop
from protocol.membership.messages import MAX_STREAMS, GroupSpec
from protocol.membership.parts import part_boundaries

logger = logging.getLogger(__name__)

RESULT_MARGIN = timedelta(seconds=5)
"""How much longer than a stream's deadline its caller waits before declaring the loop wedged."""


def stream_bounds(vector_length: int, num_streams: int) -> tuple[int, ...]:
    """``num_streams + 1`` bounds from 0 to ``vector_length``: stream ``s`` carries ``[b[s], b[s + 1])``."""
    if not 1 <= num_streams <= MAX_STREAMS:
        raise ValueError(f"num_streams must be in 1..{MAX_STREAMS}, got {num_streams}")
    return split_by_weight(vector_length, [1.0] * num_streams)


def stream_group(group: GroupSpec, stream: int) -> AllReduceGroup:
    """The all-reduce group of stream ``stream`` of an agreed round group: the same members in the
    same order, each at its stream-``stream`` address, owning parts of the stream's shard sized by
    their bandwidths (``parts.py``)."""
    if not 0 <= stream < group.num_streams:
        raise ValueError(f"stream must be in 0..{group.num_streams - 1}, got {stream}")
    bounds = stream_bounds(group.vector_length, group.num_streams)
    bandwidths = [member.bandwidth_bytes_per_s for member in group.members]
    clients = [member.client for member in group.members]
    return AllReduceGroup(
        round_id=stage_round_ids(group.round)[0],
        members=tuple(
            Member(peer_id=m.peer_id, address=m.stream_address(stream), client=m.client)
            for m in group.members
        ),
        part_bounds=part_boundaries(bandwidths, bounds[stream + 1] - bounds[stream], clients),
    )


def to_allreduce_group(group: GroupSpec) -> AllReduceGroup:
    """The all-reduce's view of an agreed one-stream group: members in order, the group's parts."""
    return AllReduceGroup(
        round_id=stage_round_ids(group.round)[0],
        members=tuple(
            Member(peer_id=m.peer_id, address=m.grpc_address, client=m.client) for m in group.members
        ),
        part_bounds=group.part_boundaries,
    )


def to_tier_plan(group: GroupSpec) -> TierPlan:
    """The tiered all-reduce's plan of an agreed group (``group.tiered``): its members in order, in
    groups of the leader's ``tier_group_size``."""
    return TierPlan(
        round_id=group.round,
        members=to_allreduce_group(group).members,
        group_size=group.tier_group_size,
        num_elements=group.vector_length,
    )


@dataclass(frozen=True, kw_only=True)
class StreamJob:
    """What the process serving stream ``stream`` needs to run its part of a round (picklable)."""

    stream: int
    group: AllReduceGroup
    my_peer_id: str
    weight: float
    codec: Codec  # stateless, so it pickles to the rank that runs the stream
    deadline: timedelta
    error_feedback_decay: float = 1.0  # β of the stream's residual (protocol/error_feedback.py)


class StreamRunner(Protocol):
    """Runs streams 1..S-1 of our rounds wherever their servers live (the node's local ranks)."""

    @property
    def addresses(self) -> tuple[str, ...]:
        """Where streams 1..S-1 listen, in order (what our Accept advertises)."""
        ...

    def run(self, jobs: Sequence[StreamJob], shards: Sequence[torch.Tensor]) -> list[AllReduceResult]:
        """Run ``jobs[i]`` on ``shards[i]`` (fp32 CPU), all at once; blocks until every stream returned
        (each within its deadline plus a margin)."""
        ...

    def reset_error_feedback(self) -> None:
        """Forget every stream's codec residual (the vector's meaning changed: we adopted a state)."""
        ...


class StreamServer:
    """One extra stream's all-reduce server, on a uvloop thread of its own; blocking calls.

    It keeps its own codec residual (error feedback) for its shard across rounds.
    """

    def __init__(
        self,
        *,
        listen_host: str,
        announce_host: str | None,
        config: AllReduceConfig,
        auth: SwarmAuth | None,
        start_timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        self._loop = BackgroundLoop()
        try:
            self._peer = self._loop.run(
                AllReducePeer.start(host=listen_host, port=0, config=config, auth=auth), start_timeout
            )
        except BaseException:
            self._loop.close()
            raise
        # The address others dial: the announced host at our port, else the one the peer bound.
        self.address = join_host_port(announce_host, self._peer.port) if announce_host else self._peer.address
        self._error_feedback: ErrorFeedback | None = None
        self._closed = False

    def allreduce(self, job: StreamJob, shard: torch.Tensor) -> AllReduceResult:
        """Average ``shard`` with the job's group; returns within the job's deadline + RESULT_MARGIN."""
        if self._closed:
            raise RuntimeError(f"the server of stream {job.stream} is closed")
        codec = job.codec
        feedback = None
        if codec.name != "none":
            feedback = self._error_feedback
            if feedback is None or (feedback.num_elements, feedback.decay) != (
                shard.numel(),
                job.error_feedback_decay,
            ):
                self._error_feedback = ErrorFeedback(shard.numel(), decay=job.error_feedback_decay)
            feedback = self._error_feedback
        registry = self._peer.registry
        if job.group.round_id <= registry.highest_opened:  # we moved to a lineage numbered lower
            self._loop.run(_rewind(self._peer), timedelta(seconds=5))
        return self._loop.run(
            self._peer.allreduce(
                shard,
                group=job.group,
                my_peer_id=job.my_peer_id,
                weight=job.weight,
                codec=codec,
                error_feedback=feedback,
                deadline=job.deadline,
            ),
            job.deadline + RESULT_MARGIN,
        )

    def residual_norm(self) -> float:
        return 0.0 if self._error_feedback is None else self._error_feedback.norm()

    def reset_error_feedback(self) -> None:
        self._error_feedback = None

    def close(self, grace: timedelta = timedelta(seconds=2)) -> None:
        """Stop the server (in-flight calls get ``grace``), then the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self._peer.stop(grace), grace + RESULT_MARGIN)
        finally:
            self._loop.close()


def fell_back(shard: torch.Tensor, why: str) -> AllReduceResult:
    """The result of a stream that could not run at all: our own shard, and why."""
    return AllReduceResult(
        averaged=shard.clone(),
        contributors=[],
        producers=[],
        fell_back=True,
        failures=[why],
        bytes_sent=0,
        bytes_recv=0,
        bytes_sent_by_phase={},
        bytes_recv_by_phase={},
        seconds=0.0,
    )


async def _rewind(peer: AllReducePeer) -> None:
    peer.rewind()


def combine(
    vector: torch.Tensor, bounds: Sequence[int], results: Sequence[AllReduceResult]
) -> AllReduceResult:
    """One round's result from its streams' (stream ``s`` covered ``vector[bounds[s]:bounds[s + 1]]``).

    Parts are listed stream after stream; if any stream fell back, the round did: ``averaged`` is a
    copy of ``vector`` (the members whose streams all committed hold a mean this member does not).
    """
    fell_back = any(result.fell_back for result in results)
    averaged = vector.clone() if fell_back else torch.cat([result.averaged for result in results])
    if averaged.numel() != bounds[-1]:
        raise ValueError(f"the streams cover {averaged.numel()} numbers, the vector has {bounds[-1]}")

    def summed(field: str) -> dict[str, int]:
        total: dict[str, int] = {}
        for result in results:
            for phase, count in getattr(result, field).items():
                total[phase] = total.get(phase, 0) + count
        return total

    def tagged(stream: int, lines: list[str]) -> list[str]:
        return lines if len(results) == 1 else [f"stream {stream}: {line}" for line in lines]

    return AllReduceResult(
        averaged=averaged,
        contributors=[part for result in results for part in result.contributors],
        producers=[producer for result in results for producer in result.producers],
        fell_back=fell_back,
        failures=[line for s, result in enumerate(results) for line in tagged(s, result.failures)],
        bytes_sent=sum(result.bytes_sent for result in results),
        bytes_recv=sum(result.bytes_recv for result in results),
        bytes_sent_by_phase=summed("bytes_sent_by_phase"),
        bytes_recv_by_phase=summed("bytes_recv_by_phase"),
        seconds=max(result.seconds for result in results),
        adjustments=[line for s, result in enumerate(results) for line in tagged(s, result.adjustments)],
        payloads=None if fell_back else _shifted_payloads(bounds, results),
    )


def _shifted_payloads(
    bounds: Sequence[int], results: Sequence[AllReduceResult]
) -> tuple[EncodedChunk, ...] | None:
    """The streams' kept payloads as chunks of the whole vector (None unless every stream kept them)."""
    if any(result.payloads is None for result in results):
        return None
    return tuple(
        dataclasses.replace(chunk, offset=bounds[s] + chunk.offset)
        for s, result in enumerate(results)
        for chunk in result.payloads or ()
    )


def run_streamed(
    vector: torch.Tensor,
    group: GroupSpec,
    ours: Callable[[torch.Tensor], Future[AllReduceResult]],
    runner: StreamRunner,
    *,
    my_peer_id: str,
    weight: float,
    codec: Codec,
    deadline: timedelta,
    wait: timedelta,
    error_feedback_decay: float = 1.0,
) -> AllReduceResult:
    """All-reduce ``vector`` on the group's S streams: shard 0 by ``ours`` (started at once), shards
    1..S-1 by ``runner`` meanwhile; the combined result. A runner that fails (a dead rank) counts as
    fallen-back streams, not as our failure; ``wait`` bounds the wait for shard 0."""
    bounds = stream_bounds(vector.numel(), group.num_streams)
    shards = [vector[bounds[s] : bounds[s + 1]] for s in range(group.num_streams)]
    first = ours(shards[0])
    jobs = [
        StreamJob(
            stream=s,
            group=stream_group(group, s),
            my_peer_id=my_peer_id,
            weight=weight,
            codec=codec,
            deadline=deadline,
            error_feedback_decay=error_feedback_decay,
        )
        for s in range(1, group.num_streams)
    ]
    try:
        others = runner.run(jobs, shards[1:])
    except Exception as error:  # the runner's processes: a failure there is a failed stream, not ours
        logger.warning("round %d: streams 1..%d failed: %s", group.round, group.num_streams - 1, error)
        others = [fell_back(shard, f"stream {job.stream}: {error}") for job, shard in zip(jobs, shards[1:], strict=True)]  # fmt: skip
    finally:
        result = first.result(timeout=wait.total_seconds())
    return combine(vector, bounds, [result, *others])
