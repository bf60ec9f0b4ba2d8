"""A state served in fragments (``--fragments F``): a piece per fragment, a round makes one fragment's
new pieces and reuses the others' (memory and hashes), and a joiner puts the whole state together
bit for bit, or refuses pieces that do not fit (issue 32: the served state made fragment-sized)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
import torch

import node.train.trainer as trainer_module
from node.model.gpt import GPT, model_config
from node.outer.fragments import FragmentedDiLoCo, FragmentPlan, model_fragment_plan
from node.outer.host_copy import HostCopies
from node.swarm.session import SwarmSession
from node.swarm.state import (
    GLOBAL_PARAMS,
    adopted_state,
    fragment_name,
    momentum_sha256,
    served_state,
    state_snapshot,
)
from node.train.trainer import Trainer
from protocol.statesync import Snapshot
from tests.node.swarm.test_catch_up import SwarmOfOne
from tests.node.swarm.test_swarm_session import corpus_file, small_config

CORPUS = "c" * 64

__all__ = ["corpus_file"]  # fixture


def _fragmented() -> FragmentedDiLoCo:
    torch.manual_seed(0)
    return FragmentedDiLoCo(GPT(model_config("nano", vocab_size=64, seq_len=16)), model_fragment_plan(
        GPT(model_config("nano", vocab_size=64, seq_len=16)), 4), outer_lr=0.7, outer_momentum=0.9)  # fmt: skip


def _served(fragmented: FragmentedDiLoCo, host: HostCopies, round: int, reuse: Snapshot | None) -> Snapshot:
    state = host.get()
    assert state.fragments is not None
    return state_snapshot(
        fragments=state.fragments, param_hash=state.param_hash, copy=False, round=round, step=round * 8,
        data={}, model="nano", corpus_sha256=CORPUS, reuse=reuse,
    )  # fmt: skip


def test_a_round_serves_one_new_fragment_and_a_joiner_assembles_the_whole_state_bit_for_bit() -> None:
    fragmented = _fragmented()
    host = HostCopies(fragmented.diloco)
    first = _served(fragmented, host, 0, None)
    assert set(first.tensors) == {
        fragment_name(n, f) for n in ("global_params", "outer_momentum") for f in range(4)
    }
    fragmented.land(2, torch.full((fragmented.num_elements(2),), 0.01), mix=0.0)
    second = _served(fragmented, host, 1, first)
    changed = {
        name for name in second.tensors if second.tensors[name].data_ptr() != first.tensors[name].data_ptr()
    }
    assert changed == {"global_params.2", "outer_momentum.2"}  # the other pieces: the same memory
    for name in second.tensors:  # every piece's hashes are its bytes' (reused or made)
        raw = second.tensors[name].numpy().tobytes()
        assert second.sha256(name) == hashlib.sha256(raw).digest()
    whole_params = fragmented.global_params()
    whole_momentum = fragmented.outer.momentum()
    assert whole_momentum is not None
    expected_momentum = hashlib.sha256(whole_momentum.numpy().tobytes()).hexdigest()
    assert momentum_sha256(second) == expected_momentum
    assert second.state_id == hashlib.sha256(whole_params.numpy().tobytes()).hexdigest()
    adopted = adopted_state(second, num_elements=fragmented.diloco.num_elements, corpus_sha256=CORPUS,
                            assemble=fragmented.outer.assemble)  # fmt: skip
    assert torch.equal(adopted.global_params, whole_params)
    assert adopted.outer_momentum is not None and torch.equal(adopted.outer_momentum, whole_momentum)
    assert adopted.param_hash == second.state_id and adopted.round == 1


def _pieces_changed(snapshot: Snapshot, change: str) -> Snapshot:
    tensors = dict(snapshot.tensors)
    metadata = json.loads(snapshot.metadata)
    if change == "missing":
        del tensors["global_params.3"]
    elif change == "dtype":
        tensors["global_params.1"] = tensors["global_params.1"].double()
    elif change == "size":
        tensors["global_params.0"] = tensors["global_params.0"][:-1]
    elif change == "momentum_missing":
        del tensors["outer_momentum.2"]
    elif change == "no_count":
        del metadata["fragments"]
    return Snapshot(round_id=snapshot.round_id, state_id=snapshot.state_id, tensors=tensors,
                    metadata=json.dumps(metadata).encode())  # fmt: skip


@pytest.mark.parametrize("change", ["missing", "dtype", "size", "momentum_missing", "no_count"])
def test_a_state_in_fragments_that_do_not_fit_is_refused(change: str) -> None:
    fragmented = _fragmented()
    snapshot = _served(fragmented, HostCopies(fragmented.diloco), 0, None)
    with pytest.raises(ValueError, match="fragment|fp32|pieces|global_params"):
        adopted_state(_pieces_changed(snapshot, change), num_elements=fragmented.diloco.num_elements,
                      corpus_sha256=CORPUS, assemble=fragmented.outer.assemble)  # fmt: skip


def test_a_whole_model_node_refuses_a_state_served_in_fragments_and_reads_a_whole_one() -> None:
    fragmented = _fragmented()
    snapshot = _served(fragmented, HostCopies(fragmented.diloco), 0, None)
    with pytest.raises(ValueError, match="served in 4 fragments and this node trains the whole model"):
        served_state(snapshot)
    whole = state_snapshot(global_params=fragmented.global_params(), outer_momentum=fragmented.outer.momentum(),
                           round=0, step=0, data={}, model="nano", corpus_sha256=CORPUS)  # fmt: skip
    params, _ = served_state(whole, fragmented.outer.assemble)  # a whole state needs no assembly
    assert params is whole.tensors[GLOBAL_PARAMS] and momentum_sha256(whole) == momentum_sha256(snapshot)


def _identity_of(corpus_file: Path, run_dir: Path) -> str:
    """The identity a node with ``--fragments 2`` announces (``JoinRequest.identity``)."""
    trainer = Trainer(
        small_config(corpus_file, run_dir, fragments=2, max_rounds=1),
        swarm=SwarmSession(SwarmOfOne(), joining=False),  # type: ignore[arg-type]
    )
    trainer.run()
    assert trainer.round.swarm is not None
    return trainer.round.swarm.identity.identity


@pytest.mark.timeout(120)
def test_nodes_that_split_the_model_into_other_fragments_are_another_run(
    corpus_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes with the same F but another split (another version's rule) would average fragment
    vectors of other parameters and serve pieces that do not line up: their identities differ, so
    they never share a round or a state; the same split gives the same identity."""
    ours = _identity_of(corpus_file, tmp_path / "a")
    assert _identity_of(corpus_file, tmp_path / "b") == ours
    real = trainer_module.model_fragment_plan

    def swapped(model: torch.nn.Module, num_fragments: int) -> FragmentPlan:
        plan = real(model, num_fragments)  # the first two parameters trade fragments
        first, second = plan.fragments
        moved = (tuple(sorted((second[0], *first[1:]))), tuple(sorted((first[0], *second[1:]))))
        return dataclasses.replace(plan, fragments=moved)

    monkeypatch.setattr(trainer_module, "model_fragment_plan", swapped)
    assert _identity_of(corpus_file, tmp_path / "c") != ours
