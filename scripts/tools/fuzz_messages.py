"""What ``scripts/tools/fuzz_rpcs.py`` sends: hypothesis strategies built on the request messages' descriptors.

Every field of a drawn request either keeps the value of a valid *template* request or gets a hostile
value (edge integers, NaN / inf, unknown enums, long strings, huge repeated fields); the serialized bytes
are then kept or mutated (truncated, bit-flipped, garbage, extended, another message type, empty, padded
past the server's message limit). ``build_rpcs`` lists the node's RPCs with their templates.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message as ProtoMessage
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning

from protocol.gen.dtnode.v1 import allreduce_pb2 as allreduce_pb
from protocol.gen.dtnode.v1 import membership_pb2 as membership_pb
from protocol.gen.dtnode.v1 import statesync_pb2 as statesync_pb
from protocol.gen.dtnode.v1 import status_pb2 as status_pb
from protocol.swarm.config import PROTOCOL_VERSION
from scripts.tools.fuzz_target import MAX_MESSAGE_BYTES, NUM_ELEMENTS, SNAPSHOT_TENSOR, lineage_hash

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
        Rpc("FinishRound", allreduce + "FinishRound", allreduce_pb.RoundFinished.DESCRIPTOR, False, False, (
            allreduce_pb.RoundFinished(round=round_ref),)),
        Rpc("Deliver", membership + "Deliver", envelope.DESCRIPTOR, False, False, (
            envelope(sender_id=peer_id, protocol_version=PROTOCOL_VERSION, join_request=join),
            envelope(sender_id=peer_id, protocol_version=PROTOCOL_VERSION, begin=membership_pb.Begin(group=group)))),
        Rpc("Collect", membership + "Collect", membership_pb.CollectRequest.DESCRIPTOR, False, False, (
            membership_pb.CollectRequest(receiver_id=peer_id, protocol_version=PROTOCOL_VERSION, wait_ms=200),)),
        Rpc("GetManifest", statesync + "GetManifest", statesync_pb.GetManifestRequest.DESCRIPTOR, False, False, (
            statesync_pb.GetManifestRequest(state_id=state_id),)),
        Rpc("FetchRange", statesync + "FetchRange", statesync_pb.FetchRangeRequest.DESCRIPTOR, False, True, (
            statesync_pb.FetchRangeRequest(state_id=state_id, tensor_name=SNAPSHOT_TENSOR, offset=0, length=8192),)),
        Rpc("GetStatus", "/dtnode.v1.Status/GetStatus", status_pb.GetStatusRequest.DESCRIPTOR, False, False, (
            status_pb.GetStatusRequest(),)),
        Rpc("PullSlice", allreduce + "PullSlice", allreduce_pb.PullSliceRequest.DESCRIPTOR, False, True, (
            allreduce_pb.PullSliceRequest(round_id=round_ref.round_id, plan_digest=round_ref.group_digest,
                                          slice_index=0, sender_peer_id=round_ref.sender_peer_id),)),
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
