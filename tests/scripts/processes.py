"""Finding the processes a benchmark started, to check it stopped every one of them."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (e.g. a run dir only the benchmark's nodes use)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # exited while we looked
    return pids


def kill_processes_mentioning(text: str) -> None:
    """SIGKILL every process whose command line contains ``text``: a failed test's leftovers."""
    for pid in processes_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # exited meanwhile
