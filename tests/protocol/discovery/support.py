"""Shared helpers for the discovery tests: records, polling with a deadline, and p2pd bookkeeping."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from protocol.membership.records import PeerRecord

PROTOCOL_VERSION = 1
T = TypeVar("T")


def make_record(peer_id: str, *, port: int = 5000, round: int = 0) -> PeerRecord:
    """An active record of ``peer_id``; ``expires_at`` is a placeholder the registry overwrites."""
    return PeerRecord(
        peer_id=peer_id,
        grpc_address=f"127.0.0.1:{port}",
        protocol_version=PROTOCOL_VERSION,
        round=round,
        param_hash=f"{round:064x}",
        ready_for_round=None,
        tokens_per_s=1000.0,
        bandwidth_bytes_per_s=1e6,
        status="active",
        expires_at=0.0,
    )


def poll(read: Callable[[], T], done: Callable[[T], bool], *, within: timedelta, every: float = 0.05) -> T:
    """Call ``read`` until ``done(result)``; the last result if the deadline passes first."""
    deadline = time.monotonic() + within.total_seconds()
    while True:
        result = read()
        if done(result) or time.monotonic() >= deadline:
            return result
        time.sleep(every)


def live_processes_in_group(pgid: int, *, name: str | None = None) -> set[int]:
    """Pids of non-zombie processes in process group ``pgid`` (optionally only those named ``name``)."""
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                text = stat.read()
        except (FileNotFoundError, ProcessLookupError):  # exited while we listed
            continue
        command = text[text.index("(") + 1 : text.rindex(")")]
        state, _parent, group = text[text.rindex(")") + 2 :].split()[:3]
        if int(group) == pgid and state != "Z" and (name is None or command == name):
            found.add(int(entry))
    return found
