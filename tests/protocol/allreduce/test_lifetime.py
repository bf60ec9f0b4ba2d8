"""How long a peer keeps a round's buffers: only while another member may still ask for them.

A member runs its rounds one after the other, so once every other member of a round has told us it
returned from it (RoundFinished) or sent us a message of a later round, none of them will pull that
round's parts again: the round is forgotten at once (not `linger` later) with its buffers. The tests
that look at a round after it ended keep its members from telling (`silent_members`). Within a round, a copy of a part is dropped once every
live member is known to hold the part; with two members that is as soon as both decoded it. And an
owner holds only a few chunks of a sender that runs ahead of a lower member (summed first).
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta

import pytest
import torch
import uvloop

from protocol.allreduce import AllReducePeer, AllReduceResult, GroupSpec, Member
from protocol.allreduce import peer as peer_module
from protocol.allreduce.client import PeerClient
from protocol.allreduce.parts import PartRole
from protocol.allreduce.round import RoundState
from protocol.codecs import get_codec
from protocol.errors import ProtocolError
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from tests.protocol.allreduce.support import (
    FAST_CONFIG,
    allreduce_all,
    local_peers,
    members_of,
    socket_free_round_state,
)

NUM_ELEMENTS = 40_000
LINGER = timedelta(seconds=60)  # far longer than the test: only the new rule can forget a round
CONFIG = FAST_CONFIG.__class__(**{**FAST_CONFIG.__dict__, "linger": LINGER})


def vectors_for(num_peers: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(NUM_ELEMENTS, generator=generator) for _ in range(num_peers)]


async def run_round(peers: list[AllReducePeer], round_id: int) -> list[AllReduceResult]:
    group = GroupSpec.build(round_id=round_id, members=members_of(peers), num_elements=NUM_ELEMENTS)
    results = await allreduce_all(peers, vectors_for(len(peers), round_id), group, get_codec("none"))
    assert not any(result.fell_back for result in results), [r.failures for r in results]
    return results


def holds_no_buffer(state: RoundState) -> bool:
    return all(p.decided is None and p.replica is None and p.reducer is None for p in state.parts)


@pytest.fixture
def silent_members(monkeypatch: pytest.MonkeyPatch) -> None:
    """Members do not send RoundFinished, as if every such call were lost."""

    async def lost(*args: object) -> None:
        return None

    monkeypatch.setattr(peer_module, "tell_finished", lost)


@pytest.mark.timeout(60)
def test_a_round_is_forgotten_by_every_member_as_soon_as_all_returned_from_it() -> None:
    """Each member tells the others it returned; one that finished and heard it from all forgets the
    round there and then, with its buffers (the fp32 views of its result among them), long before
    its linger (60 s) would."""

    async def scenario() -> None:
        async with local_peers(3, CONFIG) as peers:
            running = asyncio.ensure_future(run_round(peers, 0))
            deadline = time.monotonic() + 5
            while any(peer.registry.get(0) is None for peer in peers) and time.monotonic() < deadline:
                await asyncio.sleep(0)
            states = [peer.registry.get(0) for peer in peers]  # the rounds, caught while open
            await running
            while any(peer.registry.get(0) is not None for peer in peers) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            for peer, state in zip(peers, states, strict=True):
                assert peer.registry.get(0) is None
                assert state is not None and state.local_done and holds_no_buffer(state)

    uvloop.run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("silent_members")
def test_a_finished_tell_of_a_round_not_opened_here_is_not_remembered() -> None:
    """RoundFinished for a round this peer has not opened is answered and forgotten: it cannot make
    the peer drop that round later, while slower members may still need it. (Members are silent
    here, so only that early tell could make member 0 forget round 0.)"""

    async def scenario() -> None:
        async with local_peers(2, CONFIG) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            assert peers[0].registry.get(0) is None
            client = PeerClient(CONFIG.grpc_options(server=False))
            try:
                stub = client.stub(peers[0].address)
                ref = pb.RoundRef(round_id=0, group_digest=group.digest, sender_index=1, sender_peer_id="p1")
                await stub.FinishRound(pb.RoundFinished(round=ref), timeout=5)  # not opened here: answered
                results = await allreduce_all(peers, vectors_for(2, 0), group, get_codec("none"))
                assert not any(result.fell_back for result in results)
                state = peers[0].registry.get(0)
                assert state is not None and state.local_done  # kept for member 1, as far as 0 knows
            finally:
                await client.close()

    uvloop.run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("silent_members")
def test_a_round_is_forgotten_once_every_other_member_moved_on() -> None:
    async def scenario() -> None:
        async with local_peers(3, CONFIG) as peers:
            await run_round(peers, 0)
            finished = [peer.registry.get(0) for peer in peers]
            assert all(state is not None and state.local_done for state in finished)

            await run_round(peers, 1)  # every member sends every other one round-1 messages
            for peer, state in zip(peers, finished, strict=True):
                assert peer.registry.get(0) is None
                assert state is not None and holds_no_buffer(state)

            # Member 2 sits round 2 out: as far as 0 and 1 know, it may still pull round 1 from them.
            await run_round(peers[:2], 2)
            assert peers[0].registry.get(1) is not None
            assert peers[1].registry.get(1) is not None
            assert peers[2].registry.get(1) is not None  # it has not heard of round 2 at all

    uvloop.run(scenario())


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("silent_members")
def test_two_members_keep_no_copy_of_any_part_after_the_round() -> None:
    """Each holds both parts once it decoded them, and the other one produced or holds them too."""

    async def scenario() -> list[RoundState]:
        async with local_peers(2, CONFIG) as peers:
            await run_round(peers, 0)
            states = [peer.registry.get(0) for peer in peers]
            assert all(state is not None for state in states)
            return states  # type: ignore[return-value]

    for state in uvloop.run(scenario()):
        assert all(part.servable and part.released for part in state.parts)
        assert holds_no_buffer(state)


@pytest.mark.timeout(60)
def test_a_replica_holder_is_not_sent_the_part_again() -> None:
    """A member that receives a part as a replica asks its owner for it too (to be safe if the owner
    dies); the owner answers "you hold it" instead of sending the bytes a second time."""

    async def scenario() -> list[AllReduceResult]:
        async with local_peers(2, CONFIG) as peers:
            return await run_round(peers, 0)

    part_bytes = 4 * NUM_ELEMENTS // 2  # fp32
    for result in uvloop.run(scenario()):
        # Our contribution to the other part out and its replica out; theirs in and its replica in.
        assert 2 * part_bytes < result.bytes_recv < 2.1 * part_bytes
        assert 2 * part_bytes < result.bytes_sent < 2.1 * part_bytes
        # By phase: one part's contribution each way (reduce-scatter), one replica each way (all-gather).
        for by_phase, total in ((result.bytes_sent_by_phase, result.bytes_sent),
                                (result.bytes_recv_by_phase, result.bytes_recv)):  # fmt: skip
            assert sum(by_phase.values()) == total
            assert part_bytes < by_phase["reduce_scatter"] < 1.05 * part_bytes
            assert part_bytes < by_phase["all_gather"] < 1.05 * part_bytes


def round_state_owning_part_0(num_members: int) -> RoundState:
    return socket_free_round_state(num_members, NUM_ELEMENTS, CONFIG)


@pytest.mark.timeout(30)
def test_a_sender_far_ahead_of_a_lower_member_is_read_no_further_for_a_while() -> None:
    """Member 2's chunks are summed after member 1's: while member 1 sends nothing, the owner stops
    reading member 2 once `max_chunks_ahead` of its chunks wait, and reads on as soon as they can be
    summed, or after half the stall timeout, so that member 2 never takes the owner for stalled."""

    async def scenario() -> tuple[bool, float, float]:
        state = round_state_owning_part_0(3)
        chunk = state.group.part_num_elements(0) // (CONFIG.max_chunks_ahead + 1)
        payload = torch.ones(chunk).numpy().tobytes()
        reducer = state._new_reducer(0)
        reducer.begin(0, 1.0)  # the owner's own chunks are summed first; it has not sent them yet
        reducer.begin(1, 1.0)
        reducer.begin(2, 1.0)
        for index in range(CONFIG.max_chunks_ahead):
            reducer.add_chunk(2, index * chunk, chunk, payload)

        held = asyncio.ensure_future(state.hold_back(reducer, 2))
        await asyncio.sleep(0.3)
        was_held = not held.done()
        start = time.monotonic()
        reducer.exclude(0, "test")  # members 0 and 1 drop out: member 2's chunks can be summed
        reducer.exclude(1, "test")
        jobs = reducer.plan_folds()
        assert len(jobs) == CONFIG.max_chunks_ahead
        state.pulse.notify()
        await held
        released_after = time.monotonic() - start

        # Nobody catches up: the owner reads on after half the stall timeout anyway.
        stuck = state._new_reducer(0)
        stuck.begin(1, 1.0)
        stuck.begin(2, 1.0)
        for index in range(CONFIG.max_chunks_ahead):
            stuck.add_chunk(2, index * chunk, chunk, payload)
        start = time.monotonic()
        await state.hold_back(stuck, 2)
        return was_held, released_after, time.monotonic() - start

    was_held, released_after, held_alone = uvloop.run(scenario())
    assert was_held
    assert released_after < 0.5
    half_stall = CONFIG.stall_timeout.total_seconds() / 2
    assert half_stall - 0.05 < held_alone < half_stall + 2.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_peers", [2, 3])
def test_with_the_fp32_codec_an_owner_keeps_no_second_copy_of_its_part(num_peers: int) -> None:
    """The fp32 codec's bytes are the numbers themselves: an owner serves its decided part from where
    it summed it (its part of the result), and the bytes a member keeps for the caller
    (keep_payloads) of its own part and of the parts it pulled are views of its result there, not a
    copy. What it serves is still what it uses: the exact mean, bit for bit on every member."""
    config = CONFIG.__class__(**{**CONFIG.__dict__, "keep_payloads": True})

    async def scenario() -> list[AllReduceResult]:
        async with local_peers(num_peers, config) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            return await allreduce_all(peers, vectors_for(num_peers, 0), group, get_codec("none"))

    results = uvloop.run(scenario())
    expected = torch.stack(vectors_for(num_peers, 0)).sum(dim=0) / num_peers
    group = GroupSpec.build(
        round_id=0,
        members=[Member(peer_id=f"p{i}", address="x:1") for i in range(num_peers)],
        num_elements=NUM_ELEMENTS,
    )
    for index, result in enumerate(results):
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged.view(torch.int32), results[0].averaged.view(torch.int32))
        torch.testing.assert_close(result.averaged, expected, rtol=0, atol=1e-6)
        start = result.averaged.data_ptr()
        own = range(group.part_bounds[index], group.part_bounds[index + 1])
        own_chunks = [c for c in result.payloads or () if c.offset in own]
        assert own_chunks
        for chunk in result.payloads or ():
            if chunk.offset in own:
                assert isinstance(chunk.payload, memoryview), type(chunk.payload)
            if isinstance(chunk.payload, memoryview):  # a view of the result where it decodes
                address = torch.frombuffer(chunk.payload, dtype=torch.uint8).data_ptr()
                assert address == start + 4 * chunk.offset
                assert len(chunk.payload) == 4 * chunk.num_elements


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("silent_members")
def test_with_the_fp32_codec_a_replica_holder_keeps_views_of_its_result_once_it_used_the_replica() -> None:
    """With more than two members the parts a member votes for arrive as replicas; with the fp32 codec
    they are decoded into the result as they arrive, and the member keeps (and would serve) views of
    its result there instead of the received bytes. The results stay the exact mean."""
    num_peers = 4
    config = CONFIG.__class__(**{**CONFIG.__dict__, "keep_payloads": True})

    Held = list[tuple[int, tuple[bytes | memoryview, ...]]]  # (part, payloads) of the replicas a member used

    async def scenario() -> tuple[list[AllReduceResult], list[Held]]:
        async with local_peers(num_peers, config) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=NUM_ELEMENTS)
            results = await allreduce_all(peers, vectors_for(num_peers, 0), group, get_codec("none"))
            held: list[Held] = []
            for peer in peers:
                state = peer.registry.get(0)
                assert state is not None
                held.append(
                    [
                        (k, part.decided.payloads)
                        for k, part in enumerate(state.parts)
                        if part.decided is not None and part.decided.producer_index != state.my_index
                    ]
                )
            return results, held

    results, held = uvloop.run(scenario())
    expected = torch.stack(vectors_for(num_peers, 0)).sum(dim=0) / num_peers
    group = GroupSpec.build(
        round_id=0,
        members=[Member(peer_id=f"p{i}", address="x:1") for i in range(num_peers)],
        num_elements=NUM_ELEMENTS,
    )
    assert sum(len(replicas) for replicas in held) >= num_peers  # each part has N // 2 replica holders
    for result, replicas in zip(results, held, strict=True):
        assert not result.fell_back, result.failures
        torch.testing.assert_close(result.averaged, expected, rtol=0, atol=1e-6)
        start = result.averaged.data_ptr()
        for part_index, payloads in replicas:
            offset = group.part_bounds[part_index]
            for payload in payloads:
                assert isinstance(payload, memoryview), type(payload)
                assert torch.frombuffer(payload, dtype=torch.uint8).data_ptr() == start + 4 * offset
                offset += len(payload) // 4
            assert offset == group.part_bounds[part_index + 1]
        assert all(isinstance(chunk.payload, memoryview) for chunk in result.payloads or ())


@pytest.mark.timeout(60)
def test_a_truncated_replica_leaves_nothing_marked_as_decoded_into_the_result() -> None:
    """With two members a replica goes straight into our result; one that stops short is dropped, and
    the part must then be decoded from whatever version we do get, not skipped as if already there."""

    async def scenario() -> tuple[bool, object]:
        state = round_state_owning_part_0(2)
        state.output = torch.zeros(NUM_ELEMENTS)
        codec = get_codec("none")
        size = state.group.part_num_elements(1)
        header = pb.AverageHeader(
            part_index=1, producer_index=1, codec=codec.spec(), num_elements=size,
            contributor_indices=[0, 1], weight_sum=2.0,
        )  # fmt: skip
        state.open_replica(header, 1, committed=False)
        half = torch.ones(size // 2)
        await state.add_replica_chunk(1, 0, half.numel(), codec.encode(half).numpy().tobytes())
        with pytest.raises(ProtocolError):
            state.complete_replica(1)  # truncated
        state.fail_replica(1)
        part = state.parts[1]
        await state.client.close()
        return part.in_result, part.role

    in_result, role = uvloop.run(scenario())
    assert not in_result
    assert role is PartRole.IDLE
