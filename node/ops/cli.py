"""The ``dtnode`` command line.

``dtnode join`` starts a node; ``dtnode plan`` prints the dp x tp x pp layout the planner
(``node.parallel.plan``) chooses for K devices, with its memory estimate and reasons; ``dtnode report``
plots runs' metrics (``node/ops/report.py``) and ``dtnode sample`` generates text with a run's exported
model (``node/model/sample.py``); ``dtnode status`` shows a running node's view of the swarm
(``node/ops/status.py``); ``dtnode health`` exits 0 when a node's gRPC health says SERVING
(``node/ops/health.py``); ``dtnode bootstrap`` runs a DHT peer only, the address a swarm is found
through (``node/ops/bootstrap.py``). For ``join``, one flag per setting of :class:`~node.config.NodeConfig` is
generated from its sections, one help group each (``node/ops/cli_flags.py``), so ``--help`` documents every setting; a
flag given on the command line wins over ``DTNODE_*`` environment variables, which win over
``--config node.toml``, which wins over defaults. Before ``join`` opens a socket it checks what can
be checked (``node/ops/preflight.py``); when the run ends it logs one summary line (``node/ops/run_summary.py``).

User mistakes end with one line on stderr and exit code 2; SIGINT/SIGTERM stop the node after the
current inner step, with a checkpoint, and exit 0.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from node import __version__
from node.config import ConfigError, NodeConfig, layered_values, load_config
from node.data.tokenizer import add_tokenizer_command
from node.ops.bootstrap import BOOTSTRAP_SETTINGS
from node.ops.cli_errors import EXIT_USAGE, OneLineParser, choices_text, error_line
from node.ops.cli_flags import add_config_flags
from node.ops.logs import configure_logging

log = logging.getLogger("dtnode")


def user_mistake(command: str, message: str) -> int:
    """Print one user mistake of ``dtnode COMMAND`` as its one line (node/ops/cli_errors.py); exit code 2."""
    print(error_line(f"dtnode {command}", message), file=sys.stderr)
    return EXIT_USAGE


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="dtnode", description="Decentralized low-bandwidth training node (DiLoCo).")
    parser.add_argument("--version", action="version", version=f"dtnode {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    join = commands.add_parser(
        "join",
        help="start a node and train",
        usage="%(prog)s [--config FILE] [--SETTING VALUE ...]  (settings by group below)",
        description="Start a node. Settings: flag > DTNODE_* env > --config TOML > default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    join.add_argument(
        "--config", dest="config_file", default=None, help="TOML file of settings (env DTNODE_CONFIG)"
    )
    add_config_flags(join)
    # "resolve": the swarm's own --run-dir (the root of the node dirs) replaces the per-node flag.
    swarm = commands.add_parser(
        "swarm",
        help="start N nodes on this machine, stream their rounds, stop them, write a report",
        description="Start N `dtnode join` nodes on this machine (node i in RUN_DIR/node-<i>); every "
        "setting flag is passed to every node. Ctrl-C stops them all (twice: at once).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        conflict_handler="resolve",
    )
    swarm.add_argument("--nodes", dest="num_nodes", type=int, required=True, help="how many nodes to start")
    swarm.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="run each node on a host of the WAN emulator with its uplink capped at this (needs root)",
    )
    swarm.add_argument(
        "--stagger", type=float, default=0.0, help="start node i this many seconds times i after node 0"
    )
    swarm.add_argument(
        "--node-flags",
        dest="per_node_flags",
        action="append",
        default=[],
        metavar="I:FLAGS",
        help="flags for node I only, after all others, e.g. '2:--batch-size 16' (repeatable)",
    )
    swarm.add_argument(
        "--config", dest="config_file", default=None, help="TOML file of settings for every node"
    )
    add_config_flags(swarm)
    swarm.add_argument(
        "--run-dir",
        dest="run_dir",
        default=argparse.SUPPRESS,
        help="swarm directory: node i runs in RUN_DIR/node-<i>, logs and report.{json,md} beside [default: runs/<name>]",
    )
    plan = commands.add_parser(
        "plan",
        help="choose a dp x tp x pp layout for K devices and print why",
        description="Estimate memory per device for every dp x tp x pp layout of K devices and print the "
        "chosen one (rules and formulas: node/parallel/plan.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    plan.add_argument("--model", required=True, help="model preset (tiny, small, 350m, 1b, 7b, ...)")
    plan.add_argument("--gpus", dest="num_devices", type=int, required=True, help="devices in the node")
    plan.add_argument("--gpu-mem", dest="device_memory_gib", type=float, required=True, help="GiB per device")
    plan.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (None = the preset's)")
    plan.add_argument("--batch-size", type=int, default=16, help="sequences per inner step on this node")
    plan.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory left unplanned")
    status = commands.add_parser(
        "status",
        help="show a running node's view of the swarm: its phase, peers, rounds and param hashes",
        description="Ask a running node (its gRPC HOST:PORT, or the one in RUN_DIR/node.json) for its "
        "phase and the peers it sees, with their round, param_hash, bandwidth and last heartbeat "
        "(see node/ops/status.py). Exit 1 if it does not answer within --timeout.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    status.add_argument("address", nargs="?", default=None, metavar="ADDR", help="the node's gRPC HOST:PORT")
    status.add_argument("--json", dest="as_json", action="store_true", help="print the full status as JSON")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the node's answer")
    status.add_argument("--name", default=None, help="run name, for the default run dir runs/<name>")
    status.add_argument("--run-dir", dest="run_dir", default=None, help="run dir (None: as join resolves it)")
    status.add_argument("--config", dest="config_file", default=None, help="TOML file the node started with")
    status.add_argument(
        "--swarm-key-file",
        default=None,
        help="the swarm key file (needed to reach a node started with --tls)",
    )
    status.add_argument(
        "--tls",
        action="store_const",
        const=True,
        default=None,
        help="the node speaks mutual TLS (with the key)",
    )
    report = commands.add_parser(
        "report",
        help="plot runs' loss, bytes, peers and utilization; write report.md",
        description="Read the metrics.jsonl of node run dirs or dtnode swarm dirs (node-<i>/) and write "
        "loss.png, bytes.png, peers.png, utilization.png and report.md (see node/ops/report.py).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a node's or a swarm's run directory")
    report.add_argument("--out", default=None, help="where to write the report (default: the first RUN_DIR)")
    sample = commands.add_parser(
        "sample",
        help="generate text with a run's exported model",
        description="Load RUN_DIR/model.safetensors (or a swarm dir's node) and continue the prompt.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sample.add_argument("run_dir", metavar="RUN_DIR", help="a node's or a swarm's run directory")
    sample.add_argument("--prompt", default="", help="text to continue (empty: start a new document)")
    sample.add_argument("--max-new-tokens", type=int, default=200, help="tokens (bytes) to generate at most")
    sample.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 = greedy")
    sample.add_argument("--top-k", type=int, default=50, help="sample among the K likeliest tokens; 0 = all")
    sample.add_argument("--seed", type=int, default=0, help="seed of the sampler: same seed, same text")
    sample.add_argument("--device", default="cpu", help="device to run the model on")
    health = commands.add_parser(
        "health",
        help="exit 0 if the node at ADDR serves (gRPC health SERVING), else 1",
        description="Ask a node's gRPC port (HOST:PORT) for its grpc.health.v1 status and print it; exit 0 "
        "when SERVING, 1 otherwise or without an answer within --timeout (see node/ops/health.py). A "
        "--client-mode node has no port: its run dir's liveness.json answers (records within the "
        "round's stall bound, rounds with peers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    health.add_argument(
        "address", nargs="?", default=None, metavar="ADDR",
        help="the node's gRPC HOST:PORT (None: the local address in RUN_DIR/node.json, else 127.0.0.1 "
        "and the --listen port of the settings, as DTNODE_LISTEN gives it in the image; for a "
        "--client-mode node, which listens on nothing, RUN_DIR/liveness.json: see node/ops/liveness.py)",
    )  # fmt: skip
    health.add_argument("--service", default="", help="one service's health ('': the whole server)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    health.add_argument("--config", dest="config_file", default=None, help="the TOML file of the node")
    health.add_argument("--swarm-key-file", default=None, help="the swarm key (to reach a --tls node)")
    health.add_argument(
        "--tls", action="store_const", const=True, default=None, help="the node speaks mutual TLS (with key)"
    )
    keygen = commands.add_parser(
        "keygen",
        help="write a new swarm key file (mode 0600) for --swarm-key-file",
        description="Write 32 random bytes as hex to a new file PATH, readable by you only. Give every "
        "node of the swarm a copy (over a secure channel) and start each with --swarm-key-file PATH.",
    )
    keygen.add_argument(
        "path", metavar="PATH", help="the key file to create (an existing file is not overwritten)"
    )
    bootstrap = commands.add_parser(
        "bootstrap",
        help="run a DHT-only node (no training) that keeps a swarm discoverable; print its multiaddrs",
        description="Start a DHT peer on --dht-listen and nothing else (no model, no gRPC server), print "
        "the multiaddrs to pass to `dtnode join --peers`, and serve until Ctrl-C or SIGTERM "
        "(see node/ops/bootstrap.py). Settings: flag > DTNODE_* env > --config TOML > default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bootstrap.add_argument("--config", dest="config_file", default=None, help="TOML file of settings")
    add_config_flags(bootstrap, only=BOOTSTRAP_SETTINGS)
    add_tokenizer_command(commands)  # dtnode tokenizer train (node/data/tokenizer.py)
    return parser


def setup_logging(log_format: str = "text") -> None:
    """Log at INFO on stderr: plain or terminal lines (``text``) or JSON objects (``json``; see
    ``node/ops/logs.py``). Called with ``text`` before the flags are read, and again by ``join`` if its
    config asks for ``json``."""
    configure_logging(log_format)


def run_join(args: argparse.Namespace) -> int:
    stop = _StopOnSignals()  # first: a signal during the slow start-up still ends in a clean exit
    started = time.time()
    flags = {key: value for key, value in vars(args).items() if key not in ("command", "config_file")}
    config = load_config(config_file=args.config_file, flags=flags)
    if config.metrics.log_format != "text":
        setup_logging(config.metrics.log_format)
    from node.ops.preflight import check_before_sockets

    # Every setting that cannot work (layout, key, ports, data, the checkpoint to resume): one line and
    # exit 2 before any socket; the corpus it loads is the trainer's.
    corpus = check_before_sockets(config)
    log.info("config: %s", config.describe())
    # Imported late: torch is slow to import and --help / config errors should be instant.
    from node.train.trainer import Trainer

    if not config.network.enabled:
        trainer = Trainer(config, corpus=corpus)
        stop.attach(trainer)
        trainer.run()
        log_run_summary(config, started=started)
        return 0
    from node.swarm.join import JOIN_TIMEOUT, Prefetch
    from node.swarm.session import SwarmSession
    from node.swarm.setup import start_swarm
    from node.train.checkpoint import latest_checkpoint

    if stop.requested:  # nothing to leave yet: no socket, no swarm, no step
        log.info("stopped before the swarm started")
        return 0
    try:
        swarm = start_swarm(config)
    except Exception:
        # A signal to the node's process group reaches the helpers its start-up spawns too (torch's
        # shared-memory manager, the DHT's daemon): start-up may then fail, but the user asked to stop.
        if not stop.requested:
            raise
        log.info("stopped while the swarm started (its start-up was interrupted)", exc_info=True)
        return 0
    try:
        # A fresh joiner fetches the swarm's state while its model is being built (its data is loaded:
        # the preflight read it, before any socket).
        fresh = latest_checkpoint(config.resolved_run_dir / "checkpoints") is None
        prefetch = Prefetch(swarm, join_timeout=JOIN_TIMEOUT) if config.network.peers and fresh else None
        session = SwarmSession(
            swarm,
            joining=bool(config.network.peers),
            prefetch=prefetch,
            start_peers=config.rounds.start_peers,
        )
        trainer = Trainer(config, swarm=session, corpus=corpus)
        stop.attach(trainer)
        trainer.run()
        if not trainer.stop_requested:  # the run reached its end: let nodes behind us catch up first
            session.serve_stragglers()
    finally:
        swarm.leave()
        swarm.close()
    log_run_summary(config, started=started)
    return 0


def log_run_summary(config: NodeConfig, *, started: float) -> None:
    """One line when the run ends: rounds, held-out loss, bytes, wall time (``node/ops/run_summary.py``)."""
    from node.ops.run_summary import summarize_run, summary_line

    run_dir = config.resolved_run_dir
    summary = summarize_run(run_dir / "metrics.jsonl", started=started, ended=time.time())
    log.info("%s", summary_line(summary, run_dir))


def run_plan(args: argparse.Namespace) -> int:
    """Print the planner's choice; a model or memory that cannot work is a user mistake (exit 2)."""
    from node.model.gpt import MODEL_PRESETS, model_config
    from node.parallel.plan import plan_layout, render_plan

    if args.model not in MODEL_PRESETS:
        return user_mistake("plan", f"--model: {choices_text(MODEL_PRESETS, args.model)}")
    try:
        config = model_config(args.model)
        plan = plan_layout(
            config,
            num_devices=args.num_devices,
            device_memory_bytes=int(args.device_memory_gib * 2**30),
            seq_len=config.seq_len if args.seq_len is None else args.seq_len,
            batch_size=args.batch_size,
            headroom=args.headroom,
        )
    except ValueError as error:
        return user_mistake("plan", str(error))
    print(render_plan(plan))
    return 0


