"""The Python API (node/api.py) with a custom nn.Module, on loopback swarms.

- Two processes running scripts/examples/own_loop.py (its own MLP, AdamW and toy data) agree on the
  param_hash after every round, each averaged over both.
- A run stopped after round 2 and resumed from its state_dict (saved through torch.save) reaches
  round 4 with the same hashes, module, outer state and error-feedback residual as an uninterrupted
  run, bit for bit (a one-node swarm with the int8 codec, so the residual matters).
- A joiner adopts the state of a swarm past round 0 with the same data_id, and is refused with
  another.
- An Adopt decision (a stub averager, no sockets) loads the given state into the module and takes
  its counters; rounds due by time; options are NodeConfig's, validated by it.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from node.api import RoundReport, SwarmTrainer, api_config, join_swarm
from node.config import ConfigError
from node.outer.diloco import flatten_params
from node.outer.seam import Adopt, AdoptedState, RoundOutcome, RoundRequest, RoundStats
from node.outer.state import tensor_hash
from scripts.common import ForkedProcess
from tests.node.swarm_cluster import fork_node

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "scripts" / "examples" / "own_loop.py"

pytestmark = pytest.mark.timeout(240)

FAST = {"listen": "127.0.0.1:0", "join_window": 0.5, "heartbeat": 2.0, "record_ttl": 16.0, "codec": "int8"}


class TinyClassifier(nn.Module):
    """Not dtnode's GPT: an embedding bag and a two-layer head over 8 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(50, 16)
        self.head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))  # (B, 8)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, 50, (16, 6), generator=generator)  # (B, T)
    return ids, ids.sum(dim=1) % 8  # (B,)


