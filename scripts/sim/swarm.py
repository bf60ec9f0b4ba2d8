"""A simulated swarm: the world built from a seed, its nodes started, the run, and what it did.

``simulate(settings)`` draws every node's speed and link from the seed (``settings.py`` documents
the distributions), starts ``num_nodes`` nodes on the run's round-0 params, injects the faults of
``settings.faults`` and runs the event queue until a group of round ``num_rounds`` has averaged and
no node still forms that round (or until ``settings.stop_after``). It returns a JSON-able dict:
the settings, the product settings it ran with, one entry per round (``report.py``), the totals and
the state at the end (how many lineages the live nodes hold).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from protocol.membership.lineage import Lineage
from protocol.swarm.config import PROTOCOL_VERSION
from scripts.sim.dht import SimulatedDht
from scripts.sim.events import EventQueue
from scripts.sim.faults import FaultInjector
from scripts.sim.groups import AllReduces, GroupReport, LineageTree
from scripts.sim.links import LinkProfile, Network
from scripts.sim.node import INIT_HASH, SimNode, World
from scripts.sim.report import RunRecorder, totals
from scripts.sim.settings import SimSettings, daemon_swarm_config

STREAMS = ("speeds", "links", "dht", "faults", "starts")
"""Independent random streams, one per concept, so that (say) a fault rate leaves the links alone."""


class Swarm:
    """The world and its nodes (see the module docstring)."""

    def __init__(self, settings: SimSettings, *, progress: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.progress = progress  # told when a round's first group averaged (the CLI prints it)
        self._rounds_seen = 0
        self.config = daemon_swarm_config(settings)
        self.rngs = {name: random.Random(f"{settings.seed}/{name}") for name in STREAMS}
        self.queue = EventQueue()
        self.recorder = RunRecorder()
        self.network = Network(PROTOCOL_VERSION)
        self.lineages = LineageTree()
        self._round_done_at: float | None = None
        self._short: SimNode | None = None  # an up node short of the last round, when last asked
        self.allreduces = AllReduces(
            queue=self.queue,
            network=self.network,
            codec=self.config.wire_codec(),
            chunk_num_elements=self.config.allreduce.chunk_num_elements,
            stall_timeout=self.config.allreduce.stall_timeout.total_seconds(),
            lineages=self.lineages,
            on_report=self._group_done,
        )
        self.world = World(
            queue=self.queue,
            dht=SimulatedDht(
                rng=self.rngs["dht"],
                protocol_version=PROTOCOL_VERSION,
                delay=(settings.dht_delay_min, settings.dht_delay_max),
                loss=settings.dht_loss,
                epoch=settings.dht_epoch,
            ),
            network=self.network,
            allreduces=self.allreduces,
            lineages=self.lineages,
            config=self.config,
            settings=settings,
            codec=self.config.wire_codec(),
            recorder=self.recorder,
            nodes={},
        )
        self.faults = FaultInjector(
            self.world,
            settings.faults,
            rng=self.rngs["faults"],
            period=settings.phase_seconds,
            initial_size=settings.num_nodes,
            new_node=self.add_node,
            count=self.recorder.count_fault,
        )

    def add_node(self) -> SimNode:
        """A new node with its speed and link drawn from the seed."""
        s = self.settings
        speeds, links = self.rngs["speeds"], self.rngs["links"]
        index = len(self.world.nodes)
        peer_id = simulated_peer_id(self.settings.seed, index)
        mbit = math.exp(links.uniform(math.log(s.link_mbit_min), math.log(s.link_mbit_max)))
        profile = LinkProfile(
            latency_s=links.uniform(s.latency_ms_min, s.latency_ms_max) / 1000,
            up_bytes_per_s=mbit * 1e6 / 8,
            down_bytes_per_s=mbit * 1e6 / 8,
        )
        self.network.add(peer_id, profile)
        node = SimNode(
            self.world,
            peer_id=peer_id,
            speed=speeds.uniform(s.speed_min, s.speed_max),
            profile=profile,
            heartbeat_offset=self.rngs["starts"].random(),
            address=f"10.{index // 65536}.{index // 256 % 256}.{index % 256}:31337",
        )
        self.world.nodes[peer_id] = node
        self.recorder.speeds[peer_id] = node.speed
        self.recorder.uplinks_mbit[peer_id] = mbit
        return node

    def _group_done(self, report: GroupReport) -> None:
        self.recorder.group_done(report)
        if report.averaged and report.round > self._rounds_seen:
            self._rounds_seen = report.round
            if self.progress is not None:
                self.progress(f"round {report.round} averaged at {self.queue.now:.0f}s simulated")
        if report.averaged and report.round >= self.settings.num_rounds and self._round_done_at is None:
            self._round_done_at = self.queue.now

    def _finished(self) -> bool:
        """A group of the last round averaged, and every up node holding params reached that round
        (or a slowest phase plus ``max_wait`` passed since: some may never, if they keep missing)."""
        if self._round_done_at is None:
            return False
        settings = self.settings
        grace = settings.phase_seconds_at(settings.speed_min) + settings.max_wait
        if self.queue.now >= self._round_done_at + grace:
            return True

        def short(node: SimNode) -> bool:
            return node.is_up() and node.lineage is not None and node.lineage.round < settings.num_rounds

        # Asked after every event: the node found short last time most often still is (O(1)).
        if self._short is not None and short(self._short):
            return False
        self._short = next((node for node in self.world.nodes.values() if short(node)), None)
        return self._short is None

    def start(self) -> None:
        """Create the initial nodes on the round-0 params and schedule the faults (once)."""
        if self.world.nodes:
            return
        start = Lineage(0, INIT_HASH)
        for _ in range(self.settings.num_nodes):
            node = self.add_node()
            node.start(start, delay=self.rngs["starts"].uniform(0.0, 1.0))
            self.recorder.holds_state(node.peer_id, 0.0)
        self.faults.start()

    def run(self) -> dict[str, Any]:
        """Run to the end (``start`` first, if not done: a test may schedule its own faults between)."""
        self.start()
        stop_after = self.settings.stop_after
        with _few_collections():
            while self.queue.now < stop_after and not self._finished():
                self.queue.run_until(min(self.queue.now + 10.0, stop_after), stop=self._finished)
        return self.result()

    def result(self) -> dict[str, Any]:
        last = self.settings.num_rounds
        expired = self.network.expired_by_round
        rounds = [
            {**self.recorder.round_figures(r), "messages_expired": expired.get(r, 0)}
            for r in self.recorder.rounds()
            if r <= last
        ]
        live = [node for node in self.world.nodes.values() if node.is_up() and node.lineage is not None]
        held = Counter(node.lineage for node in live if node.lineage is not None)
        canonical = held.most_common(1)[0] if held else None
        # The other lineages: behind on the canonical chain, a node's own Δ, or a fork (see off_chain).
        chain = set(self.lineages.chain(canonical[0])) if canonical else set()
        kind_of = {
            lineage: "behind" if lineage in chain else self.lineages.off_chain(lineage, chain)
            for lineage in held
            if canonical is not None and lineage != canonical[0]
        }
        kinds = Counter(kind_of.values())
        nodes_of: Counter[str] = Counter()
        for lineage, kind in kind_of.items():
            nodes_of[kind] += held[lineage]
        config = self.config
        return {
            "settings": _plain(dataclasses.asdict(self.settings)),
            "product": {
                "rounds": _plain(dataclasses.asdict(config.rounds)),
                "record_ttl": config.record_ttl.total_seconds(),
                "heartbeat": config.heartbeat.total_seconds(),
                "view_refresh": config.view_refresh.total_seconds(),
                "message_timeout": config.message_timeout.total_seconds(),
                "stall_timeout": config.allreduce.stall_timeout.total_seconds(),
                "chunk_num_elements": config.allreduce.chunk_num_elements,
                "codec": config.codec,
            },
            "rounds": rounds,
            "totals": totals(rounds),
            "by_speed": self.recorder.by_speed(last, self.settings.speed_min, self.settings.speed_max),
            "faults": dict(sorted(self.recorder.faults.items())),
            "errors": self.recorder.errors,
            "end": {
                "simulated_seconds": round(self.queue.now, 3),
                "events": self.queue.num_events_run,
                "live_nodes": len(live),
                "lineages": len(held),
                "canonical_round": canonical[0].round if canonical else None,
                "canonical_nodes": canonical[1] if canonical else 0,
                "forked_lineages": kinds["fork"],
                "forked_nodes": nodes_of["fork"],
                "own_delta_nodes": nodes_of["own_delta"],
                "behind_nodes": nodes_of["behind"],
                "dht_stores": self.world.dht.num_stores,
                "dht_lost": self.world.dht.num_lost,
                "membership_messages": self.network.num_messages,
                "membership_messages_expired": self.network.num_messages_expired,
            },
        }


BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def simulated_peer_id(seed: int, index: int) -> str:
    """A peer id as long as a libp2p Ed25519 one (``12D3KooW`` + 44 base58 characters), so that the
    messages that list peers (a Proposal, a Begin's group) have their real wire size; ordered at
    random, as real ids are (the smallest ready id leads a round)."""
    digest = int.from_bytes(hashlib.sha256(f"{seed}/{index}".encode()).digest(), "big")
    characters = []
    for _ in range(44):
        digest, remainder = divmod(digest, 58)
        characters.append(BASE58[remainder])
    return "12D3KooW" + "".join(characters)


def _plain(value: Any) -> Any:
    """timedeltas as seconds, the rest as is (for JSON)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if hasattr(value, "total_seconds"):
        return value.total_seconds()
    return value


@contextlib.contextmanager
def _few_collections() -> Iterator[None]:
    """The run with the cyclic garbage collector's passes made rare: a run allocates millions of
    short-lived objects (events, records, messages) and makes next to no cyclic garbage, so the
    default passes (every 700 allocations, each scanning the young objects, and the full ones the
    whole heap of a thousand nodes' records) were CPU spent finding nothing. What is allocated is
    the same; only when the collector looks changes (nothing simulated reads it)."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()  # the world built so far lives through the run: no pass scans it again
    gc.set_threshold(100_000, 50, 50)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def simulate(settings: SimSettings) -> dict[str, Any]:
    """Run one simulated swarm; see the module docstring."""
    return Swarm(settings).run()
