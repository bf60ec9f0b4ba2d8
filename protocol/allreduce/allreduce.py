"""One member's all-reduce round: reduce-scatter then all-gather, with failover along backup chains.

    Phase 1, reduce-scatter: for every part k, push our weighted contribution (encoded chunk by chunk)
             to k's owner; meanwhile our own part is reduced from everyone's pushes (RoundState).
    Phase 2, all-gather:     pull every part's encoded average from whoever decided it and decode it
             straight into our result; our own part we decode from the bytes we decided. We pull
             once our own part is committed and its replica holders told (so that dying while
             pulling never strands our part), and we open our connections when the round opens.

All parts run concurrently, so encoding, sending, reducing and decoding overlap. For each part the
member walks the part's chain (owner, then the next members): a member that is gone or stalled is
skipped, and the next one gets our contribution again and is asked for the average; when the chain
reaches us we take the part over ourselves. If some part cannot be had before the deadline, we fall
back to our own vector and say so; the call always returns by its deadline.

In place (`state.in_place`) our result is our vector: a part's average is decoded over our numbers
there once it arrives (a pulled part is committed, so our contribution to it is not needed again;
see RoundState.spend), and a fallback leaves our own numbers in the parts we could not get.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from protocol.allreduce.client import PeerFailed, PushOutcome, pull_average, push_contribution
from protocol.allreduce.faults import check_fault
from protocol.allreduce.memory import release_free_memory
from protocol.allreduce.parts import PartRole, remaining, result_views
from protocol.allreduce.reducer import ReducedPart
from protocol.allreduce.registry import RoundRegistry
from protocol.allreduce.round import RoundState
from protocol.allreduce.sparse import average_codec
from protocol.codecs import fp32_view
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb


@dataclass(frozen=True, kw_only=True)
class AllReduceResult:
    """What one member got out of a round."""

    averaged: torch.Tensor
    """(E,) fp32: per part, sum(w_i x_i) / sum(w_i) over that part's contributors; our own vector if fell_back.
    With ``in_place`` it is the caller's vector itself, and if fell_back it holds the parts we got and
    our own numbers elsewhere (``contributors`` says which). Read-only: with the fp32 codec, slower
    members may still pull our part from it (and ``payloads`` are views of it) until the round is
    forgotten, so a caller that must write copies it first."""
    contributors: list[list[str]]
    """Per part, the peer ids whose contributions were averaged (identical on every member that did not fall back)."""
    producers: list[str | None]
    """Per part, the peer id that reduced it (its owner, or the backup that took it over)."""
    fell_back: bool
    """True if some part could not be had in time, so `averaged` is a copy of our own vector."""
    failures: list[str]
    """Human-readable account of every peer we lost, contribution left out, part moved or refused."""
    bytes_sent: int
    """Wire bytes (serialized messages) this member sent for the round, as of returning."""
    bytes_recv: int
    """Wire bytes this member received for the round, as of returning."""
    bytes_sent_by_phase: dict[str, int]
    """bytes_sent split into "reduce_scatter" (contributions) and "all_gather" (averages, replicas)."""
    bytes_recv_by_phase: dict[str, int]
    """bytes_recv split the same way."""
    seconds: float
    """Wall-clock duration of the call."""
    adjustments: list[str] = field(default_factory=list)
    """Contributions the aggregation rule (AllReduceConfig.aggregation) clipped or trimmed in the parts
    this member decided, e.g. "part 3: p5 norm 812 clipped to 16.2 (clipped)"; empty for "mean"."""
    payloads: tuple[EncodedChunk, ...] | None = None
    """With AllReduceConfig.keep_payloads and unless fell_back: the codec bytes ``averaged`` was
    decoded from, in order, tiling it exactly (the same bytes on every member that did not fall back).
    None with a sparse codec, whose averages are bundles of the contributors' payloads (sparse.py)."""


@dataclass(frozen=True)
class EncodedChunk:
    """``payload`` decodes (with the round's codec) into ``averaged[offset : offset + num_elements]``."""

    offset: int
    num_elements: int
    payload: bytes | memoryview  # (fp32 codec: a view of ``averaged`` there)


def tiled(
    kept: dict[int, tuple[int, bytes | memoryview]], num_elements: int
) -> tuple[EncodedChunk, ...] | None:
    """The kept chunks in order if they tile ``[0, num_elements)`` exactly, else None."""
    chunks, end = [], 0
    for offset in sorted(kept):
        size, payload = kept[offset]
        if offset != end or size <= 0:
            return None
        chunks.append(EncodedChunk(offset, size, payload))
        end = offset + size
    return tuple(chunks) if end == num_elements else None


@dataclass(frozen=True)
class _PartOutcome:
    producer_index: int
    contributor_indices: tuple[int, ...]


def _nothing() -> None:
    """A job for the compute thread that only marks the end of the queue."""


