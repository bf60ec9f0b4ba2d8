"""``dtnode swarm``: N ``dtnode join`` nodes on this machine, their progress, a clean stop, a report.

The N nodes are separate processes, as on N machines; the launcher never talks to the swarm:

1. Start. Node 0 (``python -m node.ops.cli join --run-dir RUN_DIR/node-0 …``) starts a new swarm and
   writes ``RUN_DIR/node-0/node.json``; nodes 1..N-1 then join through its multiaddr (``--peers``).
   Each runs in its own process group (a Ctrl-C in the terminal reaches only the launcher, which
   decides how to stop them), output in ``RUN_DIR/node-<i>.log``. With ``link_mbit`` each node
   runs on its own host of the WAN emulator (``scripts/tools/wan_emulator.py``: a network namespace
   with a capped uplink) and listens on that host's address. With ``stagger`` node i starts
   ``i * stagger`` after node 0 (late joiners on purpose). Node i's pid, which is also its process
   group's id, is in ``RUN_DIR/node-<i>.pid`` (a benchmark may freeze it with SIGSTOP).
2. Watch. Tail every node's ``metrics.jsonl`` (contract: ``node/ops/metrics.py``); print one line per
   outer round per node as it is written.
3. Stop. When every node has exited (they stop by themselves at ``--max-rounds``), or on the
   first SIGINT/SIGTERM: SIGTERM to every node (each finishes its step or round, checkpoints and
   leaves the swarm), a bounded wait, then SIGKILL for what is left; a second signal kills at once.
4. Report. ``RUN_DIR/report.json`` and ``report.md``: per node (this launch) the rounds, eval losses, bytes
   sent, participation (the share of its rounds after its first in which it averaged with others)
   and final ``param_hash``; whether every node held the same ``param_hash`` after every round they
   all recorded (DiLoCo's outer step leaves all members of a round with identical global params);
   wall time; then the plots and per-node table of ``dtnode report`` (``node/ops/report.py``). Each node
   has exported the swarm's model to ``node-<i>/model.safetensors`` (``dtnode sample RUN_DIR``).
5. Verdict. Exit code 0 exactly when every node exited 0 and, for a run whose nodes stopped by
   themselves, the run did its job (``swarm_report.run_problems`` on every round record of the
   run, a resumed node's earlier launches included: one final ``param_hash``, no round split, some
   round averaged two or more nodes); else 1, with the reason in one line. A run
   stopped by Ctrl-C is reported the same way and judged by its nodes' exit codes and by the rounds
   before each node's last (``swarm_report.interrupted_run_problems``: its nodes may stop a round
   apart, but a round all of them recorded before that must have one ``param_hash``).

The per-node settings the launcher picks and each node's command: ``node/ops/launch_config.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from node.config import ConfigError
from node.ops.launch_config import LOOPBACK, LaunchConfig, load_wan_emulator, node_argv
from node.ops.metrics import read_metrics, run_utilization
from node.ops.swarm_report import (
    MetricsTail,
    hash_agreement,
    interrupted_run_problems,
    node_participation,
    report_markdown,
    round_line,
    run_problems,
    swarm_participation,
)
from node.train.checkpoint import latest_checkpoint

log = logging.getLogger("dtnode.swarm")

KILL_WAIT = timedelta(seconds=10)


def checkpointed_round(run_dir: Path) -> int:
    """The round of a node's newest checkpoint (0 without one): where a restarted node resumes."""
    latest = latest_checkpoint(run_dir / "checkpoints")
    return 0 if latest is None else int(json.loads((latest / "state.json").read_text())["meta"]["round"])


