"""Swarm-key signatures on DHT records: keyed peers store only records a key holder wrote.

hivemind lets a DHT peer sign every value it stores and check every record it is asked to store or
is handed back by another peer (``RecordValidatorBase``). :class:`SwarmKeyValidator` appends

    tag = HMAC-SHA256(k_dht, key | subkey | expiration_time | value)

(``k_dht = SwarmKey.derive("dht")``) to each value and accepts a record only with the right tag, so
a peer without the key can neither announce itself to keyed peers (its peer records are refused
on store and dropped on read) nor overwrite or extend the lifetime of a keyed peer's record. The
expiration time is under the tag, so a captured record cannot be re-published to live longer.

Not covered: a record keeps its tag for its whole TTL, so it can be re-stored unchanged until it
expires; values are authenticated, not encrypted (keyless peers on the same DHT can read them, as
the signed bytes do not decode as a plain value; they see addresses, not secrets).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Final

from hivemind.dht.validation import DHTRecord, RecordValidatorBase

from protocol.auth.key import SwarmKey

_TAG_BYTES: Final = 32
_MARKER: Final = b"dtnode-mac1"


class SwarmKeyValidator(RecordValidatorBase):
    """Signs records with the swarm key and accepts only records signed with it."""

    def __init__(self, key: SwarmKey) -> None:
        self._subkey = key.derive("dht")

    def _tag(self, record: DHTRecord, value: bytes) -> bytes:
        header = struct.pack(
            ">III d", len(record.key), len(record.subkey), len(value), record.expiration_time
        )
        message = header + record.key + record.subkey + value
        return hmac.new(self._subkey, message, hashlib.sha256).digest()

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + _MARKER + self._tag(record, record.value)

    def validate(self, record: DHTRecord) -> bool:
        value, marker, tag = _split(record.value)
        return marker == _MARKER and hmac.compare_digest(tag, self._tag(record, value))

    def strip_value(self, record: DHTRecord) -> bytes:
        return _split(record.value)[0]

    @property
    def priority(self) -> int:
        return 10  # sign last, check first: the tag covers what every other validator added

    def __getstate__(self) -> dict[str, bytes]:
        return {"_subkey": self._subkey}  # the DHT process gets the subkey, never the swarm key

    def __setstate__(self, state: dict[str, bytes]) -> None:
        self._subkey = state["_subkey"]


def _split(value: bytes) -> tuple[bytes, bytes, bytes]:
    """(value, marker, tag) of a signed value; a value too short to hold them gives an empty marker."""
    cut = len(value) - _TAG_BYTES - len(_MARKER)
    if cut < 0:
        return value, b"", b""
    return value[:cut], value[cut : cut + len(_MARKER)], value[cut + len(_MARKER) :]
