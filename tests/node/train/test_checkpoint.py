"""Checkpoints: state-tree round trip, bit-identical tensors, a crash at every write point leaves the
previous checkpoint loadable, pruning, idempotence, and a node SIGKILLed at random moments resumes."""

from __future__ import annotations

import gc
import inspect
import json
import os
import random
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import node.train.checkpoint as checkpoint
from node.config import NodeConfig
from node.train.checkpoint import join_state, latest_checkpoint, load_checkpoint, save_checkpoint, split_state
from node.train.trainer import Trainer
from scripts.common import ForkedProcess
from tests.node.swarm_cluster import fork_node


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as uint8: compares NaN payloads, -0.0 and subnormals exactly."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tree(actual: Any, expected: Any, path: str = "") -> None:
    """Exact structural equality: container types, key types and order, tensor dtype/shape/bits."""
    where = path or "/"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__} is not a tensor"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        assert torch.equal(raw_bytes(actual), raw_bytes(expected)), f"{where}: tensor bits differ"
        return
    assert type(actual) is type(expected), f"{where}: {type(actual).__name__} != {type(expected).__name__}"
    if isinstance(expected, dict):
        assert [(type(k), k) for k in actual] == [(type(k), k) for k in expected], f"{where}: keys differ"
        for key in expected:
            assert_same_tree(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected), f"{where}: length differs"
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_tree(a, e, f"{path}/{index}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def sample_state(seed: int = 0) -> dict[str, Any]:
    """A tree shaped like Trainer.state_dict(), with every leaf kind the checkpoint must carry."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(4, 3, generator=generator)
    return {
        "model": {
            "weight": weight,
            "tied": weight,  # the same tensor twice (tied embeddings)
            "rows": weight[1:],  # a view into the same storage at an offset
            "transposed": weight.t(),  # non-contiguous
            "half": weight.half(),
            "bfloat16": weight.bfloat16(),
            "double": weight.double(),
            # NaN, infinities, negative zero and the smallest subnormal must survive bit for bit.
            "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-45]),
            "int64": torch.arange(-3, 3) * (2**40),
            "int32": torch.tensor([-(2**31), 2**31 - 1], dtype=torch.int32),
            "int8": torch.tensor([-128, 127], dtype=torch.int8),
            "uint8": torch.tensor([0, 255], dtype=torch.uint8),
            "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(7.5),
            "empty": torch.empty(0, 5),
        },
        "inner_optimizer": {
            "state": {  # optimizer state is keyed by parameter index: ints must stay ints
                0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(4, 3, generator=generator)},
                1: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, generator=generator)},
            },
            "param_groups": [
                {"params": [0], "lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1, "foreach": None},
                {"params": [1], "lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.0, "amsgrad": False},
            ],
        },
        "data": {"epoch": 2, "position": 17, "seed": 2**64 - 1},  # a uint64 seed beyond int64
        "misc": [None, True, False, 0, -1, 2.5, "a/b", "ünïcode", [], {}, (), ((1, 2), [3, (4.0,)])],
        "rng": {"torch": torch.get_rng_state()},
    }


def count_tensors(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        return 1
    if isinstance(tree, dict):
        return sum(count_tensors(value) for value in tree.values())
    if isinstance(tree, list | tuple):
        return sum(count_tensors(value) for value in tree)
    return 0


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("*.tmp-*"))


# --- split_state / join_state -------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_split_join_round_trip_through_json() -> None:
    state = sample_state()
    json_tree, tensors = split_state(state)
    document = json.loads(json.dumps(json_tree))  # what reaches state.json and comes back
    assert_same_tree(join_state(document, tensors), state)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors.values())
    assert len(tensors) == count_tensors(state)  # one safetensors entry per tensor leaf, none lost


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "unsupported",
    [{1, 2}, frozenset(), b"bytes", 1j, object(), torch.float32, torch.device("cpu"), np.int64(3)],
    ids=lambda value: type(value).__name__,
)
def test_split_state_rejects_unsupported_objects(unsupported: object) -> None:
    with pytest.raises(TypeError, match=r"at /a/1/b"):
        split_state({"a": [0, {"b": unsupported}]})


@pytest.mark.timeout(30)
def test_unsupported_object_writes_nothing(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, step_name(1), {"w": torch.ones(3)}, {"step": 1}, keep=2)
    with pytest.raises(TypeError):
        save_checkpoint(tmp_path, step_name(2), {"w": torch.ones(3), "bad": {1, 2}}, {"step": 2}, keep=2)
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", step_name(1)]


# --- save / load --------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_save_then_load_is_bit_identical(tmp_path: Path) -> None:
    state = sample_state()
    meta = {"step": 5, "round": 1, "param_hash": "ab" * 32, "time": 1.5, "nested": {"ids": [1, 2]}}
    path = save_checkpoint(tmp_path, step_name(5), state, meta, keep=2)
    assert path == tmp_path / step_name(5) == latest_checkpoint(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == ["state.json", "tensors.safetensors"]
    loaded_state, loaded_meta = load_checkpoint(path)
    assert_same_tree(loaded_state, state)
    assert loaded_meta == meta


@pytest.mark.timeout(30)
def test_restored_adamw_continues_exactly(tmp_path: Path) -> None:
    """A real AdamW state dict: the resumed optimizer's next step equals the uninterrupted one's."""

    def build() -> tuple[nn.Module, torch.optim.AdamW]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
        return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))

    def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
        inputs = torch.randn(5, 8, generator=torch.Generator().manual_seed(seed))  # (B, 8)
        model(inputs).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model, optimizer = build()
    for seed in range(3):
        train_step(model, optimizer, seed)
    state = {"model": model.state_dict(), "inner_optimizer": optimizer.state_dict()}
    save_checkpoint(tmp_path, step_name(3), state, {"step": 3}, keep=1)
    train_step(model, optimizer, seed=3)  # the uninterrupted run's 4th step

    resumed_model, resumed_optimizer = build()
    loaded, _ = load_checkpoint(tmp_path / step_name(3))
    resumed_model.load_state_dict(loaded["model"])
    resumed_optimizer.load_state_dict(loaded["inner_optimizer"])
    assert_same_tree(resumed_optimizer.state_dict()["param_groups"], state["inner_optimizer"]["param_groups"])
    train_step(resumed_model, resumed_optimizer, seed=3)
    assert_same_tree(resumed_model.state_dict(), model.state_dict())


# --- crash safety -------------------------------------------------------------------------------


class InjectedCrash(Exception):
    """Raised at a named point inside save_checkpoint, as if the process died there."""


def crash_mid_tensor_write(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    real_save_file = checkpoint.save_file

    def torn_save_file(tensors: dict[str, torch.Tensor], filename: str) -> None:
        real_save_file(tensors, filename)
        os.truncate(filename, os.path.getsize(filename) // 2)  # half of the bytes reached the disk
        raise InjectedCrash(filename)

    monkeypatch.setattr(checkpoint, "save_file", torn_save_file)


def crash_mid_json_write(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
    real_write = checkpoint._write_durable

    def torn_write(path: Path, data: bytes) -> None:
        if path.name != "state.json":
            real_write(path, data)
            return
        path.write_bytes(data[: len(data) // 2])
        raise InjectedCrash(str(path))

    monkeypatch.setattr(checkpoint, "_write_durable", torn_write)


def crash_at(function_name: str) -> Callable[[pytest.MonkeyPatch, Path], None]:
    """Crash when ``os.<function_name>`` is called with a destination under the checkpoint root."""

    def inject(monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        real = getattr(os, function_name)

        def crashing(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
            if Path(destination).parent == root:
                raise InjectedCrash(f"{function_name} {source} -> {destination}")
            real(source, destination)

        monkeypatch.setattr(os, function_name, crashing)

    return inject


CRASH_POINTS: dict[str, Callable[[pytest.MonkeyPatch, Path], None]] = {
    "mid-tensor-write": crash_mid_tensor_write,
    "mid-json-write": crash_mid_json_write,
    "before-rename": crash_at("rename"),  # the complete tmp dir never moves into place
    "before-latest": crash_at("replace"),  # the new dir is in place, LATEST still names the old one
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_crash_keeps_previous_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, point: str) -> None:
    previous, new = sample_state(seed=1), sample_state(seed=2)
    save_checkpoint(tmp_path, step_name(1), previous, {"step": 1}, keep=2)
    CRASH_POINTS[point](monkeypatch, tmp_path)
    with pytest.raises(InjectedCrash):
        save_checkpoint(tmp_path, step_name(2), new, {"step": 2}, keep=2)
    monkeypatch.undo()
    if point == "before-latest":
        assert (tmp_path / step_name(2) / "state.json").is_file()
    else:  # the crash left a half-written tmp dir behind, and nothing under the final name
        assert leftovers(tmp_path) == [f"{step_name(2)}.tmp-{os.getpid()}"]
        assert not (tmp_path / step_name(2)).exists()

    assert latest_checkpoint(tmp_path) == tmp_path / step_name(1)
    loaded, meta = load_checkpoint(tmp_path / step_name(1))
    assert_same_tree(loaded, previous)
    assert meta == {"step": 1}

    # The next save completes and removes what the crash left behind.
    save_checkpoint(tmp_path, step_name(2), new, {"step": 2}, keep=2)
    assert leftovers(tmp_path) == []
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(2)
    assert_same_tree(load_checkpoint(tmp_path / step_name(2))[0], new)


# Run in a child process: save_checkpoint SIGKILLed with half of tensors.safetensors on disk, so no
# Python unwinding runs and the leftover carries another process's pid.
_KILLED_SAVE = """
import os, signal, sys
from pathlib import Path
import torch
import node.train.checkpoint as checkpoint

real_save_file = checkpoint.save_file

def torn_save_file(tensors, filename):
    real_save_file(tensors, filename)
    os.truncate(filename, os.path.getsize(filename) // 2)
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint.save_file = torn_save_file
state = {"w": torch.full((1000,), 2.0), "step": 2}
checkpoint.save_checkpoint(Path(sys.argv[1]), "step-0000000002", state, {"step": 2}, keep=2)
raise SystemExit("not killed")
"""


@pytest.mark.timeout(60)
def test_sigkill_mid_write_keeps_previous_checkpoint(tmp_path: Path) -> None:
    previous, new = {"w": torch.full((1000,), 1.0), "step": 1}, {"w": torch.full((1000,), 2.0), "step": 2}
    save_checkpoint(tmp_path, step_name(1), previous, {"step": 1}, keep=2)
    child = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)], capture_output=True, text=True, timeout=50
    )
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(1)
    assert_same_tree(load_checkpoint(tmp_path / step_name(1))[0], previous)
    (dead_dir,) = tmp_path.glob("*.tmp-*")
    assert dead_dir.name != f"{step_name(2)}.tmp-{os.getpid()}" and dead_dir.is_dir()

    save_checkpoint(tmp_path, step_name(2), new, {"step": 2}, keep=2)
    assert leftovers(tmp_path) == []  # the dead process's dir is gone
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(2)
    assert_same_tree(load_checkpoint(tmp_path / step_name(2))[0], new)


# --- pruning, idempotence -----------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("keep", [1, 2, 3])
def test_pruning_keeps_the_newest(tmp_path: Path, keep: int) -> None:
    for step in range(1, 6):
        save_checkpoint(
            tmp_path, step_name(step), {"w": torch.full((3,), float(step))}, {"step": step}, keep=keep
        )
    kept = sorted(p.name for p in tmp_path.iterdir() if p.is_dir())
    assert kept == [step_name(step) for step in range(6 - keep, 6)]
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(5)
    for name in kept:
        state, meta = load_checkpoint(tmp_path / name)
        assert torch.equal(state["w"], torch.full((3,), float(meta["step"])))


@pytest.mark.timeout(30)
def test_saving_the_same_name_twice_is_idempotent(tmp_path: Path) -> None:
    first, second = sample_state(seed=1), sample_state(seed=2)
    path = save_checkpoint(tmp_path, step_name(3), first, {"step": 3}, keep=2)
    files = sorted(path.iterdir())
    before = {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in files}
    # Names are inner steps: the same name means the same state, so the second call writes nothing.
    assert save_checkpoint(tmp_path, step_name(3), second, {"step": 3}, keep=2) == path
    assert {f.name: (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(path.iterdir())} == before
    assert latest_checkpoint(tmp_path) == path
    assert_same_tree(load_checkpoint(path)[0], first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", step_name(3)]


def test_split_state_keeps_nothing_alive_once_its_results_are_dropped() -> None:
    """No reference cycle: the tensors of a saved state are freed at once, not when the cyclic
    garbage collector next runs (a swarm node's memory grew by a state copy per round)."""
    gc.disable()
    try:
        tree, tensors = split_state({"outer": {"global_params": torch.zeros(8)}, "step": 3})
        copy = weakref.ref(tensors["/outer/global_params"])
        del tree, tensors
        assert copy() is None
    finally:
        gc.enable()


@pytest.mark.timeout(30)
def test_a_complete_directory_with_other_meta_is_replaced(tmp_path: Path) -> None:
    """A crash after the rename but before LATEST moved leaves step S complete but unnamed; after the
    restart a swarm may average round S differently, so the same name with another param_hash is a
    new state, written in full (a different wall-clock `time` alone is not)."""
    older, newer = sample_state(seed=1), sample_state(seed=2)
    save_checkpoint(tmp_path, step_name(1), older, {"step": 1, "param_hash": "a"}, keep=3)
    stale = save_checkpoint(
        tmp_path, step_name(2), older, {"step": 2, "param_hash": "b", "time": 1.0}, keep=3
    )
    (tmp_path / "LATEST").write_text(step_name(1))  # as if killed before LATEST was replaced
    same = save_checkpoint(tmp_path, step_name(2), newer, {"step": 2, "param_hash": "b", "time": 2.0}, keep=3)
    assert same == stale and latest_checkpoint(tmp_path) == stale
    assert_same_tree(load_checkpoint(stale)[0], older)  # same meta but the time: nothing rewritten
    save_checkpoint(tmp_path, step_name(2), newer, {"step": 2, "param_hash": "c", "time": 3.0}, keep=3)
    state, meta = load_checkpoint(latest_checkpoint(tmp_path))
    assert_same_tree(state, newer) and meta["param_hash"] == "c"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


@pytest.mark.timeout(30)
def test_incomplete_directory_of_the_same_name_is_replaced(tmp_path: Path) -> None:
    (tmp_path / step_name(2)).mkdir(parents=True)
    (tmp_path / step_name(2) / "tensors.safetensors").write_bytes(b"torn")  # no state.json
    assert latest_checkpoint(tmp_path) is None
    state = sample_state()
    save_checkpoint(tmp_path, step_name(2), state, {"step": 2}, keep=2)
    assert_same_tree(load_checkpoint(tmp_path / step_name(2))[0], state)


# --- crash leftovers, key collisions and unsupported keys ----------------------------------------


@pytest.mark.timeout(30)
def test_leftover_latest_tmp_file_is_removed_by_next_save(tmp_path: Path) -> None:
    tmp_path.joinpath("LATEST.tmp-4194304").write_text("step-0000000001")  # a dead pid's pointer
    save_checkpoint(tmp_path, step_name(2), {"w": torch.ones(2)}, {"step": 2}, keep=2)
    assert leftovers(tmp_path) == []


@pytest.mark.timeout(30)
def test_crash_while_pruning_leaves_nothing_behind(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for step in (1, 2):
        save_checkpoint(tmp_path, step_name(step), {"w": torch.ones(2)}, {"step": step}, keep=2)
    real_rmtree = checkpoint.shutil.rmtree

    def interrupted_rmtree(path: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        if Path(path).name.startswith(step_name(1)):  # the old checkpoint, renamed before deletion
            (Path(path) / "state.json").unlink()  # the first file is gone, then the crash
            raise InjectedCrash(str(path))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(InjectedCrash):
        save_checkpoint(tmp_path, step_name(3), {"w": torch.ones(2)}, {"step": 3}, keep=2)
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / step_name(3)  # the crash came after LATEST moved
    save_checkpoint(tmp_path, step_name(4), {"w": torch.ones(2)}, {"step": 4}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", step_name(3), step_name(4)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "tree",
    [
        {"a/b": torch.tensor([1.0]), "a": {"b": torch.tensor([2.0])}},
        {1: torch.tensor([1.0]), "1": torch.tensor([2.0])},
    ],
    ids=["slash-in-key", "int-and-str-key"],
)
def test_colliding_tensor_paths_round_trip_or_raise(tmp_path: Path, tree: dict[Any, Any]) -> None:
    try:
        save_checkpoint(tmp_path, step_name(1), tree, {"step": 1}, keep=2)
    except ValueError:
        return  # refusing the tree is a correct fix too
    assert_same_tree(load_checkpoint(tmp_path / step_name(1))[0], tree)


@pytest.mark.timeout(30)
def test_tuple_dict_key_round_trips_or_is_refused(tmp_path: Path) -> None:
    tree = {"k": {(1, 2): torch.ones(2)}}
    try:
        save_checkpoint(tmp_path, step_name(1), tree, {"step": 1}, keep=2)
    except (TypeError, ValueError):
        assert latest_checkpoint(tmp_path) is None  # refused before anything became LATEST
        return
    assert_same_tree(load_checkpoint(tmp_path / step_name(1))[0], tree)


# --- end to end: dtnode join SIGKILLed at random moments ----------------------------------------


def dtnode_argv(corpus: Path, run_dir: Path) -> list[str]:
    """`dtnode ARGV`, forked from the preloaded server (a fresh interpreter spends ~3 CPU-s importing);
    offline (``--no-swarm``: the checkpoints are the subject, a DHT peer and gRPC server would only
    add their start and their orphans after each SIGKILL)."""
    return [
        "join", "--no-swarm", "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "2",
        "--eval-batches", "1", "--data", str(corpus), "--run-dir", str(run_dir), "--log-every", "1000",
        "--keep-checkpoints", "2", "--checkpoint-every", "1", "--threads", "1",
    ]  # fmt: skip


def e2e_config(corpus: Path, run_dir: Path, **overrides: Any) -> NodeConfig:
    """The config dtnode_argv gives the node (threads left alone: this is the test process)."""
    return NodeConfig.from_flat(
        model="nano", seq_len=32, batch_size=4, inner_steps=2, eval_batches=1, data=str(corpus),
        run_dir=str(run_dir), log_every=1000, keep_checkpoints=2, swarm=False, **overrides,
    )  # fmt: skip


@pytest.fixture
def node_process() -> Iterator[list[ForkedProcess]]:
    """Collects started nodes and kills any still running when the test ends, pass or fail."""
    started: list[ForkedProcess] = []
    yield started
    for process in started:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def wait_for_new_checkpoint(
    root: Path, previous: Path | None, process: ForkedProcess, log_path: Path
) -> Path:
    deadline = time.monotonic() + 60
    while (current := latest_checkpoint(root)) in (None, previous):
        assert process.poll() is None, f"node exited early:\n{log_path.read_text()}"
        assert time.monotonic() < deadline, f"no new checkpoint within 60 s:\n{log_path.read_text()}"
        time.sleep(0.02)
    assert current is not None
    return current


@pytest.mark.timeout(180)
def test_sigkilled_node_resumes_from_latest_checkpoint(
    tmp_path: Path, node_process: list[ForkedProcess]
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(inspect.getsource(inspect))  # ~130 KB of text
    run_dir, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    rng = random.Random(1234)
    previous: Path | None = None
    previous_step = 0
    for cycle in range(3):
        log_path = tmp_path / f"node-{cycle}.log"
        process = fork_node(dtnode_argv(corpus, run_dir), log_path)
        node_process.append(process)
        previous = wait_for_new_checkpoint(root, previous, process, log_path)
        delay = rng.uniform(0.0, 1.0)  # anywhere in the following rounds, saves included
        time.sleep(delay)
        os.kill(process.pid, signal.SIGKILL)  # the node's process alone, as before
        assert process.wait(timeout=10) == -signal.SIGKILL

        latest = latest_checkpoint(root)
        assert latest is not None, f"cycle {cycle}, killed {delay:.3f} s after a checkpoint"
        state, meta = load_checkpoint(latest)
        assert meta["step"] > previous_step and meta["step"] == 2 * meta["round"]
        trainer = Trainer(e2e_config(corpus, run_dir))
        trainer.metrics.close()
        assert trainer.resumed_from == latest
        assert trainer.progress.step == meta["step"]
        assert trainer.diloco.param_hash() == meta["param_hash"]
        assert_same_tree(dict(trainer.model.state_dict()), state["model"])  # a dict, not an OrderedDict
        previous, previous_step = latest, meta["step"]

    # One more round in-process: its save removes every tmp dir the killed nodes left behind.
    Trainer(e2e_config(corpus, run_dir, max_rounds=meta["round"] + 1)).run()
    assert [p.name for p in root.glob("*.tmp-*") if p.is_dir()] == []
    complete = sorted(p.name for p in root.iterdir() if (p / "state.json").is_file())
    assert latest_checkpoint(root) == root / complete[-1] == root / step_name(previous_step + 2)
