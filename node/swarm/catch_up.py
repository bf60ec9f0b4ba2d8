"""Catching up with the rounds' means: a node at most a couple of rounds behind the swarm's lineage
steps itself to the swarm's state instead of fetching it whole.

Every member of an averaged round serves the round's mean Δ̄ beside its new state, as the wire
codec's bytes it decoded it from (``swarm_state.round_mean_snapshot``; int8: ~1 byte per parameter,
the whole state is 8). Walking back from the swarm's param_hash, the node fetches each round's mean
until one starts from its own ``(round, param_hash)``, then replays the outer steps forward
(``swarm_state.caught_up_state``), each checked bit for bit against the param_hash and outer
momentum the swarm published. Any gap or mismatch: the caller fetches the whole state.

With ``--fragments`` a round steps one fragment and its members serve that fragment's mean (1/F of
the model's numbers): the node steps each missed round's fragment in turn, in the rounds' order,
each step checked against the whole param_hash and outer momentum the round led to.
"""

from __future__ import annotations

from collections.abc import Iterable

from node.outer.seam import AdoptedState, FragmentStepper, Lineage, OuterStepper, Stepped
from node.swarm.state import caught_up_state, round_mean_id, round_mean_link
from protocol.membership.lineage import LineageDecision
from protocol.membership.records import PeerRecord, SwarmView
from protocol.statesync.errors import StateSyncError
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.node import SwarmNode

MAX_CATCH_UP_ROUNDS = 2
"""How many whole-model rounds behind a node may step to the swarm's state with their means."""


def max_catch_up_rounds(num_fragments: int) -> int:
    """How many rounds behind a node may step to the swarm's state with their means: providers serve
    the means of their last this many publishes (``StateSyncConfig.num_companions_kept``). Two whole
    rounds; with ``--fragments F``, 2F fragment rounds (two whole rounds' worth: each mean is 1/F of
    the model, so as many bytes kept and fetched)."""
    return MAX_CATCH_UP_ROUNDS * max(1, num_fragments)


def catch_up_with_means(
    swarm: SwarmNode,
    decision: LineageDecision,
    *,
    ours: Lineage,
    held: Stepped,
    stepper: OuterStepper,
    num_elements: int,
    corpus_sha256: str,
    fragment_sizes: tuple[int, ...] = (),
    fragment_stepper: FragmentStepper | None = None,
) -> tuple[AdoptedState | None, int, str | None]:
    """(the swarm's state stepped to from ours, or None; bytes fetched; why not, if None). ``ours``:
    the lineage of the global state ``held`` = (params, momentum) this node holds; ``fragment_sizes``
    and ``fragment_stepper`` with ``--fragments`` (``caught_up_state``). Every fetch is
    announced (``SwarmNode.fetch_state(announce=True)``): the lineage's members train on while we
    fetch (``participation.peer_due``), so the state we step to is still theirs when we hold it."""
    canonical = decision.canonical
    # Newest first: (the mean that led to `wanted`, the state it says it leads to), then the one before.
    links: list[tuple[Snapshot, tuple[int, str]]] = []
    wanted, num_bytes = canonical.param_hash, 0
    try:
        for _ in range(canonical.round - ours[0]):
            report = swarm.fetch_state(decision, state_id=round_mean_id(wanted), announce=True)
            num_bytes += sum(report.bytes_by_source.values())
            previous, target = round_mean_link(report.snapshot)
            links.append((report.snapshot, target))
            if previous == ours:
                break
            wanted = previous[1]
        else:
            raise ValueError(f"the round means served do not lead back to ours (round {ours[0]})")
        state, previous, start = None, ours, held
        for fetched, target in reversed(links):
            state = caught_up_state(stepper, fetched, previous=previous, target=target, start=start,
                                    num_elements=num_elements, corpus_sha256=corpus_sha256,
                                    fragment_sizes=fragment_sizes, fragment_stepper=fragment_stepper)  # fmt: skip
            previous, start = target, (state.global_params, state.outer_momentum)
        if state is None or (state.round, state.param_hash) != (canonical.round, canonical.param_hash):
            raise ValueError("the round means do not end at the swarm's state")
    except (StateSyncError, ValueError, TimeoutError) as error:
        return None, num_bytes, str(error)
    return state, num_bytes, None


def rejoin_due(view: Iterable[PeerRecord], my_peer_id: str, adopted: tuple[int, str]) -> bool:
    """Whether a node that adopted the state ``adopted`` = (round, param_hash) should end its inner
    phase now: a peer of that lineage is ready for the next round (join it with the steps done so
    far), or a peer is past the adopted round (the round's lineage check then catches us up).
    On a ``SwarmView`` it reads the view's index of its lineages (built once per view): the node asks
    every view refresh while it catches up, and a scan of every peer each time adds up in a large swarm."""
    round, param_hash = adopted
    if isinstance(view, SwarmView):
        mine = view.get(my_peer_id)
        held_by_me = (mine.round, mine.param_hash) if mine is not None else None
        # past the adopted round: a lineage of a later round held by a peer other than us
        past = any(
            held[0] > round and size > (held == held_by_me) for held, size in view.lineage_sizes().items()
        )
        return past or not view.of_lineage(round, param_hash).ready_set <= {my_peer_id}
    for peer in view:
        if peer.peer_id == my_peer_id:
            continue
        if peer.round == round and peer.param_hash == param_hash and peer.ready_for_round == round + 1:
            return True
        if peer.round > round:
            return True
    return False
