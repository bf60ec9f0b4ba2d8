"""Fuzz every RPC of a live dtnode node, then check that the node still completes a normal round.

    python scripts/fuzz_rpcs.py --messages 10000          # the full campaign (issue 7)
    python scripts/fuzz_rpcs.py --messages 200 --rpcs Deliver,GetManifest

Setup: a target node (a real ``SwarmNode``: DHT peer, one gRPC server with the all-reduce, state
sync, membership and health services, the round driver) runs in its own process; a partner node
runs in this one. The two first complete round 1 together, so the target holds a real, lingering
all-reduce round and a published snapshot: fuzzed messages that name them get past the first checks
and into the round's state, not only into the parsers.

Phase 1, generation: per RPC, hypothesis draws ``--messages`` requests from strategies built on the
request's protobuf descriptor. Every field either keeps the value of a valid *template* request (the
partner's real header for round 1, the snapshot's real state id ...) or gets a hostile value: edge
integers (0, 2^32 - 1, 2^64 - 1), NaN / inf floats, unknown enum values, long strings, huge
repeated fields, wrong codecs, unknown rounds. The serialized bytes are then kept (valid wire,
wrong semantics) or mutated: truncated, bit-flipped, replaced by garbage, extended, swapped for
another message type, emptied, or padded past the server's message limit. A streaming RPC gets a
sequence of 0-4 such messages (header, then chunks).

Phase 2, sending: the requests go out as raw bytes through generic gRPC calls (identity
serializers), ``--concurrency`` at a time, each with a deadline. Every call must end with a status
before its deadline (a call still open at the deadline is a *hang*) and never with UNKNOWN or
INTERNAL (an exception escaped a servicer: a *crash*); after each RPC's campaign the node must still
answer its health check. Tracebacks in the target's log are counted as well. A pushing client that
skips the contract's handshake (1 call in 5) and is refused while still writing sees INTERNAL from
its own gRPC core, not the server's status (grpc/grpc#36066): counted apart, as BROKEN_WRITE.

Phase 3, the normal round: both nodes publish the next lineage and run round 2; each must average
with the other, and the result must equal, bit for bit, the token-weighted mean computed here the
way the protocol promises for codec "none" (per part, sum(w_i x_i) in fp32 in member order, divided
by the fp32 sum of weights).

Prints a JSON summary (per RPC: messages, status histogram, crashes, hangs, max latency) and a
one-line verdict; exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning

from protocol.allreduce.config import AllReduceConfig
from protocol.discovery.dht_node import DhtConfig
from protocol.gen.dtnode.v1 import allreduce_pb2 as allreduce_pb
from protocol.gen.dtnode.v1 import membership_pb2 as membership_pb
from protocol.gen.dtnode.v1 import statesync_pb2 as statesync_pb
from protocol.gen.dtnode.v1 import status_pb2 as status_pb
from protocol.membership.config import RoundConfig
from protocol.statesync.config import StateSyncConfig
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.config import PROTOCOL_VERSION, SwarmConfig
from protocol.swarm.node import RoundResult, SwarmNode, to_allreduce_group

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_ELEMENTS = 10_007
"""Length of the averaged vector (odd, so the two parts differ in size)."""
SNAPSHOT_TENSOR = "params"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The target's gRPC message limit (all-reduce and state sync both set it; membership needs 4 MiB)."""
NUM_TOKENS = {"target": 1000, "partner": 3000}
SEEDS = {"target": 11, "partner": 22}
FAILING_CODES = frozenset({"UNKNOWN", "INTERNAL"})
"""Statuses that mean an exception escaped a servicer (or broke the transport)."""


