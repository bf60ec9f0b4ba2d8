"""Run `dtnode join` nodes as real processes for the swarm tests, and read what they wrote.

Each node is `python -m node.ops.cli join ...` in its own process group with its own run dir; the
first one's `node.json` gives the multiaddr the others join through. Every wait is bounded and
`Cluster.close()` kills whatever is still running.

`Cluster(..., forked=True)` forks each node from a server that imported torch, its compiler stack and
the node once (tests/forking.py): a fresh interpreter spends about 3 CPU-seconds on those imports, as
much as a short node's training.
The forked node runs the CLI's `main` in a session of its own, as the fresh one does, with its
output in its log; only tests that time the interpreter's start need the fresh one.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from node.data.documents import stdlib_root
from node.ops.metrics import read_metrics
from scripts.common import ForkedProcess, exit_as_the_interpreter_would
from scripts.tools.wan_emulator import enter_network_namespace
from tests.forking import enter_child, forkserver

REPO_ROOT = Path(__file__).resolve().parents[2]

# A small corpus for the swarm tests' nodes: the stdlib's email package, a folder of 29 files (0.4 MB) on
# every machine, split and sharded as the default corpus is. The default (the whole stdlib, 31.5 MB) costs
# each node ~1 CPU-s to load and to lay out its windows; no swarm test depends on what the text is.
SMALL_CORPUS = str(stdlib_root() / "email")

# Small and quick: the nano model at 32 tokens a sequence (a third of the CPU of its 128 a step; no swarm
# test depends on the context length), short inner phases, short windows and leases, the small corpus.
FAST_FLAGS = (
    "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--eval-batches", "1", "--threads", "1",
    "--inner-steps", "10", "--log-every", "1000", "--join-window", "5", "--max-wait", "60",
    "--round-deadline", "60", "--heartbeat", "2", "--record-ttl", "16", "--checkpoint-every", "0",
    "--eval-every", "1",  # the tests compare every round's eval_loss
    "--data", SMALL_CORPUS,
)  # fmt: skip


# What a node imports before its first step (torch._dynamo: on torch's first optimizer step; the swarm's
# modules, which `dtnode join` imports only with the swarm on: hivemind and its scipy, ~0.85 CPU-s a node).
NODE_PRELOAD = (
    "node.ops.cli",
    "node.train.trainer",
    "node.ops.preflight",
    "node.train.held_out",
    "protocol.allreduce",
    "node.swarm.setup",
    "node.swarm.session",
    "node.swarm.join",
    "torch._dynamo",
)


class NodeProcess(Protocol):
    """What the tests use of a node's process: subprocess.Popen's names."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def _run_forked_node(
    argv: list[str],
    log_path: str,
    cwd: str,
    env: dict[str, str],
    netns: str | None = None,
    script: str | None = None,
) -> None:
    """In the forked child: `python -m node.ops.cli ARGV` (or SCRIPT's ``main(ARGV)``) in a new session,
    to the interpreter's own exit."""
    os.setsid()  # as start_new_session=True: a signal to the node's group reaches its DHT and p2pd
    if netns is not None:
        enter_network_namespace(netns)  # the forkserver's child has one thread yet
    enter_child(env, cwd, log_path, log_path)
    if "OMP_NUM_THREADS" in env:  # torch read it when the server imported it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if script is None:
        from node.ops.cli import main
    else:
        sys.argv = [script, *argv]
        main = runpy.run_path(script, run_name="forked_script")["main"]

    exit_as_the_interpreter_would(lambda: main(argv))


def fork_node(
    argv: Sequence[str],
    log_path: Path,
    *,
    netns: str | None = None,
    script: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path = REPO_ROOT,
) -> ForkedProcess:
    """`python -m node.ops.cli ARGV` forked from the preloaded server, once its session exists; in network
    namespace ``netns`` if given; ``script``'s ``main(ARGV)`` instead of the CLI's if given; with
    ``env`` (default: the test process's environment), in working directory ``cwd``."""
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    process = forkserver(NODE_PRELOAD).Process(
        target=_run_forked_node,
        args=(list(argv), str(log_path), str(cwd), env, netns, None if script is None else str(script)),
    )
    process.start()
    node = ForkedProcess(process)
    deadline = time.monotonic() + 30
    while node.poll() is None and time.monotonic() < deadline:  # killpg needs the child's setsid first
        try:
            if os.getpgid(node.pid) == node.pid:
                return node
        except ProcessLookupError:
            break
        time.sleep(0.01)
    return node