def run_report(args: argparse.Namespace) -> int:
    """Write the plots and report.md; a RUN_DIR without metrics is a user mistake (exit 2)."""
    from pathlib import Path

    from node.ops.report import write_report

    try:
        out = None if args.out is None else Path(args.out)
        path = write_report([Path(d) for d in args.run_dirs], out=out)
    except ValueError as error:
        return user_mistake("report", str(error))
    print(path)
    return 0


def run_sample(args: argparse.Namespace) -> int:
    """Print the prompt and the model's continuation; no export or a bad setting is exit 2."""
    from node.model.sample import sample_text

    try:
        text = sample_text(
            args.run_dir,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k or None,
            seed=args.seed,
            device=args.device,
        )
    except ValueError as error:
        return user_mistake("sample", str(error))
    print(args.prompt + text)
    return 0


def run_keygen(args: argparse.Namespace) -> int:
    """Write a fresh swarm key to a new file; an existing file is a user mistake (exit 2)."""
    from pathlib import Path

    from protocol.auth import SwarmKey

    key = SwarmKey.generate()
    try:
        key.write(Path(args.path))
    except OSError as error:  # FileExistsError included: never overwrite a key others may hold
        return user_mistake("keygen", f"cannot create {args.path}: {error.strerror}")
    print(f"wrote a swarm key to {args.path} (fingerprint {key.fingerprint}); start every node with "
          f"--swarm-key-file {args.path}")  # fmt: skip
    return 0


