"""node/ops/swarm_report.py: participation and the run's verdict from hand-written round records,
checked against counts done by hand; the report renders old and new launcher reports."""

from __future__ import annotations

from typing import Any

from node.ops.swarm_report import (
    interrupted_run_problems,
    is_averaged,
    node_participation,
    report_markdown,
    round_line,
    run_problems,
    swarm_participation,
)


def record(round_index: int, peers: int = 3, param_hash: str = "", **extra: Any) -> dict[str, Any]:
    """A round record as node/train/trainer.py writes it (the fields participation reads)."""
    return {
        "kind": "round",
        "round": round_index,
        "peers": peers,
        "param_hash": param_hash or f"h{round_index}",
        "fell_back": False,
        "adopted": False,
    } | extra


def test_averaged_means_two_or_more_contributions_of_our_own():
    assert is_averaged(record(1, peers=2))
    assert not is_averaged(record(1, peers=1))  # alone
    assert not is_averaged(record(1, peers=0, adopted=True))
    assert not is_averaged(record(1, peers=3, adopted=True))  # the swarm's mean, not ours
    assert not is_averaged(record(1, peers=2, fell_back=True))
    assert not is_averaged({"round": 1})  # no peers field: nothing known to have been averaged


def test_node_participation_counts_rounds_after_the_first_skipped_ones_included():
    # Joined late: round 3 was its first (left out); alone in 4; skipped 5 catching up (adopted
    # round 6 instead); averaged 7; fell back in 8, then adopted round 8's canonical state (the
    # last record of round 8 wins: adopted, not averaged); averaged 9.
    rounds = [
        record(3, peers=1),
        record(4, peers=1),
        record(6, adopted=True),
        record(7),
        record(8, peers=1, fell_back=True, param_hash="own"),
        record(8, adopted=True),
        record(9, param_hash="final"),
    ]
    # Pairs: rounds 4..9 = 6; averaged: 7 and 9 = 2.
    assert node_participation(rounds) == {
        "first_round": 3,
        "final_round": 9,
        "final_param_hash": "final",
        "num_pairs": 6,
        "num_averaged": 2,
        "participation": 2 / 6,
    }
    # Frozen until round 6: rounds 7..9 count, 7 and 9 averaged.
    assert node_participation(rounds, skip_through=6)["num_pairs"] == 3
    assert node_participation(rounds, skip_through=6)["num_averaged"] == 2
    assert node_participation(rounds, skip_through=9)["participation"] is None
    assert node_participation([record(1)])["num_pairs"] == 0
    assert node_participation([record(1)])["participation"] is None
    assert node_participation([])["final_param_hash"] is None


def test_swarm_participation_pools_every_nodes_pairs():
    full = node_participation([record(r) for r in (1, 2, 3, 4)])  # 3 of 3
    half = node_participation([record(1), record(2, peers=1), record(3)])  # 1 of 2
    assert swarm_participation([full, half]) == {"num_pairs": 5, "num_averaged": 4, "participation": 4 / 5}
    assert swarm_participation([])["participation"] is None


def test_a_good_run_has_no_problem():
    nodes = [[record(1), record(2), record(3)] for _ in range(3)]
    assert run_problems(["node-0", "node-1", "node-2"], nodes) == []
    # One node may start a round later (a joiner's first round): still one lineage.
    assert run_problems(["node-0", "node-1"], [[record(1), record(2)], [record(2)]]) == []
    # A single node trains alone by design.
    assert run_problems(["node-0"], [[record(1, peers=1)]]) == []


def test_a_split_on_the_final_round_is_a_problem_even_without_a_common_round():
    node_0 = [record(1, peers=2), record(2, peers=1, param_hash="a2")]
    node_1 = [record(3, peers=1, param_hash="b3")]  # never shared a round with node-0
    problems = run_problems(["node-0", "node-1"], [node_0, node_1])
    assert problems == ["final param_hash differs: node-0 a2 (round 2), node-1 b3 (round 3)"]


def test_common_round_disagreement_is_a_problem_even_when_the_nodes_end_together():
    node_0 = [record(1), record(2, param_hash="x"), record(3)]
    node_1 = [record(1), record(2, param_hash="y"), record(3)]
    assert run_problems(["node-0", "node-1"], [node_0, node_1]) == [
        "param_hash differs in common round(s) [2]"
    ]


