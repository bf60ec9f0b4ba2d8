"""Run a `python -m node.ops.cli ...` command (e.g. `dtnode swarm`) forked from the preloaded server,
and fork the `python -m node.ops.cli join ...` nodes it starts from it in turn.

`dtnode swarm` starts each node as a fresh interpreter (as on N machines), and a fresh interpreter
spends about 4 CPU-seconds importing torch, gRPC and the node before its first step: as much as a
short test node's training. Here the launcher is forked from the server that imported them
(tests/forking.py) and, inside it, `subprocess.Popen` forks each node's command (`ip netns exec NS`
before it included) instead of executing a new interpreter. Each node is still a process of its own
in a session of its own, with its own log, environment, sockets and signals, and the launcher's code
runs unchanged: it waits on the node, signals its group and reads its pid as it would a Popen's.
Any other command goes to the real `subprocess.Popen`.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from scripts.common import ForkedProcess, exit_as_the_interpreter_would
from tests.forking import enter_child, forkserver
from tests.node.swarm_cluster import NODE_PRELOAD, REPO_ROOT, enter_network_namespace

CLI_PREFIX = [sys.executable, "-m", "node.ops.cli"]


@dataclass
class Completed:
    """What the tests read of a finished command: subprocess.CompletedProcess's names, and its pid."""

    pid: int
    returncode: int
    stdout: str
    stderr: str


class ForkedCommand(ForkedProcess):
    """A forked command behind subprocess.Popen's names, ``stdout`` included (set with stdout=PIPE)."""

    stdout: IO[Any] | None = None

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fd_of(stream: IO[Any] | int | None) -> int | None:
    """The descriptor a Popen ``stdout`` / ``stderr`` argument names (None: the parent's own)."""
    if stream is None:
        return None
    assert stream != subprocess.DEVNULL, "forking_popen does not handle DEVNULL"
    return stream if isinstance(stream, int) else stream.fileno()


def _run_cli_node(
    argv: list[str], stdout: int | None, stderr: int | None, cwd: str, env: dict[str, str], netns: str | None
) -> None:
    """In the node's forked child: what exec'ing `python -m node.ops.cli ARGV` would have given it."""
    os.setsid()  # as start_new_session=True: the launcher signals the node's whole group
    if netns is not None:
        enter_network_namespace(netns)  # a forked child has one thread
    for signum in (signal.SIGINT, signal.SIGTERM):  # exec resets the launcher's handlers
        signal.signal(signum, signal.SIG_DFL)
    for module in list(sys.modules.values()):  # and forgets its WAN emulator, whose atexit kills the nodes
        emulators = getattr(module, "_live_emulators", None)
        if isinstance(emulators, set):
            emulators.clear()
    if stdout is not None:
        os.dup2(stdout, 1)
    if stderr is not None:
        os.dup2(stdout if stderr == subprocess.STDOUT and stdout is not None else stderr, 2)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    from node.ops.cli import main

    sys.argv = [*CLI_PREFIX[1:], *argv]
    exit_as_the_interpreter_would(lambda: main(argv))


def forking_popen(real_popen: type[subprocess.Popen[Any]]) -> Any:
    """A `subprocess.Popen` that forks `[ip netns exec NS] python -m node.ops.cli ARGV` (start_new_session
    required, as the launcher and the WAN emulator ask) and starts anything else with ``real_popen``."""

    def popen(args: Sequence[str], **kwargs: Any) -> Any:
        command, netns = list(args), None
        if command[:3] == ["ip", "netns", "exec"]:
            command, netns = command[4:], command[3]
        if command[:3] != CLI_PREFIX or not kwargs.get("start_new_session"):
            return real_popen(args, **kwargs)
        unknown = set(kwargs) - {"stdout", "stderr", "env", "cwd", "start_new_session", "text"}
        assert not unknown, f"forking_popen does not handle {unknown}"
        pipe = os.pipe() if kwargs.get("stdout") == subprocess.PIPE else None
        stdout, stderr = _fd_of(pipe[1] if pipe else kwargs.get("stdout")), kwargs.get("stderr")
        stderr = stderr if stderr == subprocess.STDOUT else _fd_of(stderr)
        env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
        cwd = str(kwargs.get("cwd") or os.getcwd())
        sys.stdout.flush()  # the child must not write what this process has yet to
        sys.stderr.flush()
        process = multiprocessing.get_context("fork").Process(
            target=_run_cli_node, args=(command[3:], stdout, stderr, cwd, env, netns)
        )
        process.start()
        node = ForkedCommand(process)
        if pipe is not None:  # the child holds the write end now
            os.close(pipe[1])
            node.stdout = open(pipe[0], "r" if kwargs.get("text") else "rb")  # noqa: SIM115 - the reader closes it
        return node

    return popen


def _run_forked_cli(
    argv: list[str], stdout_path: str, stderr_path: str, env: dict[str, str], script: str | None
) -> None:
    """In the forked child: `python -m node.ops.cli ARGV` (or `python SCRIPT ARGV`) in a session of its
    own, the `python -m node.ops.cli` commands it starts forked."""
    os.setsid()
    enter_child(env, REPO_ROOT, stdout_path, stderr_path)
    subprocess.Popen = forking_popen(subprocess.Popen)  # type: ignore[misc]
    if script is None:
        from node.ops.cli import main

        sys.argv = [*CLI_PREFIX[1:], *argv]
    else:
        sys.argv = [script, *argv]
        main = runpy.run_path(script, run_name="forked_script")["main"]
    exit_as_the_interpreter_would(lambda: main(argv))


def start_cli(
    argv: Sequence[str],
    stdout_path: Path,
    stderr_path: Path,
    *,
    script: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> ForkedCommand:
    """`python -m node.ops.cli ARGV` (or `python SCRIPT ARGV`), forked, with the `python -m node.ops.cli`
    commands it starts forked too."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    process = forkserver(NODE_PRELOAD).Process(
        target=_run_forked_cli,
        args=(list(argv), str(stdout_path), str(stderr_path), env, None if script is None else str(script)),
    )
    process.start()
    return ForkedCommand(process)


def run_cli(argv: Sequence[str], out_dir: Path, timeout: float, *, script: Path | None = None) -> Completed:
    """As subprocess.run(`python -m node.ops.cli ARGV` or `python SCRIPT ARGV`, capture_output=True,
    timeout=...) for these tests: the forked command's exit code, stdout and stderr (written under
    ``out_dir``)."""
    stdout_path, stderr_path = out_dir / "cli.stdout", out_dir / "cli.stderr"
    process = start_cli(argv, stdout_path, stderr_path, script=script)
    try:
        code = process.wait(timeout)
    finally:
        if process.poll() is None:  # timed out: Ctrl-C makes the launcher stop its nodes
            os.kill(process.pid, signal.SIGINT)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
    return Completed(
        process.pid, code, stdout_path.read_text(errors="replace"), stderr_path.read_text(errors="replace")
    )