def run_health(args: argparse.Namespace) -> int:
    """Exit 0 when the node at ADDR is SERVING, 1 otherwise; a bad ADDR or key is exit 2. The key,
    ``--tls`` and the default ADDR come from the settings as ``join`` reads them (flag > env > TOML)."""
    from datetime import timedelta
    from pathlib import Path

    from node.ops.health import health_settings, local_address, recorded_client_mode, run_liveness_health
    from node.ops.health import run_health as check
    from node.ops.status import check_address
    from protocol.auth.channels import SwarmAuth
    from protocol.auth.key import SwarmKey

    if not args.timeout > 0:
        raise ConfigError("--timeout must be positive")
    flags = {key: getattr(args, key) for key in ("swarm_key_file", "tls") if getattr(args, key) is not None}
    settings = health_settings(layered_values(config_file=args.config_file, flags=flags))
    if settings.tls and not settings.swarm_key_file:
        raise ConfigError("--tls needs --swarm-key-file (the TLS certificates are derived from the key)")
    if args.address is None and recorded_client_mode(settings.run_dir):  # no port to ask: its liveness file
        return run_liveness_health(settings.run_dir)
    try:
        address = check_address(args.address or local_address(settings.listen, settings.run_dir))
        key = SwarmKey.from_file(Path(settings.swarm_key_file)) if settings.swarm_key_file else None
    except ValueError as error:  # SwarmKeyError too: a missing, open or weak key file
        raise ConfigError(str(error)) from None
    auth = None if key is None else SwarmAuth(key, tls=settings.tls)
    return check(address, service=args.service, timeout=timedelta(seconds=args.timeout), auth=auth)


