"""Every mistake `dtnode join` can know of before it opens a socket is refused before it does: one
line on stderr that names the flag, exit code 2, no DHT process and no listening port.

Each mistake runs `dtnode join` forked from the preloaded server (as ``tests/node/forked_cli.py``
does: a process of its own, without ~4 CPU-s of imports), with an audit hook that records every
process it forks or spawns (the DHT peer is a forked process, its p2p daemon a spawned one), while
this test watches its process tree until it exits: the processes in it and the TCP sockets they
listen on (``/proc``). The README's table "Mistakes and what dtnode says" lists these lines.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.data.tokenizer import train_bpe
from protocol.auth import SwarmKey
from scripts.common import ForkedProcess, exit_as_the_interpreter_would
from tests.forking import enter_child, forkserver
from tests.node.run_support import one_torch_thread, write_corpus
from tests.node.swarm_cluster import NODE_PRELOAD, REPO_ROOT
from tests.node.train.test_trainer import small_config

PRELOAD = (*NODE_PRELOAD, "node.swarm.setup", "node.data.node_corpus")
PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "subprocess.Popen")


@dataclass(frozen=True)
class Kit:
    """What the mistakes are made with."""

    data: Path  # the corpus the resumable run trained on
    other_data: Path
    empty_data: Path
    tokenizer: Path
    open_key: Path  # a swarm key file mode 0644
    resumable: Path  # a run dir with a checkpoint of BASE_FLAGS' settings (byte tokens, nano, data)
    taken_port: int  # a port this test listens on, on 127.0.0.1
    free_port: int


# The settings of the resumable run (tests/node/train/test_trainer.py's small_config), with a swarm.
BASE_FLAGS = ["--model", "nano", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "3",
              "--warmup-steps", "2", "--eval-batches", "2", "--max-rounds", "2", "--listen", "127.0.0.1:0"]  # fmt: skip


@dataclass(frozen=True)
class Mistake:
    what: str  # as the README's table says it
    flag: str  # the flag the line names first
    flags: Callable[[Kit], list[str]]  # after BASE_FLAGS, --data and a fresh --run-dir
    says: str = ""  # more the line must say


MISTAKES = [
    Mistake("gRPC port in use", "--listen", lambda kit: ["--listen", f"127.0.0.1:{kit.taken_port}"], "is in use"),
    Mistake("DHT port in use", "--dht-listen", lambda kit: ["--dht-listen", f"127.0.0.1:{kit.taken_port}"],
            "is in use"),
    Mistake("metrics port in use", "--metrics-port", lambda kit: ["--metrics-port", str(kit.taken_port)],
            "is in use"),
    Mistake("resume with another tokenizer", "--tokenizer",
            lambda kit: ["--run-dir", str(kit.resumable), "--tokenizer", str(kit.tokenizer)],
            "was trained with byte tokens"),
    Mistake("resume with another corpus", "--data",
            lambda kit: ["--run-dir", str(kit.resumable), "--data", str(kit.other_data)], "was trained on corpus"),
    Mistake("resume with another model", "--model", lambda kit: ["--run-dir", str(kit.resumable), "--model", "tiny"],
            "holds a model of dim 128"),
    Mistake("bad data file (empty)", "--data", lambda kit: ["--data", str(kit.empty_data)], "is empty"),
    Mistake("bad key file (mode 644)", "--swarm-key-file", lambda kit: ["--swarm-key-file", str(kit.open_key)],
            "readable by other users"),
    Mistake("typo'd flag", "--inner-step", lambda kit: ["--inner-step", "5"], "did you mean --inner-steps?"),
    Mistake("--tp not dividing the heads", "--tp", lambda kit: ["--local-workers", "3", "--tp", "3"],
            "tp=3 does not divide num_heads=4"),
    Mistake("--peers not a multiaddr", "--peers", lambda kit: ["--peers", "127.0.0.1:17001"], "not a multiaddr"),
    Mistake("--max-rounds negative", "--max-rounds", lambda kit: ["--max-rounds", "-1"], "must be >= 0"),
    Mistake("--data path missing", "--data", lambda kit: ["--data", str(kit.data.parent / "no-such.txt")],
            "does not exist"),
    Mistake("run dir that cannot be made (a file in its path)", "--run-dir", lambda kit: ["--run-dir", str(kit.data / "run")],
            "Not a directory"),
    Mistake("one port for gRPC and DHT", "--dht-listen",
            lambda kit: ["--listen", f"127.0.0.1:{kit.free_port}", "--dht-listen", f"127.0.0.1:{kit.free_port}"],
            "is --listen's too"),
    Mistake("codec typo", "--codec", lambda kit: ["--codec", "int3"], "must be one of none, fp16, bf16"),
]  # fmt: skip


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kit]:
    root = tmp_path_factory.mktemp("mistakes")
    data = write_corpus(root)
    other_data = root / "other.txt"
    other_data.write_text(data.read_text()[::-1])
    empty_data = root / "empty.txt"
    empty_data.write_text("")
    tokenizer = root / "tokenizer.json"
    train_bpe([data.read_text()], vocab_size=300, out=tokenizer)
    open_key = root / "open.key"
    SwarmKey.generate().write(open_key)
    open_key.chmod(0o644)
    resumable = root / "resumable"
    from node.train.trainer import Trainer

    with one_torch_thread():  # one round of 3 nano steps: a real checkpoint to resume
        Trainer(small_config(data, resumable, max_rounds=1, swarm=False)).run()
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        free.bind(("127.0.0.1", 0))
        free_port = free.getsockname()[1]
        free.close()
        yield Kit(
            data, other_data, empty_data, tokenizer, open_key, resumable, taken.getsockname()[1], free_port
        )


# --- the forked `dtnode join`, and what this test sees of its process tree ---


def _run_join(
    argv: list[str], stdout_path: str, stderr_path: str, events_path: str, env: dict[str, str]
) -> None:
    """In the forked child: `python -m node.ops.cli join ARGV`, recording each process it starts."""
    os.setsid()
    enter_child(env, REPO_ROOT, stdout_path, stderr_path)
    events = open(events_path, "a", buffering=1)  # noqa: SIM115 - open until the process exits

    def record(event: str, args: tuple[object, ...]) -> None:
        if event in PROCESS_EVENTS:
            events.write(f"{event}\n")

    sys.addaudithook(record)
    from node.ops.cli import main

    sys.argv = ["node.ops.cli", *argv]
    exit_as_the_interpreter_would(lambda: main(argv))


def _listening_inodes() -> set[str]:
    """The socket inodes of every listening TCP socket of this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                if fields[3] == "0A":  # TCP_LISTEN
                    inodes.add(fields[9])
    return inodes


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants now."""
    tree, index = [pid], 0
    while index < len(tree):
        try:
            for task in os.listdir(f"/proc/{tree[index]}/task"):
                with open(f"/proc/{tree[index]}/task/{task}/children") as children:
                    tree += [int(child) for child in children.read().split()]
        except OSError:  # it ended meanwhile
            pass
        index += 1
    return tree


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    except OSError:  # it ended, or the descriptor closed, meanwhile
        pass
    return inodes


@dataclass
class Watched:
    returncode: int
    stdout: str
    stderr: str
    processes: set[int]  # every process seen in the tree, the command's own included
    listened: bool  # a socket of the tree was seen listening
    started: list[str]  # the process events the command raised (os.fork …)


def watch_join(argv: list[str], out: Path, timeout: float = 60, *, until_listening: bool = False) -> Watched:
    """Run `dtnode join ARGV` forked, watching its process tree every 10 ms until it exits (or, with
    ``until_listening``, until a socket of it listens: then its process group is killed)."""
    paths = [out / "join.stdout", out / "join.stderr", out / "join.events"]
    process = forkserver(PRELOAD).Process(
        target=_run_join, args=(["join", *argv], *map(str, paths), dict(os.environ, PYTHONUNBUFFERED="1"))
    )
    process.start()
    command = ForkedProcess(process)
    processes: set[int] = set()
    listened = False
    deadline = time.monotonic() + timeout
    try:
        while command.poll() is None and time.monotonic() < deadline and not (until_listening and listened):
            tree = _tree(command.pid)
            processes.update(tree)
            sockets = set().union(*(_socket_inodes(pid) for pid in tree))
            listened = listened or bool(sockets & _listening_inodes())
            time.sleep(0.01)
        if until_listening and command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)  # its DHT process and p2p daemon are of its group
        code = command.wait(30)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
            command.wait(10)
    stdout, stderr, events = (path.read_text() if path.exists() else "" for path in paths)
    return Watched(code, stdout, stderr, processes, listened, events.split())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mistake", MISTAKES, ids=[mistake.what for mistake in MISTAKES])
def test_a_mistake_is_one_line_naming_the_flag_exit_2_before_any_socket(
    mistake: Mistake, kit: Kit, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    argv = [*BASE_FLAGS, "--data", str(kit.data), "--run-dir", str(run_dir), *mistake.flags(kit)]
    seen = watch_join(argv, tmp_path)
    print(f"{mistake.what}: exit {seen.returncode}: {seen.stderr.strip()}")  # the README table's lines
    lines = seen.stderr.strip().splitlines()
    assert seen.returncode == 2, seen.stderr
    assert len(lines) == 1, seen.stderr
    assert lines[0].startswith(f"dtnode join: error: {mistake.flag}: "), lines[0]
    assert mistake.says in lines[0], lines[0]
    # Nothing of the swarm started: no process forked or spawned (the DHT), none seen in the tree,
    # no listening socket seen, no banner, no node.json.
    assert seen.started == [] and len(seen.processes) == 1, (seen.started, seen.processes)
    assert not seen.listened
    assert seen.stdout == ""
    assert not (run_dir / "node.json").exists() and not (kit.resumable / "node.json").exists()


@pytest.mark.timeout(120)
def test_the_watch_sees_a_node_that_starts_its_swarm(kit: Kit, tmp_path: Path) -> None:
    """The watch itself: a start with nothing wrong forks its DHT and listens before its first step
    (held there by the start barrier's wait for a second node, which never comes), and is seen to."""
    argv = [*BASE_FLAGS, "--data", str(kit.data), "--run-dir", str(tmp_path / "run"), "--start-peers", "2"]
    seen = watch_join(argv, tmp_path, timeout=60, until_listening=True)
    assert "os.fork" in seen.started and len(seen.processes) > 1 and seen.listened, seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("flag", ["--listen", "--dht-listen"])
def test_a_port_taken_after_the_probe_is_still_one_line_naming_the_flag(flag: str, tmp_path: Path) -> None:
    """The probe is a question, not a reservation: a port another process takes between it and the
    bind fails the server's start, which is refused as the probe would have refused it (the DHT
    peer or gRPC server that started first is shut down), not with gRPC's traceback."""
    from node.config import ConfigError, load_config
    from node.swarm.setup import start_swarm

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        flags = {
            "listen": "127.0.0.1:0",
            "run_dir": str(tmp_path / "run"),
            flag[2:].replace("-", "_"): f"127.0.0.1:{port}",
        }
        config = load_config(flags=flags, environ={})
        with pytest.raises(ConfigError) as refused:
            start_swarm(config)  # as after a probe that found the port free
    assert str(refused.value) == (
        f"{flag}: cannot listen on 127.0.0.1:{port}: port {port} is in use (another process listens on it); "
        "pick another port"
    )
    assert not (tmp_path / "run" / "node.json").exists()
