"""Bad requests from a raw gRPC client get the status the proto promises, and the provider keeps serving.

Each case sends requests straight through the generated stub (no fetcher logic in the way); at the
end the same provider must still serve a complete, exact fetch.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
import uvloop
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protocol.gen.dtnode.v1 import statesync_pb2 as pb
from protocol.gen.dtnode.v1 import statesync_pb2_grpc as pb_grpc
from protocol.statesync import SERVICE_NAME, fetch_state
from tests.protocol.statesync.support import (
    FETCH_OPTIONS,
    TEST_CONFIG,
    MiB,
    assert_identical,
    make_snapshot,
    providers,
)

SNAPSHOT = make_snapshot(num_params=MiB)  # 4 MiB of params, 1 MiB of momentum
PARAMS_BYTES = 4 * MiB
CHUNK = TEST_CONFIG.max_chunk_bytes


async def _status_of_fetch(stub: pb_grpc.StateSyncStub, **fields: object) -> grpc.StatusCode:
    request: dict[str, Any] = {
        "state_id": SNAPSHOT.state_id,
        "tensor_name": "global_params",
        "offset": 0,
        "length": 1000,
    }
    request.update(fields)
    call = stub.FetchRange(pb.FetchRangeRequest(**request), timeout=5)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def _still_serves(address: str) -> None:
    fetched = await fetch_state(
        [address], expected_state_id=SNAPSHOT.state_id, deadline=timedelta(seconds=10), options=FETCH_OPTIONS
    )
    assert_identical(fetched, SNAPSHOT)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"tensor_name": "no_such_tensor"}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"tensor_name": ""}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"offset": PARAMS_BYTES}, grpc.StatusCode.INVALID_ARGUMENT),  # starts at the end
        ({"offset": PARAMS_BYTES - 10, "length": 11}, grpc.StatusCode.INVALID_ARGUMENT),  # one byte too far
        ({"offset": 2**64 - 1, "length": 1}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"length": 0}, grpc.StatusCode.INVALID_ARGUMENT),
        ({"length": TEST_CONFIG.max_range_bytes + 1}, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ({"length": 2**63}, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ({"state_id": "not-a-snapshot"}, grpc.StatusCode.NOT_FOUND),
        ({"offset": PARAMS_BYTES - 10, "length": 10}, grpc.StatusCode.OK),  # the very last bytes are fine
    ],
)
def test_bad_fetch_range_gets_the_right_status_and_the_provider_keeps_serving(
    fields: dict[str, object], expected: grpc.StatusCode
) -> None:
    async def scenario() -> grpc.StatusCode:
        async with providers(1, SNAPSHOT) as [server], grpc.aio.insecure_channel(server.address) as channel:
            code = await _status_of_fetch(pb_grpc.StateSyncStub(channel), **fields)
            await _still_serves(server.address)
            return code

    assert uvloop.run(scenario()) is expected


@pytest.mark.timeout(20)
def test_manifest_statuses_and_health() -> None:
    async def scenario() -> None:
        async with providers(1, None) as [server], grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.StateSyncStub(channel)
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as nothing_yet:
                await stub.GetManifest(pb.GetManifestRequest(), timeout=5)
            assert nothing_yet.value.code() is grpc.StatusCode.NOT_FOUND
            server.provider.publish(SNAPSHOT)
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.GetManifest(pb.GetManifestRequest(state_id="other"), timeout=5)
            assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
            newest = await stub.GetManifest(pb.GetManifestRequest(), timeout=5)
            named = await stub.GetManifest(pb.GetManifestRequest(state_id=SNAPSHOT.state_id), timeout=5)
            assert newest == named and newest.state_id == SNAPSHOT.state_id
            assert [t.name for t in newest.tensors] == ["global_params", "outer_momentum", "scales"]
            assert newest.limits.max_range_bytes == TEST_CONFIG.max_range_bytes

    uvloop.run(scenario())


@pytest.mark.timeout(20)
def test_chunks_follow_the_requested_size_capped_by_the_provider() -> None:
    async def scenario() -> tuple[list[tuple[int, int]], list[int]]:
        async with providers(1, SNAPSHOT) as [server], grpc.aio.insecure_channel(server.address) as channel:
            stub = pb_grpc.StateSyncStub(channel)
            request = pb.FetchRangeRequest(
                state_id=SNAPSHOT.state_id,
                tensor_name="global_params",
                offset=4096,
                length=2500,
                max_chunk_bytes=1000,
            )
            small = [(c.offset, len(c.data)) async for c in stub.FetchRange(request, timeout=5)]
            request.length, request.max_chunk_bytes = 3 * CHUNK, 10 * CHUNK
            capped = [len(c.data) async for c in stub.FetchRange(request, timeout=5)]
            return small, capped

    small, capped = uvloop.run(scenario())
    assert small == [(4096, 1000), (5096, 1000), (6096, 500)]
    assert capped == [CHUNK] * 3


@pytest.mark.timeout(20)
def test_too_many_transfers_get_resource_exhausted_and_a_silent_reader_frees_its_slot() -> None:
    # The hog asks for 16 MiB, far more than gRPC buffers for a reader that does not read: its channel
    # keeps the HTTP/2 windows at their initial 64 KiB (no BDP probing, which can otherwise grow them
    # to megabytes on loopback and let the whole range drain into the hog's buffers).
    config = replace(
        TEST_CONFIG,
        max_concurrent_transfers=1,
        max_range_bytes=16 * MiB,
        stall_timeout=timedelta(milliseconds=500),
    )
    big = make_snapshot(num_params=4 * MiB)

    async def scenario() -> tuple[grpc.StatusCode, grpc.StatusCode]:
        async with (
            providers(1, big, config=config) as [server],
            grpc.aio.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)]) as channel,
        ):
            stub = pb_grpc.StateSyncStub(channel)
            # Hold the only slot: read one chunk of a long range, then stop reading.
            hog = stub.FetchRange(
                pb.FetchRangeRequest(state_id=big.state_id, tensor_name="global_params", length=16 * MiB),
                timeout=10,
            )
            await hog.read()
            busy = await _status_of_fetch(stub, state_id=big.state_id)
            # A fetch now finds the provider busy and retries; flow control blocks the provider's writes
            # to the silent hog, so after its stall timeout it drops the hog, and the fetch gets the slot.
            server.provider.publish(SNAPSHOT)
            await _still_serves(server.address)
            with pytest.raises(grpc.aio.AioRpcError) as dropped:
                while await hog.read() is not grpc.aio.EOF:
                    pass
            assert server.provider.num_refusals["RESOURCE_EXHAUSTED"] >= 2  # our probe and the fetch
            return busy, dropped.value.code()

    busy, dropped = uvloop.run(scenario())
    assert busy is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dropped is grpc.StatusCode.DEADLINE_EXCEEDED
