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


def processes_in_groups(process_groups: list[int]) -> list[int]:
    """Pids of the live (not zombie) processes in one of ``process_groups`` (a node's group holds its DHT
    process and p2pd: what a forked node's command line cannot name)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after "(comm)": state, ppid, pgrp, ...; comm may itself contain spaces or parens.
            state, _, process_group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # exited while we looked
        if state != "Z" and int(process_group) in process_groups:
            pids.append(int(stat.parent.name))
    return pids


def kill_process_groups(process_groups: list[int]) -> None:
    """SIGKILL every process of ``process_groups``: a failed test's leftovers."""
    for group in process_groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            continue  # gone already
