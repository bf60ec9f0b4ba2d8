"""The swarm key: a shared secret whose holders are the members of one swarm.

Every member of a closed swarm is started with the same key file (``--swarm-key-file``). The key
never travels: peers prove they hold it by MACs over what they send (``grpc_auth.py`` for gRPC
calls, ``dht.py`` for DHT records), each made with a subkey derived for that one purpose, so a
MAC of one kind can never be replayed as another.

The file holds at least 32 random bytes, written as hex (``dtnode keygen PATH`` makes one) or raw.
Loading refuses a key that is short or visibly not random (few distinct bytes), and a file that
anyone but its owner can write (they could swap the swarm's key) or that other users can read while
it is writable (a key left open by an editor or a umask: 0644, 0664), with an error that says what
to do. A file readable by all that nobody can write (0444, 0440) is a secret put in place on
purpose, the way Docker mounts its secrets, and is accepted; group read (0640) is too. The secret
is kept out of ``repr``, logs and pickles meant for disk: what is shown is a fingerprint, an HMAC of
the key, which identifies it (two nodes with different fingerprints will refuse each other)
without revealing anything about it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Final

MIN_KEY_BYTES: Final = 32
"""The shortest key accepted: 256 bits, the size of the HMAC-SHA256 key it feeds."""

_MIN_DISTINCT_BYTES: Final = 16
"""32 random bytes have ~30 distinct values; fewer than this is a typed-in or padded key."""

_LABEL_PREFIX: Final = b"dtnode/swarm-key/v1/"


class SwarmKeyError(ValueError):
    """The swarm key file is missing, unreadable, too open, or holds a weak key."""


class SwarmKey:
    """A loaded swarm key; use :meth:`derive` for a purpose-bound subkey, never the raw secret."""

    __slots__ = ("_secret", "fingerprint")

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise SwarmKeyError(
                f"a swarm key needs at least {MIN_KEY_BYTES} random bytes, got {len(secret)}; "
                "make one with `dtnode keygen PATH`"
            )
        if len(set(secret)) < _MIN_DISTINCT_BYTES:
            raise SwarmKeyError(
                "the swarm key does not look random (too few distinct bytes); make one with `dtnode keygen PATH`"
            )
        self._secret = bytes(secret)
        self.fingerprint = self.derive("fingerprint")[:8].hex()
        """A public name of the key, safe to log: peers with different fingerprints refuse each other."""

    @classmethod
    def generate(cls) -> SwarmKey:
        """A fresh key of :data:`MIN_KEY_BYTES` bytes from the OS's CSPRNG."""
        return cls(secrets.token_bytes(MIN_KEY_BYTES))

    @classmethod
    def from_file(cls, path: Path) -> SwarmKey:
        """Load the key in ``path``: hex text (whitespace ignored) or raw bytes; SwarmKeyError if unusable."""
        try:
            mode = path.stat().st_mode
        except OSError as error:
            raise SwarmKeyError(f"cannot read the swarm key file {path}: {error.strerror}") from None
        if not stat.S_ISREG(mode):
            raise SwarmKeyError(f"the swarm key file {path} is not a regular file")
        problem = _open_mode(stat.S_IMODE(mode))
        if problem:
            raise SwarmKeyError(
                f"the swarm key file {path} is {problem} (mode {stat.S_IMODE(mode):o}); run `chmod 600 {path}` "
                "(a read-only file such as a Docker secret, mode 444, is accepted too)"
            )
        try:
            content = path.read_bytes()
        except OSError as error:
            raise SwarmKeyError(f"cannot read the swarm key file {path}: {error.strerror}") from None
        return cls(_decode(content))

    def write(self, path: Path) -> None:
        """Write the key as hex to a new file ``path`` with mode 0600; FileExistsError if it exists."""
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w", encoding="ascii") as file:
            file.write(self._secret.hex() + "\n")

    def derive(self, purpose: str) -> bytes:
        """A 32-byte subkey for one purpose (HMAC-SHA256 of the label, as in HKDF-Expand, RFC 5869)."""
        return hmac.new(self._secret, _LABEL_PREFIX + purpose.encode() + b"\x01", hashlib.sha256).digest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SwarmKey) and hmac.compare_digest(self._secret, other._secret)

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"SwarmKey(fingerprint={self.fingerprint})"


def _open_mode(mode: int) -> str | None:
    """What is wrong with a key file of permission bits ``mode``, as a phrase; None if nothing."""
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by other users"
    if mode & (stat.S_IROTH | stat.S_IXOTH) and mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return "readable by other users and writable"
    return None


def _decode(content: bytes) -> bytes:
    """Hex text if the file is hex (the format keygen writes), else the raw bytes as they are."""
    text = b"".join(content.split())
    if text and len(text) % 2 == 0 and all(char in b"0123456789abcdefABCDEF" for char in text):
        return bytes.fromhex(text.decode("ascii"))
    return content
