"""The joiner's log as bench_join.py reads it: its lines stamped on arrival, and the lines that mark
each step of a join (node/ops/cli.py, node/swarm/join.py, node/swarm/session.py, node/train/trainer.py,
protocol/statesync/fetch.py print them).
"""

from __future__ import annotations

import datetime
import re
import threading
import time
from pathlib import Path
from typing import IO

READER_JOIN_TIMEOUT = datetime.timedelta(seconds=5)

# Log lines of the joiner (node/ops/cli.py, node/swarm/session.py, node/train/trainer.py, protocol/statesync/fetch.py).
SWARM_UP = re.compile(r"dtnode: joined the swarm")
TRAINER_READY = re.compile(r"training (?P<model>\S+) \((?P<params>[\d,]+) params\)")
JOIN_DECIDED = re.compile(r"joining: adopting the swarm's state \(round (?P<round>\d+)")
JOIN_FETCH_FAILED = re.compile(r"could not fetch the swarm's state \(joining\)")
FETCHED = re.compile(
    r"fetched Snapshot\(round_id=(?P<round>\d+),.* num_bytes=(?P<num_bytes>\d+), "
    r"metadata=(?P<metadata_bytes>\d+) bytes\): [\d.]+ MB in (?P<seconds>[\d.]+)s"
)
ADOPTED = re.compile(r"now at round (?P<round>\d+)")
CAUGHT_UP = re.compile(
    r"stepped to the swarm's state \(round (?P<round>\d+), .*\) with the mean of (?P<rounds>\d+) round\(s\) "
    r"\((?P<megabytes>[\d.]+) MB fetched\)"
)


class StampedOutput:
    """A process's output read on a thread: every line stamped with its arrival time, copied to a file."""

    def __init__(self, stream: IO[str], copy_path: Path) -> None:
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(stream, copy_path), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str], copy_path: Path) -> None:
        with copy_path.open("w") as copy:
            for line in stream:
                stamp = time.time()
                with self._lock:
                    self._lines.append((stamp, line.rstrip("\n")))
                copy.write(line)
                copy.flush()

    def matches(self, pattern: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
        """(arrival time, match) of every line so far that matches ``pattern``, oldest first."""
        with self._lock:
            lines = list(self._lines)
        return [(stamp, match) for stamp, line in lines if (match := pattern.search(line))]

    def first(self, pattern: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        found = self.matches(pattern)
        return found[0] if found else None

    def tail(self, num_lines: int = 30) -> str:
        with self._lock:
            return "\n".join(line for _, line in self._lines[-num_lines:])

    def close(self) -> None:
        # The pipe closes when the process group is gone; a straggler holding it must not hang us.
        self._thread.join(READER_JOIN_TIMEOUT.total_seconds())
