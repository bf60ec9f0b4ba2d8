"""DiLoCo's outer state sharded over a node's local ranks (``node/parallel/outer.py``).

A node with 2 (tp=2) or 3 (pp=3) local gloo ranks holds θ_global and the outer momentum in contiguous
ranges, one per rank. Reference: the flat outer state of ``node.outer.state`` (``torch.optim.SGD`` on
the whole vector) over the same replica, fed the same pseudo-gradient means: since the outer step is
elementwise, every range must come out bit-identical to the flat vector's, and so must the pseudo-gradient,
the params written into the model, the hash and a checkpoint (which loads either way). Each rank holds
its 1/K of the 2 N numbers, and rank 0 no flat copy.

Each check runs in a process forked from the preloaded forkserver (``in_forked_process``): a process with
one thread forks its local ranks (``node/parallel/local.py``), where the test process, with pytest's
threads, would spawn them, each a fresh interpreter importing torch and the node (~4 CPU-seconds a rank,
most of what these checks cost).
"""

from __future__ import annotations

import multiprocessing.context
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from node.config import NodeConfig
from node.model.gpt import model_config
from node.model.replica import ParallelReplica
from node.outer.diloco import DiLoCo
from node.outer.state import FlatOuterState, tensor_hash
from node.parallel.outer import ShardedOuterState, shard_ranges
from node.train.trainer import build_replica
from tests.node.parallel_support import fixed_batches, spawned_workers

SETTINGS = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def swarm_mean(delta: torch.Tensor) -> torch.Tensor:
    """A 'swarm mean' that is a fixed function of our Δ (as if another node sent −Δ/3 + 0.01)."""
    return (delta - delta / 3) / 2 + 0.005


def build(layout: dict[str, int], tmp_path: Path, sharding: str = "on") -> ParallelReplica:
    config = NodeConfig.from_flat(
        run_dir=str(tmp_path), model="nano", seq_len=32, batch_size=4, threads=1, seed=7,
        local_bucket_mb=0.1, outer_sharding=sharding, **layout,  # ~37 buckets, each cut by the ranks' ranges
    )  # fmt: skip
    replica = build_replica(config, model_config("nano", seq_len=32), torch.device("cpu"))
    assert isinstance(replica, ParallelReplica)
    return replica


def _run_check(check: Callable[..., None], tmp_path: Path, *args: object) -> None:
    """In the forked process: ``check(*args, tmp_path)``, its traceback written to ``failure.txt`` if it fails."""
    try:
        check(*args, tmp_path)
    except BaseException:
        (tmp_path / "failure.txt").write_text(traceback.format_exc())
        raise


def in_forked_process(check: Callable[..., None], tmp_path: Path, *args: object) -> None:
    """``check(*args, tmp_path)`` in a process forked from the preloaded forkserver; its failure is ours."""
    failure = tmp_path / "failure.txt"
    try:
        with spawned_workers(_run_check, [(check, tmp_path, *args)], deadline=timedelta(seconds=200)):
            pass
    finally:
        if failure.exists():
            pytest.fail(failure.read_text(), pytrace=False)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("layout", "offload"),
    [({"local_workers": 2, "tp": 2}, False), ({"local_workers": 3, "pp": 3, "microbatches": 4}, True)],
)
def test_sharded_outer_steps_match_the_flat_state_bit_for_bit(
    layout: dict[str, int], offload: bool, tmp_path: Path
) -> None:
    """(``offload``: the ranks keep their ranges on the CPU; on this CPU machine the same place.)"""
    in_forked_process(_check_sharded_outer_steps, tmp_path, layout, offload)


