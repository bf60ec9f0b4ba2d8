"""One member's tiered all-reduce: its group's flat round, its column's, then the slices it pulls.

The plan (who is in which group and column) is ``tiers.py``'s. Here one member runs it:

    stage A  the flat round of its group over the whole vector (error feedback on our own Δ, as in a
             flat round); the group's mean m_g and its weight W_g (the weights of the members whose
             contributions are in every part of it) come out;
    stage B  a member at position i < S of its group: the flat round of column i over slice i of
             m_g, weighted W_g (no error feedback: m_g is no one's own vector). The bytes it decoded
             slice i from are held for stage C (``AllReducePeer.hold_slice``);
    stage C  every other slice is pulled as those bytes from its holders (``TierPlan.holders``: our
             group's, then the next groups'), decoded like the column decoded them.

If our group stage falls back (its majority was lost: in a group of two, the other died), we go on
with our own vector as our group's share: our column gets our Δ for our slice, weighted by our own
weight (our group-mates' Δ is then missing from that slice only; it was never in it twice: each group
has one member in a column), and the slices we pull still put us on the round's mean, so we stay on
the lineage. If our column stage falls back, or a slice no holder can give, we fall back to our own
vector, as a flat round does; our group-mates then pull our slice from another group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from itertools import accumulate

import torch

from protocol.allreduce.allreduce import AllReduceResult, EncodedChunk
from protocol.allreduce.client import PeerFailed
from protocol.allreduce.peer import AllReducePeer
from protocol.allreduce.slices import HeldSlice, SliceKey
from protocol.allreduce.tiers import TierPlan
from protocol.codecs import Codec, get_codec
from protocol.error_feedback import ErrorFeedback

GROUP_SHARE = 0.4
"""Of the round's deadline, what the group stage may take; the column stage the same, stage C the rest."""


@dataclass(frozen=True, kw_only=True)
class TieredResult:
    """What one member got out of a tiered round."""

    averaged: torch.Tensor
    """(E,) fp32: the whole swarm's mean (bit-identical on every member that did not fall back), or a
    copy of our own vector if ``fell_back``."""
    fell_back: bool
    failures: list[str]
    group: AllReduceResult
    """Stage A's result (the group's mean, its contributors per part)."""
    column: AllReduceResult | None
    """Stage B's result (None if we are in no column, or fell back before it)."""
    group_weight: float
    """W_g: the weight our group's mean carried into its column."""
    pulled_from: dict[int, str] = field(default_factory=dict)
    """Per slice pulled in stage C, the peer id that served it."""
    bytes_sent: int = 0
    """Wire bytes we sent in the three stages, as of returning (our slice's serving included so far)."""
    bytes_recv: int = 0
    """Wire bytes we received in the three stages."""
    seconds: float = 0.0
    contributors: tuple[str, ...] = ()
    """Whose vectors the mean holds, as far as we can tell: the members of the groups whose column
    member contributed to our column (a member in no column: every member of the plan); empty if
    we fell back."""
    payloads: tuple[EncodedChunk, ...] | None = None
    """The codec bytes ``averaged`` was decoded from, tiling it (the same bytes on every member), when
    every slice came in the round's codec (not with a sparse codec, whose slices travel as int8)."""

    def as_allreduce_result(self, num_slices: int) -> AllReduceResult:
        """The round as a flat round's result (one "part" per slice), for callers of either kind."""
        stages = (self.group, self.column)
        sent = {"group": self.group.bytes_sent, "column": self.column.bytes_sent if self.column else 0}
        recv = {"group": self.group.bytes_recv, "column": self.column.bytes_recv if self.column else 0}
        sent["gather"] = self.bytes_sent - sum(sent.values())
        recv["gather"] = self.bytes_recv - sum(recv.values())
        return AllReduceResult(
            averaged=self.averaged,
            contributors=[list(self.contributors)] * num_slices,
            producers=[self.pulled_from.get(i) for i in range(num_slices)],
            fell_back=self.fell_back,
            failures=list(self.failures),
            bytes_sent=self.bytes_sent,
            bytes_recv=self.bytes_recv,
            bytes_sent_by_phase=sent,
            bytes_recv_by_phase=recv,
            seconds=self.seconds,
            adjustments=[a for stage in stages if stage is not None for a in stage.adjustments],
            payloads=self.payloads,
        )


