"""From the node's settings to a running swarm side: ``swarm_config`` maps ``NodeConfig`` onto
``SwarmConfig`` (the local stream servers use it too), ``start_swarm`` starts the ``SwarmNode``,
prints how to join it (addresses other machines can dial first, loopback last) and records it in
``RUN_DIR/node.json``."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from node.config import ConfigError, NetworkConfig, NodeConfig
from node.swarm.catch_up import max_catch_up_rounds
from protocol.allreduce.config import AllReduceConfig
from protocol.auth.channels import SwarmAuth
from protocol.auth.key import SwarmKey
from protocol.discovery.addresses import join_host_port, local_dial_address, parse_host_port, split_announce
from protocol.discovery.dht_node import DhtConfig, DhtStartupError
from protocol.membership.config import RoundConfig
from protocol.statesync.config import StateSyncConfig
from protocol.swarm.config import SwarmConfig
from protocol.swarm.node import SwarmNode
from protocol.swarm.ports import bind_problem


def dht_listen(network: NetworkConfig) -> str:
    """Where the DHT peer listens: ``--dht-listen``, else the ``--listen`` host (every interface for an
    empty one) at any free port. ValueError if ``--listen`` is not ``HOST:PORT``."""
    if network.dht_listen:
        return network.dht_listen
    listen_host, _ = parse_host_port(network.listen, flag="--listen", empty_host="0.0.0.0")
    return join_host_port(listen_host, 0)


def dht_config(config: NodeConfig) -> DhtConfig:
    """The DHT peer's settings: ``--dht-listen`` (default: the ``--listen`` host, any port), and what others
    dial: ``--dht-announce``, else ``--announce``'s host at the DHT's listen port. ValueError if malformed."""
    network = config.network
    listen = dht_listen(network)
    announce = network.dht_announce or None
    if announce is None and network.announce:
        host, _ = split_announce(network.announce)
        _, listen_port = parse_host_port(listen, flag="--dht-listen", empty_host="")
        announce = join_host_port(host, listen_port)
    return DhtConfig(
        initial_peers=tuple(address.strip() for address in network.peers.split(",") if address.strip()),
        listen=listen,
        announce=announce,
        identity_path=config.security.identity_path or None,
        use_relay=network.use_relay,
        client_mode=network.client_mode,
    )


def swarm_key(config: NodeConfig) -> SwarmKey | None:
    """The swarm key of ``--swarm-key-file``, None for an open swarm; ValueError if it cannot be used."""
    return SwarmKey.from_file(Path(config.security.key_file)) if config.security.key_file else None


def swarm_config(config: NodeConfig) -> SwarmConfig:
    """The swarm side's settings from the node's (durations in seconds become timedeltas)."""
    announce_host, announce_port = None, None
    try:
        if config.network.announce:
            announce_host, announce_port = split_announce(config.network.announce)
        if config.network.client_mode and config.rounds.streams > 1:
            # Streams 2.. are all-reduce servers of their own, which peers dial.
            raise ValueError("--client-mode accepts no connections: it runs one stream (--swarm-streams 1)")
        dht = dht_config(config)
        max_wait = timedelta(seconds=config.rounds.max_wait)
        join_window = timedelta(seconds=config.rounds.join_window)
        rounds = RoundConfig(
            min_peers=config.rounds.min_peers,
            join_window=join_window,
            max_wait=max_wait,
            proposal_timeout=min(timedelta(seconds=5), join_window),
            begin_timeout=min(timedelta(seconds=10), join_window) + min(timedelta(seconds=5), join_window),
            tier_group_size=config.rounds.tier_group_size,
        )
        key = swarm_key(config)
        auth = None if key is None else SwarmAuth(key, tls=config.security.tls)
        return SwarmConfig(
            run_name=config.run.name,
            listen=config.network.listen,
            announce_host=announce_host,
            announce_port=announce_port,
            dht=dht,
            rounds=rounds,
            allreduce=AllReduceConfig(
                keep_payloads=True,  # the round's mean is served on compressed (node/swarm/state.py)
                aggregation=config.rounds.aggregation,  # type: ignore[arg-type]  # NodeConfig checked it
                clip_factor=config.rounds.clip_factor,
                trim_per_side=config.rounds.trim,
            ),
            codec=config.rounds.codec,
            topk_density=config.rounds.topk_density,
            error_feedback_decay=config.rounds.error_feedback_decay,
            round_deadline=timedelta(seconds=config.rounds.deadline),
            sync_deadline=timedelta(seconds=config.rounds.sync_deadline),
            bandwidth_bytes_per_s=config.network.bandwidth_mbit * 1e6 / 8,
            client_mode=config.network.client_mode,
            heartbeat=timedelta(seconds=config.network.heartbeat),
            record_ttl=timedelta(seconds=config.network.record_ttl),
            auth=auth,
            # The rounds' means a node may step with: 2F with fragments (node/swarm/catch_up.py).
            statesync=StateSyncConfig(num_companions_kept=max_catch_up_rounds(config.outer.fragments)),
        )
    except ValueError as error:  # SwarmKeyError too: a missing, open or weak key file
        raise ConfigError(str(error)) from None


LOOPBACK_PREFIXES = ("/ip4/127.", "/ip6/::1/")


def _taken_port(flag: str, address: str) -> str | None:
    """After a server failed to start: ``flag``'s ``address`` refused as the preflight refuses it
    (node/ops/preflight.py), if it cannot be bound now (taken since the probe), else None."""
    host, port = parse_host_port(address, flag=flag, empty_host="")  # "": every interface, as the preflight
    problem = bind_problem(host, port) if port else None
    return None if problem is None else f"{flag}: cannot listen on {host}:{port}: {problem}"


def local_address(listen: str, port: int) -> str:
    """``host:port`` at which a process on this machine reaches a server bound to ``listen`` at
    ``port``: the listen host, loopback for a wildcard one."""
    host, _ = parse_host_port(listen, flag="--listen", empty_host="")
    return local_dial_address(host, port)


def reachable_first(multiaddrs: list[str]) -> list[str]:
    """``multiaddrs`` with the loopback ones last (otherwise in order): the first address printed
    under "To join it from another machine" is one another machine can dial."""
    return sorted(multiaddrs, key=lambda address: address.startswith(LOOPBACK_PREFIXES))


def _join_command(run_name: str, peers: str) -> str:
    return f"dtnode join --name {run_name} --peers {peers}"


def start_swarm(config: NodeConfig, *, join_hint: Callable[[str, str], str] | None = None) -> SwarmNode:
    """Start the node's swarm side, print how to join it, and record it in ``RUN_DIR/node.json``.
    ``join_hint(run_name, peers)``: how another machine joins (default: the ``dtnode join`` command;
    the Python API's nodes train the user's module, which only ``join_swarm`` can)."""
    try:
        swarm = SwarmNode(swarm_config(config))
    except DhtStartupError as error:  # a port taken since the preflight's probe is named as it would be
        raise ConfigError(_taken_port("--dht-listen", dht_config(config).listen) or str(error)) from None
    except OSError as error:
        raise ConfigError(_taken_port("--listen", config.network.listen) or f"--listen: {error}") from None
    multiaddrs = reachable_first(swarm.multiaddrs())
    run_dir = config.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    client = config.network.client_mode  # it listens on nothing: no address to record
    # local_address: where a process on this machine reaches it (`dtnode health`, a container's
    # HEALTHCHECK): the port it bound, which the address others dial may not show (a port forward's).
    local = None if config.network.client_mode else local_address(config.network.listen, swarm.server.port)
    identity = {
        "peer_id": swarm.peer_id,
        "multiaddrs": multiaddrs,
        "grpc_address": None if client else swarm.grpc_address,
        "local_address": local,
        "client_mode": client,
    }
    # Written whole, then renamed: a reader (the launcher, `dtnode status`, a test) polling for the file
    # sees no file or the complete one, never an empty or half-written one.
    partial = run_dir / f".node.json.{os.getpid()}"
    partial.write_text(json.dumps(identity, indent=2) + "\n")
    os.replace(partial, run_dir / "node.json")
    action = "joined the swarm" if config.network.peers else "started a new swarm"
    if client:  # nobody can dial it, so nobody can join through it either
        print(f"dtnode: joined the swarm {config.run.name!r} as {swarm.peer_id} in client mode (accepts no "
              "connections; join others through a node without --client-mode).", flush=True)  # fmt: skip
        return swarm
    print(
        f"dtnode: {action} {config.run.name!r} as {swarm.peer_id} (gRPC {swarm.grpc_address}).\n"
        "To join it from another machine:\n  "
        + (join_hint or _join_command)(config.run.name, ",".join(multiaddrs)),
        flush=True,
    )
    return swarm
