"""Request deserializers that do not raise: bytes that are not the expected message become a value
the servicer refuses with INVALID_ARGUMENT.

With the generated registration a request that does not parse makes gRPC answer UNKNOWN and log a
traceback, so a peer's garbage would look like our own bug (found by ``scripts/tools/fuzz_rpcs.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage


class Malformed(NamedTuple):
    """Bytes that did not parse as the request; the RPC refuses them with INVALID_ARGUMENT."""

    error: str


def lenient(message_type: type[ProtoMessage]) -> Callable[[bytes], object]:
    """A request deserializer for ``message_type`` that returns :class:`Malformed` instead of raising."""

    def parse(data: bytes) -> object:
        try:
            return message_type.FromString(data)
        except DecodeError as error:
            return Malformed(f"malformed request: {error}")

    return parse
