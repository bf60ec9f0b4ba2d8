"""What a simulated run did, per round: the recorder the nodes report to, and the figures it makes.

Per round r (the r-th outer round of a lineage):

- ``formation_seconds``: from a node's ``RoundFormation`` start to its ``StartAllReduce`` (median,
  max over the nodes that got into a group);
- ``groups`` and ``group_sizes``: the groups whose all-reduce ran, with their contributors;
  ``split_groups`` = groups beyond the first among those formed from one lineage (the protocol
  split it), ``other_lineage_groups`` = groups formed from lineages other than the largest group's
  (nodes that stepped alone or a partition's side, which the lineage rule re-syncs later);
- ``participation``: of the *live* nodes, those up (not crashed, frozen or gone) from the first
  formation start of the round to its last group's end and holding the swarm's state before it
  began, the share that averaged in a group of the round (a node partitioned away counts as live);
- ``bytes_sent``: the byte formula's bytes per contributing node (``allreduce_cost.py``);
- ``max_peers_per_node``: the most other nodes one node exchanged with in the round's all-reduce
  (a flat group's size - 1; a tiered one's group and column, ``allreduce_cost.round_cost``);
- ``compute_utilization``: training seconds over wall seconds, summed over the nodes whose round r
  ended (averaged, fell back, adopted), each from its previous round's end;
- ``fell_back``: groups whose all-reduce had no live strict majority (members listed, members locked);
- ``leader``: the biggest group's leader: its uplink (Mbit/s: it sends every member a proposal and
  a Begin, each listing every member), membership messages it received and bytes it sent while
  forming, and how long its Begins took to reach the last member that locked
  (``last_lock - first_lock``; a Begin cut by the send deadline never arrives, so a cut fan-out
  shows as at most that deadline: read it with ``messages_expired``);
- ``messages_expired``: membership messages of the round that were not sent by the driver's
  deadline (``links.py``), any sender's.

Over the run, ``by_speed``: per third of the speed range, the share of its nodes' wall time spent
forming rounds (waiting for the others) and their compute utilization (``RunRecorder.by_speed``).

``summary_line`` is one line for a terminal; ``to_json`` is deterministic for a seed (no wall time).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from scripts.sim.groups import GroupReport


@dataclass
class Formed:
    peer_id: str
    outcome: str
    started: float
    seconds: float
    messages_in: int
    bytes_out: int


@dataclass
class RunRecorder:
    """Collects what nodes and groups report (implements ``node.Recorder``)."""

    formations: dict[int, list[Formed]] = field(default_factory=lambda: defaultdict(list))
    groups: dict[int, list[GroupReport]] = field(default_factory=lambda: defaultdict(list))
    round_ends: dict[int, list[tuple[str, str, float, float]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    averaged_by: dict[int, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))
    downtime: dict[str, list[list[float]]] = field(default_factory=dict)  # peer -> [[down, up], ...]
    state_since: dict[str, float] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    host: dict[int, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    """Round -> peer -> host seconds its RoundFormation calls took (wall clock: not in the JSON)."""
    uplinks_mbit: dict[str, float] = field(default_factory=dict)
    """Peer -> its uplink in Mbit/s, as drawn when it was added."""
    speeds: dict[str, float] = field(default_factory=dict)
    """Peer -> its compute speed (1x = ``phase_seconds`` a phase), as drawn when it was added."""

    def formed(
        self,
        peer_id: str,
        round: int,
        outcome: str,
        started: float,
        seconds: float,
        messages_in: int,
        bytes_out: int,
    ) -> None:
        self.formations[round].append(Formed(peer_id, outcome, started, seconds, messages_in, bytes_out))

    def round_end(
        self, peer_id: str, round: int, how: str, compute_seconds: float, wall_seconds: float
    ) -> None:
        self.round_ends[round].append((peer_id, how, compute_seconds, wall_seconds))

    def averaged(self, peer_id: str, round: int, bytes_sent: int) -> None:
        self.averaged_by[round][peer_id] = bytes_sent

    def up(self, peer_id: str, now: float) -> None:
        spans = self.downtime.setdefault(peer_id, [[-1.0, now]])  # not there before it started
        if spans[-1][1] == float("inf"):
            spans[-1][1] = now

    def down(self, peer_id: str, now: float) -> None:
        self.downtime.setdefault(peer_id, []).append([now, float("inf")])

    def holds_state(self, peer_id: str, now: float) -> None:
        self.state_since.setdefault(peer_id, now)

    def error(self, peer_id: str, round: int, what: str) -> None:
        if len(self.errors) < 20:
            self.errors.append({"peer_id": peer_id, "round": round, "error": what})

    def host_seconds(self, peer_id: str, round: int, seconds: float) -> None:
        by_peer = self.host[round]
        by_peer[peer_id] = by_peer.get(peer_id, 0.0) + seconds

    def host_line(self, index: int) -> str:
        """How long the product's formation code ran on this host for round ``index``: the biggest
        group's leader, the busiest node, all nodes (measured, so not part of the JSON)."""
        by_peer = self.host.get(index, {})
        groups = sorted(self.groups.get(index, []), key=lambda g: (-len(g.contributors), g.group_id))
        leader = by_peer.get(groups[0].leader_id, 0.0) if groups else 0.0
        busiest = max(by_peer.values(), default=0.0)
        return (
            f"round {index}: host CPU in RoundFormation calls: leader {leader:.3f}s, busiest node "
            f"{busiest:.3f}s, all nodes {sum(by_peer.values()):.2f}s"
        )

    def count_fault(self, kind: str) -> None:
        self.faults[kind] += 1

    def group_done(self, report: GroupReport) -> None:
        self.groups[report.round].append(report)

    # --- figures ---

    def _up_throughout(self, peer_id: str, start: float, end: float) -> bool:
        return not any(down < end and up > start for down, up in self.downtime.get(peer_id, []))

    def round_figures(self, index: int) -> dict[str, Any]:
        formations = self.formations.get(index, [])
        groups = sorted(self.groups.get(index, []), key=lambda g: (-len(g.contributors), g.group_id))
        ran = [g for g in groups if g.averaged]
        in_group = [f.seconds for f in formations if f.outcome == "group"]
        start = min((f.started for f in formations), default=0.0)
        end = max((g.end for g in groups), default=start)
        live = [
            peer_id
            for peer_id, since in self.state_since.items()
            if since <= start and self._up_throughout(peer_id, start, end)
        ]
        averaged = self.averaged_by.get(index, {})
        num_averaged_live = sum(1 for peer_id in live if peer_id in averaged)
        bytes_sent = list(averaged.values())
        ends = self.round_ends.get(index, [])
        compute = sum(e[2] for e in ends)
        wall = sum(e[3] for e in ends)
        leader: dict[str, Any] = {}
        if groups:
            biggest = groups[0]
            own = [f for f in formations if f.peer_id == biggest.leader_id and f.outcome == "group"]
            leader = {
                "peer_id": biggest.leader_id,
                "uplink_mbit": round_(self.uplinks_mbit.get(biggest.leader_id, 0.0)),
                "messages_in": own[0].messages_in if own else None,
                "bytes_out": own[0].bytes_out if own else None,
                "begin_fanout_seconds": round_(biggest.last_lock - biggest.first_lock),
            }
        outcomes = Counter(f.outcome for f in formations)
        return {
            "round": index,
            "formation_seconds_median": round_(statistics.median(in_group)) if in_group else None,
            "formation_seconds_max": round_(max(in_group)) if in_group else None,
            "groups": len(ran),
            "group_sizes": [len(g.contributors) for g in ran],
            "groups_fell_back": len(groups) - len(ran),
            "fell_back": [{"listed": g.num_listed, "locked": g.num_locked} for g in groups if not g.averaged],
            "split_groups": len(ran) - len({g.parent for g in ran}),
            "other_lineage_groups": len({g.parent for g in ran}) - 1 if ran else 0,
            "live_nodes": len(live),
            "live_averaged": num_averaged_live,
            "participation": round_(num_averaged_live / len(live)) if live else None,
            "outcomes": dict(sorted(outcomes.items())),
            "bytes_sent_mean": round(statistics.fmean(bytes_sent)) if bytes_sent else None,
            "bytes_sent_max": max(bytes_sent) if bytes_sent else None,
            "allreduce_seconds": round_(max((g.allreduce_seconds for g in ran), default=0.0)),
            "max_peers_per_node": max((g.max_peers for g in ran), default=0),
            "compute_utilization": round_(compute / wall) if wall > 0 else None,
            "leader": leader,
            "started_at": round_(start),
            "ended_at": round_(end),
        }

    def rounds(self) -> list[int]:
        return sorted(set(self.groups) | set(self.formations))

    def by_speed(self, last: int, speed_min: float, speed_max: float, bands: int = 3) -> list[dict[str, Any]]:
        """Per band of speeds (``bands`` equal slices of [speed_min, speed_max], slowest first), over
        rounds 1..``last``: the share of its nodes' wall time spent forming rounds (from the phase's end
        to the group's start, or to learning that the round was missed: the wait for the others,
        issue 33's "fast nodes blocked"), and their compute utilization (training / wall). Wall time
        is that of their round records, each from their previous round's end."""
        width = (speed_max - speed_min) / bands or 1.0

        def band(peer_id: str) -> int:
            return min(int((self.speeds.get(peer_id, speed_min) - speed_min) / width), bands - 1)

        forming, compute, wall = [0.0] * bands, [0.0] * bands, [0.0] * bands
        nodes: list[set[str]] = [set() for _ in range(bands)]
        for index in range(1, last + 1):
            for formed in self.formations.get(index, []):
                forming[band(formed.peer_id)] += formed.seconds
            for peer_id, _, trained, seconds in self.round_ends.get(index, []):
                b = band(peer_id)
                compute[b] += trained
                wall[b] += seconds
                nodes[b].add(peer_id)
        return [
            {
                "speeds": [round_(speed_min + b * width), round_(speed_min + (b + 1) * width)],
                "nodes": len(nodes[b]),
                "formation_share": round_(forming[b] / wall[b]) if wall[b] > 0 else None,
                "compute_utilization": round_(compute[b] / wall[b]) if wall[b] > 0 else None,
            }
            for b in range(bands)
        ]


