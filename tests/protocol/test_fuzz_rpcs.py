"""Fuzzing every RPC of a live node (scripts/tools/fuzz_rpcs.py, 200 calls per RPC here, 10,000 in the full
run): no crash, no hang, the node stays healthy and then completes a normal, exact round. Plus the
regressions the fuzzer found: bytes that do not parse as the request get INVALID_ARGUMENT from the
membership and state-sync services, not UNKNOWN with a traceback."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch

from protocol.gen.dtnode.v1 import membership_pb2 as membership_pb
from protocol.gen.dtnode.v1 import statesync_pb2 as statesync_pb
from protocol.membership.transport import MembershipServicer, add_membership_to_server
from protocol.statesync.config import MAX_CHUNKS_PER_RANGE
from protocol.statesync.provider import StateProvider, add_state_sync_to_server
from protocol.statesync.snapshot import Snapshot
from tests.machine_load import load_factor
from tests.scripts.script_loader import load_script

fuzz = load_script("fuzz_rpcs")


# A hang is a call still open at its deadline. The node answers most calls in ms; the slowest it may
# take is a FetchRange of 4096 one-byte chunks while 7 others stream (1.9 s on 2 idle cores, 9-10 s at
# a load of 10, where a fixed 10 s deadline counted such calls as hangs) or a Collect long poll,
# answered at 90% of the caller's deadline. So: 10 s on an idle machine, stretched by the load factor
# when the campaign starts (tests/machine_load.py).
IDLE_MACHINE_DEADLINE = timedelta(seconds=10)


@pytest.mark.timeout(170)  # idle-machine seconds; the run takes ~30 s alone
def test_short_fuzz_run_per_rpc(tmp_path: Path) -> None:
    summary = fuzz.run_campaign(
        num_messages=200,
        deadline=IDLE_MACHINE_DEADLINE * load_factor(),
        random_seed=3,
        work_dir=tmp_path,
        log=lambda line: None,
    )
    assert set(summary["rpcs"]) == set(fuzz.build_rpc_names())
    for name, report in summary["rpcs"].items():
        assert report["messages"] == 200, name
        assert report["crashes"] == 0 and report["hangs"] == 0, (name, report)
        assert not set(report["statuses"]) & {"UNKNOWN", "INTERNAL", "NO_STATUS"}, (name, report)
        assert report["healthy_after"] and report["alive_after"], name
        # Some calls got all the way through: the templates reach the node's real state.
        assert len(report["statuses"]) >= 3, (name, report["statuses"])
    assert summary["target_tracebacks"] == 0, Path(summary["target_log"]).read_text()[-3000:]
    for when in ("round_before", "round_after"):
        verdict = summary[when]
        assert verdict["both_contributed"] and verdict["identical"] and verdict["exact_mean"], verdict
    assert summary["target_alive_at_end"] and summary["ok"]


async def _status_of_garbage(path: str, streaming_response: bool) -> grpc.StatusCode:
    server = grpc.aio.server()
    add_state_sync_to_server(server, StateProvider())
    add_membership_to_server(server, MembershipServicer(lambda sender, message: None, protocol_version=1))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            garbage = b"\xff\xff\xff"  # field 31, wire type 7: not protobuf
            try:
                if streaming_response:
                    call = channel.unary_stream(path)(garbage, timeout=5)
                    while await call.read() is not grpc.aio.EOF:
                        pass
                    return await call.code()
                await channel.unary_unary(path)(garbage, timeout=5)
            except grpc.aio.AioRpcError as error:
                return error.code()
            return grpc.StatusCode.OK
    finally:
        await server.stop(0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("path", "streaming_response"),
    [
        ("/dtnode.v1.Membership/Deliver", False),
        ("/dtnode.v1.Membership/Collect", False),
        ("/dtnode.v1.StateSync/GetManifest", False),
        ("/dtnode.v1.StateSync/FetchRange", True),
    ],
)
def test_unparsable_request_is_invalid_argument(path: str, streaming_response: bool) -> None:
    assert asyncio.run(_status_of_garbage(path, streaming_response)) == grpc.StatusCode.INVALID_ARGUMENT


async def _deliver_to_handler(handler_error: Exception) -> tuple[grpc.StatusCode, MembershipServicer]:
    def on_message(sender: str, message: object) -> None:
        raise handler_error

    servicer = MembershipServicer(on_message, protocol_version=1)
    server = grpc.aio.server()
    add_membership_to_server(server, servicer)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    envelope = membership_pb.MembershipEnvelope(
        sender_id="peer-a",
        protocol_version=1,
        join_request=membership_pb.JoinRequest(round=1, param_hash="a" * 64),
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await channel.unary_unary("/dtnode.v1.Membership/Deliver")(
                    envelope.SerializeToString(), timeout=5
                )
            except grpc.aio.AioRpcError as error:
                return error.code(), servicer
            return grpc.StatusCode.OK, servicer
    finally:
        await server.stop(0)


@pytest.mark.timeout(30)
def test_a_message_the_handler_refuses_is_invalid_argument_and_a_bug_is_internal() -> None:
    """The fuzzer's finding: an envelope whose sender_id is the receiving node's own id made the round
    driver raise ValueError, answered INTERNAL ("my fault") with a traceback. A ValueError is the
    handler refusing the message: INVALID_ARGUMENT. Any other exception stays INTERNAL."""
    code, servicer = asyncio.run(
        _deliver_to_handler(ValueError("a peer does not send round messages to itself"))
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and servicer.num_refusals == {"INVALID_ARGUMENT": 1}
    code, servicer = asyncio.run(_deliver_to_handler(RuntimeError("bug in the handler")))
    assert code == grpc.StatusCode.INTERNAL and servicer.num_refusals == {"INTERNAL": 1}


async def _fetch_in_tiny_chunks(length: int) -> tuple[grpc.StatusCode, int]:
    provider = StateProvider()
    params = torch.arange(4096, dtype=torch.float32)  # (4096,) 16 KiB
    provider.publish(Snapshot(round_id=0, state_id="s", tensors={"params": params}, metadata=b""))
    server = grpc.aio.server()
    add_state_sync_to_server(server, provider)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    request = statesync_pb.FetchRangeRequest(
        state_id="s", tensor_name="params", length=length, max_chunk_bytes=1
    )
    num_chunks = 0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/dtnode.v1.StateSync/FetchRange")(
                request.SerializeToString(), timeout=20
            )
            try:
                while await call.read() is not grpc.aio.EOF:
                    num_chunks += 1
            except grpc.aio.AioRpcError as error:
                return error.code(), num_chunks
            return await call.code(), num_chunks
    finally:
        await server.stop(0)


@pytest.mark.timeout(60)
def test_a_range_in_tiny_chunks_is_refused_past_the_chunk_bound() -> None:
    """The fuzzer's finding: 1-byte chunks made a FetchRange one gRPC message per byte (it outlived
    its 5 s deadline; a 256 MiB range would hold a transfer slot for 256M writes)."""
    bound = MAX_CHUNKS_PER_RANGE
    assert asyncio.run(_fetch_in_tiny_chunks(bound)) == (grpc.StatusCode.OK, bound)
    assert asyncio.run(_fetch_in_tiny_chunks(bound + 1)) == (grpc.StatusCode.INVALID_ARGUMENT, 0)
