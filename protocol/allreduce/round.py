"""One all-reduce round as seen by one member: what it knows, how it decides the parts it reduces, and
what the servicer asks of it.

`RoundState` is the state the servicer and the member's tasks share: the group and our index in it, the
deadlines of the phases (reduce-scatter, all-gather, the round itself, and how long a finished round
lingers to serve its parts), one `PartState` per part, the members that failed us and what went wrong,
the bytes counted both ways, and the round's background tasks. It builds the headers of what we send
(`round_ref`, `average_header`) and, when the round ends (`finish_locally`, `close`), drops every
buffer at once.

For every part this member is in one role:

    IDLE               it neither reduces nor holds the part (it only pulls it)
    REDUCING           it owns the part, or took it over as a backup, and collects contributions
    RECEIVING_REPLICA  the part's producer is handing it a copy of the decided average
    DECIDED            it holds the part's final encoded average and serves exactly those bytes
    MOVED              it reduced the part but a backup took it over first; it refers pullers on

Deciding a part (`_decide`): fold contributions until all are resolved or the phase deadline passes,
encode the average once (a sparse codec: bundle the contributors' payloads instead, `sparse.py`), hand replicas (all at once) to live members after us in the part's backup
chain until we and the replica holders are a strict majority of the group (no other version of the
part can win one now), then tell those holders (the voters) it is committed. It is committed once a
voter takes the notice (at once if we alone are that majority: one server): we use it then, and serve
it once every voter was told (so our death mid-serve leaves them able to serve it). A member that
cannot reach the owner takes the part over (`take_over`), so a part may be reduced
twice; the majority is what keeps survivors bit-identical:

    every member accepts (votes for) at most one version of a part: its own, from the moment it starts
    reducing the part, or the first replica it completes; it refuses any other replica (ABORTED);
    a version is served or used only once it is committed: held by a strict majority, and a voter
    took its producer's commit notice (see "stranded" below);
    two strict majorities share a member, and that member voted once, so at most one version of a
    part is ever committed, hence served or decoded, whatever the failures or one-way partitions.

A version that misses its majority is never used: its producer stops serving the part (MOVED) and its
replica holders never serve it; if no version of a part commits, every member falls back. A replica
holder waits for the commit notice only while its producer can still send it: once the producer
failed us or told us the part moved on from it, the replica is *stranded* (`stranded`): it stays our
vote, is never served or used, and we and our pullers walk on along the chain. A producer lost
between winning its majority and telling it therefore costs the survivors one failure detection (at
once for a dead peer, the stall timeout for a frozen one), not the round's deadline; if no voter was
told, no version of the part can commit any more and every member falls back.

A producer we took for gone may only have been frozen or starved, and tell us late. Each voter settles
the version once (`settle_stranded`): it takes the commit notice, and from then on serves and uses the
version, or it acts on the version being stranded (sends a puller on, or walks on itself), and from
then on refuses the notice (ABORTED). The producer uses its version only once a voter took the notice;
if none did (each refused, or did not answer in time), the version is never committed: the producer
keeps it as its vote and walks on like a stranded voter. So a puller that found the part nowhere saw
every voter on its way settle it as stranded, and no member can use it after that; and a voter that
took the notice never sent anyone on: every puller that asks it gets the same bytes. Without one-way
partitions, every survivor ends such a part alike: all with the same bytes, or all without the part
(fallen back). The replicas also
keep survivors bit-identical when a producer dies in the middle of the all-gather: its holders serve
the same committed bytes. Liveness needs a live, mutually reachable strict majority.

What the servicer asks of the round: take the contributions pushed to us (`open_contribution`), and
the replicas of decided parts handed to us (`open_replica`: accepting one is our vote for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Coroutine
from concurrent.futures import Executor
from datetime import timedelta
from typing import Any

import grpc
import torch

from protocol.allreduce.client import PeerClient, PeerFailed, push_replica
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.contributions import ContributionSource
from protocol.allreduce.faults import FaultPlan, check_fault
from protocol.allreduce.group import GroupSpec
from protocol.allreduce.pace import PACE_FINISH_FRACTION, PACE_MAX_WAIT_FRACTION, SendPace, member_send_bytes
from protocol.allreduce.parts import (
    PartRole,
    PartState,
    Pulse,
    ReplicaBuffer,
    check_average_header,
    remaining,
    result_views,
)
from protocol.allreduce.reducer import PartReducer, ReducedPart, SenderStatus
from protocol.allreduce.sparse import SummedContributions, average_codec, check_sparse_round, is_sparse
from protocol.codecs import Codec, CodecError, fp32_view
from protocol.error_feedback import ErrorFeedback
from protocol.errors import ProtocolError, invalid
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb

logger = logging.getLogger(__name__)

ALL_GATHER_FRACTION = 0.95
"""The all-gather must end by this fraction of the deadline; the rest is for assembling the result."""


class RoundState:
    """Everything one member knows about one round, how it decides the parts it reduces, and what the
    servicer asks of it; the servicer and the member's tasks share it."""

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
        send_rate: float | None = None,
    ) -> None:
        check_sparse_round(codec, config, group.num_members)
        self.group = group
        self.my_index = my_index
        self.codec = codec
        # A sparse codec's averages are the contributors' own payloads, summed by every member (sparse.py).
        self.sparse = is_sparse(codec)
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
        # Every chunk we write in the round waits its turn here (None: at full rate; pace.py).
        self.pace: SendPace | None = None
        if send_rate is not None:
            self.pace = SendPace(
                rate=send_rate,
                total_bytes=member_send_bytes(group, my_index, codec, config.chunk_num_elements),
                finish_by=self.started + PACE_FINISH_FRACTION * seconds * config.reduce_scatter_fraction,
                burst_bytes=codec.encoded_num_bytes(config.chunk_num_elements),
                max_wait=PACE_MAX_WAIT_FRACTION * config.stall_timeout.total_seconds(),
            )
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
            contributor_weights=list(reduced.contributor_weights),
        )

    def check_average_header(self, header: pb.AverageHeader, part_index: int) -> None:
        """Raise ValueError unless an average header fits this round and part."""
        check_average_header(header, part_index, self.group, self.codec)

    # --- deciding the parts this member reduces: its own, and those it takes over as a backup ----------

    def _new_reducer(self, part_index: int, accumulator: torch.Tensor | None = None) -> PartReducer:
        reducer = PartReducer(
            part_index=part_index,
            producer_index=self.my_index,
            num_elements=self.group.part_num_elements(part_index),
            num_members=self.group.num_members,
            codec=self.codec,
            chunk_num_elements=self.config.chunk_num_elements,
            accumulator=accumulator,
            rule=self.config.aggregation_rule,
        )
        for member in self.failed:
            reducer.give_up_on(member, "unreachable earlier in this round")
        return reducer

    def start_owner(self, output: torch.Tensor) -> None:
        """Start reducing our own part, with our fp32 vector as our own contribution.

        The sum accumulates in our part of `output` (the result buffer): that slice is only written
        again when we decode the decided average into it, after the sum was encoded. With in_place,
        `output` is our vector, whose numbers there are our contribution: the sum gets its own buffer
        (1/N of the vector) and the average is copied into `output` once decided. With a sparse codec
        our contribution is our encoded payload, as every other member's (nothing is summed here).
        """
        part = self.parts[self.my_index]
        assert part.role is PartRole.IDLE
        accumulator = None if self.in_place else output[self.group.part_slice(self.my_index)]
        reducer = self._new_reducer(self.my_index, accumulator=accumulator)
        part.role, part.reducer = PartRole.REDUCING, reducer
        if self.sparse:
            self._spawn(self._feed_own_contribution(self.my_index, reducer))
        else:
            reducer.add_local(self.my_index, self.weight, self.vector[self.group.part_slice(self.my_index)])
        self._spawn(self._decide(self.my_index, self.reduce_scatter_deadline, taken_over=False))

    def take_over(self, part_index: int, reason: str) -> None:
        """Reduce another member's part as its backup: everyone resends their contributions to us."""
        part = self.parts[part_index]
        assert part.role is PartRole.IDLE, part.role
        part.role, part.reducer = PartRole.REDUCING, self._new_reducer(part_index)
        self.record_failure(f"taking part {part_index} over ({reason})")
        deadline = time.monotonic() + self.config.takeover_fraction * remaining(self.all_gather_deadline)
        self._spawn(self._feed_own_contribution(part_index, part.reducer))
        self._spawn(self._decide(part_index, deadline, taken_over=True))
        self.pulse.notify()

    async def _feed_own_contribution(self, part_index: int, reducer: PartReducer) -> None:
        """Our contribution to a part we took over: the same encoded chunks we pushed to its owner."""
        if self.local_done or not self.contributes_to(part_index):
            why = "had already finished the round" if self.local_done else "holds the part's average already"
            reducer.exclude(self.my_index, f"this member {why}")
            self.pulse.notify()
            return
        offset = 0
        try:
            reducer.begin(self.my_index, self.weight)
            for chunk_index, size in enumerate(self.source.chunk_sizes(part_index)):
                payload = await self.source.payload(part_index, chunk_index)
                reducer.add_chunk(self.my_index, offset, size, payload)
                self.pulse.notify()
                offset += size
            reducer.complete(self.my_index)
        except ProtocolError as error:
            reducer.exclude(self.my_index, str(error))
        except ValueError as error:  # our own numbers do not encode (non-finite)
            reducer.exclude(self.my_index, f"its own contribution does not encode: {error}")
        self.pulse.notify()

    async def _fold_until(self, reducer: PartReducer, deadline: float) -> None:
        """Fold chunks as they arrive; at `deadline` leave out members that have not started.

        Returns once every contribution is summed or left out, or the reducer is poisoned (a partly
        summed member failed, or did not finish before the all-gather deadline).
        """
        loop = asyncio.get_running_loop()
        while not reducer.poisoned:
            jobs = reducer.plan_folds()
            if jobs and self._num_held_back:
                self.pulse.notify()  # their queues shrank: senders held back may be read again
            if jobs:
                await loop.run_in_executor(self.executor, reducer.run_folds, jobs)
                reducer.folds_done(jobs)
                continue
            if reducer.is_done():
                reducer.finalize()
                return
            if not reducer.finalized and (reducer.all_arrived() or remaining(deadline) <= 0):
                reducer.finalize()
                self.pulse.notify()
                continue
            if reducer.finalized and remaining(self.all_gather_deadline) <= 0:
                reducer.poisoned = "partly summed contributions did not finish before the all-gather deadline"
                return
            await self.pulse.wait_next(remaining(self.all_gather_deadline if reducer.finalized else deadline))

    async def hold_back(self, reducer: PartReducer, member: int) -> None:
        """Before reading more of `member`'s contribution, wait while `max_chunks_ahead` of its chunks
        wait to be summed, at most half the stall timeout (the sender's writes then block, but not long
        enough for it to take us for stalled). A robust rule or a sparse codec needs every contribution
        whole: never held."""
        limit = self.config.max_chunks_ahead
        if reducer.waits_for_all or reducer.num_queued(member) < limit:
            return

        def may_read_on() -> bool:
            streaming = reducer.status(member) is SenderStatus.STREAMING
            return reducer.num_queued(member) < limit or bool(reducer.poisoned) or not streaming

        self._num_held_back += 1
        try:
            await self.pulse.wait_for(may_read_on, self.config.stall_timeout.total_seconds() / 2)
        finally:
            self._num_held_back -= 1

    async def _decide(self, part_index: int, deadline: float, *, taken_over: bool) -> None:
        try:
            await self._decide_part(part_index, deadline, taken_over=taken_over)
        finally:
            if part_index == self.my_index and not taken_over:
                self._own_part_settled.set()

    async def own_part_settled(self) -> None:
        """Return once our own part is committed and its voters told, or moved on (or the all-gather
        deadline passed).

        We pull the other parts only then: a member that dies in the middle of the all-gather has
        handed its own part over by then, so the others can still use it. (Between a majority
        accepting our replicas and our telling them, our death would leave them holding a version
        nobody may use, and every member would fall back.) The pulls only wait for our own replica
        round trips, which the other owners go through at the same time before they serve.
        """
        if self.group.part_num_elements(self.my_index) == 0:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(remaining(self.all_gather_deadline)):
                await self._own_part_settled.wait()

    async def _decide_part(self, part_index: int, deadline: float, *, taken_over: bool) -> None:
        part = self.parts[part_index]
        reducer = part.reducer
        assert reducer is not None
        await self._fold_until(reducer, deadline)
        if reducer.poisoned:
            self._move(part_index, reducer.poisoned)
            return
        for member, reason in reducer.exclusion_reasons().items():
            if member != self.my_index:
                self.record_failure(
                    f"part {part_index}: left out {self.group.members[member].peer_id} ({reason})"
                )
        if not reducer.contributors:
            self._move(part_index, "no contribution arrived")
            return
        for member, adjustment in reducer.adjustments.items():
            self.record_adjustment(
                f"part {part_index}: {self.group.members[member].peer_id} {adjustment} ({reducer.rule.kind})"
            )
        reduced = await asyncio.get_running_loop().run_in_executor(
            self.executor,
            lambda: reducer.encode_average(
                # Only an owner keeps feedback for its part's average; a backup's residual there is
                # its sender residual, already spent on the contribution it pushed. A sparse average
                # is not encoded: every residual is a sender's.
                error_feedback=None if taken_over or self.sparse else self.error_feedback,
                part_offset=self.group.part_bounds[part_index],
            ),
        )
        if self.sparse and (overflow := self._sparse_overflow(reduced)):
            self._move(part_index, overflow)  # a version nobody could decode must not be committed
            return
        check_fault(self.fault_plan, "reduce_done", self.round_id)
        voters = await self._gather_votes(part_index, reduced)
        if voters is None:
            return
        check_fault(self.fault_plan, "votes_done", self.round_id)
        # A strict majority (we and the voters) holds our version, so no other version of the part can
        # win one. It is committed once a voter takes our notice (`_tell_committed`); a voter that
        # already sent a puller on, taking us for gone, refuses it. We alone (one server) are a
        # majority no one else votes in: committed at once.
        part.role, part.reducer, part.decided = PartRole.DECIDED, None, reduced
        part.committed = not voters
        self.pulse.notify()
        await asyncio.gather(*(self._tell_committed(part_index, reduced, voter) for voter in voters))
        if not part.committed:
            # Some of the voters may have told pullers the part is not to be had: using it now would
            # leave those members fallen back and us averaged. It stays our vote, like a stranded replica.
            part.never_committed = True
            self.record_failure(
                f"part {part_index}: no voter took our commit notice, so it is never committed"
            )
            self.pulse.notify()

    def _sparse_overflow(self, reduced: ReducedPart) -> str:
        """Why a sparse average we decided cannot be decoded (its sum would overflow), or ""."""
        decoder = SummedContributions(self.codec, reduced.contributor_weights, reduced.weight_sum)
        try:
            for size, payload in zip(reduced.chunk_sizes, reduced.payloads, strict=True):
                decoder.check_sum(payload, size)
        except CodecError as error:
            return str(error)
        return ""

    async def _gather_votes(self, part_index: int, reduced: ReducedPart) -> list[int] | None:
        """Hand our decided average to members until they and we are a strict majority; return them.

        The replicas go out at once, to as many members as the majority needs: on a saturated uplink
        each hand-off waits a queueing delay for every reply, so hand-offs one after the other would
        leave the link idle for several such delays. A member that fails is replaced by the next
        candidate. Returns None (the part moved) if some member holds another version or too few
        accepted ours: then our version must never be served or used. Until this returns our role
        stays REDUCING, so we refuse every other producer's replica: we vote for our own version.
        """
        part = self.parts[part_index]
        # Besides ours: 1 + S // 2 > S / 2 of the S servers. Clients (never dialled) hold no replica and
        # vote for nothing, so two strict majorities of the servers still share a voter.
        num_votes_needed = self.group.num_servers // 2
        chain = self.group.chain(part_index)
        position = chain.index(self.my_index)
        # The members after us in the chain first (pullers that fail over reach them first), then the
        # ones before us: an owner that moved the part may still vote for our version.
        candidates = deque(chain[position + 1 :] + chain[:position])
        voters: list[int] = []
        in_flight: dict[asyncio.Future[None], int] = {}
        started: list[asyncio.Future[None]] = []
        try:
            while len(voters) < num_votes_needed:
                while candidates and len(voters) + len(in_flight) < num_votes_needed:
                    target = candidates.popleft()
                    if target in self.failed:
                        continue  # pullers skip it too: they only walk past members that failed them
                    hand_off: asyncio.Future[None] = asyncio.ensure_future(
                        push_replica(self, target, reduced, self.all_gather_deadline)
                    )
                    in_flight[hand_off] = target
                    started.append(hand_off)
                    part.telling.add(target)  # its pull of our part waits: it gets the bytes here
                if not in_flight:
                    break
                done, _ = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for hand_off in done:
                    target = in_flight.pop(hand_off)
                    try:
                        hand_off.result()
                    except PeerFailed as error:
                        part.telling.discard(target)
                        if error.moved:
                            self._move(part_index, f"member {target} holds another version of it: {error}")
                            return None
                        self.mark_failed(target, f"replica of part {part_index} not accepted: {error}")
                        continue
                    voters.append(target)
                    part.holders.add(target)
        finally:
            for hand_off in in_flight:
                hand_off.cancel()
            if in_flight:
                await asyncio.wait(in_flight)
            for hand_off in started:  # outcomes we no longer need (the part moved) are dropped
                if hand_off.done() and not hand_off.cancelled():
                    hand_off.exception()
            part.telling.intersection_update(voters)
            self.pulse.notify()
        if len(voters) < num_votes_needed:
            self._move(
                part_index,
                f"only {len(voters) + 1} of {self.group.num_servers} members hold our average, not a majority",
            )
            return None
        return voters

    async def _tell_committed(self, part_index: int, reduced: ReducedPart, voter: int) -> None:
        """Tell a voter our version is committed; its pull waits for this (see `telling`). The first
        voter that takes the notice commits the version: it serves and uses its copy from then on."""
        part = self.parts[part_index]
        try:
            await push_replica(self, voter, reduced, self.all_gather_deadline, committed=True)
            part.told_committed.add(voter)
            part.committed = True
        except PeerFailed as error:
            # A refusal (it already sent a puller on, taking us for gone) or no answer: not a taker.
            # Were the version committed by another voter, this one can still pull it from us; it
            # just may not serve its copy.
            self.record_failure(f"member {voter} was not told part {part_index} is committed: {error}")
        finally:
            part.telling.discard(voter)
            self.pulse.notify()

    def note_holder(self, part_index: int, member: int) -> None:
        """`member` now holds the part's committed bytes; drop our copy once every live member does.

        Its producer holds them too, and we count once we decoded them into our result. A member that
        asks later (we wrongly thought it dead) is sent on along the chain. With two members, both
        hold the part as soon as each decoded it, so neither keeps a copy after the round.
        """
        part = self.parts[part_index]
        if part.decided is None or not part.servable:
            return
        part.holders.add(member)
        if part.decided.producer_index != self.my_index:  # a producer counts itself once it decoded
            part.holders.add(part.decided.producer_index)
        if part.holders | self.failed >= set(range(self.group.num_members)):
            part.decided, part.released = None, True

    def note_not_serving(self, part_index: int, member: int) -> None:
        """`member` answered that the part moved on from it: it gave its version up (or released it)."""
        self.parts[part_index].not_serving.add(member)
        self.pulse.notify()

    def stranded(self, part_index: int) -> bool:
        """We hold a version of the part that was never committed here, and we no longer wait for it to
        be: its producer failed us or told us the part moved on from it, or we settled it as stranded
        already (`settle_stranded`; as its producer: no voter took our commit notice).

        Waiting for the notice would hold us and our pullers until the all-gather deadline. We stop
        waiting instead, but keep our vote: the version is neither served nor used, we accept no other
        version, and we and our pullers walk on along the part's chain. That is safe whether or not the
        version was committed: were it committed (a voter took the notice), that voter serves it further
        down the chain, and no other version can win a majority past the votes for it, ours included.
        """
        part = self.parts[part_index]
        if part.role is not PartRole.DECIDED or part.committed or part.decided is None:
            return False
        if part.never_committed:
            return True
        producer = part.decided.producer_index
        return producer != self.my_index and (producer in self.failed or producer in part.not_serving)

    def settle_stranded(self, part_index: int) -> bool:
        """Whether the version we hold is stranded; if so it is settled for good, as we are about to act
        on it (send a puller on, or walk on ourselves): we refuse its producer's late commit notice.

        A producer we took for gone may only have been frozen or starved. Taking its notice after
        someone walked on past us would let the members that reach us later use the part while those
        that walked on fall back.
        """
        if not self.stranded(part_index):
            return False
        self.parts[part_index].never_committed = True
        return True

    def _move(self, part_index: int, reason: str) -> None:
        part = self.parts[part_index]
        part.role, part.reducer, part.gave_up = PartRole.MOVED, None, True
        self.record_failure(f"part {part_index} moved: {reason}")
        self.pulse.notify()

    async def wait_decided(self, part_index: int, deadline: float) -> ReducedPart | None:
        """Our turn in the chain of a part: take it over if we do not hold it, then wait for the decision.

        Returns the decided average, or None if the part moved on, the version we hold is stranded (then
        settled: we walk on past it), or the deadline passed.
        """
        part = self.parts[part_index]
        if part.role is PartRole.IDLE:
            self.take_over(part_index, "its earlier chain members did not serve it")
        # A replica we hold is only usable once its producer tells us a majority holds it, and that
        # notice is only waited for while the producer may still send it.
        await self.pulse.wait_for(
            lambda: part.servable or part.role is PartRole.MOVED or self.stranded(part_index),
            remaining(deadline),
        )
        if part.servable:
            return part.decided
        self.settle_stranded(part_index)
        return None

    # --- what the servicer asks: contributions pushed to us, replicas handed to us ---------------------

    async def open_contribution(self, part_index: int, member: int, weight: float) -> PartReducer | None:
        """A member starts pushing its contribution; returns the reducer, or None if already decided."""
        part = self.parts[part_index]
        while True:
            if part.role is PartRole.DECIDED:
                return None
            if part.role is PartRole.MOVED:
                raise ProtocolError(grpc.StatusCode.ABORTED, f"part {part_index} moved to a backup")
            if part.role is PartRole.REDUCING:
                assert part.reducer is not None
                part.reducer.begin(member, weight)
                self.pulse.notify()
                return part.reducer
            if part.role is PartRole.IDLE:
                self.take_over(part_index, f"member {member} pushed it to us")
                continue
            # A replica hand-off is under way: it decides whether we serve the owner's bytes or reduce.
            if not await self.pulse.wait_for(
                lambda: part.role is not PartRole.RECEIVING_REPLICA, remaining(self.all_gather_deadline)
            ):
                raise ProtocolError(grpc.StatusCode.UNAVAILABLE, "replica hand-off did not finish in time")

    def contribution_failed(self, part_index: int, member: int, reason: str, *, vanished: bool) -> None:
        """A push ended badly: leave the member out of the part; if its stream broke, it is gone."""
        reducer = self.parts[part_index].reducer
        if reducer is not None:
            reducer.exclude(member, reason)
        if vanished:
            self.mark_failed(member, reason)
        self.pulse.notify()

    def open_replica(self, header: pb.AverageHeader, sender: int, *, committed: bool) -> None:
        """The producer of a part starts handing us its decided average, or says it is committed.

        Accepting a replica is our vote for the sender's version of the part, so we accept one only
        while we have voted for none (IDLE), or our own version is dead (MOVED: we gave it up before it
        was committed, and only we could commit it); a member reducing the part votes for its own. We
        take a commit notice unless we settled the replica as stranded already (`settle_stranded`).
        """
        part_index = header.part_index
        try:
            self.check_average_header(header, part_index)
        except ValueError as error:
            raise invalid(str(error)) from error
        if header.producer_index != sender:
            raise invalid(f"member {sender} sent a replica produced by member {header.producer_index}")
        part = self.parts[part_index]
        holds_senders = (
            part.role is PartRole.DECIDED
            and part.decided is not None
            and part.decided.producer_index == sender
        )
        if committed:
            if not holds_senders:
                raise ProtocolError(
                    grpc.StatusCode.FAILED_PRECONDITION, f"no replica of yours for part {part_index} here"
                )
            if part.never_committed:  # we sent a puller (or ourselves) on: it must not be used now
                raise ProtocolError(
                    grpc.StatusCode.ABORTED,
                    f"part {part_index} was settled here as never committed: you were taken for gone",
                )
            part.committed = True
            self.pulse.notify()
        if holds_senders:
            raise ProtocolError(grpc.StatusCode.ALREADY_EXISTS, f"already hold your part {part_index}")
        if part.role not in (PartRole.IDLE, PartRole.MOVED):
            raise ProtocolError(grpc.StatusCode.ABORTED, f"part {part_index} is {part.role.value} here")
        # We decode the replica into our result as it arrives instead of keeping a copy (a part less
        # at the end of the round) where we need no bytes to serve it later. With two members nobody
        # but its producer and us could ever want this part, and the producer holds it. With the fp32
        # codec the numbers in our result are the bytes, which we serve from there. A version never
        # committed is overwritten by the part we do get, or our result is not used (we fall back);
        # in place, our numbers there are spent (should we have to reduce the part again, we are
        # left out unless our contribution is cached; see `spend`).
        decode_on_arrival = self.group.num_members <= 2 or self.codec.payload_is_fp32
        keep = self.output is None or not decode_on_arrival
        part.role, part.replica = PartRole.RECEIVING_REPLICA, ReplicaBuffer(header=header, keep=keep)
        self.pulse.notify()

    async def add_replica_chunk(
        self, part_index: int, offset: int, num_elements: int, payload: bytes
    ) -> None:
        replica = self.parts[part_index].replica
        if replica is None:
            raise ProtocolError(grpc.StatusCode.ABORTED, f"round {self.round_id} was forgotten here")
        decoder = average_codec(self.codec, replica.header.contributor_weights, replica.header.weight_sum)
        replica.add_chunk(offset, num_elements, payload, decoder)
        if not replica.keep:
            if self.output is None:
                raise ProtocolError(grpc.StatusCode.ABORTED, f"round {self.round_id} is over here")
            self.spend(part_index)
            start = self.group.part_bounds[part_index] + offset
            target = self.output[start : start + num_elements]
            # (fp32 codec: what we keep is where it is decoded to, not a second copy)
            self.keep_payload(
                start, num_elements, fp32_view(target) if self.codec.payload_is_fp32 else payload
            )
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self.executor, decoder.decode_into, payload, target
                )
            except CodecError as error:
                raise invalid(str(error)) from error

    def complete_replica(self, part_index: int) -> None:
        part = self.parts[part_index]
        if part.replica is None:
            raise ProtocolError(grpc.StatusCode.ABORTED, f"round {self.round_id} was forgotten here")
        decided = part.replica.complete()  # raises if truncated: then fail_replica, and nothing is in_result
        if not part.replica.keep and self.codec.payload_is_fp32 and self.output is not None:
            # The numbers are in our result, which are the fp32 bytes: we can serve them from there.
            views = result_views(self.output, self.group.part_bounds[part_index], decided.chunk_sizes)
            decided = dataclasses.replace(decided, payloads=views)
        part.in_result, part.decided = not part.replica.keep, decided
        part.role, part.replica = PartRole.DECIDED, None
        self.pulse.notify()

    def fail_replica(self, part_index: int) -> None:
        """The hand-off broke: forget the partial copy; we may have to take the part over later.

        Unless we already produced a version of the part and gave it up: a producer reduces a part at
        most once (a second version under our index could pass for the first at its replica holders).
        """
        part = self.parts[part_index]
        if part.role is PartRole.RECEIVING_REPLICA:
            part.role = PartRole.MOVED if part.gave_up else PartRole.IDLE
            part.replica, part.in_result = None, False
            self.pulse.notify()

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