def round_(value: float) -> float:
    """Figures to a millisecond / a thousandth, so the JSON reads well and compares exactly."""
    return round(value, 3)


def totals(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's figures over its rounds."""
    live = sum(r["live_nodes"] for r in rounds)
    averaged = sum(r["live_averaged"] for r in rounds)
    utilizations = [r["compute_utilization"] for r in rounds if r["compute_utilization"] is not None]
    return {
        "rounds": len(rounds),
        "split_groups": sum(r["split_groups"] for r in rounds),
        "other_lineage_groups": sum(r["other_lineage_groups"] for r in rounds),
        "live_node_rounds": live,
        "live_node_rounds_averaged": averaged,
        "participation": round_(averaged / live) if live else None,
        "compute_utilization_mean": round_(statistics.fmean(utilizations)) if utilizations else None,
        "max_peers_per_node": max((r["max_peers_per_node"] for r in rounds), default=0),
    }


def summary_line(result: dict[str, Any]) -> str:
    t = result["totals"]
    rounds = result["rounds"]
    formation = [r["formation_seconds_max"] for r in rounds if r["formation_seconds_max"] is not None]
    sizes = [max(r["group_sizes"], default=0) for r in rounds]
    return (
        f"swarm_sim: {result['settings']['num_nodes']} nodes, {t['rounds']} rounds, seed {result['settings']['seed']}: "
        f"participation {t['participation']}, split groups {t['split_groups']}, "
        f"groups on other lineages {t['other_lineage_groups']}, "
        f"largest group {max(sizes, default=0)}, peers per node max {t['max_peers_per_node']}, "
        f"formation max {max(formation, default=0.0):.1f}s, "
        f"utilization {t['compute_utilization_mean']}, lineages at end {result['end']['lineages']} "
        f"(forked {result['end']['forked_lineages']}, nodes on their own Δ {result['end']['own_delta_nodes']}, "
        f"behind {result['end']['behind_nodes']}), "
        f"simulated {result['end']['simulated_seconds']:.0f}s"
    )