def swarm_config(initial_peers: tuple[str, ...]) -> SwarmConfig:
    """A loopback node with exact averaging, short waits (fuzzed calls end fast) and 4 MiB messages."""
    return SwarmConfig(
        run_name="fuzz-rpcs",
        listen="127.0.0.1:0",
        dht=DhtConfig(listen="127.0.0.1:0", initial_peers=initial_peers),
        rounds=RoundConfig(
            min_peers=2,
            join_window=timedelta(seconds=1),
            max_wait=timedelta(seconds=30),
            proposal_timeout=timedelta(seconds=2),
            begin_timeout=timedelta(seconds=4),
        ),
        allreduce=AllReduceConfig(
            chunk_num_elements=4096,
            max_message_bytes=MAX_MESSAGE_BYTES,
            stall_timeout=timedelta(seconds=2),
            heartbeat_interval=timedelta(milliseconds=400),
            max_early_wait=timedelta(milliseconds=300),
            linger=timedelta(minutes=30),  # round 1 stays servable for the whole campaign
        ),
        statesync=StateSyncConfig(
            max_chunk_bytes=256 * 1024, max_range_bytes=1 << 20, max_message_bytes=MAX_MESSAGE_BYTES
        ),
        codec="none",
        round_deadline=timedelta(seconds=20),
        heartbeat=timedelta(seconds=0.5),
        record_ttl=timedelta(seconds=8),
        dht_call_timeout=timedelta(seconds=2),
        view_refresh=timedelta(seconds=0.25),
    )


def lineage_hash(round: int) -> str:
    """The param_hash both nodes publish before round ``round + 1`` (any agreed SHA-256 will do)."""
    return hashlib.sha256(f"fuzz-lineage-{round}".encode()).hexdigest()


def round_vector(who: str, round: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEEDS[who] * 1000 + round)
    return torch.randn(NUM_ELEMENTS, generator=generator)  # (E,)


def run_round(node: SwarmNode, who: str, round: int) -> RoundResult:
    """Round ``round`` from lineage ``(round - 1, lineage_hash(round - 1))``."""
    return node.run_round(
        round_vector(who, round),
        round=round - 1,
        param_hash=lineage_hash(round - 1),
        num_tokens=NUM_TOKENS[who],
        tokens_per_s=1000.0,
        error_feedback=None,
    )


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


# --- the target: a live node in its own process, driven by JSON lines on stdin -----------------------


def serve() -> int:
    """Run the target node: print its address, then obey ``round`` / ``publish`` / ``quit`` commands."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    node = SwarmNode(swarm_config(()))
    params = torch.arange(64 * 1024, dtype=torch.float32)  # (N,) 256 KiB: FetchRange has bytes to serve
    snapshot = Snapshot(
        round_id=0,
        state_id=lineage_hash(0),
        tensors={SNAPSHOT_TENSOR: params},
        metadata=b"{}",
        block_bytes=4096,
    )
    node.publish(round=0, param_hash=lineage_hash(0), tokens_per_s=1000.0, snapshot=snapshot)
    ready = {"address": node.server.address, "multiaddrs": node.multiaddrs(), "peer_id": node.peer_id}
    print(json.dumps(ready), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "publish":
                round = int(command["round"])
                node.publish(round=round, param_hash=lineage_hash(round), tokens_per_s=1000.0, snapshot=None)
                print(json.dumps({"published": round}), flush=True)
            elif command["op"] == "round":
                result = run_round(node, "target", int(command["round"]))
                reply: dict[str, Any] = {"kind": result.kind, "reason": result.reason}
                if result.allreduce is not None:
                    reply["sha256"] = tensor_sha256(result.allreduce.averaged)
                    reply["fell_back"] = result.allreduce.fell_back
                print(json.dumps(reply), flush=True)
            else:
                break
    finally:
        node.leave()
        node.close()
    return 0


class Target:
    """The target process: started with ``--serve``, its stderr (the node's log) kept in a file."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )  # fmt: skip
        self.ready = self.reply(timedelta(seconds=60))
        self.address: str = self.ready["address"]

    def reply(self, timeout: timedelta) -> dict[str, Any]:
        """The next JSON line of the target (a reader thread, so the wait has a deadline)."""
        assert self.process.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout.total_seconds())
        if not lines or not lines[0]:
            raise RuntimeError(f"the target did not answer in {timeout}:\n{self.log_tail()}")
        return json.loads(lines[0])

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def num_tracebacks(self) -> int:
        return self.log_path.read_text(errors="replace").count("Traceback")

    def stop(self) -> None:
        if self.alive():
            try:
                self.send({"op": "quit"})
                self.process.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


# --- generation: hypothesis strategies on the message descriptors -------------------------------------

FD = FieldDescriptor
_UNSIGNED = {FD.TYPE_UINT32: 32, FD.TYPE_UINT64: 64, FD.TYPE_FIXED32: 32, FD.TYPE_FIXED64: 64}
_SIGNED = {FD.TYPE_INT32: 32, FD.TYPE_INT64: 64, FD.TYPE_SINT32: 32, FD.TYPE_SINT64: 64}


