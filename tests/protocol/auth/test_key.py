"""Swarm key files, the per-call token check (injected clock) and the DHT record validator; no sockets."""

from __future__ import annotations

import os
import pickle
import stat
from datetime import timedelta
from pathlib import Path

import pytest
from hivemind.dht.validation import DHTRecord

from protocol.auth.dht import SwarmKeyValidator
from protocol.auth.grpc_auth import CallVerifier, ReplayCache, call_token
from protocol.auth.key import MIN_KEY_BYTES, SwarmKey, SwarmKeyError

pytestmark = pytest.mark.timeout(30)

METHOD = "/dtnode.v1.StateSync/GetManifest"
NOW = 1_800_000_000


def test_keygen_file_is_private_and_loads_back(tmp_path: Path) -> None:
    key = SwarmKey.generate()
    path = tmp_path / "swarm.key"
    key.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert SwarmKey.from_file(path) == key
    with pytest.raises(FileExistsError):
        key.write(path)  # never overwrite a key others may already hold
    raw = tmp_path / "raw.key"
    raw.write_bytes(bytes(range(40)))
    raw.chmod(0o600)
    assert SwarmKey.from_file(raw) == SwarmKey(bytes(range(40)))
    assert SwarmKey.from_file(path) != SwarmKey.from_file(raw)


def test_secret_stays_out_of_repr_and_pickled_validator(tmp_path: Path) -> None:
    key = SwarmKey.generate()
    path = tmp_path / "swarm.key"
    key.write(path)
    secret_hex = path.read_text().strip()
    assert secret_hex not in repr(key) and secret_hex not in str(key)
    assert key.fingerprint in repr(key)
    pickled = pickle.dumps(SwarmKeyValidator(key))  # what the forked DHT process receives
    assert bytes.fromhex(secret_hex) not in pickled and secret_hex.encode() not in pickled


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"0123456789abcdef" * 2,
            f"at least {MIN_KEY_BYTES} random bytes, got 16",
        ),  # 32 hex chars = 16 bytes
        (b"correct horse battery staple!!!", "got 31"),
        (b"a" * 64 + b"\n", "does not look random"),  # hex of 32 bytes all 0xaa
        (b"", "got 0"),
    ],
)
def test_weak_keys_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "weak.key"
    path.write_bytes(content)
    path.chmod(0o600)
    with pytest.raises(SwarmKeyError, match=message):
        SwarmKey.from_file(path)


@pytest.mark.parametrize(
    ("mode", "problem"),
    [
        (0o644, "readable by other users and writable"),  # an editor's or a umask's file
        (0o604, "readable by other users and writable"),
        (0o664, "writable by other users"),
        (0o620, "writable by other users"),
        (0o660, "writable by other users"),
        (0o464, "writable by other users"),  # read-only for its owner, but the group may swap the key
    ],
)
def test_open_key_files_are_refused(tmp_path: Path, mode: int, problem: str) -> None:
    path = tmp_path / "open.key"
    SwarmKey.generate().write(path)
    path.chmod(mode)
    with pytest.raises(SwarmKeyError, match=f"{problem} \\(mode {mode:o}\\); run `chmod 600 {path}`"):
        SwarmKey.from_file(path)


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o440, 0o444])
def test_private_or_read_only_key_files_load(tmp_path: Path, mode: int) -> None:
    """0444 is how Docker mounts a secret (/run/secrets/<name>): readable by all, writable by nobody,
    so nobody can swap the key; a file others can read that its owner can still write is refused."""
    path = tmp_path / "secret.key"
    key = SwarmKey.generate()
    key.write(path)
    path.chmod(mode)
    assert SwarmKey.from_file(path) == key


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SwarmKeyError, match="cannot read the swarm key file .*nope.key"):
        SwarmKey.from_file(tmp_path / "nope.key")
    with pytest.raises(SwarmKeyError, match="not a regular file"):
        SwarmKey.from_file(tmp_path)


