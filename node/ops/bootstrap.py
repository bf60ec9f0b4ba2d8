"""``dtnode bootstrap``: a DHT peer and nothing else, to keep a swarm discoverable.

A swarm is found through the multiaddrs of its running peers (``dtnode join --peers``). Training
nodes come and go; a bootstrap node is the address that stays: a hivemind DHT peer on a fixed port
of a machine others can dial (a small VM), with no model, no data, no gRPC server and no rounds, as
hivemind's ``hivemind-dht`` is for hivemind. It takes part in the DHT as any peer does (it stores and
serves the records of every run that uses it), prints the multiaddrs to pass to ``--peers`` and runs
until SIGINT or SIGTERM.

With ``--swarm-key-file`` it signs nothing of its own but refuses every record not signed with the
key (``protocol/auth/dht.py``), as a keyed node does, so a closed swarm's records stay its own.
``--dht-announce`` gives the address others dial when it is not the listen address (a port forward);
``--identity-path`` keeps the peer id, and so the multiaddrs, the same across restarts: the address
written into other nodes' start scripts then never changes.
"""

from __future__ import annotations

import logging
import signal
import threading
from datetime import timedelta
from types import FrameType

from node.config import ConfigError, NodeConfig

log = logging.getLogger("dtnode")

BOOTSTRAP_SETTINGS = ("peers", "dht_listen", "dht_announce", "use_relay", "swarm_key_file", "identity_path")
"""The settings ``dtnode bootstrap`` takes (flags, ``DTNODE_*``, TOML): where its DHT peer listens, what
it announces, whom it joins, its key and its identity. Everything else is for training nodes."""

LIVENESS_POLL = timedelta(seconds=1)
"""How often the command checks that its DHT process is still alive."""


def run_bootstrap(config: NodeConfig, stop: threading.Event | None = None) -> int:
    """Start the DHT peer, print how to join through it, serve until ``stop`` is set (SIGINT / SIGTERM
    set it when None); 0 after a requested stop, 1 if the DHT process died. ConfigError (exit 2) for
    settings that cannot work or a DHT that does not start."""
    from node.swarm.setup import dht_config, reachable_first, swarm_key
    from protocol.discovery.dht_node import DhtNode, DhtStartupError

    if not config.network.dht_listen:
        raise ConfigError(
            "--dht-listen must be set, HOST:PORT on a fixed port: the one others put in --peers"
        )
    try:
        settings = dht_config(config)
        key = swarm_key(config)
    except ValueError as error:  # SwarmKeyError too: a missing, open or weak key file
        raise ConfigError(str(error)) from None
    if stop is None:
        stop = _stop_on_signals()
    try:
        node = DhtNode(settings, swarm_key=key)
    except DhtStartupError as error:
        raise ConfigError(str(error)) from None
    try:
        multiaddrs = reachable_first(node.visible_multiaddrs())
        closed = f"closed swarm, key fingerprint {key.fingerprint}" if key is not None else "open swarm"
        print(
            f"dtnode: bootstrap node {node.peer_id} ({closed}); DHT only, it trains nothing.\n"
            f"Join any run through it:\n  dtnode join --name NAME --peers {','.join(multiaddrs)}",
            flush=True,
        )
        while not stop.wait(LIVENESS_POLL.total_seconds()):
            if not node.is_alive():
                log.error("the DHT process of the bootstrap node died; exiting")
                return 1
        log.info("stopping the bootstrap node")
        return 0
    finally:
        node.shutdown()


def _stop_on_signals() -> threading.Event:
    """An event SIGINT and SIGTERM set (the DHT process ignores both; it is stopped by ``shutdown``)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop
