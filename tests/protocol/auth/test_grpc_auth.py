"""A closed swarm's gRPC server on loopback: members' calls pass, every other call is UNAUTHENTICATED.

One real ``NodeServer`` (all-reduce, state sync, membership, health, status on one port) started with
a swarm key; clients with the key, without it, with another key, with a replayed or stale token.
The server must refuse each bad call before its servicer sees it and go on serving members.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import timedelta
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol.allreduce import GroupSpec, Member
from protocol.auth import REFUSAL, SwarmKey
from protocol.auth.channels import SwarmAuth
from protocol.auth.grpc_auth import METADATA_KEY, call_token
from protocol.codecs import get_codec
from protocol.gen.dtnode.v1 import statesync_pb2 as statesync_pb
from protocol.gen.dtnode.v1 import statesync_pb2_grpc as statesync_grpc
from protocol.membership.messages import JoinRequest, Message
from protocol.membership.transport import MembershipClient
from protocol.statesync.errors import StateSyncError
from protocol.statesync.fetch import fetch_state
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig
from protocol.swarm.server import NodeServer
from tests.protocol.allreduce.support import FAST_CONFIG, allreduce_all, exact_mean, local_peers, members_of
from tests.protocol.statesync.support import MiB, assert_identical, make_snapshot

GET_MANIFEST = "/dtnode.v1.StateSync/GetManifest"
H0 = "0" * 64
SHORT = timedelta(seconds=5)


def key_file(tmp_path: Path, name: str) -> tuple[SwarmKey, str]:
    """A fresh key written as keygen does, and its secret as it appears in the file."""
    path = tmp_path / name
    SwarmKey.generate().write(path)
    return SwarmKey.from_file(path), path.read_text().strip()


async def get_manifest(address: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """One raw GetManifest call with hand-made metadata; its status code."""
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await statesync_grpc.StateSyncStub(channel).GetManifest(
                statesync_pb.GetManifestRequest(), metadata=metadata, timeout=SHORT.total_seconds()
            )
        except grpc.aio.AioRpcError as error:
            assert error.code() != grpc.StatusCode.UNAUTHENTICATED or error.details().startswith(REFUSAL)
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.timeout(60)
def test_closed_server_serves_members_and_refuses_everyone_else(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    key, secret = key_file(tmp_path, "swarm.key")
    other_key, _ = key_file(tmp_path, "other.key")
    snapshot = make_snapshot(num_params=MiB // 4)
    received: list[tuple[str, Message]] = []
    config = SwarmConfig(run_name="closed", listen="127.0.0.1:0", auth=SwarmAuth(key))
    assert secret not in repr(config)

    async def scenario() -> None:
        server = await NodeServer.start(config, lambda sender, message: received.append((sender, message)))
        try:
            server.state_provider.publish(snapshot)
            address = server.address

            # Membership: a keyless or wrong-key sender is refused; the member's message arrives.
            join = JoinRequest(round=1, param_hash=H0)
            senders = {
                "keyless": MembershipClient(sender_id="keyless", protocol_version=PROTOCOL_VERSION),
                "stranger": MembershipClient(
                    sender_id="stranger", protocol_version=PROTOCOL_VERSION, auth=SwarmAuth(other_key)
                ),
                "member": MembershipClient(
                    sender_id="member", protocol_version=PROTOCOL_VERSION, auth=SwarmAuth(key)
                ),
            }
            delivered = {
                name: await client.send(address, join, timeout=SHORT) for name, client in senders.items()
            }
            await asyncio.gather(*(client.close() for client in senders.values()))
            assert delivered == {"keyless": False, "stranger": False, "member": True}
            assert [sender for sender, _ in received] == ["member"]

            # State sync: the keyless fetch fails with the refusal named; the member's is bit-identical.
            with pytest.raises(StateSyncError, match=f"UNAUTHENTICATED: {REFUSAL}: no swarm key presented"):
                await fetch_state([address], expected_state_id=None, deadline=SHORT)
            with pytest.raises(StateSyncError, match=f"UNAUTHENTICATED: {REFUSAL}: wrong swarm key"):
                await fetch_state(
                    [address], expected_state_id=None, deadline=SHORT, auth=SwarmAuth(other_key)
                )
            fetched = await fetch_state(
                [address], expected_state_id=None, deadline=SHORT, auth=SwarmAuth(key)
            )
            assert_identical(fetched, snapshot)

            # Hand-made tokens: a captured token works once; stale, future and other-method ones never.
            token = call_token(key, GET_MANIFEST)
            assert await get_manifest(address, ((METADATA_KEY, token),)) == grpc.StatusCode.OK
            assert await get_manifest(address, ((METADATA_KEY, token),)) == grpc.StatusCode.UNAUTHENTICATED
            for timestamp in (int(time.time()) - 600, int(time.time()) + 600):
                stale = call_token(key, GET_MANIFEST, timestamp=timestamp)
                assert (
                    await get_manifest(address, ((METADATA_KEY, stale),)) == grpc.StatusCode.UNAUTHENTICATED
                )
            deliver_token = call_token(key, "/dtnode.v1.Membership/Deliver")
            assert (
                await get_manifest(address, ((METADATA_KEY, deliver_token),))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            assert await get_manifest(address, ()) == grpc.StatusCode.UNAUTHENTICATED

            # Health stays open (load balancers, `grpc_health_probe`), and members are still served.
            async with grpc.aio.insecure_channel(address) as channel:
                health = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=SHORT.total_seconds()
                )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            again = await fetch_state([address], expected_state_id=None, deadline=SHORT, auth=SwarmAuth(key))
            assert_identical(again, snapshot)
        finally:
            await server.stop(timedelta(milliseconds=100))

    uvloop.run(scenario())
    assert caplog.text.count("refused /dtnode.v1.") >= 8
    assert secret not in caplog.text


@pytest.mark.timeout(60)
def test_keyed_allreduce_equals_torch_mean_and_keyless_peer_is_left_out(tmp_path: Path) -> None:
    key, _ = key_file(tmp_path, "swarm.key")
    num_elements = 30_011
    generator = torch.Generator().manual_seed(3)
    vectors = [torch.randn(num_elements, generator=generator) * (i + 1) for i in range(3)]

    async def scenario() -> tuple[GroupSpec, list, list]:
        async with local_peers(3, FAST_CONFIG, auth=SwarmAuth(key)) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=num_elements)
            keyed = await allreduce_all(peers, vectors, group, get_codec("none"))
            async with local_peers(1, FAST_CONFIG) as outsiders:
                # The outsider believes it is the third member of a round the members are running.
                members = [*members_of(peers[:2]), Member(peer_id="p2", address=outsiders[0].address)]
                mixed_group = GroupSpec.build(round_id=1, members=members, num_elements=num_elements)
                mixed = await allreduce_all(
                    [peers[0], peers[1], outsiders[0]], vectors, mixed_group, get_codec("none"),
                    deadline=timedelta(seconds=10),
                )  # fmt: skip
            return mixed_group, keyed, mixed

    mixed_group, keyed, mixed = uvloop.run(scenario())
    for result in keyed:
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, torch.stack(vectors).mean(dim=0))
    # The members' parts average only the members' contributions: the outsider's push was refused.
    members_only = ["p0", "p1"]
    for part in (0, 1):
        for result in mixed[:2]:
            assert result.contributors[part] == members_only, result.failures
        reference = exact_mean(vectors, [1.0] * 3, mixed_group, [members_only] * 3)
        piece = mixed_group.part_slice(part)
        assert torch.equal(mixed[0].averaged[piece], reference[piece])
    outsider = mixed[2]
    assert any(REFUSAL in failure for failure in outsider.failures), outsider.failures


@pytest.mark.timeout(60)
def test_tls_swarm_serves_only_holders_of_a_swarm_certificate(tmp_path: Path) -> None:
    key, _ = key_file(tmp_path, "swarm.key")
    other_key, _ = key_file(tmp_path, "other.key")
    snapshot = make_snapshot(num_params=MiB // 4)
    config = SwarmConfig(run_name="tls", listen="127.0.0.1:0", auth=SwarmAuth(key, tls=True))
    num_elements = 20_011
    generator = torch.Generator().manual_seed(4)
    vectors = [torch.randn(num_elements, generator=generator) for _ in range(2)]

    async def scenario() -> list:
        server = await NodeServer.start(config, lambda sender, message: None)
        try:
            server.state_provider.publish(snapshot)
            address = server.address
            # A member (its own certificate, issued from the key) fetches over mutual TLS.
            fetched = await fetch_state(
                [address], expected_state_id=None, deadline=SHORT, auth=SwarmAuth(key, tls=True)
            )
            assert_identical(fetched, snapshot)
            # Plaintext (with or without the key) and TLS with another swarm's CA never get a connection.
            for auth in (None, SwarmAuth(key), SwarmAuth(other_key, tls=True)):
                with pytest.raises(StateSyncError, match="GetManifest: (UNAVAILABLE|DEADLINE_EXCEEDED)"):
                    await fetch_state(
                        [address], expected_state_id=None, deadline=timedelta(seconds=3), auth=auth
                    )
            again = await fetch_state(
                [address], expected_state_id=None, deadline=SHORT, auth=SwarmAuth(key, tls=True)
            )
            assert_identical(again, snapshot)
        finally:
            await server.stop(timedelta(milliseconds=100))
        async with local_peers(2, FAST_CONFIG, auth=SwarmAuth(key, tls=True)) as peers:
            group = GroupSpec.build(round_id=0, members=members_of(peers), num_elements=num_elements)
            return await allreduce_all(peers, vectors, group, get_codec("none"))

    results = uvloop.run(scenario())
    for result in results:
        assert not result.fell_back, result.failures
        assert torch.equal(result.averaged, torch.stack(vectors).mean(dim=0))
