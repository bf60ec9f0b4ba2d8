"""A swarm node stopped and resumed continues exactly as an uninterrupted one: whatever one round
carries into the next (the codec's error-feedback residual) is in the checkpoint.

Real ``dtnode join`` processes (forked from the test's preloaded server), each a swarm of one (DHT, gRPC, the int8 or top-k all-reduce of a group of
one): the reference runs rounds 1-4 in one go; the other stops after round 2 and resumes to round 4
in the same run dir. Without the residual in the checkpoint, round 3's outer step encodes another
vector and every later loss differs. With top-k the residual is most of Δ (all a round left unsent).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from node.ops.metrics import read_metrics
from tests.node.swarm_cluster import FAST_FLAGS, fork_node

FLAGS = [
    *FAST_FLAGS,
    "--inner-steps",
    "3",
    "--total-steps",
    "12",
    "--checkpoint-every",
    "1",
]


def join(run_dir: Path, max_rounds: int, codec: list[str]) -> None:
    """`dtnode join` to ``max_rounds``, forked from the preloaded server (tests/forking.py: a fresh
    interpreter would spend ~3 CPU-seconds importing, as much as the node's training)."""
    log_path = run_dir.with_name(f"{run_dir.name}-{max_rounds}.log")
    argv = ["join", "--run-dir", str(run_dir), *FLAGS, *codec, "--max-rounds", str(max_rounds)]
    node = fork_node(argv, log_path)
    try:
        code = node.wait(timeout=150)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(timeout=10)
    assert code == 0, log_path.read_text(errors="replace")[-6000:]


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "codec",
    [["--codec", "int8"], ["--codec", "topk", "--topk-density", "0.03"]],
    ids=["int8", "topk"],
)
def test_a_resumed_swarm_node_matches_an_uninterrupted_one_bit_for_bit(
    tmp_path: Path, codec: list[str]
) -> None:
    join(tmp_path / "uninterrupted", 4, codec)
    join(tmp_path / "resumed", 2, codec)
    join(tmp_path / "resumed", 4, codec)
    reference = read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl", kind="step")
    resumed = read_metrics(tmp_path / "resumed" / "metrics.jsonl", kind="step")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference] == list(range(1, 13))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    reference_rounds = read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl", kind="round")
    resumed_rounds = read_metrics(tmp_path / "resumed" / "metrics.jsonl", kind="round")
    assert reference_rounds[-1]["round"] == resumed_rounds[-1]["round"] == 4
    assert reference_rounds[-1]["param_hash"] == resumed_rounds[-1]["param_hash"]