@dataclass(frozen=True)
class Context:
    """Values of the live node that make a fuzzed field meaningful (real rounds, ids, hashes)."""

    ints: tuple[int, ...]
    strings: tuple[str, ...]
    blobs: tuple[bytes, ...]


def _integers(bits: int, signed: bool, context: Context) -> st.SearchStrategy[int]:
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    edges = sorted(
        {
            value
            for value in (0, 1, 2, 3, 255, 4096, high, high - 1, low, (1 << 31) - 1)
            if low <= value <= high
        }
    )
    known = [value for value in context.ints if low <= value <= high]
    return st.one_of(st.sampled_from(edges), st.sampled_from(known or [0]), st.integers(low, high))


def _scalar(field_descriptor: FieldDescriptor, context: Context) -> st.SearchStrategy[Any]:
    kind = field_descriptor.type
    if kind in _UNSIGNED:
        return _integers(_UNSIGNED[kind], False, context)
    if kind in _SIGNED:
        return _integers(_SIGNED[kind], True, context)
    if kind == FD.TYPE_FLOAT:  # NaN, inf, -0.0, subnormals, +-3.4e38
        return st.floats(width=32)
    if kind == FD.TYPE_DOUBLE:
        return st.floats()
    if kind == FD.TYPE_BOOL:
        return st.booleans()
    if kind == FD.TYPE_ENUM:  # proto3 enums are open: unknown numbers parse
        known_numbers = [value.number for value in field_descriptor.enum_type.values]
        return st.one_of(st.sampled_from(known_numbers), st.integers(-(1 << 31), (1 << 31) - 1))
    if kind == FD.TYPE_STRING:
        return st.one_of(
            st.sampled_from(context.strings),
            st.text(max_size=40),
            st.integers(0, 5000).map(lambda n: "x" * n),
        )
    if kind == FD.TYPE_BYTES:
        return st.one_of(
            st.sampled_from(context.blobs),
            st.binary(max_size=64),
            st.integers(0, 300_000).map(bytes),
        )
    raise AssertionError(f"no strategy for field type {kind}")


def _present(message: ProtoMessage | None, name: str) -> bool:
    return message is not None and any(f.name == name for f, _ in message.ListFields())


@st.composite
def message_strategy(
    draw: st.DrawFn,
    descriptor: Descriptor,
    template: ProtoMessage | None,
    context: Context,
    depth: int = 0,
) -> ProtoMessage:
    """A message of ``descriptor``: each field keeps the template's value (7 in 10) or gets a hostile one."""
    message = message_factory.GetMessageClass(descriptor)()
    chosen_oneof_members: set[str] = set()
    for oneof in descriptor.oneofs:
        names = [f.name for f in oneof.fields]
        templated = template.WhichOneof(oneof.name) if template is not None else None
        if templated is not None and draw(st.integers(0, 9)) < 7:
            chosen_oneof_members.add(templated)
        else:
            choice = draw(st.sampled_from([*names, None]))
            if choice is not None:
                chosen_oneof_members.add(choice)
    for field_descriptor in descriptor.fields:
        name = field_descriptor.name
        if field_descriptor.containing_oneof is not None and name not in chosen_oneof_members:
            continue
        keep = _present(template, name) and draw(st.integers(0, 9)) < 7
        repeated = field_descriptor.is_repeated
        if field_descriptor.type == FD.TYPE_MESSAGE:
            sub_templates = list(getattr(template, name)) if repeated and template is not None else []
            if repeated:
                if keep:
                    elements = sub_templates
                elif depth < 2:
                    count = draw(st.sampled_from([0, 1, 2, 3, 1100]))  # 1100 > the 1024-member limit
                    sub = draw(message_strategy(field_descriptor.message_type, None, context, depth + 1))
                    elements = [sub] * count
                else:
                    elements = []
                getattr(message, name).extend(elements)
                continue
            sub_template = getattr(template, name) if _present(template, name) else None
            if not keep and (depth >= 3 or draw(st.integers(0, 9)) < 2):
                continue  # leave it unset
            sub = draw(
                message_strategy(
                    field_descriptor.message_type, sub_template if keep else None, context, depth + 1
                )
            )
            getattr(message, name).CopyFrom(sub)
            if field_descriptor.containing_oneof is not None:
                getattr(message, name).SetInParent()
        elif repeated:
            values = list(getattr(template, name)) if keep and template is not None else draw(
                st.one_of(st.lists(_scalar(field_descriptor, context), max_size=6),
                          st.tuples(_scalar(field_descriptor, context), st.integers(0, 3000)).map(
                              lambda value_count: [value_count[0]] * value_count[1]))  # long lists
            )  # fmt: skip
            getattr(message, name).extend(values)
        else:
            value = getattr(template, name) if keep else draw(_scalar(field_descriptor, context))
            setattr(message, name, value)
    return message