def group_weight(result: AllReduceResult, weights: dict[str, float], nonempty: Sequence[bool]) -> float:
    """W_g: the summed weights of the members whose contributions are in every nonempty part."""
    parts = [set(c) for c, has in zip(result.contributors, nonempty, strict=True) if has]
    everywhere = set.intersection(*parts) if parts else set()
    return float(sum(weights[p] for p in sorted(everywhere)))


SPARSE_CARRIER = "int8"
"""How a sparse codec's column mean travels in stage C (it is no codec's bytes: ``_held``)."""


def _held(
    result: AllReduceResult, averaged: torch.Tensor, codec: Codec, chunk_num_elements: int
) -> HeldSlice:
    """What we serve of our column's slice: the bytes we decoded it from. A sparse codec's column mean
    is the sum of its contributors' payloads, no codec's bytes: it is encoded once more with
    ``SPARSE_CARRIER``, in chunks of ``chunk_num_elements``, and our own slice (``averaged``, a view of
    our result) becomes what those bytes decode to, as every puller's does. Every member of the
    column encodes the same numbers the same way, so every group gets the same bytes, and int8 costs a
    quarter of fp32 (with the carrier's rounding on top of the codec's)."""
    if result.payloads is not None:
        return HeldSlice(
            codec=codec,
            chunk_sizes=tuple(chunk.num_elements for chunk in result.payloads),
            payloads=tuple(chunk.payload for chunk in result.payloads),
            weight_sum=0.0,
        )
    carrier = get_codec(SPARSE_CARRIER)
    pieces = averaged.split(chunk_num_elements)
    payloads = []
    for piece in pieces:
        payload = carrier.encode(piece.contiguous()).numpy().tobytes()
        carrier.decode_into(payload, piece)
        payloads.append(payload)
    return HeldSlice(
        codec=carrier,
        chunk_sizes=tuple(piece.numel() for piece in pieces),
        payloads=tuple(payloads),
        weight_sum=0.0,
    )