def verifier(key: SwarmKey, *, max_nonces: int = 100) -> CallVerifier:
    return CallVerifier(key, max_skew=timedelta(seconds=30), max_nonces=max_nonces, clock=lambda: NOW)


def test_token_check_accepts_once_and_names_every_refusal() -> None:
    key, other = SwarmKey.generate(), SwarmKey.generate()
    check = verifier(key)
    token = call_token(key, METHOD, timestamp=NOW - 29, nonce="n1")
    assert check.check(METHOD, token) is None
    assert check.check(METHOD, token) == "replayed token"
    assert check.check(METHOD, None) == "no swarm key presented"
    assert check.check(METHOD, "v1.garbage") == "malformed token"
    assert check.check(METHOD, call_token(other, METHOD, timestamp=NOW, nonce="n2")) == "wrong swarm key"
    # A token is bound to its method: one for Deliver does not open GetManifest.
    assert (
        check.check(METHOD, call_token(key, "/dtnode.v1.Membership/Deliver", timestamp=NOW))
        == "wrong swarm key"
    )
    tampered = call_token(key, METHOD, timestamp=NOW, nonce="n3").replace(f".{NOW}.", f".{NOW + 1}.")
    assert check.check(METHOD, tampered) == "wrong swarm key"
    stale = check.check(METHOD, call_token(key, METHOD, timestamp=NOW - 31, nonce="n4"))
    future = check.check(METHOD, call_token(key, METHOD, timestamp=NOW + 31, nonce="n5"))
    assert stale is not None and "-31 s off our clock" in stale
    assert future is not None and "+31 s off our clock" in future
    assert check.check(METHOD, call_token(key, METHOD, timestamp=NOW, nonce="n6")) is None


def test_full_replay_cache_refuses_what_it_forgot() -> None:
    cache = ReplayCache(max_nonces=3)
    for index, timestamp in enumerate([105, 101, 103]):
        assert cache.admit(f"n{index}", timestamp, oldest_valid=100) is None
    # Full: admitting a fourth forgets the oldest (101), so nothing at or before 101 may pass any more.
    assert cache.admit("n3", 104, oldest_valid=100) is None
    assert len(cache) == 3 and cache.floor == 101
    assert cache.admit("n1", 101, oldest_valid=100) == "token older than the replay cache remembers"
    assert cache.admit("n9", 100, oldest_valid=100) == "token older than the replay cache remembers"
    assert cache.admit("n0", 105, oldest_valid=100) == "replayed token"
    # Nonces that left the window are dropped without raising the floor.
    assert cache.admit("n10", 200, oldest_valid=150) is None
    assert len(cache) == 1 and cache.floor == 101


def record(value: bytes, *, expiration_time: float = 1234.5) -> DHTRecord:
    return DHTRecord(key=b"dtnode/run/peers", subkey=b"peer-a", value=value, expiration_time=expiration_time)


def test_dht_validator_accepts_only_records_signed_with_the_key() -> None:
    validator = SwarmKeyValidator(SwarmKey.generate())
    value = os.urandom(100)
    signed = record(validator.sign_value(record(value)))
    assert validator.validate(signed)
    assert validator.strip_value(signed) == value
    assert not validator.validate(record(value))  # unsigned
    assert not validator.validate(record(b""))
    outsider = SwarmKeyValidator(SwarmKey.generate())
    assert not validator.validate(record(outsider.sign_value(record(value))))
    # The tag covers the expiration time, the value and the subkey: none can be changed.
    assert not validator.validate(record(signed.value, expiration_time=99999.0))
    flipped = bytearray(signed.value)
    flipped[3] ^= 1
    assert not validator.validate(record(bytes(flipped)))
    moved = DHTRecord(
        key=signed.key, subkey=b"peer-b", value=signed.value, expiration_time=signed.expiration_time
    )
    assert not validator.validate(moved)