@dataclass
class Node:
    name: str
    run_dir: Path
    process: NodeProcess
    log_path: Path
    argv: list[str] = field(default_factory=list)

    def records(self, kind: str = "round") -> list[dict[str, Any]]:
        """The node's metrics records of ``kind`` so far (a half-written last line is skipped)."""
        return read_metrics(self.run_dir / "metrics.jsonl", kind=kind)

    def hashes(self) -> dict[int, str]:
        """round -> param_hash after it, for the rounds this node took part in (not adopted)."""
        return {r["round"]: r["param_hash"] for r in self.records() if not r.get("adopted")}

    def averaged_hashes(self) -> dict[int, str]:
        """round -> param_hash after it, for the rounds this node averaged with others. A node stopped by
        SIGTERM may end on a round it fell back in alone (its peer left first): that round steps on its
        own Δ, so its param_hash is its own, not the lineage's."""
        return {
            r["round"]: r["param_hash"]
            for r in self.records()
            if r["peers"] >= 2 and not r["fell_back"] and not r.get("adopted")
        }

    def identity(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "node.json").read_text())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        """``signum`` to the node's process group (its DHT process too), as a terminal or systemd does."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signum)

    def signal_process(self, signum: int) -> None:
        """``signum`` to the node's own process only."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def wait(self, timeout: float) -> int:
        """The exit code within ``timeout``; else AssertionError with the log's tail, after the node
        wrote every thread's stack there (SIGUSR1, ``dtnode join``): where it hung."""
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal_process(signal.SIGUSR1)
            time.sleep(1.0)
            raise AssertionError(f"the node did not exit within {timeout} s:\n{tail(self, 120)}") from None


class Cluster:
    """Nodes of one run under ``root``; use as a context manager."""

    def __init__(
        self, root: Path, *, name: str = "swarmtest", flags: Sequence[str] = FAST_FLAGS, forked: bool = False
    ) -> None:
        self.root = root
        self.name = name
        self.flags = list(flags)
        self.forked = forked
        self.nodes: list[Node] = []

    def start(
        self,
        extra: Sequence[str] = (),
        *,
        peers: str | None = None,
        wrap: Sequence[str] = (),
        netns: str | None = None,
    ) -> Node:
        """Start one node; ``wrap`` prefixes the command (e.g. ``ip netns exec NS``); ``netns`` runs
        it in that network namespace (a forked node enters it itself, a fresh one through ``ip netns exec``)."""
        index = len(self.nodes)
        run_dir = self.root / f"node-{index}"
        log_path = self.root / f"node-{index}.log"
        argv = [sys.executable, "-m", "node.ops.cli", "join", "--name", self.name, "--run-dir", str(run_dir)]
        argv += self.flags + list(extra)
        if peers:
            argv += ["--peers", peers]
        process: NodeProcess
        if self.forked and not wrap:
            log_path.write_bytes(b"")
            process = fork_node(argv[3:], log_path, netns=netns)  # after `python -m node.ops.cli`
            node = Node(name=f"node-{index}", run_dir=run_dir, process=process, log_path=log_path, argv=argv)
            self.nodes.append(node)
            return node
        if netns is not None:
            wrap = ["ip", "netns", "exec", netns, *wrap]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [*wrap, *argv],
                cwd=REPO_ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        node = Node(name=f"node-{index}", run_dir=run_dir, process=process, log_path=log_path, argv=argv)
        self.nodes.append(node)
        return node

    def first_multiaddr(self, node: Node, timeout: float = 60.0, prefix: str = "/ip4/127.0.0.1/") -> str:
        """Wait for ``node`` to write node.json and return its multiaddr starting with ``prefix``."""
        wait_for(
            lambda: (node.run_dir / "node.json").exists(), timeout, f"{node.name} to write node.json", node
        )
        addresses = [a for a in node.identity()["multiaddrs"] if a.startswith(prefix)]
        assert addresses, f"{node.name} has no multiaddr starting with {prefix}: {node.identity()}"
        return addresses[0]

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for node in self.nodes:
            try:
                codes.append(node.wait(max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{node.name} still running after {timeout}s:\n{tail(node)}") from None
        return codes

    def close(self) -> None:
        for node in self.nodes:
            node.signal(signal.SIGKILL)
        for node in self.nodes:
            try:
                node.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def tail(node: Node, lines: int = 40) -> str:
    return "\n".join(node.log().splitlines()[-lines:])


def wait_for(condition: Callable[[], bool], timeout: float, what: str, node: Node | None = None) -> None:
    """Poll ``condition`` every 0.2 s until true; AssertionError (with the node's log) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if node is not None and node.process.poll() is not None:
            raise AssertionError(
                f"{node.name} exited with {node.process.returncode} waiting for {what}:\n{tail(node)}"
            )
        time.sleep(0.2)
    detail = f":\n{tail(node)}" if node is not None else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{detail}")


def kill_one_and_run_on(
    nodes: list[Node], *, rounds_before: int, rounds_after: int, timeout: float = 300
) -> int:
    """Once every node recorded ``rounds_before`` rounds, SIGKILL the last one; once every survivor
    recorded ``rounds_after`` more, stop them with SIGTERM and check they exit 0. Returns how many
    rounds the survivors had recorded at the kill (at most)."""
    first, victim, survivors = nodes[0], nodes[-1], nodes[:-1]
    wait_for(
        lambda: all(len(node.records()) >= rounds_before for node in nodes), timeout, "rounds before", first
    )
    victim.signal(signal.SIGKILL)
    at_kill = max(len(node.records()) for node in survivors)
    wait_for(
        lambda: all(len(node.records()) >= at_kill + rounds_after for node in survivors),
        timeout,
        "rounds after the kill",
        first,
    )
    for node in survivors:
        node.signal(signal.SIGTERM)
    for node in survivors:
        assert node.wait(60) == 0, tail(node)
    return at_kill
