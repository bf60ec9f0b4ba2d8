"""The settings of ``dtnode swarm`` (``node/ops/launcher.py``): the user's flags validated once, the
per-node additions, and each node's ``dtnode join`` command.

Left unset by the user, the launcher picks ``--start-peers N`` (the nodes begin training together:
none runs rounds alone while the others start), ``--threads max(1, cores // N)`` (one machine is
shared), ``--shard-index i --num-shards N`` (round 1 already reads disjoint data; the swarm
reshards among each round's members after that), loopback listen addresses (or the emulated
host's) and ``--bandwidth-mbit`` = the emulated link. ``--seed`` and ``--data-seed`` are the
same for every node: the swarm shares one initialisation. ``--node-flags I:FLAGS`` gives single
nodes flags of their own (e.g. node 2 twice the batch), applied after all of the above.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from node.config import ConfigError, NodeConfig, flat_defaults, flat_values, load_config
from node.ops.cli_errors import OneLineParser, what_is_wrong
from node.ops.cli_flags import add_config_flags

REPO_ROOT = Path(__file__).resolve().parents[2]
WAN_EMULATOR_PATH = REPO_ROOT / "scripts" / "tools" / "wan_emulator.py"
LOOPBACK = "127.0.0.1"
NODE_DEFAULTS = flat_defaults()


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
    """Setting (flat name, as ``node.config.FLAT_NAMES`` lists them) -> value given on the command
    line, passed to every node."""
    config_file: Path | None = None
    """``--config`` TOML passed to every node."""
    base: NodeConfig
    """The nodes' resolved settings (flag > env > TOML > default) before per-node additions."""
    link_mbit: float | None = None
    """Run every node in the WAN emulator with its uplink capped at this many Mbit/s."""
    stagger: timedelta = timedelta(0)
    """Node i starts ``i * stagger`` after node 0 (and not before node 0 wrote its address)."""
    node_overrides: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    """Node index -> setting (flat name) -> value for that node only, after every other flag."""
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
    return name in config.node_flags or flat_values(config.base)[name] != NODE_DEFAULTS[name]


def launch_config(
    *,
    num_nodes: int,
    node_flags: Mapping[str, Any],
    config_file: str | None = None,
    link_mbit: float | None = None,
    stagger_seconds: float = 0.0,
    node_overrides: Mapping[int, Mapping[str, Any]] | None = None,
) -> LaunchConfig:
    """Validate the user's settings once, here, rather than in N failing nodes; ConfigError if wrong."""
    if num_nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {num_nodes}")
    if link_mbit is not None and not link_mbit > 0:
        raise ConfigError(f"--link-mbit must be > 0, got {link_mbit}")
    if not (stagger_seconds >= 0 and math.isfinite(stagger_seconds)):
        raise ConfigError(f"--stagger must be >= 0 seconds, got {stagger_seconds}")
    base = load_config(config_file=config_file, flags=node_flags)
    overrides = {index: dict(flags) for index, flags in (node_overrides or {}).items()}
    for index, flags in overrides.items():
        if not 0 <= index < num_nodes:
            raise ConfigError(f"--node-flags names node {index}, but the nodes are 0..{num_nodes - 1}")
        if "run_dir" in flags or "peers" in flags:
            raise ConfigError(f"--node-flags {index}: the launcher sets each node's --run-dir and --peers")
        try:
            load_config(config_file=config_file, flags={**node_flags, **flags})
        except ConfigError as error:
            raise ConfigError(f"--node-flags {index}: {error}") from None
    if not base.network.enabled:
        raise ConfigError("dtnode swarm runs a swarm: drop --no-swarm (dtnode join --no-swarm trains alone)")
    settings = flat_values(base)
    if link_mbit is not None:
        load_wan_emulator()  # a missing emulator or no namespaces: say so before starting anything
        for key in ("peers", "listen", "dht_listen", "announce", "dht_announce"):
            if settings[key] != NODE_DEFAULTS[key]:
                flag = "--" + key.replace("_", "-")
                raise ConfigError(f"--link-mbit gives every node an emulated host of its own: drop {flag}")
    elif num_nodes > 1:
        for key in ("listen", "dht_listen"):
            address = settings[key]
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
        stagger=timedelta(seconds=stagger_seconds),
        node_overrides=overrides,
    )


class _NodeFlagsParser(OneLineParser):
    """``dtnode join``'s flags as ``--node-flags`` reads them: a mistake (with "did you mean") is a
    ConfigError that names the spec, printed as ``dtnode swarm``'s one line."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(what_is_wrong(message))


def parse_node_flags(specs: Sequence[str]) -> dict[int, dict[str, Any]]:
    """``dtnode swarm --node-flags`` values, ``I:FLAGS`` each (``"2:--batch-size 16"``), as node
    index -> setting (flat name) -> value; one index given twice merges, the later flag winning."""
    parser = _NodeFlagsParser(prog="--node-flags", add_help=False, allow_abbrev=False)
    add_config_flags(parser)
    overrides: dict[int, dict[str, Any]] = {}
    for spec in specs:
        index, colon, text = spec.partition(":")
        if not colon or not index.strip().isdigit():
            raise ConfigError(f"--node-flags {spec!r}: expected I:FLAGS, e.g. '2:--batch-size 16'")
        try:
            flags = vars(parser.parse_args(shlex.split(text)))
        except (ConfigError, ValueError) as error:  # ValueError: shlex's unclosed quote
            raise ConfigError(f"--node-flags {spec!r}: {error}") from None
        overrides.setdefault(int(index), {}).update(flags)
    return overrides


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
    if not _user_set(config, "start_peers"):
        extra["start_peers"] = config.num_nodes
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
    if config.base.metrics.port:  # one Prometheus port per node: the user's, then the next ones
        extra["metrics_port"] = config.base.metrics.port + index
        if host is not None and not _user_set(config, "metrics_listen"):
            extra["metrics_listen"] = host  # its emulated host's loopback is not this machine's
    all_peers = ",".join(address for address in (config.base.network.peers, peers) if address)
    if all_peers:
        extra["peers"] = all_peers
    argv = [sys.executable, "-m", "node.ops.cli", "join"]
    if config.config_file is not None:
        argv += ["--config", str(config.config_file)]
    own = flags_to_argv(config.node_overrides.get(index, {}))  # last: argparse keeps the last value
    return argv + flags_to_argv(config.node_flags) + flags_to_argv(extra) + own


def load_wan_emulator() -> ModuleType:
    """``scripts/tools/wan_emulator.py`` of this checkout, loaded by path; ConfigError if it cannot run here."""
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
