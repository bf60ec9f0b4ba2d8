"""A DHT peer's libp2p identity kept in a file, so that its peer id survives a restart.

A libp2p peer id is the hash of the peer's public key, and the multiaddr others pass to
``--peers`` ends in it (``/ip4/…/tcp/7001/p2p/<peer id>``). hivemind's p2p daemon draws a new key
at every start unless it is given a key file (``identity_path``). ``--identity-path FILE``:

- the first start writes a new RSA key there (libp2p's ``crypto.pb.PrivateKey`` protobuf, as
  hivemind writes it), created with mode 0600 in one ``open(O_CREAT | O_EXCL)``, so the key is never
  readable by others, not even for a moment, and two nodes racing for one path cannot both write;
- every later start reads it back: the same peer id, and with a fixed ``--dht-listen`` port the
  same multiaddr, so a bootstrap address printed once stays valid.

A key file others may read (group or world bits) is refused, as ssh refuses one: anyone who reads
it can pose as this peer.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.crypto import RSAPrivateKey


class IdentityFileError(ValueError):
    """The identity file cannot be used: unreadable, readable by others, or not a key."""


def create_identity(path: Path) -> None:
    """Write a new key to ``path`` (mode 0600); FileExistsError if the file exists."""
    key = RSAPrivateKey()
    payload = crypto_pb2.PrivateKey(key_type=crypto_pb2.KeyType.RSA, data=key.to_bytes()).SerializeToString()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(payload)
        file.flush()
        os.fsync(file.fileno())


def identity_peer_id(path: Path) -> str:
    """The peer id of the key in ``path``; IdentityFileError if it is not usable."""
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as error:
        raise IdentityFileError(f"cannot read the identity file {path}: {error.strerror}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise IdentityFileError(
            f"the identity file {path} is open to other users (mode {stat.filemode(mode)}): chmod 600 {path}"
        )
    try:
        return str(PeerID.from_identity(data).to_base58())
    except Exception as error:  # protobuf or DER errors of any kind: not a key this daemon can use
        raise IdentityFileError(f"{path} is not a libp2p private key ({type(error).__name__})") from None


def ensure_identity(path: Path) -> tuple[str, bool]:
    """This peer's identity in ``path``, made on first use: (peer id, whether it was just created)."""
    created = False
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            create_identity(path)
            created = True
        except FileExistsError:  # another process made it first: use theirs
            pass
    return identity_peer_id(path), created


def check_identity_path(path: Path) -> None:
    """Without creating anything: ValueError if ``path`` exists but is unusable, or is a folder."""
    if path.is_dir():
        raise IdentityFileError(f"the identity path {path} is a folder; give a file name")
    if path.exists():
        identity_peer_id(path)
