"""``dtnode swarm``: N ``dtnode join`` nodes on this machine, their progress, a clean stop, a report.

The N nodes are separate processes, as on N machines; the launcher never talks to the swarm:

1. Start. Node 0 (``python -m node.cli join --run-dir RUN_DIR/node-0 …``) starts a new swarm and
   writes ``RUN_DIR/node-0/node.json``; nodes 1..N-1 then join through its multiaddr (``--peers``).
   Each runs in its own process group (a Ctrl-C in the terminal reaches only the launcher, which
   decides how to stop them), output in ``RUN_DIR/node-<i>.log``. With ``link_mbit`` each node
   runs on its own host of the WAN emulator (``scripts/wan_emulator.py``: a network namespace
   with a capped uplink) and listens on that host's address.
2. Watch. Tail every node's ``metrics.jsonl`` (contract: ``node/metrics.py``); print one line per
   outer round per node as it is written.
3. Stop. When every node has exited (they stop by themselves at ``--max-rounds``), or on the
   first SIGINT/SIGTERM: SIGTERM to every node (each finishes its step or round, checkpoints and
   leaves the swarm), a bounded wait, then SIGKILL for what is left; a second signal kills at once.
4. Report. ``RUN_DIR/report.json`` and ``report.md``: per node the rounds, eval losses and bytes
   sent; whether every node held the same ``param_hash`` after every round they all recorded
   (DiLoCo's outer step leaves all members of a round with identical global params); wall time;
   then the plots and per-node table of ``dtnode report`` (``node/report.py``). Each node has
   exported the swarm's model to ``node-<i>/model.safetensors`` (``dtnode sample RUN_DIR``).

Left unset by the user, the launcher picks ``--threads max(1, cores // N)`` (one machine is
shared), ``--shard-index i --num-shards N`` (round 1 already reads disjoint data; the swarm
reshards among each round's members after that), loopback listen addresses (or the emulated
host's) and ``--bandwidth-mbit`` = the emulated link. ``--seed`` and ``--data-seed`` are the
same for every node: the swarm shares one initialisation.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

from node.checkpoint import latest_checkpoint
from node.config import ConfigError, NodeConfig, load_config
from node.swarm_report import MetricsTail, hash_agreement, report_markdown, round_line

log = logging.getLogger("dtnode.swarm")

REPO_ROOT = Path(__file__).resolve().parents[1]
WAN_EMULATOR_PATH = REPO_ROOT / "scripts" / "wan_emulator.py"
LOOPBACK = "127.0.0.1"
KILL_WAIT = timedelta(seconds=10)
NODE_DEFAULTS = {f.name: f.default for f in fields(NodeConfig)}


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What ``dtnode swarm`` runs; build it with :func:`launch_config`, which validates it."""

    num_nodes: int
    """How many nodes to start on this machine."""
    root: Path
    """Run directory of the swarm: node i in ``root/node-<i>``, logs and report beside them."""
    node_flags: Mapping[str, Any]
    """``NodeConfig`` field -> value given on the command line, passed to every node."""
    config_file: Path | None = None
    """``--config`` TOML passed to every node."""
    base: NodeConfig
    """The nodes' resolved settings (flag > env > TOML > default) before per-node additions."""
    link_mbit: float | None = None
    """Run every node in the WAN emulator with its uplink capped at this many Mbit/s."""
    num_cores: int = field(default_factory=available_cores)
    """CPU cores this process may use, shared by the nodes."""
    stop_grace: timedelta = timedelta(seconds=60)
    """After SIGTERM, how long nodes may take to finish their round, checkpoint and leave."""
    start_timeout: timedelta = timedelta(seconds=120)
    """How long node 0 may take to write its ``node.json`` (imports, DHT start-up)."""
    poll_interval: timedelta = timedelta(seconds=0.5)
    """How often the metrics files and the processes are looked at."""


def _user_set(config: LaunchConfig, name: str) -> bool:
    """Whether the user chose ``name`` (flag, env or TOML), so the launcher must not pick it."""
    return name in config.node_flags or getattr(config.base, name) != NODE_DEFAULTS[name]


def launch_config(
    *,
    num_nodes: int,
    node_flags: Mapping[str, Any],
    config_file: str | None = None,
    link_mbit: float | None = None,
) -> LaunchConfig:
    """Validate the user's settings once, here, rather than in N failing nodes; ConfigError if wrong."""
    if num_nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {num_nodes}")
    if link_mbit is not None and not link_mbit > 0:
        raise ConfigError(f"--link-mbit must be > 0, got {link_mbit}")
    base = load_config(config_file=config_file, flags=node_flags)
    if not base.swarm:
        raise ConfigError("dtnode swarm runs a swarm: drop --no-swarm (dtnode join --no-swarm trains alone)")
    if link_mbit is not None:
        load_wan_emulator()  # a missing emulator or no namespaces: say so before starting anything
        for key in ("peers", "listen", "dht_listen", "announce"):
            if getattr(base, key) != NODE_DEFAULTS[key]:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"--link-mbit gives every node an emulated host of its own: drop {flag}")
    elif num_nodes > 1:
        for key in ("listen", "dht_listen"):
            address = getattr(base, key)
            if address and not address.endswith(":0"):
                flag = "--" + key.replace("_", "-")
                raise ConfigError(
                    f"{num_nodes} nodes on one machine cannot share {flag} {address}: use port 0"
                )
    # Per node: the run dir is RUN_DIR/node-<i>; the peers are the user's plus node 0.
    flags = {key: value for key, value in node_flags.items() if key not in ("run_dir", "peers")}
    return LaunchConfig(
        num_nodes=num_nodes,
        root=base.resolved_run_dir,
        node_flags=flags,
        config_file=None if config_file is None else Path(config_file).resolve(),
        base=base,
        link_mbit=link_mbit,
    )


