"""``--identity-path``: a key file made on first start (mode 0600) gives the same peer id after restarts."""

from __future__ import annotations

import socket
import stat
from datetime import timedelta
from pathlib import Path

import pytest

from protocol.discovery.dht_node import DhtConfig, DhtNode, DhtStartupError
from protocol.discovery.identity import IdentityFileError, check_identity_path, ensure_identity


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_key_is_made_once_with_mode_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "identity.key"  # the folder is made too
    peer_id, created = ensure_identity(path)
    assert created and peer_id.startswith(("Qm", "12D3"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created_again = ensure_identity(path)
    assert (again, created_again) == (peer_id, False)
    other, _ = ensure_identity(tmp_path / "other.key")
    assert other != peer_id  # a new file is a new key


def test_unusable_identity_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    ensure_identity(path)
    path.chmod(0o644)
    with pytest.raises(IdentityFileError, match="chmod 600"):
        check_identity_path(path)
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"not a key")
    garbage.chmod(0o600)
    with pytest.raises(IdentityFileError, match="not a libp2p private key"):
        check_identity_path(garbage)
    with pytest.raises(IdentityFileError, match="is a folder"):
        check_identity_path(tmp_path)
    with pytest.raises(ValueError, match="chmod 600"):  # DhtConfig checks it before any start
        DhtConfig(identity_path=str(path))
    check_identity_path(tmp_path / "absent.key")  # made at start: fine


@pytest.mark.timeout(120)
def test_a_restarted_node_keeps_its_peer_id_and_multiaddr(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    port = free_port()
    config = DhtConfig(listen=f"127.0.0.1:{port}", identity_path=str(path))
    with DhtNode(config) as first:
        peer_id, multiaddrs = first.peer_id, first.visible_multiaddrs()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert peer_id == ensure_identity(path)[0]  # the daemon runs as the key in the file
    with DhtNode(config) as restarted:
        assert restarted.peer_id == peer_id
        assert restarted.visible_multiaddrs() == multiaddrs == [f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id}"]
    with DhtNode(DhtConfig(listen="127.0.0.1:0")) as anonymous:  # without a path: a new id each start
        assert anonymous.peer_id != peer_id


@pytest.mark.timeout(120)
def test_a_joiner_restarted_with_its_identity_rejoins_as_the_same_peer(tmp_path: Path) -> None:
    path = tmp_path / "joiner.key"
    with DhtNode(DhtConfig(listen="127.0.0.1:0")) as bootstrap:
        joiner_config = DhtConfig(
            listen="127.0.0.1:0",
            initial_peers=tuple(bootstrap.visible_multiaddrs()),
            identity_path=str(path),
            startup_timeout=timedelta(seconds=30),
        )
        with DhtNode(joiner_config) as joiner:
            peer_id = joiner.peer_id
        # On restart hivemind asks the swarm whether a live peer holds this identity; none does.
        with DhtNode(joiner_config) as rejoined:
            assert rejoined.peer_id == peer_id
            assert rejoined.reconnect([bootstrap.peer_id]) == 1
            # Two live peers with one identity: the second start is refused.
            with pytest.raises(DhtStartupError):
                DhtNode(joiner_config)