def test_a_stopped_run_is_judged_on_the_rounds_before_each_nodes_last():
    # Stopped a round apart, the last node alone on its own Δ: not a problem of a stopped run.
    node_0 = [record(1), record(2), record(3, peers=1, fell_back=True, param_hash="own")]
    node_1 = [record(1), record(2)]
    assert interrupted_run_problems([node_0, node_1]) == []
    # Stopped before any round averaged: nothing to judge.
    assert interrupted_run_problems([[record(1, peers=1)], []]) == []
    # A split before the stop is a failure of the run however it was stopped.
    node_1 = [record(1), record(2, param_hash="other"), record(3)]
    assert interrupted_run_problems([node_0, node_1]) == [
        "param_hash differs in common round(s) [2] before the stop"
    ]


def test_a_run_where_no_round_averaged_two_nodes_is_a_problem():
    # Both nodes on the same hash (one followed the other by adopting), but nothing was averaged.
    node_0 = [record(1, peers=1), record(2, peers=1)]
    node_1 = [record(1, peers=0, adopted=True), record(2, peers=0, adopted=True)]
    assert run_problems(["node-0", "node-1"], [node_0, node_1]) == ["no round averaged two or more nodes"]
    silent = run_problems(["node-0", "node-1", "node-2"], [node_0, [], node_1])
    assert silent == ["node-1 recorded no round", "no round averaged two or more nodes"]


def launcher_report(**extra: Any) -> dict[str, Any]:
    node = {"name": "node-0", "exit_code": 0, "num_rounds": 3, "eval_losses": [3.0, None, 2.5],
            "bytes_sent": 2e6, "bytes_recv": 2e6, "fell_back_rounds": [], "adopted_rounds": []}  # fmt: skip
    return {
        "num_nodes": 1, "link_mbit": None, "stopped_by": "finished", "wall_seconds": 12.0,
        "param_hash": {"common_rounds": [1, 2, 3], "disagreeing_rounds": [], "all_agree": True},
        "nodes": [node | extra.pop("node", {})],
    } | extra  # fmt: skip


def test_report_shows_participation_and_the_verdict():
    per_node = {"num_pairs": 2, "num_averaged": 1, "participation": 0.5, "final_round": 3,
                "final_param_hash": "0123456789abcdef", "first_round": 1, "utilization": 0.934}  # fmt: skip
    text = report_markdown(
        launcher_report(
            node=per_node,
            participation={"num_pairs": 2, "num_averaged": 1, "participation": 0.5},
            problems=["no round averaged two or more nodes"],
        )
    )
    assert "Verdict: **no round averaged two or more nodes**." in text
    assert "Participation: 50.0% (1 of 2 (node, round) pairs" in text
    assert "| 50.0% (1/2) | 0.93 | 3 | 0123456789 |" in text
    assert "Verdict: ok." in report_markdown(launcher_report(problems=[]))


def test_report_of_an_older_launcher_renders_without_participation():
    text = report_markdown(launcher_report())
    assert "Participation" not in text and "Verdict" not in text
    # No participation or utilization recorded: "-" in both columns.
    assert text.splitlines()[-1].endswith("| 0 | 0 | - | - | - | - |")


def test_the_launchers_round_line_shows_bytes_density_and_the_all_reduce_share():
    sparse = {"round": 3, "eval_loss": 2.71, "peers": 3, "bytes_sent": 1_523_456, "bytes_recv": 9,
              "density": 62 / 4096, "allreduce_share": 0.031, "param_hash": "0cefb6a965aa"}  # fmt: skip
    assert round_line("node-1", sparse) == (
        "node-1 round 3 | eval_loss 2.7100 | peers 3 | sent 1.52 MB at density 1.51% | all-reduce 3% "
        "| param_hash 0cefb6a965"
    )
    alone = {
        "round": 1,
        "eval_loss": None,
        "peers": 1,
        "bytes_sent": 0,
        "param_hash": "ab" * 6,
        "adopted": True,
    }
    assert round_line("node-0", alone) == (
        "node-0 round 1 | eval_loss - | peers 1 | sent 0 B | param_hash ababababab | adopted the swarm's state"
    )


def test_the_launchers_round_line_names_a_fragment_round_and_its_hash():
    record = {"round": 6, "eval_loss": None, "peers": 2, "bytes_sent": 289_500, "density": 1.0,
              "fragment": 2, "fragment_hash": "7a1c0e9b2d44", "param_hash": "0cefb6a965aa"}  # fmt: skip
    assert round_line("node-0", record) == (
        "node-0 round 6 | eval_loss - | peers 2 | sent 289.5 kB at density 100% | fragment 2 7a1c0e9b2d "
        "| param_hash 0cefb6a965"
    )
