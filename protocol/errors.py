"""The one error a servicer turns into a gRPC status: a request this peer refuses.

Every service (all-reduce, state sync) raises :class:`ProtocolError` where it refuses a call; its
servicer ends the call with the error's ``code`` and ``message`` and logs one line. Errors raised
to the caller of a client (``StateSyncError``, a failed round) are not refusals and live beside
their package.
"""

from __future__ import annotations

import grpc


class ProtocolError(Exception):
    """A request we refuse; the servicer answers it with ``code`` and ``message`` and logs one line."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid(message: str) -> ProtocolError:
    """The request is malformed: INVALID_ARGUMENT."""
    return ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, message)
