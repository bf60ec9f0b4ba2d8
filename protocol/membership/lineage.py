"""Which global params the swarm follows: the canonical lineage, and who must re-sync to it.

A *lineage* is a ``(round, param_hash)`` pair: peers that hold the same global params after the
same number of outer rounds. DiLoCo (Douillard et al., 2023) only works if every peer of a round
applies the outer step to the *same* global params, so a round only ever groups peers of one
lineage (see ``rounds.py``) and a peer never merges pseudo-gradients computed from other params.
When lineages differ (a network partition let two halves train apart, a peer missed a round, a
peer's state got corrupted) one of them is declared canonical and the others re-sync to it by
fetching a canonical peer's state; nothing is averaged across lineages.

The rule, a deterministic function of the set of live records:

1. group the live peers by ``(round, param_hash)``;
2. the canonical lineage has the most peers;
3. ties: the higher ``round`` (more outer steps done), then the lexicographically smaller
   ``param_hash`` (arbitrary but the same on every peer).

A peer outside the canonical lineage must re-sync; :func:`decide_lineage` lists the canonical
peers to fetch from, in an order that spreads several re-syncing peers over different sources
(rendezvous hashing: each source's rank is a hash of ``(local id, source id)``).

Why a healed partition is back to one lineage within two rounds
---------------------------------------------------------------
Say sides A (4 peers) and B (2 peers) trained apart and the network heals. Once every peer's DHT
view holds every live record (one record refresh), every peer evaluates the rule over the same
multiset of ``(round, param_hash)`` and so names the *same* canonical lineage: A's, because it
has more peers (3 vs 3 would be decided by the higher round, then the smaller hash; the rule
never yields "no winner"). Peers evaluate it when they get ready for a round and on every view
change while forming one (``rounds.py``):

- round 1 after the heal: each B peer finds itself outside the canonical lineage, stops forming
  its round and re-syncs from A's peers (fetching a source's state once the source is out of
  its all-reduce, so it gets A's state after this round). A's peers find themselves canonical
  and go on; proposals are lineage-checked, so no B pseudo-gradient enters A's average.
- round 2: the B peers hold A's ``(round, param_hash)`` and join A's round like any peer.

The decision cannot flip back and forth: re-syncing only *adds* peers to the canonical lineage
and removes them from the others, so the canonical lineage keeps the most peers, and when it
advances a round all its members advance together (they average the same bytes, so they reach
the same new ``param_hash``).

Assumption behind "two": the records a peer decides on are settled. Right after a round the
members publish their new ``(round, param_hash)`` within one DHT store; a decision taken in that
short window may see the lineage split in two (some members already at ``round + 1``) and so
delay a re-sync by one round or, if the split halves are each smaller than the other side, pick
the other side. Either way nothing is merged: every decision only moves peers *into* the lineage
it names, and the next decision, on settled records, is the rule above. The daemon keeps the
window small by publishing its record immediately after every outer step; the inner phase
(minutes) is far longer than a DHT store (about a second).

A round group that formed among a minority (say 2 of 5 peers, the other 3 having missed the
proposal) moves those 2 to a new lineage that has fewer peers than the 3 left behind; the rule
then makes the 2 re-sync back, losing their round but never diverging.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from protocol.membership.records import PeerRecord, SwarmView


@dataclass(frozen=True, order=True)
class Lineage:
    """Global params identified by how many outer rounds they went through and their hash."""

    round: int
    param_hash: str

    @classmethod
    def of(cls, record: PeerRecord) -> Lineage:
        return cls(round=record.round, param_hash=record.param_hash)


@dataclass(frozen=True)
class LineageDecision:
    """The canonical lineage and what it means for the local peer."""

    canonical: Lineage
    num_canonical_peers: int
    local: Lineage
    in_canonical: bool
    sync_sources: tuple[str, ...]
    """Canonical peers to fetch global state from, best first; empty when ``in_canonical``."""


def lineage_sizes(records: Iterable[PeerRecord]) -> Counter[Lineage]:
    """Number of peers per lineage (one record per peer expected, as in a ``SwarmView``)."""
    return Counter(Lineage.of(record) for record in records)


def _rule_order(lineage: Lineage, num_peers: int) -> tuple[int, int, str]:
    """Most peers first, then the higher round, then the smaller hash: a total order, so one winner."""
    return (-num_peers, -lineage.round, lineage.param_hash)


def canonical_lineage(records: Iterable[PeerRecord]) -> tuple[Lineage, int]:
    """The canonical lineage of ``records`` and its number of peers (see the module docstring)."""
    sizes = lineage_sizes(records)
    if not sizes:
        raise ValueError("no records: an empty swarm has no lineage")
    best = min(sizes, key=lambda lineage: _rule_order(lineage, sizes[lineage]))
    return best, sizes[best]


def _ranked(view: SwarmView) -> tuple[tuple[int, str], ...]:
    """The view's lineages, as ``(round, param_hash)``, in the rule's order (once per view)."""
    sizes = view.lineage_sizes()
    return tuple(sorted(sizes, key=lambda held: (-sizes[held], -held[0], held[1])))


def _canonical_in_view(view: SwarmView, local: PeerRecord, *, defer: bool) -> tuple[Lineage, int]:
    """:func:`canonical_lineage` of the view's peers with ``local`` in place of the view's copy of
    it (left out if ``defer`` and there are others), without counting every peer again: that
    changes the view's sizes of at most two lineages (the copy's, one fewer; ``local``'s, one more),
    so the winner is one of those two or the best of the view's ranking that is neither."""
    sizes, ranking = view.lineage_sizes(), view.memo(_ranked)
    changed: dict[tuple[int, str], int] = {}
    own = view.get(local.peer_id)
    if own is not None:
        changed[(own.round, own.param_hash)] = -1
    num_others = len(view) - (own is not None)
    if not (defer and num_others):
        held = (local.round, local.param_hash)
        changed[held] = changed.get(held, 0) + 1
    candidates = [(held, sizes.get(held, 0) + delta) for held, delta in changed.items()]
    unchanged = next((held for held in ranking if held not in changed), None)
    if unchanged is not None:
        candidates.append((unchanged, sizes[unchanged]))
    (round, param_hash), num_peers = min(
        ((held, num_peers) for held, num_peers in candidates if num_peers > 0),
        key=lambda candidate: (-candidate[1], -candidate[0][0], candidate[0][1]),  # _rule_order
    )
    return Lineage(round, param_hash), num_peers


