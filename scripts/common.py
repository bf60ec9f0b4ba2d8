"""What the scripts share: the checkout's root, the output flags, SIGTERM as an exit, JSON out.

Every script run as a file starts with the same line, before it imports anything of ``scripts``::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

(``python scripts/bench/x.py`` puts ``scripts/bench/``, not the checkout, on ``sys.path``); this module
cannot hold that line, since importing it needs the line first. ``tools/wan_emulator.py`` imports
nothing from here: ``dtnode swarm --link-mbit`` loads that one file by path, outside any checkout's
``sys.path``.

The output conventions the helpers keep:

- one JSON object per measurement on stdout as it is made (``print_json``), then a one-line summary;
- ``--json-out PATH`` writes what the run printed (or its summary) to a file as well (``write_json``);
- ``--keep-logs DIR`` keeps each run's scratch directory under ``DIR/<name>``; without it the scratch is
  a temporary directory, removed after the run (``scratch_dir``);
- SIGTERM raises ``SystemExit(128 + signum)`` (``exit_on_sigterm``), so the ``with`` and ``finally``
  blocks that stop child processes and remove network namespaces run, as they do for Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import multiprocessing.process
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

REPO_ROOT = Path(__file__).resolve().parents[1]

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def add_output_flags(parser: argparse.ArgumentParser, *, keep_logs: bool = False) -> None:
    """``--json-out PATH`` and, with ``keep_logs``, ``--keep-logs DIR``."""
    parser.add_argument(
        "--json-out", type=Path, default=None, metavar="PATH", help="also write the run's JSON records here"
    )
    if keep_logs:
        parser.add_argument(
            "--keep-logs",
            type=Path,
            default=None,
            metavar="DIR",
            help="keep each run's directory and logs under DIR (default: a temporary directory, removed)",
        )


def print_json(value: Any) -> None:
    """One JSON object on one line of stdout, flushed (a reader may be following the run)."""
    print(json.dumps(value), flush=True)


def write_json(path: Path | None, value: Any) -> None:
    """``value`` as indented JSON at ``path`` (``--json-out``); nothing when no path was given."""
    if path is not None:
        path.write_text(json.dumps(value, indent=2) + "\n")


@contextlib.contextmanager
def scratch_dir(keep_logs: Path | None, name: str, *, prefix: str) -> Iterator[Path]:
    """``keep_logs / name`` (made, and kept) or, without ``keep_logs``, a temporary directory removed
    on exit."""
    if keep_logs is not None:
        path = keep_logs / name
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as scratch:
        yield Path(scratch)


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> SignalHandler:
    """Make SIGTERM unwind like Ctrl-C (``SystemExit(128 + 15)``); the handler it replaced."""
    return signal.signal(signal.SIGTERM, _raise_system_exit)


class ForkedScript:
    """``main(argv)`` of the script run as ``__main__``, in a process forked from a forkserver that imported
    that script (and ``torch._dynamo``, which torch imports at a model's first step) once: a child costs a
    fork, not a fresh interpreter's imports (~2.5 CPU-s with torch). The server only imports (and then
    freezes what they made, ``scripts/forkserver_gc.py``: a child's garbage collections skip it), so each
    child starts as clean as a fresh ``python SCRIPT`` would. stdout and stderr go to ``log_path``; ``poll``,
    ``wait``, ``kill`` and ``returncode`` are ``subprocess.Popen``'s.

    Only for the main program: the forkserver is one per process, started with the preload of its first
    user, so a library caller (a test process) may already run it for other children."""

    def __init__(self, main: Callable[[list[str]], int], argv: list[str], log_path: Path) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["__main__", "torch._dynamo", "scripts.forkserver_gc"])  # gc last
        self._process = context.Process(target=_run_forked, args=(main, argv, str(log_path)))
        self._process.start()

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        self._process.is_alive()  # reaps the child if it ended
        return self._process.exitcode

    def wait(self) -> int | None:
        self._process.join()
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()


def start_script(
    argv: list[str], main: Callable[[list[str]], int], log_path: Path, *, forked: bool
) -> subprocess.Popen[bytes] | ForkedScript:
    """``argv`` (``python SCRIPT ARGS…``, stdout and stderr to ``log_path``): with ``forked``, ``main(ARGS)``
    as a ``ForkedScript`` (for the script run as the main program), else a fresh interpreter."""
    if forked:
        return ForkedScript(main, argv[2:], log_path)
    with log_path.open("wb") as log:  # the child holds its own descriptor
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)


def _run_forked(main: Callable[[list[str]], int], argv: list[str], log_path: str) -> None:
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), sys.stdout.fileno())
        os.dup2(log.fileno(), sys.stderr.fileno())
    exit_as_the_interpreter_would(lambda: main(argv))


def exit_as_the_interpreter_would(main: Callable[[], object]) -> NoReturn:
    """In a forked child: run ``main`` and exit with the code ``python`` would give it (an int as it is,
    None 0, an uncaught error its traceback and 1), after what the interpreter does on its way out and a
    multiprocessing child skips: the non-daemon threads joined, the atexit handlers run."""
    import atexit

    try:
        status: object = main()
    except SystemExit as stop:
        status = stop.code
    except BaseException:  # noqa: BLE001 - whatever it is, the child reports it and exits 1
        traceback.print_exc()
        status = 1
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else (0 if status is None else 1))


class ForkedProcess:
    """A process forked from a preloaded server (multiprocessing's forkserver), behind the names of
    subprocess.Popen that the launchers and tests use: ``pid``, ``returncode``, ``poll``, ``wait``."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        assert process.pid is not None
        self._process = process
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode  # (exitcode polls the child, and reaps it once it ended)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"process {self.pid}", timeout or 0.0)
        return self._process.exitcode


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None where matplotlib is not installed (the
    scripts then write their JSON and say no plot was made)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