def _check_sharded_outer_steps(layout: dict[str, int], offload: bool, tmp_path: Path) -> None:
    replica = build(layout, tmp_path)
    # Forked, not spawned: the CPU this module saves (see the docstring).
    assert all(isinstance(p, multiprocessing.context.ForkProcess) for p in replica.workers.processes)
    try:
        sharded = replica.outer_state(offload=offload, **SETTINGS)
        assert isinstance(sharded, ShardedOuterState)
        flat = FlatOuterState(replica, device=torch.device("cpu"), **SETTINGS)
        diloco = DiLoCo(replica.model, local=replica, outer=sharded)
        assert torch.equal(sharded.params(), flat.params())
        assert sharded.momentum() is None
        initial = flat.params().clone()
        batches = fixed_batches()
        for round_index in range(3):  # three rounds: Nesterov with a momentum built up
            for batch in batches[3 * round_index : 3 * round_index + 3]:
                replica.train_step([batch], lr=1e-3)
            flat_delta = flat.delta()
            delta = diloco.pseudo_gradient()
            assert torch.equal(delta, flat_delta)  # the same Δ (from the same model)
            diloco.outer_step(swarm_mean(delta))
            flat.step(swarm_mean(flat_delta))
            # The sharded step: the same SGD arithmetic per range.
            assert diloco.param_hash() == flat.hash() == tensor_hash(sharded.params())
            assert torch.equal(sharded.params(), flat.params())
            momentum, flat_momentum = sharded.momentum(), flat.momentum()
            assert momentum is not None and flat_momentum is not None
            assert torch.equal(momentum, flat_momentum)
            assert torch.equal(replica.read_params("cpu"), flat.params())  # θ_local ← θ_global
        moved = float((flat.params() - initial).norm() / initial.norm())
        assert moved > 1e-3, moved  # the rounds changed θ_global: equality above is not vacuous

        # Each rank holds its range of both vectors, nothing more.
        num_elements = flat.num_elements
        ranges = shard_ranges(num_elements, layout["local_workers"])
        assert sharded.num_bytes_per_rank() == [8 * (last - first) for first, last in ranges.values()]
        assert max(ranges[r][1] - ranges[r][0] for r in ranges) <= num_elements // layout["local_workers"] + 1

        # A checkpoint of either loads into the other (the flat SGD's state-dict format).
        state = diloco.state_dict()
        other = FlatOuterState(replica, device=torch.device("cpu"), **SETTINGS)
        DiLoCo(replica.model, local=replica, outer=other).load_state_dict(state)
        assert torch.equal(other.params(), flat.params())
        assert torch.equal(other.momentum(), flat.momentum())  # type: ignore[arg-type]
        diloco.load_global_state(torch.zeros(num_elements), None)
        assert sharded.momentum() is None and diloco.param_hash() == tensor_hash(torch.zeros(num_elements))
        diloco.load_state_dict(  # torch's own SGD state dict, as a single-process node saves it
            {"global_params": flat.params().clone(), "outer_optimizer": flat.optimizer.state_dict()}
        )
        assert diloco.param_hash() == flat.hash()
        assert torch.equal(sharded.momentum(), flat.momentum())  # type: ignore[arg-type]
    finally:
        replica.close()


def test_shard_ranges_tile_the_vector_in_nearly_equal_pieces() -> None:
    for num_elements, world_size in [(10, 3), (919_680, 4), (2, 3), (7, 1)]:
        ranges = shard_ranges(num_elements, world_size)
        assert sorted(ranges) == list(range(world_size))
        ends = [ranges[rank] for rank in range(world_size)]
        assert ends[0][0] == 0 and ends[-1][1] == num_elements
        assert all(ends[i][1] == ends[i + 1][0] for i in range(world_size - 1))
        sizes = [last - first for first, last in ends]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="auto shards on GPUs")
def test_on_cpu_the_outer_state_stays_flat_unless_asked(tmp_path: Path) -> None:
    """``--outer-sharding auto`` (the default) keeps it whole on rank 0 when the ranks share the host's
    memory: shards would only add the gathered copy a joiner fetches beside them."""
    in_forked_process(_check_flat_unless_asked, tmp_path)


def _check_flat_unless_asked(tmp_path: Path) -> None:
    replica = build({"local_workers": 2, "tp": 2}, tmp_path, sharding="auto")
    try:
        assert replica.outer_state(offload=False, **SETTINGS) is None
    finally:
        replica.close()
