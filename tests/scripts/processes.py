"""Finding the processes a benchmark started, to check it stopped every one of them."""

from __future__ import annotations

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
