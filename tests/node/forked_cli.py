"""``python -m node.cli ARGS`` in a process forked from a server that imported the node once.

Most of a short ``dtnode join``'s CPU time is its start: torch, the compiler stack its optimizer pulls in
on the first step, the trainer and gRPC (about 3 CPU-seconds here, more than ten inner steps of the nano
model), and the intra-node parity tests start dozens of nodes. multiprocessing's forkserver imports those
modules once per test process (it starts no thread, so forking it is safe) and forks each node from it.
The node then runs the CLI's own ``__main__`` (``runpy``, as ``python -m`` does) in a process of its own,
with its stdout and stderr in files and its exit code, and spawns its local ranks itself, as it does for
users. Nothing is initialised on a GPU before the fork (importing torch does not touch CUDA), but the GPU
tests still start a fresh interpreter (``run_cli(..., fresh=True)``). A forked node sees the environment
the test process had when its forkserver started: a test that sets variables for its node runs it fresh.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path

# The CLI and what a node imports before its first step (torch._dynamo: torch's optimizers import it on
# their first call).
PRELOAD = [
    "node.cli",
    "node.trainer",
    "node.preflight",
    "node.held_out",
    "node.parallel.local",
    "torch._dynamo",
]
_FORKSERVER = multiprocessing.get_context("forkserver")
KILL_WAIT_SECONDS = 10


@dataclass(frozen=True)
class CliResult:
    """What ``subprocess.run(..., capture_output=True)`` reports of a finished run."""

    returncode: int
    stdout: str
    stderr: str


def _exit_code(status: object) -> int:
    if status is None:
        return 0
    if isinstance(status, int):
        return status
    print(status, file=sys.stderr)  # sys.exit("message"), as the interpreter does
    return 1


def _run_in_fork(argv: list[str], stdout_path: str, stderr_path: str) -> None:
    """In the forked child: ``python -m node.cli *argv`` to its end, then the interpreter's own exit."""
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["node.cli", *argv]  # runpy puts the module's path first, as python -m does
    try:
        runpy.run_module("node.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:  # an uncaught error: the traceback and exit code 1, as the interpreter gives
        traceback.print_exc()
        code = 1
    # What the interpreter does on its way out, which a multiprocessing child skips: wait for the
    # non-daemon threads, then run the atexit handlers.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _preload() -> None:
    # One forkserver per process, and its preload list is global: keep what other tests asked for
    # (tests/protocol/allreduce/support.py preloads its worker) beside ours. Once the server runs, the
    # list no longer matters; a module not preloaded is imported in the child instead.
    asked = getattr(multiprocessing.forkserver._forkserver, "_preload_modules", [])
    _FORKSERVER.set_forkserver_preload(sorted({*asked, *PRELOAD}))


def run_cli(argv: list[str], output_dir: Path, *, timeout: float, fresh: bool = False) -> CliResult:
    """Run ``dtnode ARGV`` to its end (killed after ``timeout`` seconds, then an AssertionError).

    Forked from the preloaded server, or ``fresh``: ``python -m node.cli`` in a new interpreter.
    """
    if fresh:
        result = subprocess.run(
            [sys.executable, "-m", "node.cli", *argv], capture_output=True, text=True, timeout=timeout
        )
        return CliResult(result.returncode, result.stdout, result.stderr)
    output_dir.mkdir(parents=True, exist_ok=True)
    stdout_path, stderr_path = output_dir / "cli.stdout", output_dir / "cli.stderr"
    _preload()
    process = _FORKSERVER.Process(target=_run_in_fork, args=(argv, str(stdout_path), str(stderr_path)))
    process.start()
    process.join(timeout)
    if process.exitcode is None:  # its local ranks exit on their own once it is gone (parent watch)
        process.kill()
        process.join(KILL_WAIT_SECONDS)
        raise AssertionError(
            f"dtnode {' '.join(argv)} ran past {timeout} s: {stderr_path.read_text()[-3000:]}"
        )
    return CliResult(process.exitcode, stdout_path.read_text(), stderr_path.read_text())