def checkpointed_round(run_dir: Path) -> int:
    """The round of a node's newest checkpoint (0 without one): where a restarted node resumes."""
    latest = latest_checkpoint(run_dir / "checkpoints")
    return 0 if latest is None else int(json.loads((latest / "state.json").read_text())["meta"]["round"])


def flags_to_argv(flags: Mapping[str, Any]) -> list[str]:
    """The ``dtnode join`` arguments that set ``flags`` (the inverse of ``add_config_flags``)."""
    argv = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def node_argv(config: LaunchConfig, index: int, *, peers: str, host: str | None) -> list[str]:
    """The command of node ``index``: the user's flags plus the per-node ones the user left unset."""
    extra: dict[str, Any] = {"run_dir": str((config.root / f"node-{index}").resolve())}
    if not _user_set(config, "threads"):
        extra["threads"] = max(1, config.num_cores // config.num_nodes)
    if not _user_set(config, "num_shards") and not _user_set(config, "shard_index"):
        extra["shard_index"], extra["num_shards"] = index, config.num_nodes
    if host is not None or not _user_set(config, "listen"):
        extra["listen"] = f"{host or LOOPBACK}:0"
    if host is not None:
        extra["dht_listen"] = f"{host}:0"
        if not _user_set(config, "bandwidth_mbit"):
            extra["bandwidth_mbit"] = config.link_mbit
    if config.base.metrics_port:  # one Prometheus port per node: the user's, then the next ones
        extra["metrics_port"] = config.base.metrics_port + index
    all_peers = ",".join(address for address in (config.base.peers, peers) if address)
    if all_peers:
        extra["peers"] = all_peers
    argv = [sys.executable, "-m", "node.cli", "join"]
    if config.config_file is not None:
        argv += ["--config", str(config.config_file)]
    return argv + flags_to_argv(config.node_flags) + flags_to_argv(extra)


@dataclass
class NodeProcess:
    index: int
    run_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    tail: MetricsTail
    rounds: list[dict[str, Any]] = field(default_factory=list)

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
    }


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
        max_rounds = config.base.max_rounds
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
        report: dict[str, Any] = {
            "num_nodes": config.num_nodes,
            "run_dir": str(config.root),
            "link_mbit": config.link_mbit,
            "stopped_by": self._stopped_by,
            "wall_seconds": round(time.monotonic() - started, 1),
            "exit_codes": exit_codes,
            "param_hash": agreement,
            "nodes": [node_summary(node) for node in self.nodes],
        }
        (config.root / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (config.root / "report.md").write_text(report_markdown(report))
        write_plots_report(config.root)
        hashes = f"agreed in {len(agreement['common_rounds'])} common round(s)"
        if agreement["disagreeing_rounds"]:
            hashes = f"differs in rounds {agreement['disagreeing_rounds']} of {agreement['common_rounds']}"
        print(f"dtnode swarm: done in {report['wall_seconds']:.0f} s | exit codes {exit_codes} | "
              f"param_hash {hashes} | {config.root / 'report.md'}", flush=True)  # fmt: skip
        ok = len(self.nodes) == config.num_nodes and all(code == 0 for code in exit_codes)
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
            self._start(index, wan, peers=multiaddr)
        return True

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
        running = list(running)
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
    """Replace ``report.md`` by the full report (``node/report.py``): plots and per-node numbers.

    A report that cannot be made (no node wrote a record) leaves the launcher's summary in place.
    """
    from node.report import write_report  # matplotlib is slow to import: only when the run is over

    try:
        write_report([root])
    except ValueError as error:
        log.warning("no plots: %s", error)


def load_wan_emulator() -> ModuleType:
    """``scripts/wan_emulator.py`` of this checkout, loaded by path; ConfigError if it cannot run here."""
    if not WAN_EMULATOR_PATH.is_file():
        raise ConfigError(
            f"--link-mbit needs the WAN emulator {WAN_EMULATOR_PATH} (a source checkout of dtnode)"
        )
    module = sys.modules.get("wan_emulator")
    if module is None:
        spec = importlib.util.spec_from_file_location("wan_emulator", WAN_EMULATOR_PATH)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["wan_emulator"] = module  # its dataclasses resolve their module through sys.modules
        spec.loader.exec_module(module)
    reason = module.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--link-mbit: {reason}")
    return module