async def _decode_reduced(state: RoundState, reduced: ReducedPart, output: torch.Tensor) -> None:
    """Decode the bytes we decided (or hold as a replica) into our result, like any puller would.

    With the fp32 codec we keep views of our result there, not the bytes, from then on: nothing writes
    that slice again (one committed version per part), so a replica's received bytes go at once.
    """
    if state.parts[reduced.part_index].in_result:
        return  # the replica was decoded into our result as it arrived
    state.spend(reduced.part_index)
    start = state.group.part_bounds[reduced.part_index]
    offsets = list(accumulate(reduced.chunk_sizes, initial=start))[:-1]
    chunks = list(zip(offsets, reduced.chunk_sizes, reduced.payloads, strict=True))
    fp32 = state.codec.payload_is_fp32
    kept = result_views(output, start, reduced.chunk_sizes) if fp32 else reduced.payloads
    for (offset, size, _), payload in zip(chunks, kept, strict=True):
        state.keep_payload(offset, size, payload)

    decoder = average_codec(state.codec, reduced.contributor_weights, reduced.weight_sum)

    def decode() -> None:
        for offset, size, payload in chunks:
            decoder.decode_into(payload, output[offset : offset + size])

    await asyncio.get_running_loop().run_in_executor(state.executor, decode)
    part = state.parts[reduced.part_index]
    if fp32 and part.decided is reduced:
        part.decided = dataclasses.replace(reduced, payloads=tuple(kept))


