"""Errors that travel back to a peer as a gRPC status."""

from __future__ import annotations

import grpc


class ProtocolError(Exception):
    """A request we refuse; the servicer answers it with `code` and `message` and logs one line."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"


def invalid(message: str) -> ProtocolError:
    """The request is malformed: INVALID_ARGUMENT."""
    return ProtocolError(grpc.StatusCode.INVALID_ARGUMENT, message)
