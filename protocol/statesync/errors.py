"""The error the state-sync fetcher raises to its caller (a provider refuses with ``protocol.errors.ProtocolError``)."""

from __future__ import annotations


class StateSyncError(Exception):
    """The fetcher could not get a complete, verified snapshot; the message says what happened to each source."""