def _rendezvous_rank(local_id: str, source_id: str) -> bytes:
    return hashlib.sha256(f"{local_id}\x00{source_id}".encode()).digest()


def decide_lineage(
    records: Iterable[PeerRecord] | SwarmView, local: PeerRecord, *, defer: bool = False
) -> LineageDecision:
    """Decide the canonical lineage over ``records`` (the live peers) plus ``local``.

    ``local`` replaces the local peer's own record if ``records`` holds one: a peer knows its
    state better than the DHT's copy. The result is a pure function of the records, so peers with
    the same view decide the same. Given a ``SwarmView`` (the same decision as on its ``peers``),
    the lineages' sizes are counted once per view, not on every call.

    ``defer``: the local peer does not count (unless it is alone): a fresh node joining a swarm
    follows the swarm's lineage, even where its own init would win the rule's tie-break (two nodes
    at round 0 on different inits); the swarm's nodes, whose records were there first, never adopt
    a newcomer's init.
    """
    if isinstance(records, SwarmView):
        view = records
        canonical, num_peers = _canonical_in_view(view, local, defer=defer)

        def canonical_peers() -> Iterable[PeerRecord]:
            return view.of_lineage(canonical.round, canonical.param_hash).records

    else:
        by_id = {record.peer_id: record for record in records}
        by_id[local.peer_id] = local
        others = [record for record in by_id.values() if record.peer_id != local.peer_id]
        canonical, num_peers = canonical_lineage(others if defer and others else by_id.values())

        def canonical_peers() -> Iterable[PeerRecord]:
            return (record for record in by_id.values() if Lineage.of(record) == canonical)

    local_lineage = Lineage.of(local)
    in_canonical = local_lineage == canonical
    sources: tuple[str, ...] = ()
    if not in_canonical:
        # (a client-mode peer serves no state: it accepts no connections; ``local`` is not canonical,
        # and the view's copy of it, which may be, does not count)
        canonical_ids = [
            record.peer_id
            for record in canonical_peers()
            if record.peer_id != local.peer_id and not record.client
        ]
        canonical_ids.sort(key=lambda peer_id: (_rendezvous_rank(local.peer_id, peer_id), peer_id))
        sources = tuple(canonical_ids)
    return LineageDecision(
        canonical=canonical,
        num_canonical_peers=num_peers,
        local=local_lineage,
        in_canonical=in_canonical,
        sync_sources=sources,
    )
