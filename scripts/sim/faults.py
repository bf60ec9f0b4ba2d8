"""Faults at rates: crashes, freezes, restarts, graceful leaves, joins, and one partition that heals.

Every nominal round (``phase_seconds``) the injector draws, from the run's seed, how many of the
live nodes crash, freeze and leave (binomial, each node with the rate's probability) and how many
fresh nodes join (binomial over the initial swarm's size), and spreads those events uniformly over
the next nominal round. A crashed node starts again ``restart_after`` seconds later (0: never) from
its last state. A partition splits the nodes in two at ``partition_at`` (the smaller side holds
``partition_fraction`` of the nodes, drawn at random): messages across it are lost and each side
has its own DHT, until it heals ``partition_seconds`` later.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from scripts.sim.node import NodeState, SimNode, World
from scripts.sim.settings import FaultRates


class FaultInjector:
    """Schedules the faults of ``rates`` on ``world`` (see the module docstring)."""

    def __init__(
        self,
        world: World,
        rates: FaultRates,
        *,
        rng: random.Random,
        period: float,
        initial_size: int,
        new_node: Callable[[], SimNode],
        count: Callable[[str], None],
    ) -> None:
        self.world = world
        self.rates = rates
        self.rng = rng
        self.period = period
        self.initial_size = initial_size
        self.new_node = new_node
        self.count = count

    def start(self) -> None:
        queue = self.world.queue
        if any((self.rates.crash, self.rates.freeze, self.rates.leave, self.rates.join)):
            queue.after(self.period, self._draw)
        if self.rates.partition_at > 0:
            queue.at(self.rates.partition_at, self._split)

    def _live(self) -> list[SimNode]:
        return [
            node for node in self.world.nodes.values() if node.is_up() and node.state is not NodeState.OFF
        ]

    def _binomial(self, n: int, p: float) -> int:
        return sum(1 for _ in range(n) if self.rng.random() < p)

    def _draw(self) -> None:
        queue, rates = self.world.queue, self.rates
        live = self._live()
        for kind, rate in (("crash", rates.crash), ("freeze", rates.freeze), ("leave", rates.leave)):
            victims = self.rng.sample(live, min(self._binomial(len(live), rate), len(live)))
            for node in victims:
                queue.after(self.rng.uniform(0, self.period), functools.partial(self._hit, node, kind))
        for _ in range(self._binomial(self.initial_size, rates.join)):
            queue.after(self.rng.uniform(0, self.period), self._join)
        queue.after(self.period, self._draw)

    def _hit(self, node: SimNode, kind: str) -> None:
        if not node.is_up():
            return
        self.count(kind)
        if kind == "crash":
            node.crash()
            if self.rates.restart_after > 0:
                self.world.queue.after(self.rates.restart_after, lambda: self._restart(node))
        elif kind == "freeze":
            node.freeze(self.rates.freeze_seconds)
        else:
            node.leave()

    def _restart(self, node: SimNode) -> None:
        if not node.alive:
            self.count("restart")
            node.start(node.lineage, delay=5.0)  # the daemon's start-up: model, data, DHT bootstrap

    def _join(self) -> None:
        self.count("join")
        self.new_node().start(None, delay=5.0)

    def _split(self) -> None:
        self.count("partition")
        ids = sorted(self.world.nodes)
        small = set(self.rng.sample(ids, round(len(ids) * self.rates.partition_fraction)))
        side_of = {peer_id: 1 for peer_id in ids if peer_id in small}
        self.world.network.side_of = dict(side_of)
        self.world.dht.split(side_of, 2, self.world.queue.now)
        self.world.queue.after(self.rates.partition_seconds, self._heal)

    def _heal(self) -> None:
        self.count("heal")
        self.world.network.side_of = {}
        self.world.dht.heal(self.world.queue.now)
