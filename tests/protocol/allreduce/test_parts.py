"""The wire size of a chunk message, computed without serializing, against protobuf's own count."""

from __future__ import annotations

import pytest

from protocol.allreduce.parts import chunk_message_num_bytes
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb

MESSAGE_TYPES = [pb.ContributionMessage, pb.ReplicaMessage, pb.AverageMessage]


@pytest.mark.parametrize("message_type", MESSAGE_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize(
    ("offset", "num_elements", "payload_num_bytes"),
    [
        (0, 0, 0),  # proto3 leaves every field out: an empty chunk is still a present sub-message
        (0, 1, 1),
        (127, 128, 127),  # varints cross from one byte to two at 128
        (16_383, 16_384, 16_384),  # and from two to three at 16384
        (1 << 20, 1 << 18, (1 << 18) + 4096),  # a default int8 chunk
        ((1 << 35) + 3, (1 << 21) - 1, 3 << 21),  # 64-bit offsets and payloads above 2 MiB
    ],
)
def test_chunk_message_size_is_protobufs(
    message_type: type, offset: int, num_elements: int, payload_num_bytes: int
) -> None:
    chunk = pb.TensorChunk(offset=offset, num_elements=num_elements, payload=b"\x07" * payload_num_bytes)
    message = message_type(chunk=chunk)
    assert chunk_message_num_bytes(offset, num_elements, payload_num_bytes) == message.ByteSize()
    assert message.ByteSize() == len(message.SerializeToString())
