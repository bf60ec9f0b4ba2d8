"""DHT peers for nodes behind NAT: a client-mode peer (answers no DHT request, listens on no port) and
relays on."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from protocol.discovery.dht_node import DhtConfig, DhtNode
from tests.scripts.processes import listening_tcp_sockets

TIMEOUT = timedelta(seconds=10)


def process_tree(pid: int | None) -> list[int]:
    """``pid`` and its children (the DHT process and its p2p daemon)."""
    assert pid is not None
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(int(child) for child in children)]


def test_a_client_cannot_start_a_swarm_and_relays_are_off_unless_asked() -> None:
    with pytest.raises(ValueError, match="needs initial_peers"):
        DhtConfig(client_mode=True)
    kwargs = DhtConfig().hivemind_kwargs()
    assert (
        kwargs["use_relay"] is False and kwargs["use_auto_relay"] is False and kwargs["client_mode"] is False
    )
    relayed = DhtConfig(use_relay=True).hivemind_kwargs()
    assert relayed["use_relay"] is True and relayed["use_auto_relay"] is True
    assert relayed["force_reachability"] is None  # auto-relay acts only once AutoNAT says "private"


@pytest.mark.timeout(60)
def test_a_client_peer_stores_and_reads_through_a_full_peer_and_relays_start() -> None:
    with DhtNode(DhtConfig(listen="127.0.0.1:0", use_relay=True)) as server:
        peers = tuple(server.visible_multiaddrs())
        with DhtNode(DhtConfig(listen="127.0.0.1:0", initial_peers=peers, client_mode=True)) as client:
            assert client._dht.client_mode and not server._dht.client_mode
            # The client's DHT process and p2p daemon listen on no port; the server's daemon does.
            assert listening_tcp_sockets(process_tree(client.pid)) == []
            assert listening_tcp_sockets(process_tree(server.pid)) != []
            assert client.visible_multiaddrs() == []
            expires = get_dht_time() + 30
            assert client.store("k", "from the client", expiration_time=expires, subkey="c", timeout=TIMEOUT)
            entry = server.get("k", latest=True, timeout=TIMEOUT)
            assert entry is not None and isinstance(entry.value, dict)
            assert entry.value["c"].value == "from the client"
            assert server.store("k", "from the server", expiration_time=expires, subkey="s", timeout=TIMEOUT)
            seen = client.get("k", latest=True, timeout=TIMEOUT)
            assert seen is not None and isinstance(seen.value, dict) and set(seen.value) == {"c", "s"}