@dataclass
class NodeProcess:
    index: int
    run_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    tail: MetricsTail
    rounds: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    exit_reported: bool = False

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    def signal_group(self, signum: int) -> None:
        """Signal the node's whole process group (its DHT process and p2pd daemon included)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signum)

    def log_tail(self, num_lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-num_lines:])


def node_summary(node: NodeProcess) -> dict[str, Any]:
    rounds = node.rounds
    return {
        "name": node.name,
        "run_dir": str(node.run_dir),
        "pid": node.process.pid,
        "exit_code": node.process.returncode,
        "num_rounds": len(rounds),
        "rounds": [r["round"] for r in rounds],
        "eval_losses": [r["eval_loss"] for r in rounds],
        "final_eval_loss": rounds[-1]["eval_loss"] if rounds else None,
        "bytes_sent": sum(int(r["bytes_sent"]) for r in rounds),
        "bytes_recv": sum(int(r["bytes_recv"]) for r in rounds),
        "fell_back_rounds": [r["round"] for r in rounds if r.get("fell_back")],
        "adopted_rounds": [r["round"] for r in rounds if r.get("adopted")],
        "utilization": run_utilization(rounds)[2],  # inner compute / wall, first step to last record
    } | node_participation(rounds)


class SwarmLauncher:
    """Runs one :class:`LaunchConfig`; :meth:`request_stop` is safe to call from a signal handler."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.nodes: list[NodeProcess] = []
        self._stop_requested = False
        self._kill_requested = False
        self._stopped_by = "finished"

    def request_stop(self) -> None:
        """First call: stop the nodes gracefully; a second call: kill them now."""
        if self._stop_requested:
            self._kill_requested = True
        self._stop_requested = True

    def run(self) -> int:
        """Start, watch, stop, report; 0 exactly when every node exited 0."""
        config = self.config
        max_rounds = config.base.run.max_rounds
        if max_rounds and all(
            checkpointed_round(config.root / f"node-{i}") >= max_rounds for i in range(config.num_nodes)
        ):
            print(f"dtnode swarm: every node of {config.root} is at round {max_rounds} already: nothing to do "
                  "(raise --max-rounds to go on)", flush=True)  # fmt: skip
            return 0
        config.root.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        print(f"dtnode swarm: {config.num_nodes} node(s) in {config.root} (logs: node-<i>.log)", flush=True)
        try:
            with self._hosts() as wan:
                if self._start_all(wan):
                    self._follow(self.nodes, until=lambda: self._stop_requested)
                self._stop_all()
        finally:
            self._kill_leftovers()
        for node in self.nodes:
            self._print_rounds(node)
        exit_codes = [node.process.returncode for node in self.nodes]
        agreement = hash_agreement([node.rounds for node in self.nodes])
        summaries = [node_summary(node) for node in self.nodes]
        # The verdict is on the whole run: a resumed node's rounds of earlier launches count too.
        history = [read_metrics(node.run_dir / "metrics.jsonl", kind="round") for node in self.nodes]
        if self._stopped_by == "signal":
            problems = interrupted_run_problems(history)
        else:
            problems = run_problems([node.name for node in self.nodes], history)
        report: dict[str, Any] = {
            "num_nodes": config.num_nodes,
            "run_dir": str(config.root),
            "link_mbit": config.link_mbit,
            "stopped_by": self._stopped_by,
            "wall_seconds": round(time.monotonic() - started, 1),
            "exit_codes": exit_codes,
            "param_hash": agreement,
            "participation": swarm_participation(summaries),
            "problems": problems,
            "nodes": summaries,
        }
        (config.root / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (config.root / "report.md").write_text(report_markdown(report))
        write_plots_report(config.root)
        hashes = f"agreed in {len(agreement['common_rounds'])} common round(s)"
        if agreement["disagreeing_rounds"]:
            hashes = f"differs in rounds {agreement['disagreeing_rounds']} of {agreement['common_rounds']}"
        share = report["participation"]["participation"]
        averaged = "-" if share is None else f"{100 * share:.0f}%"
        print(f"dtnode swarm: done in {report['wall_seconds']:.0f} s | exit codes {exit_codes} | "
              f"param_hash {hashes} | participation {averaged} | {config.root / 'report.md'}", flush=True)  # fmt: skip
        ok = len(self.nodes) == config.num_nodes and all(code == 0 for code in exit_codes)
        if ok and problems and self._stopped_by in ("finished", "signal"):
            print(f"dtnode swarm: FAILED: {'; '.join(problems)}", flush=True)
            return 1
        return 0 if ok else 1

    # --- start ---

    @contextlib.contextmanager
    def _hosts(self) -> Iterator[Any]:
        """The WAN emulator with one host per node (None without ``link_mbit``)."""
        num_hosts, link_mbit = self.config.num_nodes, self.config.link_mbit
        if link_mbit is None:
            yield None
            return
        try:
            wan = load_wan_emulator().WanEmulator(num_hosts, link_mbit, name_prefix="dtswarm")
        except RuntimeError as error:  # `ip netns add` refused, e.g. a container without CAP_SYS_ADMIN
            raise ConfigError(f"--link-mbit: cannot build the WAN emulator: {error}") from None
        with wan:
            yield wan

    def _start_all(self, wan: Any) -> bool:
        """Node 0, then the others through its multiaddr; False if the swarm could not be started."""
        first = self._start(0, wan, peers="")
        host = None if wan is None else wan.address(0)
        multiaddr = self._first_multiaddr(first, prefix=f"/ip4/{host or LOOPBACK}/")
        if multiaddr is None:
            return False
        for index in range(1, self.config.num_nodes):
            self._wait_until(first.started + index * self.config.stagger.total_seconds())
            if self._stop_requested:
                return True
            self._start(index, wan, peers=multiaddr)
        return True

    def _wait_until(self, due: float) -> None:
        """Staggered start: follow the started nodes' rounds until ``due`` (monotonic) or a stop."""
        self._follow(self.nodes, until=lambda: self._stop_requested or time.monotonic() >= due)

    def _start(self, index: int, wan: Any, *, peers: str) -> NodeProcess:
        run_dir = self.config.root / f"node-{index}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "node.json").unlink(missing_ok=True)  # a previous run's: its address is stale
        argv = node_argv(self.config, index, peers=peers, host=None if wan is None else wan.address(index))
        log_path = self.config.root / f"node-{index}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        tail = MetricsTail(run_dir / "metrics.jsonl")
        with log_path.open("wb") as log_file:
            popen_kwargs: dict[str, Any] = {"stdout": log_file, "stderr": subprocess.STDOUT, "env": env}
            if wan is None:
                process = subprocess.Popen(argv, start_new_session=True, **popen_kwargs)
            else:
                process = wan.popen(index, argv, **popen_kwargs)  # its own session, in the namespace
        node = NodeProcess(index=index, run_dir=run_dir, log_path=log_path, process=process, tail=tail)
        (self.config.root / f"node-{index}.pid").write_text(f"{process.pid}\n")
        self.nodes.append(node)
        where = "" if wan is None else f" on emulated host {wan.address(index)}"
        print(f"{node.name} started (pid {process.pid}){where}", flush=True)
        return node

    def _first_multiaddr(self, node: NodeProcess, *, prefix: str) -> str | None:
        """Node 0's multiaddr (one starting with ``prefix`` if any) from its node.json; None if none."""
        path = node.run_dir / "node.json"
        deadline = time.monotonic() + self.config.start_timeout.total_seconds()
        while not self._stop_requested:
            try:
                multiaddrs = (
                    [str(a) for a in json.loads(path.read_text())["multiaddrs"]] if path.exists() else None
                )
            except (json.JSONDecodeError, KeyError):
                multiaddrs = None  # being written: read it again at the next poll
            if multiaddrs:
                return next((address for address in multiaddrs if address.startswith(prefix)), multiaddrs[0])
            if multiaddrs is not None:
                problem = "has no address others can dial"
            elif node.process.poll() is not None:
                problem = f"exited with code {node.process.returncode} before it started the swarm"
            elif time.monotonic() > deadline:
                problem = f"did not write {path} within {self.config.start_timeout}"
            else:
                time.sleep(self.config.poll_interval.total_seconds())
                continue
            log.error("%s %s:\n%s", node.name, problem, node.log_tail())
            self._stopped_by = "error"
            return None
        return None

    # --- watch and stop ---

    def _follow(self, running: list[NodeProcess], until: Callable[[], bool]) -> list[NodeProcess]:
        """Print rounds and exits as they come until ``running`` all exited or ``until()``; the rest."""
        running = [node for node in running if not node.exit_reported]
        while running and not until():
            for node in list(running):
                self._print_rounds(node)
                if node.process.poll() is not None:
                    running.remove(node)
                    self._on_exit(node)
            time.sleep(self.config.poll_interval.total_seconds())
        return running

    def _print_rounds(self, node: NodeProcess) -> None:
        for record in node.tail.read_rounds():
            node.rounds.append(record)
            print(round_line(node.name, record), flush=True)

    def _on_exit(self, node: NodeProcess) -> None:
        node.exit_reported = True
        code = node.process.returncode
        last = f" after round {node.rounds[-1]['round']}" if node.rounds else ""
        print(f"{node.name} exited with code {code}{last}", flush=True)
        if code != 0:
            print(f"{node.name}: last lines of {node.log_path}:\n{node.log_tail()}", flush=True)
        # Its DHT process or p2pd daemon must not outlive it.
        node.signal_group(signal.SIGKILL)

    def _stop_all(self) -> None:
        """SIGTERM to the running nodes, wait up to ``stop_grace`` (rounds keep printing), then SIGKILL."""
        if self._stop_requested and self._stopped_by == "finished":
            self._stopped_by = "signal"
        running = [node for node in self.nodes if node.process.poll() is None]
        if not running:
            return
        print(f"dtnode swarm: stopping {len(running)} node(s) (SIGTERM; again to kill at once)", flush=True)
        for node in running:
            node.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_grace.total_seconds()
        running = self._follow(running, until=lambda: self._kill_requested or time.monotonic() > deadline)
        for node in running:
            print(f"{node.name} still running: SIGKILL", flush=True)
        self._kill_leftovers()
        for node in running:
            self._on_exit(node)

    def _kill_leftovers(self) -> None:
        """Whatever path led here (an exception included), no node process outlives the launcher."""
        for node in self.nodes:
            if node.process.poll() is None:
                node.signal_group(signal.SIGKILL)
                try:
                    node.process.wait(timeout=KILL_WAIT.total_seconds())
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) survived SIGKILL for %s", node.name, node.process.pid, KILL_WAIT)


def write_plots_report(root: Path) -> None:
    """Replace ``report.md`` by the full report (``node/ops/report.py``): plots and per-node numbers.

    A report that cannot be made (no node wrote a record) leaves the launcher's summary in place.
    """
    from node.ops.report import write_report  # matplotlib is slow to import: only when the run is over

    try:
        write_report([root])
    except ValueError as error:
        log.warning("no plots: %s", error)