async def run_tiered(
    peer: AllReducePeer,
    vector: torch.Tensor,
    *,
    plan: TierPlan,
    my_peer_id: str,
    weights: Sequence[float],
    codec: Codec,
    error_feedback: ErrorFeedback | None,
    deadline: timedelta,
    bandwidths: Sequence[float] | None = None,
    linger: timedelta = timedelta(seconds=30),
) -> TieredResult:
    """Average ``vector`` with the plan's members (``weights``: one per member, in plan order;
    ``bandwidths``: per member, for the parts of the group stage; None: equal parts)."""
    started = time.monotonic()
    end = started + deadline.total_seconds()
    me = plan.index_of(my_peer_id)
    by_peer = {m.peer_id: float(w) for m, w in zip(plan.members, weights, strict=True)}
    g, position = plan.group_of(me), plan.position_of(me)
    group = plan.group_spec(g, None if bandwidths is None else [bandwidths[i] for i in plan.groups[g]])
    failures: list[str] = []

    key = SliceKey(round_id=plan.round_id, plan_digest=plan.digest, slice_index=position)
    holds = position < plan.num_slices

    def fallen(stage: str, column: AllReduceResult | None = None) -> TieredResult:
        if holds and held is None:
            peer.slices.abandon(key)  # our group-mates ask the next group's holder at once
        failures.append(f"fell back to our own vector ({stage})")
        return TieredResult(
            averaged=vector.clone(), fell_back=True, failures=failures, group=group_result,
            column=column, group_weight=weight_g, bytes_sent=sent, bytes_recv=received,
            seconds=time.monotonic() - started,
        )  # fmt: skip

    held: HeldSlice | None = None  # our column's slice, once we hold it for stage C
    group_result = await peer.allreduce(
        vector, group=group, my_peer_id=my_peer_id, weight=by_peer[my_peer_id], codec=codec,
        error_feedback=error_feedback, deadline=deadline * GROUP_SHARE,
    )  # fmt: skip
    failures += [f"group stage: {f}" for f in group_result.failures]
    sent, received = group_result.bytes_sent, group_result.bytes_recv
    nonempty = [group.part_num_elements(k) > 0 for k in range(group.num_members)]
    weight_g = group_weight(group_result, by_peer, nonempty)  # (fell back: its contributors are only us)
    if group_result.fell_back:  # (its result is a copy of our vector)
        failures.append("the group stage fell back: our own Δ is our group's share of our slice")
    mean_g = group_result.averaged

    out = torch.empty_like(vector)
    column_result: AllReduceResult | None = None
    if holds:
        part = plan.slice_of(position)
        column_result = await peer.allreduce(
            mean_g[part].contiguous(), group=plan.column_spec(position), my_peer_id=my_peer_id,
            weight=weight_g, codec=codec, error_feedback=None, keep_payloads=True,
            deadline=timedelta(seconds=max(min(deadline.total_seconds() * GROUP_SHARE, end - time.monotonic()), 1e-3)),
        )  # fmt: skip
        failures += [f"column stage: {f}" for f in column_result.failures]
        sent, received = sent + column_result.bytes_sent, received + column_result.bytes_recv
        if column_result.fell_back:
            return fallen("the column stage", column_result)
        out[part] = column_result.averaged
        held = await asyncio.get_running_loop().run_in_executor(
            peer.executor, _held, column_result, out[part], codec, peer.config.chunk_num_elements
        )
        peer.hold_slice(
            key,
            held,
            pullers=frozenset(m.peer_id for m in plan.members),
            linger=linger + timedelta(seconds=max(0.0, end - time.monotonic())),
        )

    pulled: dict[int, str] = {}
    # Per slice, the codec and (offset in the vector, numbers, payload) of the bytes we decoded it from.
    encoded: dict[int, tuple[Codec, list[tuple[int, int, bytes | memoryview]]]] = {}
    if held is not None:
        offsets = accumulate(held.chunk_sizes, initial=plan.slice_bounds[position])
        encoded[position] = (held.codec, list(zip(offsets, held.chunk_sizes, held.payloads, strict=False)))

    async def pull(slice_index: int) -> bool:
        nonlocal sent, received
        asked = dataclasses.replace(key, slice_index=slice_index)
        for holder in plan.holders(me, slice_index):
            if holder == me:
                continue
            member = plan.members[holder]
            try:
                traffic = await peer.pull_slice(
                    member.address,
                    asked,
                    my_peer_id=my_peer_id,
                    deadline=end,
                    out=out[plan.slice_of(slice_index)],
                )
            except PeerFailed as error:
                failures.append(f"slice {slice_index} from {member.peer_id}: {error}")
                continue
            sent, received = sent + traffic.bytes_sent, received + traffic.bytes_recv
            pulled[slice_index] = member.peer_id
            if traffic.codec is not None:
                start = plan.slice_bounds[slice_index]
                encoded[slice_index] = (traffic.codec, [(start + o, n, p) for o, n, p in traffic.chunks])
            return True
        failures.append(f"slice {slice_index}: no holder could serve it")
        return False

    got = await asyncio.gather(*(pull(i) for i in range(plan.num_slices) if i != position))
    if held is not None:  # what we served of our slice so far (group-mates may still be pulling it)
        sent += peer.slices.bytes_served(key)
    if not all(got):
        return fallen("the gather stage", column_result)
    return_payloads = len(encoded) == plan.num_slices and all(
        used.spec() == codec.spec() for used, _ in encoded.values()
    )
    payloads = (
        tuple(EncodedChunk(o, n, p) for i in sorted(encoded) for o, n, p in encoded[i][1])
        if return_payloads
        else None
    )
    if column_result is None:
        contributors = tuple(m.peer_id for m in plan.members)
    else:
        column = plan.column(position)
        reps = {peer for part in column_result.contributors for peer in part}
        groups = [plan.group_of(i) for i in column if plan.members[i].peer_id in reps]
        contributors = tuple(plan.members[i].peer_id for gi in sorted(groups) for i in plan.groups[gi])
    return TieredResult(
        averaged=out, fell_back=False, failures=failures, group=group_result, column=column_result,
        group_weight=weight_g, pulled_from=pulled, bytes_sent=sent, bytes_recv=received,
        seconds=time.monotonic() - started, contributors=contributors, payloads=payloads,
    )  # fmt: skip
