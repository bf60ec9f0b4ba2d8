"""Where the peers of ``bench_allreduce.py`` run, and running one implementation's N peer processes.

``PeerHosts`` places peer i in the i-th network namespace of a ``WanEmulator`` (uplinks capped at the
given rate) or on this machine's loopback, and stops every peer with its children on the way out.
``run_peers`` runs one process per peer until all exit, one fails (the others then get
``FAILURE_GRACE``) or the timeout passes, and returns their output as a ``PeerRun``; a peer meant to
kill itself (``killed``) must end by SIGKILL, and its death is no failure.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO

from scripts.bench.allreduce_summary import PeerRun
from scripts.tools.wan_emulator import WanEmulator, stop_process_groups
from scripts.workers.hivemind_worker import descendant_pids

STOP_GRACE = datetime.timedelta(seconds=5)
# Once a peer failed, the others get this long to finish (or fail) on their own before being stopped.
FAILURE_GRACE = datetime.timedelta(seconds=60)


class PeerHosts:
    """Where the N peers run: the namespaces of a WanEmulator (capped uplinks) or this machine's loopback.

    A context manager: leaving it (also on Ctrl-C or SIGTERM) stops every peer process with its
    children, then removes the emulator's namespaces.
    """

    def __init__(self, num_peers: int, link_mbit: float | None) -> None:
        self.num_peers = num_peers
        self.emulator = WanEmulator(num_peers, link_mbit) if link_mbit is not None else None
        self.processes: list[subprocess.Popen] = []

    def address(self, index: int) -> str:
        return self.emulator.address(index) if self.emulator is not None else "127.0.0.1"

    def popen(self, index: int, argv: Sequence[str], stdout: IO[str], stderr: IO[str]) -> subprocess.Popen:
        if self.emulator is not None:
            process = self.emulator.popen(index, argv, stdout=stdout, stderr=stderr, text=True)
        else:
            # Own session: a Ctrl-C on the terminal reaches only us, and we stop the peers in order.
            process = subprocess.Popen(argv, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
        self.processes.append(process)
        return process

    def tx_bytes(self) -> list[int] | None:
        """Bytes each host's eth0 has sent so far (None on loopback, where all peers share `lo`)."""
        if self.emulator is None:
            return None
        counts = []
        for index in range(self.num_peers):
            command = ["ip", "-n", self.emulator.namespace(index), "-j", "-s", "link", "show", "dev", "eth0"]
            output = subprocess.run(command, capture_output=True, text=True, check=True, timeout=20).stdout
            counts.append(int(json.loads(output)[0]["stats64"]["tx"]["bytes"]))
        return counts

    def stop(self, processes: Sequence[subprocess.Popen]) -> None:
        """SIGTERM each running peer's process group, SIGKILL it after STOP_GRACE, and kill its
        descendants too (hivemind's p2pd may leave the group)."""
        running = [process for process in processes if process.poll() is None]
        descendants = [pid for process in running for pid in descendant_pids(process.pid)]
        stop_process_groups(running, STOP_GRACE)
        for pid in descendants:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue  # it exited with its parent

    def __enter__(self) -> PeerHosts:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.stop(self.processes)
        finally:
            if self.emulator is not None:
                self.emulator.close()


def run_peers(
    hosts: PeerHosts,
    argvs: list[list[str]],
    log_dir: Path,
    timeout: datetime.timedelta,
    *,
    killed: int | None = None,
) -> PeerRun:
    """Run one process per peer until all exit, one fails (then the others get FAILURE_GRACE) or timeout.

    Peer `killed` (if any) is to SIGKILL itself at a fault point: that exit is expected, any other
    (or none by the timeout) is its failure."""
    log_dir.mkdir(parents=True)
    tx_before = hosts.tx_bytes()
    processes, files = [], []
    try:
        for index, argv in enumerate(argvs):
            stdout = open(log_dir / f"peer-{index}.out", "w")  # closed in finally
            stderr = open(log_dir / f"peer-{index}.err", "w")
            files += [stdout, stderr]
            processes.append(hosts.popen(index, argv, stdout, stderr))
        deadline = time.monotonic() + timeout.total_seconds()

        def failed(index: int, process: subprocess.Popen) -> bool:
            expected = -signal.SIGKILL if index == killed else 0
            return process.poll() not in (None, expected)

        while time.monotonic() < deadline and any(p.poll() is None for p in processes):
            if any(failed(i, p) for i, p in enumerate(processes)):
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE.total_seconds())
            time.sleep(0.2)
        timed_out = [i for i, p in enumerate(processes) if p.poll() is None]
        hosts.stop(processes)
    finally:
        for file in files:
            file.close()
    tx_after = hosts.tx_bytes()
    error = None
    for index, process in enumerate(processes):
        if index in timed_out or process.returncode != (-signal.SIGKILL if index == killed else 0):
            tail = (log_dir / f"peer-{index}.err").read_text().strip().splitlines()[-3:]
            status = "did not finish in time" if index in timed_out else f"exited {process.returncode}"
            if index == killed and index not in timed_out:
                status += " (it was to be SIGKILLed at its fault point)"
            error = f"peer {index} {status}: {' / '.join(tail)[-400:]}"
            break
    return PeerRun(
        stdouts=[(log_dir / f"peer-{index}.out").read_text() for index in range(len(processes))],
        error=error,
        tx_bytes=None
        if tx_before is None
        else [b - a for a, b in zip(tx_before, tx_after or [], strict=True)],
    )
