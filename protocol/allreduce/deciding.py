"""How one member decides the parts it reduces, so that every survivor ends bit-identical.

Deciding a part (`_decide`): fold contributions until all are resolved or the phase deadline passes,
encode the average once, hand replicas (all at once) to live members after us in the part's backup
chain until we and the replica holders are a strict majority of the group; the average is then
committed: we use it and tell those holders, which may then serve and use theirs; we serve it once
they all know (so our death mid-serve leaves them able to serve it). A
member that cannot reach the owner takes the part over (`take_over`), so a part may be reduced
twice; the majority is what keeps survivors bit-identical:

    every member accepts (votes for) at most one version of a part: its own, from the moment it starts
    reducing the part, or the first replica it completes; it refuses any other replica (ABORTED);
    a version is served or used only once it is committed, i.e. held by a strict majority;
    two strict majorities share a member, and that member voted once, so at most one version of a
    part is ever committed, hence served or decoded, whatever the failures or one-way partitions.

A version that misses its majority is never used: its producer stops serving the part (MOVED) and its
replica holders never serve it; if no version of a part commits, every member falls back. The
replicas also keep survivors bit-identical when a producer dies in the middle of the all-gather: its
holders serve the same committed bytes. Liveness needs a live, mutually reachable strict majority.

`PartDecider` adds this to `RoundCore`; the roles (IDLE, REDUCING, ...) are listed in `round.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque

import torch

from protocol.allreduce.client import PeerFailed, push_replica
from protocol.allreduce.faults import check_fault
from protocol.allreduce.parts import PartRole, remaining
from protocol.allreduce.reducer import PartReducer, ReducedPart, SenderStatus
from protocol.allreduce.round_core import RoundCore
from protocol.errors import ProtocolError


class PartDecider(RoundCore):
    """Deciding the parts this member reduces: its own, and those it takes over as a backup."""

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
        (1/N of the vector) and the average is copied into `output` once decided.
        """
        part = self.parts[self.my_index]
        assert part.role is PartRole.IDLE
        accumulator = None if self.in_place else output[self.group.part_slice(self.my_index)]
        reducer = self._new_reducer(self.my_index, accumulator=accumulator)
        reducer.add_local(self.my_index, self.weight, self.vector[self.group.part_slice(self.my_index)])
        part.role, part.reducer = PartRole.REDUCING, reducer
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
        enough for it to take us for stalled). A robust rule needs every contribution whole: never held."""
        limit = self.config.max_chunks_ahead
        if reducer.rule.waits_for_all or reducer.num_queued(member) < limit:
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
                # its sender residual, already spent on the contribution it pushed.
                error_feedback=None if taken_over else self.error_feedback,
                part_offset=self.group.part_bounds[part_index],
            ),
        )
        check_fault(self.fault_plan, "reduce_done", self.round_id)
        voters = await self._gather_votes(part_index, reduced)
        if voters is None:
            return
        # A strict majority (we and the voters) holds our version: it is committed, so we serve and
        # use it from now on, and tell the voters, which may then serve and use their copies.
        part.role, part.reducer, part.decided, part.committed = PartRole.DECIDED, None, reduced, True
        self.pulse.notify()
        await asyncio.gather(*(self._tell_committed(part_index, reduced, voter) for voter in voters))

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
        """Tell a voter our version is committed; its pull waits for this (see `telling`)."""
        part = self.parts[part_index]
        try:
            await push_replica(self, voter, reduced, self.all_gather_deadline, committed=True)
            part.told_committed.add(voter)
        except PeerFailed as error:
            # It can still pull the committed bytes from us; it just may not serve its copy.
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

    def _move(self, part_index: int, reason: str) -> None:
        part = self.parts[part_index]
        part.role, part.reducer, part.gave_up = PartRole.MOVED, None, True
        self.record_failure(f"part {part_index} moved: {reason}")
        self.pulse.notify()

    async def wait_decided(self, part_index: int, deadline: float) -> ReducedPart | None:
        """Our turn in the chain of a part: take it over if we do not hold it, then wait for the decision.

        Returns the decided average, or None if the part moved on or the deadline passed.
        """
        part = self.parts[part_index]
        if part.role is PartRole.IDLE:
            self.take_over(part_index, "its earlier chain members did not serve it")
        # A replica we hold is only usable once its producer tells us a majority holds it.
        await self.pulse.wait_for(lambda: part.servable or part.role is PartRole.MOVED, remaining(deadline))
        return part.decided if part.servable else None