def run_status(args: argparse.Namespace) -> int:
    """Print a node's status; the run dir (for ADDR's default) is resolved as ``join`` resolves it."""
    from datetime import timedelta
    from pathlib import Path

    from node.ops.status import run_status as print_status

    if not args.timeout > 0:
        return user_mistake("status", "--timeout must be positive")
    from node.ops.health import health_settings
    from protocol.auth.channels import SwarmAuth
    from protocol.auth.key import SwarmKey

    keys = ("name", "run_dir", "swarm_key_file", "tls")
    flags = {key: getattr(args, key) for key in keys if getattr(args, key) is not None}
    # Only the settings status reads, as `dtnode health` does: a whole NodeConfig checks the codec and
    # the model preset, which imports torch (more CPU than the rest of the command).
    config = health_settings(layered_values(config_file=args.config_file, flags=flags))
    if config.tls and not config.swarm_key_file:
        raise ConfigError("--tls needs --swarm-key-file (the TLS certificates are derived from the key)")
    auth = None
    if config.swarm_key_file:  # a --tls node answers only over TLS with the swarm's certificates
        try:
            auth = SwarmAuth(SwarmKey.from_file(Path(config.swarm_key_file)), tls=config.tls)
        except ValueError as error:  # SwarmKeyError: missing, open or weak key file
            return user_mistake("status", f"--swarm-key-file: {error}")
    timeout = timedelta(seconds=args.timeout)
    return print_status(
        address=args.address,
        run_dir=config.run_dir,
        as_json=args.as_json,
        timeout=timeout,
        auth=auth,
    )