async def _pull_or_use_replica(
    state: RoundState,
    target: int,
    part_index: int,
    decode_chunk: Callable[[pb.AverageHeader, int, int, bytes], Awaitable[None]],
    output: torch.Tensor,
) -> _PartOutcome:
    """Pull the part from `target`, unless its producer hands us the replica first (then use that copy).

    The members after the producer that make up its majority receive the decided bytes as replicas
    before anyone may pull them, so pulling them again would only duplicate traffic. A replica is used
    only once its producer told us it is committed (held by a majority), like the pulled bytes.
    """
    part = state.parts[part_index]
    pull = asyncio.ensure_future(
        pull_average(state, target, part_index, state.all_gather_deadline, decode_chunk)
    )
    replica = asyncio.ensure_future(
        state.pulse.wait_for(lambda: part.servable, remaining(state.all_gather_deadline))
    )
    try:
        await asyncio.wait({pull, replica}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        replica.cancel()
    if not pull.done() and part.servable:
        pull.cancel()
        with contextlib.suppress(asyncio.CancelledError, PeerFailed):
            await pull
    try:
        header = await pull
    except (asyncio.CancelledError, PeerFailed):
        # The producer answers "you hold the replica" (or we cancelled the pull): use our copy.
        if not part.servable or part.decided is None:
            raise
        decided = part.decided
        await _decode_reduced(state, decided, output)
        state.note_holder(part_index, state.my_index)
        return _PartOutcome(decided.producer_index, decided.contributor_indices)
    return _PartOutcome(header.producer_index, tuple(header.contributor_indices))


async def _gather_part(state: RoundState, part_index: int, output: torch.Tensor) -> _PartOutcome | None:
    """Get the decided average of one part into `output`, walking the part's chain; None if impossible."""
    loop = asyncio.get_running_loop()
    start = state.group.part_bounds[part_index]
    me = state.my_index

    async def decode_chunk(header: pb.AverageHeader, offset: int, size: int, payload: bytes) -> None:
        state.spend(part_index)  # (pulled bytes are committed: no member will need our numbers there)
        target = output[start + offset : start + offset + size]
        # (fp32 codec: what we keep is where it is decoded to, not a second copy)
        state.keep_payload(
            start + offset, size, fp32_view(target) if state.codec.payload_is_fp32 else payload
        )
        decoder = average_codec(state.codec, header.contributor_weights, header.weight_sum)
        await loop.run_in_executor(state.executor, decoder.decode_into, payload, target)

    for position, target in enumerate(state.group.chain(part_index)):
        if target == me:
            reduced = await state.wait_decided(part_index, state.all_gather_deadline)
            if reduced is not None:
                await _decode_reduced(state, reduced, output)
                state.note_holder(part_index, me)
                return _PartOutcome(reduced.producer_index, reduced.contributor_indices)
            if state.parts[part_index].role is PartRole.MOVED:
                continue
            if state.stranded(part_index):  # (settled by wait_decided: its late commit is refused)
                state.record_failure(f"part {part_index}: the version we hold was never committed")
                continue
            state.record_failure(f"part {part_index} was not decided before the deadline")
            return None
        if target in state.failed:
            continue
        # In place, our numbers for the part may be (partly) overwritten already: a pull of it broke
        # off midway (the chain members after it hold the same committed bytes), or a replica we
        # decoded as it arrived was never committed. Then we only pull.
        if state.contributes_to(part_index):
            # Our first push goes to the owner within the reduce-scatter phase; a resend to a backup
            # may take until the all-gather deadline (the backup applies its own, shorter, deadline).
            push_deadline = state.reduce_scatter_deadline if position == 0 else state.all_gather_deadline
            outcome, detail = await push_contribution(state, target, part_index, push_deadline)
            if outcome is PushOutcome.FAILED:
                state.mark_failed(target, f"push of part {part_index}: {detail}")
                continue
            if outcome is PushOutcome.MOVED:
                state.note_not_serving(part_index, target)
                continue
            if outcome in (PushOutcome.REFUSED, PushOutcome.LATE):
                state.record_failure(f"our contribution to part {part_index} was left out: {detail}")
        await state.own_part_settled()
        try:
            return await _pull_or_use_replica(state, target, part_index, decode_chunk, output)
        except PeerFailed as error:
            if error.moved:
                state.note_not_serving(part_index, target)
            else:
                state.mark_failed(target, f"pull of part {part_index}: {error}")
    state.record_failure(f"no member of part {part_index}'s chain could serve it")
    return None


async def _trim_memory_every(interval: float) -> None:
    """Give freed heap memory back to the OS every `interval` seconds (on a thread: it locks the arenas)."""
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        await loop.run_in_executor(None, release_free_memory)


async def run_allreduce(state: RoundState, registry: RoundRegistry) -> AllReduceResult:
    """Run the round described by `state` to completion (or to its deadline)."""
    group, me = state.group, state.my_index
    registry.open(state)
    trim_interval = state.config.memory_trim_interval
    trimming = (
        None
        if trim_interval is None
        else asyncio.ensure_future(_trim_memory_every(trim_interval.total_seconds()))
    )
    try:
        # Handshakes first, while the links are still quiet (see AllReduceConfig.connect_timeout).
        # (a client member accepts no connections: nobody dials it)
        state.client.connect([m.address for i, m in enumerate(group.members) if i != me and not m.client])
        output = state.vector if state.in_place else torch.empty_like(state.vector)  # (E,)
        state.output = output
        if group.part_num_elements(me) > 0:
            state.start_owner(output)
        check_fault(state.fault_plan, "round_open", state.round_id)
        tasks = {
            part_index: asyncio.ensure_future(_gather_part(state, part_index, output))
            for part_index in range(group.num_members)
            if group.part_num_elements(part_index) > 0
        }
        if tasks:
            _, pending = await asyncio.wait(tasks.values(), timeout=remaining(state.deadline))
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
                state.record_failure(f"{len(pending)} part(s) not gathered before the deadline")
        # `output` becomes the caller's: replicas stop going into it, and the chunks of theirs already
        # queued on the compute thread are decoded before we return (the thread runs jobs in order).
        state.output = None
        await asyncio.get_running_loop().run_in_executor(state.executor, _nothing)
        outcomes = {k: t.result() if not t.cancelled() else None for k, t in tasks.items()}
        fell_back = any(outcome is None for outcome in outcomes.values())
        peer_ids = [m.peer_id for m in group.members]
        if fell_back and not state.in_place:
            averaged = state.vector.clone()
            contributors = [[peer_ids[me]] for _ in range(group.num_members)]
            producers: list[str | None] = [peer_ids[me]] * group.num_members
            state.record_failure("fell back to our own vector")
        else:
            # In place, a fallen-back vector holds the parts we got and our own numbers elsewhere
            # (or, in a part whose pull broke off with nobody left to serve it, some of each).
            averaged = output
            missing_contributors, missing_producer = (
                ([peer_ids[me]], peer_ids[me]) if fell_back else ([], None)
            )
            got = {k: outcome for k, outcome in outcomes.items() if outcome is not None}
            contributors = [
                [peer_ids[i] for i in got[k].contributor_indices] if k in got else list(missing_contributors)
                for k in range(group.num_members)
            ]
            producers = [
                peer_ids[got[k].producer_index] if k in got else missing_producer
                for k in range(group.num_members)
            ]
            if fell_back:
                mixed = sorted(k for k in state.spent if k not in got)
                state.record_failure(
                    "fell back to our own numbers in the parts we could not get (in place"
                    + (f"; parts {mixed} hold some of the average)" if mixed else ")")
                )
        check_fault(state.fault_plan, "round_done", state.round_id)
        return AllReduceResult(
            averaged=averaged,
            contributors=contributors,
            producers=producers,
            fell_back=fell_back,
            failures=list(state.failures),
            bytes_sent=state.bytes_sent,
            bytes_recv=state.bytes_recv,
            bytes_sent_by_phase={
                "reduce_scatter": state.bytes_sent_reduce_scatter,
                "all_gather": state.bytes_sent - state.bytes_sent_reduce_scatter,
            },
            bytes_recv_by_phase={
                "reduce_scatter": state.bytes_recv_reduce_scatter,
                "all_gather": state.bytes_recv - state.bytes_recv_reduce_scatter,
            },
            seconds=time.monotonic() - state.started,
            adjustments=list(state.adjustments),
            # (A sparse round's bytes are the contributors' payloads, which the round's codec alone
            # does not decode: its mean is served as fp32.)
            payloads=None
            if fell_back or state.kept_payloads is None or state.sparse
            else tiled(state.kept_payloads, averaged.numel()),
        )
    finally:
        if trimming is not None:
            trimming.cancel()
        registry.finished(state)