@dataclass(frozen=True)
class Oversized:
    """A message padded past the server's limit; the bytes are made only when sent."""

    prefix: bytes
    num_bytes: int

    def materialize(self) -> bytes:
        # An unknown length-delimited field 1000 (tag bytes c2 3e): valid wire, just too large.
        padding = self.num_bytes - len(self.prefix)
        return self.prefix + b"\xc2\x3e" + _varint(padding) + bytes(padding)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


Wire = bytes | Oversized


@st.composite
def wire_strategy(
    draw: st.DrawFn, message: st.SearchStrategy[ProtoMessage], foreign: tuple[bytes, ...]
) -> Wire:
    """The serialized message, kept (about half the time) or mutated at the byte level."""
    data = draw(message).SerializeToString()
    mutation = draw(st.integers(0, 99))
    if mutation < 50:
        return data  # valid wire, hostile semantics
    if mutation < 65 and data:
        return data[: draw(st.integers(0, len(data) - 1))]  # truncated
    if mutation < 75 and data:
        position = draw(st.integers(0, len(data) - 1))
        return data[:position] + bytes([data[position] ^ draw(st.integers(1, 255))]) + data[position + 1 :]
    if mutation < 85:
        return draw(st.binary(min_size=1, max_size=200))  # garbage
    if mutation < 90:
        return data + draw(st.binary(min_size=1, max_size=50))  # trailing junk
    if mutation < 95:
        return draw(st.sampled_from(foreign))  # another message type's bytes
    if mutation < 98:
        return b""
    return Oversized(data, MAX_MESSAGE_BYTES + draw(st.integers(1, 65536)))


