"""What one simulated swarm is: its size, the product's own settings, and the world's distributions.

The swarm's protocol settings are never restated here: :func:`daemon_swarm_config` builds the
``SwarmConfig`` the daemon would run with, through the daemon's own builder
(``node.swarm.setup.swarm_config`` from a ``NodeConfig``), so the simulated nodes form rounds with
the same ``RoundConfig``, record TTL, heartbeat, view refresh, codec and stall timeout as
``dtnode join`` with the same flags.

The world's distributions (each draw from the run's seed, documented where it is made):

- compute speed: uniform in ``[speed_min, speed_max]`` (1x-4x), a node's inner phase lasting
  ``phase_seconds / speed`` (a fixed H), or ``round_seconds`` for every node (``--round-seconds``:
  rounds due by time, each node's tokens in proportion to its speed);
- access link: uplink = downlink, log-uniform in ``[link_mbit_min, link_mbit_max]`` Mbit/s (10 Mbit/s
  to 1 Gbit/s spans home DSL to a datacenter port evenly in orders of magnitude); one-way latency to
  the core uniform in ``[latency_ms_min, latency_ms_max]``, a pair's latency the sum of both ends';
- DHT: a stored record becomes visible to readers after a delay uniform in ``[dht_delay_min,
  dht_delay_max]`` seconds, or is lost with probability ``dht_loss``; readers see the DHT as it was
  at the last ``dht_epoch`` boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from node.config import NodeConfig
from node.swarm.setup import swarm_config
from protocol.swarm.config import SwarmConfig


@dataclass(frozen=True, kw_only=True)
class FaultRates:
    """How often things go wrong, per node and per nominal round (``phase_seconds``)."""

    crash: float = 0.0
    """Fraction of live nodes that crash (stop without a tombstone) per nominal round."""
    restart_after: float = 0.0
    """Seconds after which a crashed node starts again from its last state; 0: it never does."""
    freeze: float = 0.0
    """Fraction of live nodes that freeze (no heartbeat, no answer) per nominal round."""
    freeze_seconds: float = 30.0
    """How long a freeze lasts."""
    leave: float = 0.0
    """Fraction of live nodes that leave gracefully (a tombstone) per nominal round."""
    join: float = 0.0
    """New nodes per nominal round, as a fraction of the initial swarm (fresh, fetching the state)."""
    partition_at: float = 0.0
    """Simulated second at which the swarm splits in two (0: never)."""
    partition_seconds: float = 120.0
    """How long the partition lasts before it heals."""
    partition_fraction: float = 0.3
    """Share of the nodes on the smaller side."""

    def __post_init__(self) -> None:
        for name in ("crash", "freeze", "leave", "join", "partition_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("restart_after", "freeze_seconds", "partition_at", "partition_seconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    """One simulated run (see the module docstring for the distributions)."""

    num_nodes: int = 8
    """Nodes at the start (all hold the same round-0 state)."""
    num_rounds: int = 5
    """The run ends once a group of this round averaged (or at ``max_seconds``)."""
    seed: int = 0
    """Every random draw of the run comes from this."""
    num_params: int = 100_000_000
    """Length of the pseudo-gradient vector (fp32 numbers); state = 8 bytes per number."""
    codec: str = "int8"
    """The wire codec (``protocol.codecs``), as ``--codec``."""
    phase_seconds: float = 120.0
    """An inner phase (H steps) at speed 1x."""
    round_seconds: float = 0.0
    """``--round-seconds`` of the daemon: every node's phase lasts this long, whatever its speed; 0:
    H steps, ``phase_seconds / speed``."""
    speed_min: float = 1.0
    speed_max: float = 4.0
    link_mbit_min: float = 10.0
    link_mbit_max: float = 1000.0
    latency_ms_min: float = 5.0
    latency_ms_max: float = 50.0
    dht_delay_min: float = 0.2
    dht_delay_max: float = 1.5
    dht_loss: float = 0.02
    dht_epoch: float = 0.25
    faults: FaultRates = field(default_factory=FaultRates)
    join_window: float = 15.0
    """``--join-window`` (the daemon's default)."""
    max_wait: float = 120.0
    """``--max-wait`` (the daemon's default)."""
    max_seconds: float = 0.0
    """Simulated seconds after which the run stops whatever happened; 0: from the rounds asked."""
    tier_group_size: int = 0
    """``--tier-group-size`` of the daemon: a group of more nodes runs its all-reduce tiered; 0: flat."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.num_rounds < 1 or self.num_params < 1:
            raise ValueError("num_nodes, num_rounds and num_params must be >= 1")
        if not 0 < self.speed_min <= self.speed_max:
            raise ValueError("need 0 < speed_min <= speed_max")
        if not 0 < self.link_mbit_min <= self.link_mbit_max:
            raise ValueError("need 0 < link_mbit_min <= link_mbit_max")
        if not 0 <= self.latency_ms_min <= self.latency_ms_max:
            raise ValueError("need 0 <= latency_ms_min <= latency_ms_max")
        if not 0 <= self.dht_delay_min <= self.dht_delay_max or not 0 <= self.dht_loss < 1:
            raise ValueError("need 0 <= dht_delay_min <= dht_delay_max and 0 <= dht_loss < 1")
        if self.phase_seconds <= 0 or self.dht_epoch <= 0:
            raise ValueError("phase_seconds and dht_epoch must be positive")
        if self.round_seconds < 0:
            raise ValueError(f"round_seconds must be >= 0, got {self.round_seconds}")

    def phase_seconds_at(self, speed: float) -> float:
        """How long a node of ``speed`` trains an inner phase."""
        return self.round_seconds if self.round_seconds > 0 else self.phase_seconds / speed

    @property
    def stop_after(self) -> float:
        """Simulated seconds the run may last at most."""
        if self.max_seconds > 0:
            return self.max_seconds
        slowest = self.phase_seconds_at(self.speed_min)
        return self.num_rounds * 3 * (slowest + self.max_wait + 300.0) + 600.0


def daemon_node_config(settings: SimSettings) -> NodeConfig:
    """The ``NodeConfig`` of ``dtnode join --codec ... --join-window ... --max-wait ...
    [--round-seconds ...] [--tier-group-size ...]``."""
    by_time = {"round_seconds": settings.round_seconds} if settings.round_seconds > 0 else {}
    tiers = {"tier_group_size": settings.tier_group_size} if settings.tier_group_size > 0 else {}
    return NodeConfig.from_flat(
        codec=settings.codec, join_window=settings.join_window, max_wait=settings.max_wait, **by_time, **tiers
    )


def daemon_swarm_config(settings: SimSettings) -> SwarmConfig:
    """The ``SwarmConfig`` the daemon builds from :func:`daemon_node_config` (its own builder)."""
    return swarm_config(daemon_node_config(settings))
