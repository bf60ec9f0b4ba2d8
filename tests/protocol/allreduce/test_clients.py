"""Client members (``--client-mode``: they accept no connections) in the all-reduce.

A client owns no part, is nobody's backup and holds no replica; it pushes its contribution to the
owners and pulls the averages. Here a client's announced address refuses connections (its own
server is elsewhere), so any call toward it would fail the round's "no failures" checks.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import uvloop

from protocol.allreduce import AllReducePeer, AllReduceResult, GroupSpec, Member
from protocol.codecs import get_codec
from tests.protocol.allreduce.support import exact_mean, local_peers

NOWHERE = "127.0.0.1:9"  # the discard port: nothing listens there, a dial is refused


def mixed_members(num_servers: int, servers: list[AllReducePeer], client_ids: list[str]) -> list[Member]:
    """Servers s0.. and clients, sorted by id as membership orders them (clients interleaved)."""
    members = [Member(peer_id=f"s{i}", address=servers[i].address) for i in range(num_servers)]
    members += [Member(peer_id=peer_id, address=NOWHERE, client=True) for peer_id in client_ids]
    return sorted(members, key=lambda member: member.peer_id)


def test_clients_own_no_part_back_up_none_and_a_group_needs_a_server() -> None:
    members = [
        Member(peer_id="a", address="h:1"),
        Member(peer_id="b", address="h:2", client=True),
        Member(peer_id="c", address="h:3"),
        Member(peer_id="d", address="h:4", client=True),
    ]
    group = GroupSpec.build(round_id=1, members=members, num_elements=1001, bandwidths=[1.0, 5.0, 1.0, 9.0])
    assert group.part_num_elements(1) == 0 and group.part_num_elements(3) == 0
    assert group.part_num_elements(0) + group.part_num_elements(2) == 1001
    assert group.num_servers == 2
    # A part's chain walks the servers only: a client cannot be dialled to serve or back up a part.
    assert group.chain(0) == (0, 2) and group.chain(2) == (2, 0)
    # The flag is part of the agreed group: a peer that thinks a client is a server differs.
    plain = GroupSpec(
        round_id=1,
        members=tuple(Member(peer_id=m.peer_id, address=m.address) for m in members),
        part_bounds=group.part_bounds,
    )
    assert plain.digest != group.digest
    with pytest.raises(ValueError, match="client-mode members only cannot form"):
        GroupSpec.build(round_id=1, members=[members[1], members[3]], num_elements=10)
    with pytest.raises(ValueError, match="own no part"):
        GroupSpec(round_id=1, members=tuple(members), part_bounds=(0, 1, 2, 3, 1001))


async def run_round(
    servers: list[AllReducePeer],
    clients: list[AllReducePeer],
    group: GroupSpec,
    vectors: dict[str, torch.Tensor],
    weights: dict[str, float],
    codec: str,
    skip: frozenset[str] = frozenset(),
) -> dict[str, AllReduceResult]:
    import asyncio

    peers = {f"s{i}": peer for i, peer in enumerate(servers)} | {
        f"c{i}": peer for i, peer in enumerate(clients)
    }
    running = {
        peer_id: peer.allreduce(
            vectors[peer_id],
            group=group,
            my_peer_id=peer_id,
            weight=weights[peer_id],
            codec=get_codec(codec),
            error_feedback=None,
            deadline=timedelta(seconds=20),
        )
        for peer_id, peer in peers.items()
        if peer_id not in skip
    }
    results = await asyncio.gather(*running.values())
    return dict(zip(running, results, strict=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("num_servers", "num_clients"), [(1, 1), (2, 2), (3, 1)])
def test_clients_contribute_and_get_the_exact_mean_without_being_dialled(
    num_servers: int, num_clients: int
) -> None:
    client_ids = [f"c{i}" for i in range(num_clients)]
    generator = torch.Generator().manual_seed(num_servers * 10 + num_clients)
    ids = sorted([f"s{i}" for i in range(num_servers)] + client_ids)
    vectors = {peer_id: torch.randn(30_011, generator=generator) * (i + 1) for i, peer_id in enumerate(ids)}
    weights = {peer_id: 1.0 + 0.5 * i for i, peer_id in enumerate(ids)}

    async def scenario() -> tuple[GroupSpec, dict[str, AllReduceResult]]:
        async with local_peers(num_servers + num_clients) as peers:
            servers, clients = peers[:num_servers], peers[num_servers:]
            members = mixed_members(num_servers, servers, client_ids)
            group = GroupSpec.build(round_id=0, members=members, num_elements=30_011)
            return group, await run_round(servers, clients, group, vectors, weights, "none")

    group, results = uvloop.run(scenario())
    for peer_id, result in results.items():
        assert not result.fell_back and result.failures == [], (peer_id, result.failures)
        assert torch.equal(result.averaged, results["s0"].averaged)
    # Every part (the servers' parts: clients own none) averages every member, clients included.
    owned = [k for k in range(group.num_members) if group.part_num_elements(k)]
    assert [sorted(results["s0"].contributors[k]) for k in owned] == [ids] * num_servers
    ordered_vectors = [vectors[m.peer_id] for m in group.members]
    ordered_weights = [weights[m.peer_id] for m in group.members]
    reference = exact_mean(ordered_vectors, ordered_weights, group, results["s0"].contributors)
    assert torch.equal(results["s0"].averaged, reference)


@pytest.mark.timeout(90)
def test_a_dead_server_is_backed_up_by_servers_only_and_the_client_still_agrees() -> None:
    ids = ["c0", "s0", "s1", "s2"]
    generator = torch.Generator().manual_seed(7)
    vectors = {peer_id: torch.randn(20_000, generator=generator) for peer_id in ids}
    weights = dict.fromkeys(ids, 1.0)

    async def scenario() -> dict[str, AllReduceResult]:
        async with local_peers(4) as peers:
            servers, client = peers[:3], peers[3]
            group = GroupSpec.build(
                round_id=0, members=mixed_members(3, servers, ["c0"]), num_elements=20_000
            )
            await servers[0].stop(timedelta(0))  # s0 is dead before the round: s1 takes its part
            return await run_round(servers, [client], group, vectors, weights, "int8", skip=frozenset({"s0"}))

    results = uvloop.run(scenario())
    for peer_id in ("c0", "s1", "s2"):
        assert not results[peer_id].fell_back, results[peer_id].failures
        assert torch.equal(results[peer_id].averaged, results["s1"].averaged)
        assert results[peer_id].contributors == results["s1"].contributors
    survivors = ["c0", "s1", "s2"]
    assert all(sorted(part) == survivors for part in results["s1"].contributors if part)
    # Nobody dialled the client: the servers' failures name only s0.
    for peer_id in ("s1", "s2"):
        assert not any("c0" in failure for failure in results[peer_id].failures), results[peer_id].failures
    expected = torch.stack([vectors[p] for p in survivors]).mean(dim=0)
    torch.testing.assert_close(results["c0"].averaged, expected, atol=0.05, rtol=0)