def fresh_model(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = TinyClassifier()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_to(
    swarm: SwarmTrainer, model: nn.Module, opt: torch.optim.Optimizer, rounds: int
) -> list[RoundReport]:
    reports = []
    while swarm.num_rounds < rounds:
        ids, labels = batch(swarm.num_steps)
        nn.functional.cross_entropy(model(ids), labels).backward()
        opt.step()
        opt.zero_grad()
        report = swarm.step(tokens=ids.numel())
        if report is not None:
            reports.append(report)
    return reports


def loopback_address(run_dir: Path, timeout: float = 60.0) -> str:
    """The loopback multiaddr a node wrote to RUN_DIR/node.json (waits for it)."""
    path = run_dir / "node.json"
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text().strip().endswith("}"):
        assert time.monotonic() < deadline, f"{path} not written in {timeout}s"
        time.sleep(0.2)
    addresses = json.loads(path.read_text())["multiaddrs"]
    return next(a for a in addresses if a.startswith("/ip4/127.0.0.1/"))


def test_two_processes_agree_on_param_hash_every_round(tmp_path: Path) -> None:
    name = f"api-{uuid.uuid4().hex[:10]}"
    common = ["--name", name, "--rounds", "3", "--inner-steps", "5", "--batch-size", "8",
              "--min-peers", "2", "--start-peers", "2", "--join-window", "3", "--listen", "127.0.0.1:0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes: list[ForkedProcess] = []
    try:
        for index in range(2):
            run_dir = tmp_path / f"node-{index}"
            argv = [*common, "--run-dir", str(run_dir), "--hashes", str(tmp_path / f"hashes-{index}.json")]
            if index == 1:
                argv += ["--peers", loopback_address(tmp_path / "node-0")]
            # The script's main, forked from the preloaded server (a fresh interpreter spends ~3 CPU-s
            # importing torch, hivemind and the node).
            processes.append(fork_node(argv, tmp_path / f"node-{index}.log", script=EXAMPLE, env=env))
        for process in processes:
            assert process.wait(timeout=180) == 0, (tmp_path / "node-0.log").read_text()[-3000:]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
    runs = [json.loads((tmp_path / f"hashes-{index}.json").read_text()) for index in range(2)]
    for reports in runs:
        assert [r["round"] for r in reports] == [1, 2, 3]
        assert {(r["kind"], r["num_peers"]) for r in reports} == {("averaged", 2)}
        assert sorted({tuple(r["shard"]) for r in reports}) in ([(0, 2)], [(1, 2)])
    assert [r["param_hash"] for r in runs[0]] == [r["param_hash"] for r in runs[1]]
    assert len({r["param_hash"] for r in runs[0]}) == 3  # the params moved every round
    assert {tuple(r["shard"]) for r in runs[0]} != {tuple(r["shard"]) for r in runs[1]}  # disjoint data


def run(run_dir: Path, name: str, **options: Any) -> SwarmTrainer:
    return join_swarm(options.pop("model"), run_name=name, inner_steps=4, run_dir=str(run_dir),
                      **{**FAST, **options})  # fmt: skip


def test_resume_after_round_two_is_bit_exact(tmp_path: Path) -> None:
    name = f"api-resume-{uuid.uuid4().hex[:10]}"
    model, opt = fresh_model()
    swarm = run(tmp_path / "a", name, model=model, data_id="toy")
    try:
        straight = train_to(swarm, model, opt, 4)
        straight_state = swarm.state_dict()
    finally:
        swarm.close()

    model, opt = fresh_model()
    swarm = run(tmp_path / "b", name + "-a", model=model, data_id="toy")
    try:
        first = train_to(swarm, model, opt, 2)
        buffer = io.BytesIO()
        torch.save({"swarm": swarm.state_dict(), "opt": opt.state_dict()}, buffer)
    finally:
        swarm.close()
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["swarm"]["swarm"]["error_feedback"].abs().sum() > 0  # int8 left a residual to carry

    model, opt = fresh_model(seed=7)  # another init: only the checkpoint can make it equal
    opt.load_state_dict(saved["opt"])
    swarm = run(tmp_path / "c", name + "-b", model=model, data_id="toy", state=saved["swarm"])
    try:
        assert swarm.num_rounds == 2
        second = train_to(swarm, model, opt, 4)
        resumed_state = swarm.state_dict()
    finally:
        swarm.close()

    assert [r.param_hash for r in first + second] == [r.param_hash for r in straight]
    assert [r.kind for r in straight] == ["solo"] * 4  # a swarm of one node: groups of one
    for key in ("module", "swarm"):
        torch.testing.assert_close(resumed_state[key], straight_state[key], rtol=0, atol=0)
    torch.testing.assert_close(resumed_state["outer"], straight_state["outer"], rtol=0, atol=0)
    assert resumed_state["counters"] == straight_state["counters"]


def test_joiner_adopts_same_data_id_and_is_refused_another(tmp_path: Path) -> None:
    name = f"api-join-{uuid.uuid4().hex[:10]}"
    model, opt = fresh_model()
    source = run(tmp_path / "a", name, model=model, data_id="corpus-a")
    try:
        train_to(source, model, opt, 3)
        address = loopback_address(tmp_path / "a")
        joiner_model, _ = fresh_model()
        joiner = run(tmp_path / "ok", name, model=joiner_model, data_id="corpus-a", peers=address)
        try:
            assert (joiner.num_rounds, joiner.param_hash()) == (3, source.param_hash())
            torch.testing.assert_close(
                dict(joiner_model.state_dict()), dict(model.state_dict()), rtol=0, atol=0
            )
        finally:
            joiner.close()
        with pytest.raises(ConfigError, match="another corpus"):
            run(tmp_path / "bad", name, model=fresh_model()[0], data_id="corpus-b", peers=address)
    finally:
        source.close()


def test_nodes_of_another_data_id_never_share_a_round_and_say_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both fresh, one seed: the same round-0 params, so only the identity in their records (the
    data_id's) tells them apart. The joiner is refused (it found only nodes of another data_id)
    after a WARNING naming the peer; the first node's rounds stay its own, each reported as solo."""
    name = f"api-data-{uuid.uuid4().hex[:10]}"
    model, opt = fresh_model()
    source = run(tmp_path / "a", name, model=model, data_id="corpus-a")
    try:
        # How to join a node of a custom module: through the API, not `dtnode join` (dtnode's own model).
        printed = capsys.readouterr().out
        assert "join_swarm(<a TinyClassifier" in printed and "dtnode join" not in printed, printed
        address = loopback_address(tmp_path / "a")
        with caplog.at_level("WARNING"), pytest.raises(ConfigError, match="another corpus or model"):
            run(tmp_path / "b", name, model=fresh_model()[0], data_id="corpus-b", peers=address)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        source_id = json.loads((tmp_path / "a" / "node.json").read_text())["peer_id"]
        assert any(source_id in w and "trains another model or data" in w for w in warnings), warnings
        reports = train_to(source, model, opt, 2)
        assert [(r.kind, r.num_peers) for r in reports] == [("solo", 1), ("solo", 1)]
    finally:
        source.close()


def test_a_fresh_node_of_another_seed_takes_the_swarms_init_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two fresh nodes of one model and data_id but other seeds: the joiner takes the first node's
    round-0 params before its first step (whichever hash is smaller) and says so at WARNING; then
    every round averages the two, on one param_hash."""
    name = f"api-seed-{uuid.uuid4().hex[:10]}"
    first_model, first_opt = fresh_model(seed=0)
    first = run(tmp_path / "a", name, model=first_model, data_id="toy", min_peers=2)
    try:
        second_model, second_opt = fresh_model(seed=7)
        assert (
            tensor_hash(flatten_params(list(second_model.parameters()), device="cpu")) != first.param_hash()
        )
        with caplog.at_level("WARNING"):
            second = run(tmp_path / "b", name, model=second_model, data_id="toy", min_peers=2,
                         peers=loopback_address(tmp_path / "a"))  # fmt: skip
        try:
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any("round-0 params" in w and first.param_hash()[:12] in w for w in warnings), warnings
            assert second.param_hash() == first.param_hash()
            torch.testing.assert_close(
                dict(second_model.state_dict()), dict(first_model.state_dict()), rtol=0, atol=0
            )
            results: dict[str, list[RoundReport]] = {}
            threads = [
                threading.Thread(target=lambda k=k, s=s, m=m, o=o: results.__setitem__(k, train_to(s, m, o, 2)))
                for k, s, m, o in (("first", first, first_model, first_opt), ("second", second, second_model, second_opt))
            ]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(180)
            assert set(results) == {"first", "second"}
            for reports in results.values():
                assert [(r.kind, r.num_peers) for r in reports] == [("averaged", 2), ("averaged", 2)]
            assert [r.param_hash for r in results["first"]] == [r.param_hash for r in results["second"]]
        finally:
            second.close()
    finally:
        first.close()


def test_two_api_nodes_behind_the_start_barrier_read_disjoint_shards_from_the_first_step(
    tmp_path: Path,
) -> None:
    """start_peers=2: the barrier assigns each node its shard before its first step (the user's loop
    reads ``swarm.shard`` for its first batch), where both read shard (0, 1) in round 1 before."""
    name = f"api-shards-{uuid.uuid4().hex[:10]}"
    first_model, _ = fresh_model()
    trainers: dict[str, SwarmTrainer] = {}
    first = SwarmTrainer(first_model, config=api_config(name=name, start_peers=2, run_dir=str(tmp_path / "a"),
                                                        inner_steps=4, **FAST), data_id="toy")  # fmt: skip
    try:
        starter = threading.Thread(target=first.start)  # holds at the barrier until the second is live
        starter.start()
        second = join_swarm(fresh_model()[0], run_name=name, data_id="toy", start_peers=2, inner_steps=4,
                            run_dir=str(tmp_path / "b"), peers=loopback_address(tmp_path / "a"), **FAST)  # fmt: skip
        trainers["second"] = second
        starter.join(120)
        assert not starter.is_alive()
        assert sorted([first.shard, second.shard]) == [(0, 2), (1, 2)]
        assert first.num_steps == second.num_steps == 0  # before the first step
    finally:
        first.close()
        for trainer in trainers.values():
            trainer.close()


def test_options_are_node_config_fields() -> None:
    assert api_config(codec="int4", min_peers=3).rounds.codec == "int4"
    with pytest.raises(ConfigError, match="unknown setting"):
        api_config(not_a_field=1)
    with pytest.raises(ConfigError, match="overlap"):
        api_config(overlap=True)
    with pytest.raises(ConfigError):
        api_config(inner_steps=0)  # validated by NodeConfig
    with pytest.raises(ValueError, match="exactly one"):
        SwarmTrainer(TinyClassifier(), config=api_config(swarm=False), data_id="x").step()


class AdoptingAverager:
    """Sends the loop to adopt ``state`` at round 1 (a node that missed the swarm's round)."""

    def __init__(self, state: AdoptedState) -> None:
        self.state = state

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        return RoundOutcome(Adopt(self.state), RoundStats(num_peers=0))


def test_adopt_decision_loads_the_swarms_state_into_the_module() -> None:
    model, opt = fresh_model()
    swarm = SwarmTrainer(model, config=api_config(swarm=False, inner_steps=3), data_id="toy")
    other = torch.randn(swarm.diloco.num_elements, generator=torch.Generator().manual_seed(5))
    momentum = torch.randn(other.shape, generator=torch.Generator().manual_seed(6))
    state = AdoptedState(round=7, param_hash=tensor_hash(other), global_params=other,
                         outer_momentum=momentum, metadata={"step": 70, "data": {}})  # fmt: skip
    swarm.round.averager = AdoptingAverager(state)
    (report,) = train_to_step(swarm, model, opt, 3)
    assert (report.kind, report.round, report.step, report.param_hash) == ("adopted", 7, 70, state.param_hash)
    assert torch.equal(flatten_params(list(model.parameters()), device="cpu"), other)
    adopted_momentum = swarm.diloco.momentum_buffer()
    assert adopted_momentum is not None and torch.equal(adopted_momentum, momentum)
    assert swarm.step(tokens=1) is None  # a new phase of 3 steps starts at the swarm's step 70
    swarm.close()


def test_round_due_by_time() -> None:
    model, opt = fresh_model()
    swarm = SwarmTrainer(model, config=api_config(swarm=False, round_seconds=0.2), data_id="toy")
    swarm.start()
    assert swarm.step(samples=4) is None
    time.sleep(0.25)
    report = swarm.step(samples=4)
    assert report is not None and (report.round, report.weight, report.kind) == (1, 8.0, "solo")  # no swarm
    with pytest.raises(ValueError, match="counts samples"):
        swarm.step(tokens=5)
    swarm.close()


def train_to_step(
    swarm: SwarmTrainer, model: nn.Module, opt: torch.optim.Optimizer, steps: int
) -> list[RoundReport]:
    reports = []
    for _ in range(steps):
        ids, labels = batch(swarm.num_steps)
        nn.functional.cross_entropy(model(ids), labels).backward()
        opt.step()
        opt.zero_grad()
        if (report := swarm.step(tokens=ids.numel())) is not None:
            reports.append(report)
    return reports