def draw_examples(strategy: st.SearchStrategy[Any], num_examples: int, random_seed: int) -> list[Any]:
    """``num_examples`` values of ``strategy`` (hypothesis as a generator: no shrinking, no database)."""
    examples: list[Any] = []
    # The strategies close over the node's context (a 16 KiB payload among it): not worth a repr.
    warnings.filterwarnings("ignore", message="Generating overly large repr", category=HypothesisWarning)

    @seed(random_seed)
    @settings(
        max_examples=num_examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(example: Any) -> None:
        examples.append(example)

    while len(examples) < num_examples:  # hypothesis may stop early (then the next pass repeats some)
        before = len(examples)
        collect()
        if len(examples) == before:
            break
    return examples[:num_examples]


# --- the RPCs and their valid templates -------------------------------------------------------------


@dataclass(frozen=True)
class Rpc:
    """One RPC: its path, its shape, and the valid requests its fuzzed ones are built around."""

    name: str
    path: str
    request: Descriptor
    streaming_request: bool
    streaming_response: bool
    templates: tuple[ProtoMessage, ...]
    reply: type[ProtoMessage] | None = None
    """The reply message of a client-streaming RPC (read during the handshake)."""


@dataclass(frozen=True)
class Case:
    """One fuzzed call: its request messages, and whether it waits for the go-ahead after the first."""

    messages: list[Wire]
    handshake: bool = True


def build_rpcs(context: Context, round_ref: allreduce_pb.RoundRef, part_sizes: tuple[int, int]) -> list[Rpc]:
    """Every RPC of the node, each with templates that the live node would accept."""
    codec = allreduce_pb.CodecSpec(kind=allreduce_pb.CODEC_KIND_NONE)
    chunk = allreduce_pb.TensorChunk(offset=0, num_elements=4, payload=bytes(16))
    contribution = allreduce_pb.ContributionHeader(
        round=round_ref, part_index=0, codec=codec, num_elements=part_sizes[0], weight=3000.0
    )
    average = allreduce_pb.AverageHeader(
        part_index=0, producer_index=1, contributor_indices=[0, 1], codec=codec,
        num_elements=part_sizes[0], weight_sum=4000.0,
    )  # fmt: skip
    state_id, peer_id = lineage_hash(0), context.strings[0]
    join = membership_pb.JoinRequest(round=2, param_hash=lineage_hash(1))
    member = membership_pb.GroupMember(
        peer_id=peer_id, grpc_address="127.0.0.1:1", num_tokens=5, bandwidth_bytes_per_s=1e6
    )
    group = membership_pb.GroupSpec(
        round=2, group_id="g", leader_id=peer_id, param_hash=lineage_hash(1), vector_length=NUM_ELEMENTS,
        members=[member], part_boundaries=[0, NUM_ELEMENTS],
    )  # fmt: skip
    envelope = membership_pb.MembershipEnvelope
    allreduce, statesync, membership = (
        "/dtnode.v1.AllReduce/",
        "/dtnode.v1.StateSync/",
        "/dtnode.v1.Membership/",
    )
    return [
        Rpc("PushContribution", allreduce + "PushContribution", allreduce_pb.ContributionMessage.DESCRIPTOR, True, True, (
            allreduce_pb.ContributionMessage(header=contribution), allreduce_pb.ContributionMessage(chunk=chunk)),
            allreduce_pb.ContributionReply),
        Rpc("PushReplica", allreduce + "PushReplica", allreduce_pb.ReplicaMessage.DESCRIPTOR, True, True, (
            allreduce_pb.ReplicaMessage(header=allreduce_pb.ReplicaHeader(round=round_ref, average=average)),
            allreduce_pb.ReplicaMessage(chunk=chunk)), allreduce_pb.ReplicaReply),
        Rpc("PullAverage", allreduce + "PullAverage", allreduce_pb.PullAverageRequest.DESCRIPTOR, False, True, (
            allreduce_pb.PullAverageRequest(round=round_ref, part_index=1),)),
        Rpc("Deliver", membership + "Deliver", envelope.DESCRIPTOR, False, False, (
            envelope(sender_id=peer_id, protocol_version=PROTOCOL_VERSION, join_request=join),
            envelope(sender_id=peer_id, protocol_version=PROTOCOL_VERSION, begin=membership_pb.Begin(group=group)))),
        Rpc("GetManifest", statesync + "GetManifest", statesync_pb.GetManifestRequest.DESCRIPTOR, False, False, (
            statesync_pb.GetManifestRequest(state_id=state_id),)),
        Rpc("FetchRange", statesync + "FetchRange", statesync_pb.FetchRangeRequest.DESCRIPTOR, False, True, (
            statesync_pb.FetchRangeRequest(state_id=state_id, tensor_name=SNAPSHOT_TENSOR, offset=0, length=8192),)),
        Rpc("GetStatus", "/dtnode.v1.Status/GetStatus", status_pb.GetStatusRequest.DESCRIPTOR, False, False, (
            status_pb.GetStatusRequest(),)),
    ]  # fmt: skip


def case_strategy(rpc: Rpc, context: Context, foreign: tuple[bytes, ...]) -> st.SearchStrategy[Case]:
    """One call: exactly one message for a unary request; for a stream 0-4 (header, chunks), sent with
    the contract's handshake 4 times in 5."""
    per_template = [wire_strategy(message_strategy(rpc.request, t, context), foreign) for t in rpc.templates]
    if not rpc.streaming_request:
        return st.one_of(*per_template).map(lambda wire: Case([wire]))
    header, chunk = per_template
    messages = st.one_of(
        st.tuples(header, st.lists(chunk, max_size=3)).map(lambda pair: [pair[0], *pair[1]]),
        st.lists(st.one_of(header, chunk), max_size=4),
    )
    return st.builds(Case, messages, st.integers(0, 4).map(bool))


# --- sending -------------------------------------------------------------------------------------------


@dataclass
class RpcReport:
    """What one RPC's campaign came to."""

    messages: int = 0
    statuses: Counter[str] = field(default_factory=Counter)
    crashes: int = 0
    hangs: int = 0
    max_latency_s: float = 0.0
    healthy_after: bool = False
    examples: list[str] = field(default_factory=list)  # a few failing cases, hex, for the record

    def as_json(self) -> dict[str, Any]:
        return {
            "messages": self.messages, "statuses": dict(sorted(self.statuses.items())), "crashes": self.crashes,
            "hangs": self.hangs, "max_latency_s": round(self.max_latency_s, 3), "healthy_after": self.healthy_after,
            "failing_examples": self.examples,
        }  # fmt: skip


async def call_once(channel: grpc.aio.Channel, rpc: Rpc, case: Case, deadline: timedelta) -> str:
    """Send one fuzzed call; its final status code's name.

    A pushing client that follows the contract writes the header, waits for the first answer that
    is not a heartbeat, and sends its chunks only after SendChunks. A client that writes everything at
    once (``handshake=False``) and is refused meanwhile sees its write fail with INTERNAL "Internal
    error from Core" instead of the server's status (grpc/grpc#36066; the contract tells senders to
    wait for that reason): that outcome is counted as BROKEN_WRITE, not as a crash.
    """
    messages = [m.materialize() if isinstance(m, Oversized) else m for m in case.messages]
    timeout = deadline.total_seconds()
    if not rpc.streaming_request:
        try:
            if rpc.streaming_response:
                stream = channel.unary_stream(rpc.path)(messages[0], timeout=timeout)
                while await stream.read() is not grpc.aio.EOF:
                    pass
                return (await stream.code()).name
            await channel.unary_unary(rpc.path)(messages[0], timeout=timeout)
            return grpc.StatusCode.OK.name
        except grpc.aio.AioRpcError as error:
            return error.code().name
    assert rpc.reply is not None
    call = channel.stream_stream(rpc.path, response_deserializer=rpc.reply.FromString)(timeout=timeout)
    writing = False
    try:
        rest = messages
        if case.handshake and messages:
            writing = True
            await call.write(messages[0])
            writing = False
            rest = messages[1:]
            while (reply := await call.read()) is not grpc.aio.EOF and reply.WhichOneof(
                "body"
            ) == "still_working":
                pass
            if reply is grpc.aio.EOF:
                return (await call.code()).name
            if reply.WhichOneof("body") != "send_chunks":
                rest = []  # the part is decided: no chunks to send
        writing = True
        for message in rest:
            await call.write(message)
        await call.done_writing()
        writing = False
        while await call.read() is not grpc.aio.EOF:
            pass
        return (await call.code()).name
    except grpc.aio.AioRpcError as error:
        broken = writing and not case.handshake and error.code() == grpc.StatusCode.INTERNAL
        return "BROKEN_WRITE" if broken else error.code().name
    except asyncio.InvalidStateError:  # wrote after the server ended the call: its status stands
        return (await call.code()).name


async def fuzz_rpc(
    address: str, rpc: Rpc, cases: list[Case], *, concurrency: int, deadline: timedelta
) -> RpcReport:
    """Send every case (``concurrency`` at once); then ask the node's health service."""
    report = RpcReport()
    semaphore = asyncio.Semaphore(concurrency)
    options = [
        ("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES),
    ]
    async with grpc.aio.insecure_channel(address, options=options) as channel:

        async def one(case: Case) -> None:
            async with semaphore:
                started = time.monotonic()
                try:  # a safety net on top of the call's own deadline: this script never hangs
                    async with asyncio.timeout(deadline.total_seconds() + 5):
                        code = await call_once(channel, rpc, case, deadline)
                except TimeoutError:
                    code = "NO_STATUS"
                seconds = time.monotonic() - started
            report.messages += 1
            report.statuses[code] += 1
            report.max_latency_s = max(report.max_latency_s, seconds)
            hung = code == "NO_STATUS" or (
                code == "DEADLINE_EXCEEDED" and seconds >= 0.95 * deadline.total_seconds()
            )
            report.hangs += hung
            report.crashes += code in FAILING_CODES
            if (hung or code in FAILING_CODES) and len(report.examples) < 5:
                report.examples.append(f"{code}: " + " | ".join(
                    (m.prefix.hex()[:200] + "+pad") if isinstance(m, Oversized) else m.hex()[:200] for m in case.messages))  # fmt: skip

        await asyncio.gather(*(one(case) for case in cases))
        report.healthy_after = await healthy(channel)
    return report


async def healthy(channel: grpc.aio.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        answer = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=3.0)
    except grpc.aio.AioRpcError:
        return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


# --- the campaign --------------------------------------------------------------------------------------


def check_round(
    target: Target, partner: SwarmNode, round: int, timeout: timedelta
) -> tuple[dict[str, Any], RoundResult]:
    """Run round ``round`` on both nodes at once; return (the target's reply, the partner's result)."""
    target.send({"op": "round", "round": round})
    with ThreadPoolExecutor(max_workers=1) as pool:
        mine = pool.submit(run_round, partner, "partner", round)
        theirs = target.reply(timeout)
        return theirs, mine.result(timeout.total_seconds())


def exact_mean(result: RoundResult, peer_ids: dict[str, str], round: int) -> torch.Tensor:
    """Per part: sum(w_i x_i) in fp32 in member order, divided by the fp32 sum of the weights."""
    assert result.group is not None and result.allreduce is not None
    group = to_allreduce_group(result.group)
    who = {peer_id: name for name, peer_id in peer_ids.items()}
    reference = torch.empty(NUM_ELEMENTS)
    for part, contributors in enumerate(result.allreduce.contributors):
        piece = group.part_slice(part)
        total = torch.zeros(group.part_num_elements(part))
        weight_sum = torch.zeros(())
        for peer_id in [m.peer_id for m in group.members if m.peer_id in contributors]:
            weight = float(NUM_TOKENS[who[peer_id]])
            total = total + round_vector(who[peer_id], round)[piece] * weight
            weight_sum = weight_sum + weight
        reference[piece] = total / weight_sum
    return reference


def verify_round(
    target: Target, partner: SwarmNode, round: int, peer_ids: dict[str, str]
) -> tuple[dict[str, Any], RoundResult]:
    """A normal round: both averaged with each other, identical bytes, equal to the exact mean."""
    theirs, mine = check_round(target, partner, round, timedelta(seconds=60))
    verdict: dict[str, Any] = {"target": theirs, "partner_kind": mine.kind, "ok": False}
    if mine.kind == "averaged" and theirs.get("kind") == "averaged" and mine.allreduce is not None:
        averaged = mine.allreduce.averaged
        both = all(sorted(c) == sorted(peer_ids.values()) for c in mine.allreduce.contributors)
        verdict.update(
            both_contributed=both,
            identical=theirs.get("sha256") == tensor_sha256(averaged),
            exact_mean=torch.equal(averaged, exact_mean(mine, peer_ids, round)),
        )
        verdict["ok"] = (
            both and verdict["identical"] and verdict["exact_mean"] and not mine.allreduce.fell_back
        )
    return verdict, mine


def publish_both(target: Target, partner: SwarmNode, round: int) -> None:
    target.send({"op": "publish", "round": round})
    target.reply(timedelta(seconds=10))
    partner.publish(round=round, param_hash=lineage_hash(round), tokens_per_s=1000.0, snapshot=None)


def wait_for_lineage(partner: SwarmNode, peer_ids: dict[str, str], round: int) -> None:
    """Until the partner's DHT view shows both nodes at lineage ``round`` (at most 20 s)."""
    give_up = time.monotonic() + 20
    while time.monotonic() < give_up:
        view = partner.view()
        if all((r := view.get(p)) is not None and r.round == round for p in peer_ids.values()):
            return
        time.sleep(0.2)
    raise RuntimeError(f"the nodes never both showed lineage {round} in the DHT")


def run_campaign(
    *,
    num_messages: int,
    rpc_names: list[str] | None = None,
    concurrency: int = 32,
    deadline: timedelta = timedelta(seconds=5),
    random_seed: int = 0,
    work_dir: Path | None = None,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Start the target and a partner, run round 1, fuzz every RPC, run round 2; the JSON summary."""
    work_dir = work_dir or Path(tempfile.mkdtemp(prefix="fuzz-rpcs-"))
    target = Target(work_dir / "target.log")
    partner: SwarmNode | None = None
    summary: dict[str, Any] = {
        "messages_per_rpc": num_messages,
        "rpcs": {},
        "target_log": str(target.log_path),
    }
    try:
        partner = SwarmNode(swarm_config(tuple(target.ready["multiaddrs"])))
        peer_ids = {"target": target.ready["peer_id"], "partner": partner.peer_id}
        partner.publish(round=0, param_hash=lineage_hash(0), tokens_per_s=1000.0, snapshot=None)
        wait_for_lineage(partner, peer_ids, 0)
        before, first = verify_round(target, partner, 1, peer_ids)
        summary["round_before"] = before
        if not before["ok"] or first.group is None:
            raise RuntimeError(f"round 1 (before fuzzing) failed: {before}")
        group = to_allreduce_group(first.group)
        partner_index = group.index_of(partner.peer_id)
        round_ref = allreduce_pb.RoundRef(
            round_id=1, group_digest=group.digest, sender_index=partner_index, sender_peer_id=partner.peer_id
        )
        publish_both(target, partner, 1)
        context = Context(
            ints=(1, 2, partner_index, 1 - partner_index, *(group.part_num_elements(i) for i in range(2)), 64 * 1024 * 4),
            strings=(partner.peer_id, target.ready["peer_id"], lineage_hash(0), lineage_hash(1), SNAPSHOT_TENSOR, target.address),
            blobs=(group.digest, bytes(16), bytes(4 * 4096)),
        )  # fmt: skip
        part_sizes = (group.part_num_elements(0), group.part_num_elements(1))
        rpcs = [
            r for r in build_rpcs(context, round_ref, part_sizes) if rpc_names is None or r.name in rpc_names
        ]
        foreign = tuple(
            t.SerializeToString() for r in build_rpcs(context, round_ref, part_sizes) for t in r.templates
        )
        for index, rpc in enumerate(rpcs):
            started = time.monotonic()
            cases = draw_examples(case_strategy(rpc, context, foreign), num_messages, random_seed + index)
            generated = time.monotonic()
            report = asyncio.run(
                fuzz_rpc(target.address, rpc, cases, concurrency=concurrency, deadline=deadline)
            )
            summary["rpcs"][rpc.name] = {
                **report.as_json(), "seconds_generating": round(generated - started, 1),
                "seconds_sending": round(time.monotonic() - generated, 1), "alive_after": target.alive(),
            }  # fmt: skip
            log(f"{rpc.name}: {json.dumps(summary['rpcs'][rpc.name]['statuses'])}")
            if not target.alive():
                break
        if target.alive():
            wait_for_lineage(partner, peer_ids, 1)
            summary["round_after"], _ = verify_round(target, partner, 2, peer_ids)
    finally:
        summary["target_alive_at_end"] = target.alive()
        if partner is not None:
            partner.leave()
            partner.close()
        target.stop()
        summary["target_tracebacks"] = target.num_tracebacks()
    reports = summary["rpcs"].values()
    summary["ok"] = bool(
        summary["target_alive_at_end"]
        and summary["target_tracebacks"] == 0
        and summary.get("round_after", {}).get("ok", False)
        and all(
            r["crashes"] == 0 and r["hangs"] == 0 and r["healthy_after"] and r["alive_after"] for r in reports
        )
        and len(summary["rpcs"]) == len(rpc_names or build_rpc_names())
    )
    return summary


def build_rpc_names() -> list[str]:
    return [
        "PushContribution",
        "PushReplica",
        "PullAverage",
        "Deliver",
        "GetManifest",
        "FetchRange",
        "GetStatus",
    ]


def one_line(summary: dict[str, Any]) -> str:
    reports = summary["rpcs"]
    total = sum(r["messages"] for r in reports.values())
    return (
        f"{'PASS' if summary['ok'] else 'FAIL'}: {total} messages over {len(reports)} RPCs, "
        f"{sum(r['crashes'] for r in reports.values())} crashes, {sum(r['hangs'] for r in reports.values())} hangs, "
        f"max latency {max((r['max_latency_s'] for r in reports.values()), default=0.0):.2f}s, "
        f"{summary['target_tracebacks']} tracebacks, round after fuzzing "
        f"{'exact' if summary.get('round_after', {}).get('ok') else 'FAILED'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help="Run the target node (internal).")
    parser.add_argument("--messages", type=int, default=10_000, help="Fuzzed calls per RPC.")
    parser.add_argument("--rpcs", default="", help="Comma-separated RPC names (default: all).")
    parser.add_argument("--concurrency", type=int, default=32, help="Calls in flight at once.")
    parser.add_argument("--deadline-seconds", type=float, default=5.0, help="Deadline of every fuzzed call.")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (per RPC: seed + index).")
    parser.add_argument("--out", default="", help="Also write the JSON summary here.")
    args = parser.parse_args()
    if args.serve:
        return serve()
    logging.basicConfig(level=logging.ERROR)
    summary = run_campaign(
        num_messages=args.messages,
        rpc_names=[name for name in args.rpcs.split(",") if name] or None,
        concurrency=args.concurrency,
        deadline=timedelta(seconds=args.deadline_seconds),
        random_seed=args.seed,
    )
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(one_line(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