def run_swarm(args: argparse.Namespace) -> int:
    from node.ops.launch_config import launch_config, parse_node_flags
    from node.ops.launcher import SwarmLauncher

    options = ("command", "config_file", "num_nodes", "link_mbit", "stagger", "per_node_flags")
    flags = {key: value for key, value in vars(args).items() if key not in options}
    config = launch_config(
        num_nodes=args.num_nodes,
        node_flags=flags,
        config_file=args.config_file,
        link_mbit=args.link_mbit,
        stagger_seconds=args.stagger,
        node_overrides=parse_node_flags(args.per_node_flags),
    )
    launcher = SwarmLauncher(config)

    def on_signal(signum: int, frame: Any) -> None:
        launcher.request_stop()  # the first stops the nodes gracefully, a second kills them

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return launcher.run()


class _StopOnSignals:
    """SIGINT/SIGTERM: finish the current step (or round), checkpoint, leave the swarm, exit 0.
    SIGUSR1: write every thread's stack to the log and go on (where is a node that does not move?).

    Installed before anything slow starts: a signal that arrives while the DHT starts or the model
    is built is kept and handed to the trainer, which then stops before its first step.
    """

    def __init__(self) -> None:
        self._trainer: Any = None
        self._requested = False
        self._pid = os.getpid()
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        # SIGUSR1: every thread's stack to the log (stderr), written by C code, so it works while the
        # main thread is stuck inside a native call (where the handlers above cannot run). Not where
        # stderr is no file (dtnode join called in-process with its output captured).
        with contextlib.suppress(AttributeError, OSError, ValueError):
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)

    @property
    def requested(self) -> bool:
        """A signal has asked the node to stop."""
        return self._requested

    def attach(self, trainer: Any) -> None:
        self._trainer = trainer
        if self._requested:
            trainer.request_stop()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:  # a child forked after we were installed (the DHT): default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        log.info("received %s: finishing the current step", signal.Signals(signum).name)
        self._requested = True
        if self._trainer is not None:
            self._trainer.request_stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging()
    try:
        if args.command == "join":
            return run_join(args)
        if args.command == "swarm":
            return run_swarm(args)
        if args.command == "plan":
            return run_plan(args)
        if args.command == "status":
            return run_status(args)
        if args.command == "report":
            return run_report(args)
        if args.command == "sample":
            return run_sample(args)
        if args.command == "bootstrap":
            from node.ops.bootstrap import run_bootstrap

            flags = {key: value for key, value in vars(args).items() if key not in ("command", "config_file")}
            return run_bootstrap(load_config(config_file=args.config_file, flags=flags))
        if args.command == "keygen":
            return run_keygen(args)
        if args.command == "health":
            return run_health(args)
        if args.command == "tokenizer":
            from node.data.tokenizer import run_tokenizer

            return run_tokenizer(args)
    except ConfigError as error:
        return user_mistake(args.command, str(error))
    parser.error(f"unknown command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
