"""Deterministic fault injection for a provider: it misbehaves at a counted point, never "after 0.3 s".

A provider counts the GetManifest calls it answers and the chunks it sends (over all its streams).
A `ServeFaultPlan` names a point, a count and an action; the fault fires when the provider is about to
answer manifest number `after` (0-based) or send chunk number `after`:

    abort    that one call ends with UNAVAILABLE; later calls are served normally
    die      that call and every later one end with UNAVAILABLE (the provider is gone)
    stall    that call and every later one hang, sending nothing, until the fetcher gives up
             (a frozen process whose sockets stay open)
    corrupt  at "chunk": that chunk and every later one has its first byte flipped;
             at "manifest": that manifest and every later one advertises a wrong SHA-256 for its
             first tensor (a lying source)
    pause    that call waits until `StateProvider.resume()`, then goes on normally (a test uses
             the pause to change the provider's state at an exact point of a transfer)

Written as "POINT:ACTION[:AFTER]", e.g. "chunk:die:3" or "manifest:stall". Providers in tests can
also await `StateProvider.fault_fired` to act (e.g. stop their server) exactly when the fault fires.
"""

from __future__ import annotations

from dataclasses import dataclass

FAULT_POINTS = ("manifest", "chunk")
FAULT_ACTIONS = ("abort", "die", "stall", "corrupt", "pause")


@dataclass(frozen=True, kw_only=True)
class ServeFaultPlan:
    """Where and how a provider misbehaves."""

    point: str
    """"manifest" (a GetManifest answer) or "chunk" (a chunk of any FetchRange stream)."""
    action: str
    """One of FAULT_ACTIONS."""
    after: int = 0
    """Fire at the provider's manifest or chunk with this 0-based number, counted over all calls."""

    def __post_init__(self) -> None:
        if self.point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; choose one of {FAULT_POINTS}")
        if self.action not in FAULT_ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; choose one of {FAULT_ACTIONS}")
        if self.after < 0:
            raise ValueError(f"after must be >= 0, got {self.after}")

    @property
    def persistent(self) -> bool:
        """Whether the fault, once fired, stays ("die", "stall", "corrupt")."""
        return self.action in ("die", "stall", "corrupt")

    @classmethod
    def parse(cls, spec: str) -> ServeFaultPlan:
        """Parse "POINT:ACTION[:AFTER]"."""
        fields = spec.split(":")
        if len(fields) not in (2, 3):
            raise ValueError(f"fault spec must be POINT:ACTION[:AFTER], got {spec!r}")
        try:
            after = int(fields[2]) if len(fields) == 3 else 0
        except ValueError as error:
            raise ValueError(f"fault spec {spec!r}: AFTER must be an integer") from error
        return cls(point=fields[0], action=fields[1], after=after)


def flip_first_byte(data: bytes) -> bytes:
    """The same bytes with the first one inverted (what a "corrupt" fault sends)."""
    return bytes([data[0] ^ 0xFF]) + data[1:] if data else data
