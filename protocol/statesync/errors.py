"""Errors of state sync: one the fetcher raises to its caller, one a provider turns into a gRPC status."""

from __future__ import annotations

import grpc


class StateSyncError(Exception):
    """The fetcher could not get a complete, verified snapshot; the message says what happened to each source."""


class Refusal(Exception):
    """A request the provider refuses; the servicer ends the call with `code` and `message`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return f"{self.code.name}: {self.message}"
