"""What one member knows about one all-reduce round, the headers it sends, and the round's lifetime.

`RoundCore` is the state the servicer and the member's tasks share: the group and our index in it, the
deadlines of the phases (reduce-scatter, all-gather, the round itself, and how long a finished round
lingers to serve its parts), one `PartState` per part, the members that failed us and what went wrong,
the bytes counted both ways, and the round's background tasks. It builds the headers of what we send
(`round_ref`, `average_header`) and, when the round ends (`finish_locally`, `close`), drops every
buffer at once. How parts get decided is in `deciding.py`; what the servicer asks, in `round.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from concurrent.futures import Executor
from datetime import timedelta
from typing import Any

import torch

from protocol.allreduce.client import PeerClient
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.contributions import ContributionSource
from protocol.allreduce.faults import FaultPlan
from protocol.allreduce.group import GroupSpec
from protocol.allreduce.parts import PartRole, PartState, Pulse, check_average_header
from protocol.allreduce.reducer import ReducedPart
from protocol.codecs import Codec
from protocol.error_feedback import ErrorFeedback
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb

logger = logging.getLogger(__name__)

ALL_GATHER_FRACTION = 0.95
"""The all-gather must end by this fraction of the deadline; the rest is for assembling the result."""


class RoundCore:
    """Everything one member knows about one round; the servicer and the member's tasks share it."""

    def __init__(
        self,
        *,
        group: GroupSpec,
        my_index: int,
        codec: Codec,
        weight: float,
        vector: torch.Tensor,
        error_feedback: ErrorFeedback | None,
        config: AllReduceConfig,
        deadline: timedelta,
        executor: Executor,
        client: PeerClient,
        fault_plan: FaultPlan | None,
        in_place: bool = False,
    ) -> None:
        self.group = group
        self.my_index = my_index
        self.codec = codec
        self.weight = weight
        self.vector = vector
        self.error_feedback = error_feedback
        self.config = config
        self.executor = executor
        self.client = client
        self.fault_plan = fault_plan
        self.started = time.monotonic()
        seconds = deadline.total_seconds()
        self.reduce_scatter_deadline = self.started + seconds * config.reduce_scatter_fraction
        self.all_gather_deadline = self.started + seconds * ALL_GATHER_FRACTION
        self.deadline = self.started + seconds
        self.retain_until = self.deadline + config.linger.total_seconds()
        self.parts = [PartState() for _ in group.members]
        self.failed: set[int] = set()
        self.failures: list[str] = []
        self.adjustments: list[str] = []  # contributions the robust aggregation rule clipped or trimmed
        self.bytes_sent = 0  # all wire bytes of the round, both phases
        self.bytes_recv = 0
        self.bytes_sent_reduce_scatter = 0  # the part of them that carried contributions
        self.bytes_recv_reduce_scatter = 0
        self.local_done = False
        self.output: torch.Tensor | None = None  # (E,) our result while allreduce() runs
        # With in_place our result is `vector` itself: each part's average overwrites our numbers there,
        # once they are no longer needed (see `spend`).
        self.in_place = in_place
        self.spent: set[int] = set()  # parts whose slice of `vector` may already hold (some of) the average
        # With config.keep_payloads: offset -> (numbers, bytes) decoded into our result there.
        self.kept_payloads: dict[int, tuple[int, bytes | memoryview]] | None = (
            {} if config.keep_payloads else None
        )
        self.pulse = Pulse()
        self.source = ContributionSource(
            vector=vector,
            group=group,
            my_index=my_index,
            codec=codec,
            error_feedback=error_feedback,
            chunk_num_elements=config.chunk_num_elements,
            executor=executor,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._own_part_settled = asyncio.Event()
        self._num_held_back = 0  # contribution streams waiting in hold_back

    @property
    def round_id(self) -> int:
        return self.group.round_id

    def round_ref(self) -> pb.RoundRef:
        me = self.group.members[self.my_index]
        return pb.RoundRef(
            round_id=self.round_id,
            group_digest=self.group.digest,
            sender_index=self.my_index,
            sender_peer_id=me.peer_id,
        )

    def count_contribution_bytes(self, *, sent: int = 0, received: int = 0) -> None:
        """Wire bytes of a contribution stream (reduce-scatter), pushed or received; everything else
        counted in bytes_sent/bytes_recv alone (averages pulled and served, replicas) is all-gather."""
        self.bytes_sent += sent
        self.bytes_recv += received
        self.bytes_sent_reduce_scatter += sent
        self.bytes_recv_reduce_scatter += received

    def keep_payload(self, offset: int, num_elements: int, payload: bytes | memoryview) -> None:
        """Remember the bytes about to be decoded into our result at ``offset`` (with keep_payloads).

        Call it where the decode is queued on the compute thread, in the same order: a later decode
        of the same chunk (a replica never committed, then the part we did get) replaces it, as in
        the result."""
        if self.kept_payloads is not None:
            self.kept_payloads[offset] = (num_elements, payload)

    def spend(self, part_index: int) -> None:
        """With in_place: the average of a part is about to be written over our numbers there.

        A pulled average is committed (one version per part), so our contribution to that part is
        never asked for again. A replica is decoded as it arrives, before it is committed: should a
        backup reduce the part again after all, we resend our contribution only if it is cached
        (`contributes_to`), else we are left out of it, never counted with the average in place of
        our numbers.
        """
        if self.in_place:
            self.spent.add(part_index)

    def contributes_to(self, part_index: int) -> bool:
        """Whether we can still send our contribution to the part: our numbers there are still in
        `vector` (always, unless in_place), or it is cached encoded (with error feedback)."""
        return part_index not in self.spent or self.source.holds(part_index)

    def record_failure(self, message: str) -> None:
        self.failures.append(message)
        logger.info("round %d member %d: %s", self.round_id, self.my_index, message)

    def record_adjustment(self, message: str) -> None:
        self.adjustments.append(message)
        logger.info("round %d member %d: %s", self.round_id, self.my_index, message)

    def mark_failed(self, member: int, reason: str) -> None:
        """We could not talk to `member`: stop waiting for its contributions in this round."""
        if member == self.my_index or member in self.failed:
            return
        self.failed.add(member)
        self.record_failure(f"peer {self.group.members[member].peer_id} failed: {reason}")
        for part in self.parts:
            if part.role is PartRole.REDUCING and part.reducer is not None:
                part.reducer.give_up_on(member, reason)
        self.pulse.notify()

    def _spawn(self, coroutine: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("round %d: background task failed", self.round_id, exc_info=task.exception())

    def average_header(self, reduced: ReducedPart) -> pb.AverageHeader:
        return pb.AverageHeader(
            part_index=reduced.part_index,
            producer_index=reduced.producer_index,
            contributor_indices=list(reduced.contributor_indices),
            codec=self.codec.spec(),
            num_elements=reduced.num_elements,
            weight_sum=reduced.weight_sum,
        )

    def check_average_header(self, header: pb.AverageHeader, part_index: int) -> None:
        """Raise ValueError unless an average header fits this round and part."""
        check_average_header(header, part_index, self.group, self.codec)

    # --- lifetime --------------------------------------------------------------------------------------

    def finish_locally(self) -> None:
        """Our allreduce() returned: keep serving decided parts, drop what only our own result needed."""
        self.local_done = True
        self.source.release()
        self.vector = torch.empty(0)
        self.output = None  # the caller's now: nothing of ours may write into it any more

    def close(self) -> None:
        """The round is forgotten: stop its background work and drop every buffer it holds.

        Tasks and callbacks form reference cycles with this object, which only the cyclic garbage
        collector breaks, and it runs rarely (large byte buffers do not count towards triggering it):
        the buffers are dropped here so that they go at once.
        """
        for task in list(self._tasks):
            task.cancel()
        self.source.release()
        self.vector = torch.empty(0)
        for part in self.parts:
            if part.decided is not None:
                part.released = True
            part.reducer = part.decided = part.replica = None
