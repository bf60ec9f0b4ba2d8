"""The canonical-lineage rule, and partition-heal scenarios that must converge to one lineage.

The heal scenarios run a small lineage-level simulation: each round, every peer applies
``decide_lineage`` to the whole swarm's records; re-syncing peers copy their first source's state;
the peers of each lineage that stayed put average together and advance to a new hash that
depends on their lineage and member set (as the real all-reduce would).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import replace

import pytest

from protocol.membership.lineage import Lineage, canonical_lineage, decide_lineage, lineage_sizes
from protocol.membership.records import PeerRecord, SwarmView
from tests.protocol.membership.fake_swarm import PROTOCOL_VERSION, fake_hash, make_record

HA, HB, HC = fake_hash("A"), fake_hash("B"), fake_hash("C")


def _records(spec: dict[str, tuple[int, str]]) -> list[PeerRecord]:
    return [make_record(peer_id, round=r, param_hash=h) for peer_id, (r, h) in spec.items()]


def test_most_peers_wins() -> None:
    records = _records({"a": (3, HA), "b": (3, HA), "c": (9, HB)})
    assert canonical_lineage(records) == (Lineage(3, HA), 2)
    assert lineage_sizes(records) == {Lineage(3, HA): 2, Lineage(9, HB): 1}


def test_ties_go_to_the_higher_round_then_the_smaller_hash() -> None:
    small, large = sorted([HA, HB])
    assert canonical_lineage(_records({"a": (3, small), "b": (4, large)}))[0] == Lineage(4, large)
    assert canonical_lineage(_records({"a": (4, large), "b": (4, small)}))[0] == Lineage(4, small)
    with pytest.raises(ValueError, match="empty"):
        canonical_lineage([])


def test_decision_for_members_and_outsiders() -> None:
    records = _records({"a": (5, HA), "b": (5, HA), "c": (5, HA), "d": (5, HB), "e": (4, HA)})
    inside = decide_lineage(records, records[0])
    assert inside.in_canonical and inside.sync_sources == () and inside.num_canonical_peers == 3
    outside = decide_lineage(records, records[3])
    assert (
        not outside.in_canonical and outside.canonical == Lineage(5, HA) and outside.local == Lineage(5, HB)
    )
    assert sorted(outside.sync_sources) == ["a", "b", "c"]
    # Rendezvous order: rank = SHA-256(local id, NUL, source id), an independent recomputation.
    expected = sorted("abc", key=lambda s: hashlib.sha256(f"d\x00{s}".encode()).digest())
    assert list(outside.sync_sources) == expected
    behind = decide_lineage(records, records[4])  # missed a round: same hash lineage, older round
    assert not behind.in_canonical and sorted(behind.sync_sources) == ["a", "b", "c"]


def test_sources_are_spread_over_re_syncing_peers() -> None:
    canonical = _records({f"src{i}": (1, HA) for i in range(8)})
    firsts = {
        decide_lineage(canonical, make_record(f"joiner{j}", param_hash=HB)).sync_sources[0] for j in range(40)
    }
    assert len(firsts) > 3  # not everyone hammers the same source


def test_local_record_overrides_its_stale_dht_copy() -> None:
    records = _records({"a": (2, HA), "b": (2, HB), "c": (2, HB)})
    # The DHT still says a is at HA, but a has re-synced to HB: it is canonical now.
    decision = decide_lineage(records, make_record("a", round=2, param_hash=HB))
    assert decision.in_canonical and decision.num_canonical_peers == 3


# --- partition heal ---


def _simulate_round(
    states: dict[str, tuple[int, str]], visible: dict[str, set[str]]
) -> dict[str, tuple[int, str]]:
    """One outer round: every peer decides on the records it sees, then trains or re-syncs.

    A re-syncing peer fetches its source's state once the source's round is done (the daemon
    fetches from a peer that is not mid-all-reduce), so it ends the round holding that state.
    """
    new_states = dict(states)
    stayers: dict[Lineage, list[str]] = {}
    sources: dict[str, str] = {}
    for peer_id in sorted(states):
        seen = [make_record(p, round=states[p][0], param_hash=states[p][1]) for p in sorted(visible[peer_id])]
        local = make_record(peer_id, round=states[peer_id][0], param_hash=states[peer_id][1])
        decision = decide_lineage(seen, local)
        if decision.in_canonical:
            stayers.setdefault(decision.local, []).append(peer_id)
        else:
            source = decision.sync_sources[0]
            assert states[source] == (decision.canonical.round, decision.canonical.param_hash)
            sources[peer_id] = source
    for lineage, members in stayers.items():  # each lineage's peers average together
        digest = fake_hash(f"{lineage.param_hash}|{lineage.round}|{','.join(members)}")
        for peer_id in members:
            new_states[peer_id] = (lineage.round + 1, digest)
    for peer_id, source in sources.items():
        new_states[peer_id] = new_states[source]
    return new_states


def _heal(
    side_a: dict[str, tuple[int, str]], side_b: dict[str, tuple[int, str]]
) -> list[dict[str, tuple[int, str]]]:
    """Run 3 rounds after the partition heals (everyone sees everyone); return the states per round."""
    states = {**side_a, **side_b}
    everyone = {peer_id: set(states) for peer_id in states}
    history = [states]
    for _ in range(3):
        states = _simulate_round(states, everyone)
        history.append(states)
    return history


def _lineages(states: dict[str, tuple[int, str]]) -> set[tuple[int, str]]:
    return set(states.values())


def _train_apart(sizes: tuple[int, int], rounds: tuple[int, int]) -> tuple[dict, dict]:
    """Two sides that started from one state and trained apart for ``rounds`` rounds each."""
    sides = []
    for side, (size, num_rounds) in enumerate(zip(sizes, rounds, strict=True)):
        peers = {f"{'ab'[side]}{i}": (0, HC) for i in range(size)}
        only_us = {peer_id: set(peers) for peer_id in peers}
        for _ in range(num_rounds):
            peers = _simulate_round(peers, only_us)
        assert len(_lineages(peers)) == 1  # a side on its own stays one lineage
        sides.append(peers)
    return sides[0], sides[1]


@pytest.mark.parametrize("rounds", [(5, 5), (5, 8), (8, 5)])
def test_four_versus_two_heals_to_the_larger_side_within_two_rounds(rounds: tuple[int, int]) -> None:
    side_a, side_b = _train_apart((4, 2), rounds)
    history = _heal(side_a, side_b)
    # Round 1 after the heal: a trains on; b re-syncs to a's state (whatever the round counts).
    round_a = side_a["a0"][0]
    assert _lineages(history[1]) == {history[1]["a0"]} and history[1]["a0"][0] == round_a + 1
    # Round 2: everyone trains in that one lineage, b included in the average.
    members = ",".join(sorted({**side_a, **side_b}))
    assert _lineages(history[2]) == {
        (round_a + 2, fake_hash(f"{history[1]['a0'][1]}|{round_a + 1}|{members}"))
    }
    assert len(_lineages(history[3])) == 1  # and it stays one


@pytest.mark.parametrize("rounds", [(6, 6), (6, 9), (9, 6)])
def test_three_versus_three_tie_is_broken_the_same_way_by_everyone(rounds: tuple[int, int]) -> None:
    side_a, side_b = _train_apart((3, 3), rounds)
    (round_a, hash_a), (round_b, hash_b) = side_a["a0"], side_b["b0"]
    if round_a != round_b:
        winner = side_a if round_a > round_b else side_b  # more outer steps wins
    else:
        winner = side_a if hash_a < hash_b else side_b  # then the smaller hash
    loser = side_b if winner is side_a else side_a
    history = _heal(side_a, side_b)
    winner_round = next(iter(winner.values()))[0]
    assert len(_lineages(history[1])) == 1 and next(iter(history[1].values()))[0] == winner_round + 1
    assert all(history[1][peer_id] == history[1][next(iter(winner))] for peer_id in loser)
    assert len(_lineages(history[2])) == 1 and len(_lineages(history[3])) == 1


def test_decisions_do_not_depend_on_record_order() -> None:
    side_a, side_b = _train_apart((3, 3), (4, 4))
    records = _records({**side_a, **side_b})
    decisions = {decide_lineage(list(order), records[0]) for order in itertools.permutations(records)}
    assert len(decisions) == 1


def test_a_fresh_joiner_defers_to_the_swarms_init_even_where_its_own_wins_the_tie() -> None:
    """Two round-0 inits, one node each: the rule's tie-break (the smaller hash) would keep the
    joiner's and send the swarm's node back to it; deferring, the joiner follows the swarm."""
    small, large = sorted([fake_hash("init a"), fake_hash("init b")])
    swarm_node = make_record("swarm", round=0, param_hash=large)
    joiner = make_record("joiner", round=0, param_hash=small)
    assert decide_lineage([swarm_node], joiner).in_canonical  # the tie-break alone: the joiner's init
    deferred = decide_lineage([swarm_node], joiner, defer=True)
    assert deferred.canonical == Lineage(0, large) and not deferred.in_canonical
    assert deferred.sync_sources == ("swarm",)
    # Alone, a deferring node is its own lineage.
    assert decide_lineage([], joiner, defer=True).in_canonical


# --- on a SwarmView: the same decision, the lineages counted once per view ---


def _random_view(rng: random.Random, num_peers: int, hashes: list[str]) -> SwarmView:
    records = []
    for index in range(num_peers):
        record = make_record(
            f"p{rng.randrange(10**6):06d}-{index}",
            round=rng.choice((3, 4, 5)),
            param_hash=rng.choice(hashes),
            ready=rng.random() < 0.5,
        )
        records.append(replace(record, client=rng.random() < 0.2))
    return SwarmView.build(records, now=0.0, protocol_version=PROTOCOL_VERSION)


@pytest.mark.parametrize("seed", range(4))
def test_a_views_decision_is_the_rule_on_its_records(seed: int) -> None:
    """The reference is the rule on the view's records as a plain list (counted on every call)."""
    rng = random.Random(seed)
    for _ in range(300):
        view = _random_view(rng, rng.randrange(0, 12), [HA, HB, HC][: rng.randrange(1, 4)])
        if view.peers and rng.random() < 0.6:  # we are in the view, maybe under a stale lineage
            round = rng.choice((3, 4, 5))
            local = replace(
                rng.choice(view.peers),
                round=round,
                param_hash=rng.choice([HA, HB]),
                ready_for_round=round + 1,
            )
        else:
            local = make_record("local", round=rng.choice((3, 4, 5)), param_hash=rng.choice([HA, HB, HC]))
        for defer in (False, True):
            assert decide_lineage(view, local, defer=defer) == decide_lineage(
                list(view.peers), local, defer=defer
            )


def test_a_view_counts_its_lineages_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A formation applies the rule on every event: on a view of 1000 peers, each call after the
    first looks at a few lineages, not at every record again."""
    view = _random_view(random.Random(9), 1000, [HA, HB])
    local = make_record("local", round=4, param_hash=HA)
    first = decide_lineage(view, local)
    calls = 0
    original = Lineage.of.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Lineage], record: PeerRecord) -> Lineage:
        nonlocal calls
        calls += 1
        return original(cls, record)  # type: ignore[no-any-return]

    monkeypatch.setattr(Lineage, "of", classmethod(counted))
    for _ in range(10):
        assert decide_lineage(view, local) == first
    assert calls <= 10 * 3
