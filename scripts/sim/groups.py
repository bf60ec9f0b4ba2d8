"""The all-reduces in flight: a locked group's members, when its round ends, and the params it makes.

A group begins when its members lock into it (``StartAllReduce`` from their own ``RoundFormation``).
The all-reduce is not run: it ends ``allreduce_seconds`` (``allreduce_cost.py``) after its last
member locked. Faults follow the product's all-reduce (ARCHITECTURE.md, "The all-reduce"):

- a member that never locks (it withdrew, crashed, froze) is dropped once no member locked for the
  stall timeout (``AllReduceConfig.stall_timeout``): the others' round ends then;
- a member that dies or freezes after it locked is dropped after the stall timeout as well, once;
- a part commits only with a live, mutually reachable strict majority of the group: the side of a
  partition holding one averages, every other member falls back to its own Δ;
- the members that averaged hold the same new params: their ``param_hash`` is a hash of the parent
  lineage, the group and its contributors (equal inputs, equal hash, as the real bytes are equal).

``LineageTree`` remembers which params came from which (the rounds' means a catch-up steps through).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from protocol.codecs import Codec
from protocol.membership.lineage import Lineage
from protocol.membership.messages import GroupSpec
from scripts.sim.allreduce_cost import MemberTraffic, round_cost
from scripts.sim.events import Event, EventQueue
from scripts.sim.links import Network


def derived_hash(*parts: object) -> str:
    """A param_hash for params made from ``parts`` (64 hex characters, as the product's)."""
    return hashlib.sha256("\x00".join(str(part) for part in parts).encode()).hexdigest()


@dataclass(frozen=True)
class Origin:
    """How params came to be: their parent lineage, and whether a group averaged them."""

    parent: Lineage
    averaged: bool


class LineageTree:
    """Every lineage the run made, and its parent."""

    def __init__(self) -> None:
        self.origins: dict[Lineage, Origin] = {}

    def add(self, lineage: Lineage, origin: Origin) -> None:
        self.origins[lineage] = origin

    def chain(self, lineage: Lineage) -> list[Lineage]:
        """``lineage`` and its ancestors, newest first (back to the run's init or a joiner's fetch)."""
        chain = [lineage]
        while (origin := self.origins.get(chain[-1])) is not None:
            chain.append(origin.parent)
        return chain

    def off_chain(self, held: Lineage, chain: set[Lineage]) -> str:
        """How params ``held`` that are not on ``chain`` (the canonical lineage's ancestry) left it:
        ``"fork"`` if every round since was averaged by a group (a group formed apart from the
        swarm: a split group or a partition's side), ``"own_delta"`` if one of them stepped on its
        node's own Δ (the node re-syncs at its next round's lineage check)."""
        current = held
        while current not in chain:
            origin = self.origins.get(current)
            if origin is None:
                return "fork"  # params from outside the run's tree: nothing leads back
            if not origin.averaged:
                return "own_delta"
            current = origin.parent
        return "fork"

    def means_lead_back(self, newest: Lineage, held: Lineage) -> bool:
        """Whether the rounds' means step from ``held`` to ``newest``: every round between was
        averaged by a group (whose members serve its mean), and the chain reaches ``held``."""
        current = newest
        while current.round > held.round:
            origin = self.origins.get(current)
            if origin is None or not origin.averaged:
                return False
            current = origin.parent
        return current == held


class Member(Protocol):
    """What a group needs of a member node."""

    peer_id: str

    def is_up(self) -> bool: ...

    def allreduce_done(self, group: GroupSpec, lineage: Lineage | None, traffic: MemberTraffic) -> None:
        """The round ended: averaged into ``lineage``, or None (fell back to its own Δ)."""


@dataclass
class GroupRun:
    """One group's all-reduce while it runs."""

    group: GroupSpec
    traffic: list[MemberTraffic]
    seconds: float
    first_lock: float
    locked: dict[str, Member] = field(default_factory=dict)
    lock_times: dict[str, float] = field(default_factory=dict)
    ending: Event | None = None
    penalised: bool = False
    done: bool = False
    max_peers: int = 0


@dataclass(frozen=True)
class GroupReport:
    """What one group's round did (for the report)."""

    round: int
    group_id: str
    leader_id: str
    parent: Lineage
    num_listed: int
    num_locked: int
    contributors: tuple[str, ...]
    averaged: bool
    first_lock: float
    last_lock: float
    end: float
    allreduce_seconds: float
    bytes_sent: tuple[int, ...]
    """Per contributor (the byte formula's, for the group as listed)."""
    max_peers: int = 0
    """The most others one member exchanges with in the round (flat: members - 1; tiered: its group
    and its column)."""


class AllReduces:
    """The groups whose all-reduce runs now (see the module docstring)."""

    def __init__(
        self,
        *,
        queue: EventQueue,
        network: Network,
        codec: Codec,
        chunk_num_elements: int,
        stall_timeout: float,
        lineages: LineageTree,
        on_report: Callable[[GroupReport], None],
    ) -> None:
        self.queue = queue
        self.network = network
        self.codec = codec
        self.chunk_num_elements = chunk_num_elements
        self.stall_timeout = stall_timeout
        self.lineages = lineages
        self.on_report = on_report
        self.runs: dict[str, GroupRun] = {}

    def lock(self, member: Member, group: GroupSpec) -> None:
        """``member`` locked into ``group`` (its StartAllReduce)."""
        now = self.queue.now
        run = self.runs.get(group.group_id)
        if run is None:
            cost = round_cost(group, self.codec, self.chunk_num_elements, self.network)
            run = GroupRun(
                group=group,
                traffic=cost.traffic,
                seconds=cost.seconds,
                first_lock=now,
                max_peers=max(cost.peers),
            )
            self.runs[group.group_id] = run
        assert not run.done, "a member locked into a group whose round is over"
        run.locked[member.peer_id] = member
        run.lock_times[member.peer_id] = now
        if run.ending is not None:
            run.ending.cancel()
        all_locked = len(run.locked) == len(group.members)
        delay = run.seconds if all_locked else self.stall_timeout + run.seconds
        run.ending = self.queue.after(delay, lambda: self._end(run))

    def _end(self, run: GroupRun) -> None:
        now = self.queue.now
        lost = [peer_id for peer_id, member in run.locked.items() if not member.is_up()]
        if lost and not run.penalised:
            run.penalised = True  # the others notice the silent members after the stall timeout
            run.ending = self.queue.after(self.stall_timeout, lambda: self._end(run))
            return
        run.done = True
        del self.runs[run.group.group_id]
        group = run.group
        live = [peer_id for peer_id, member in run.locked.items() if member.is_up()]
        # The strict majority that commits the parts must be live and reachable from one another.
        sides: dict[int, list[str]] = {}
        for peer_id in live:
            sides.setdefault(self.network.side_of.get(peer_id, 0), []).append(peer_id)
        majority = [ids for ids in sides.values() if 2 * len(ids) > len(group.members)]
        contributors = tuple(sorted(majority[0])) if majority else ()
        parent = Lineage(group.round - 1, group.param_hash)
        new = Lineage(
            group.round, derived_hash(parent.round, parent.param_hash, group.group_id, *contributors)
        )
        if contributors:
            self.lineages.add(new, Origin(parent=parent, averaged=True))
        index = {peer_id: i for i, peer_id in enumerate(group.member_ids)}
        self.on_report(
            GroupReport(
                round=group.round,
                group_id=group.group_id,
                leader_id=group.leader_id,
                parent=parent,
                num_listed=len(group.members),
                num_locked=len(run.locked),
                contributors=contributors,
                averaged=bool(contributors),
                first_lock=run.first_lock,
                last_lock=max(run.lock_times.values()),
                end=now,
                allreduce_seconds=run.seconds,
                bytes_sent=tuple(run.traffic[index[peer_id]].sent for peer_id in contributors),
                max_peers=run.max_peers,
            )
        )
        for peer_id, member in run.locked.items():  # a dead one ignores it; a frozen one, once it thaws
            member.allreduce_done(
                group, new if peer_id in contributors else None, run.traffic[index[peer_id]]
            )
