"""``MissedRoundWait``: how long a node that missed a round waits for the group that began it without
it. It reads real ``SwarmView``s of ``PeerRecord``s on an injected clock; the expected deadlines are
the daemon's defaults added up by hand (stall timeout 30 s + heartbeat 2 s + DHT call 5 s = 37 s;
round deadline 5 min)."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.membership.records import PeerRecord, SwarmView
from protocol.swarm.config import SwarmConfig
from protocol.swarm.participation import MissedRoundWait, missed_round_wait
from tests.protocol.membership.fake_swarm import H0, PROTOCOL_VERSION, make_record

CONFIG = SwarmConfig(run_name="missed-wait")
WAIT = 37.0  # 30 s + 2 s + 5 s, the defaults
ROUND_DEADLINE = 300.0
MISSED_AT = 1000.0
LINEAGE = (3, H0)  # we hold round 3's params and missed round 4

pytestmark = pytest.mark.timeout(30)


def view(*peers: PeerRecord) -> SwarmView:
    return SwarmView.build([make_record("me", round=3), *peers], now=0.0, protocol_version=PROTOCOL_VERSION)


IN_THE_ROUND = view(make_record("member", round=3, ready=True))  # locked into round 4: still ready for it
PUBLISHED = view(make_record("member", round=4, param_hash="b" * 64))  # its all-reduce ended
GONE = view()  # froze or died: its record expired
GAVE_UP = view(make_record("member", round=3))  # on our lineage, no longer ready: not in a round


def first_over(wait: MissedRoundWait, view_at: dict[float, SwarmView], until: float) -> float:
    """The first second (our clock, asked once a second from the miss) at which the wait is over."""
    current = IN_THE_ROUND
    for now in range(int(MISSED_AT), int(until) + 1):
        current = view_at.get(float(now), current)
        if wait.over(current, float(now)):
            return float(now)
    pytest.fail(f"still waiting at {until}")


def wait_for(told_by: str | None) -> MissedRoundWait:
    return MissedRoundWait(CONFIG, lineage=LINEAGE, told_by=told_by, now=MISSED_AT)


def test_the_defaults_add_up_to_the_hand_figures() -> None:
    assert missed_round_wait(CONFIG).total_seconds() == WAIT
    assert CONFIG.round_deadline.total_seconds() == ROUND_DEADLINE


def test_a_missed_node_waits_while_the_group_that_told_it_runs_its_all_reduce() -> None:
    """The member that said the round started stays in it for 160 s (a large model's all-reduce over
    home links), far past the 37 s a fixed wait gave it: the wait ends 37 s after the last view that
    showed it in the round, not at the miss plus 37 s."""
    wait = wait_for("member")
    assert not wait.over(IN_THE_ROUND, MISSED_AT + WAIT)
    assert not wait.over(IN_THE_ROUND, MISSED_AT + 150.0)
    assert (
        first_over(wait_for("member"), {MISSED_AT + 160.0: PUBLISHED}, MISSED_AT + 400)
        == MISSED_AT + 159 + WAIT
    )


@pytest.mark.parametrize("after", [GONE, GAVE_UP], ids=["froze-or-died", "gave-up"])
def test_the_wait_ends_the_fixed_wait_after_the_group_is_no_longer_seen_in_the_round(
    after: SwarmView,
) -> None:
    """Issue 31's bound: a group that froze or died (its records expire) holds nobody beyond the fixed
    wait from the last sign of it; nor does a teller that is no longer ready for the round."""
    assert first_over(wait_for("member"), {MISSED_AT + 10.0: after}, MISSED_AT + 400) == MISSED_AT + 9 + WAIT


def test_without_a_teller_or_with_one_never_seen_the_wait_is_the_fixed_one() -> None:
    """A miss at max_wait names nobody; a teller on another lineage is not in our round."""
    assert first_over(wait_for(None), {}, MISSED_AT + 400) == MISSED_AT + WAIT
    other = view(dataclasses.replace(make_record("member", round=3, ready=True), param_hash="c" * 64))
    assert first_over(wait_for("member"), {MISSED_AT: other}, MISSED_AT + 400) == MISSED_AT + WAIT


def test_a_teller_seen_in_the_round_for_ever_holds_at_most_the_round_deadline_plus_the_wait() -> None:
    """No all-reduce runs past the round deadline: a teller whose record says so for longer (stuck)
    holds us at most that long, then the fixed wait."""
    over = first_over(wait_for("member"), {}, MISSED_AT + 1000)
    assert over == MISSED_AT + ROUND_DEADLINE + WAIT
