"""Adopting the swarm's state, with no sockets: OuterRound.snapshot -> adopted_state -> the loop's
one adoption path (``OuterRound``, handed the state by a fake swarm side at join or as a round's
``Adopt`` answer).

A joiner that adopts a peer's snapshot must be that peer as far as the swarm can tell: the same
global params (param_hash), outer momentum, counters and data position. The inner AdamW state is
deliberately *not* part of it (DiLoCo keeps it per node, ``OuterRound._adopt``), so to compare whole
training trajectories the test hands the joiner the source's inner state too; then every loss and
the next round's param_hash must match bit for bit. The model has no dropout and the data order
is a pure function of (seed, epoch, position), so no RNG state is involved.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import inspect
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from node.config import NodeConfig
from node.data.batches import load_corpus
from node.ops.metrics import read_metrics
from node.outer.diloco import DiLoCo, flatten_params
from node.outer.round import RoundApplied
from node.outer.seam import (
    Averaged,
    OuterStepper,
    RoundOutcome,
    RoundRequest,
    Stepped,
)
from node.swarm.state import (
    GLOBAL_PARAMS,
    OUTER_MOMENTUM,
    ROUND_MEAN,
    ROUND_MEAN_CHUNKS,
    ROUND_MEAN_PAYLOAD,
    RoundMean,
    adopted_state,
    caught_up_state,
    round_mean_id,
    round_mean_snapshot,
    served_codec,
)
from node.train.trainer import Trainer
from protocol.allreduce.allreduce import EncodedChunk
from protocol.codecs import get_codec
from protocol.gen.dtnode.v1 import allreduce_pb2 as pb
from protocol.statesync.snapshot import Snapshot
from tests.node.outer.scripted_swarm import ScriptedSwarm


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(inspect.getsource(inspect) * 2)  # ~250 KB of Python source
    return path


def small_config(corpus_file: Path, run_dir: Path, **overrides: object) -> NodeConfig:
    settings: dict[str, object] = dict(
        model="nano", seq_len=32, batch_size=4, inner_steps=2, eval_batches=2, warmup_steps=2,
        total_steps=30, data=str(corpus_file), run_dir=str(run_dir), log_every=100, inner_lr=3e-3,
        eval_every=1,  # every round's eval_loss is compared
    )  # fmt: skip
    settings.update(overrides)
    return NodeConfig.from_flat(**settings)


def end_phase(trainer: Trainer) -> RoundApplied:
    """Inner steps as the loop runs them (``OuterRound.at_step_boundary`` after each) until the phase
    ends; the round applied then."""
    for _ in range(trainer.config.inner.steps):
        trainer.inner_step()
        applied = trainer.round.at_step_boundary()
        if applied is not None:
            return applied
    raise AssertionError("the phase did not end after H inner steps")


def round_record(trainer: Trainer) -> dict[str, Any]:
    """The phase's end and the record of the round it applied, as ``metrics.jsonl`` holds it."""
    applied = end_phase(trainer)
    record = read_metrics(trainer.metrics.path, kind="round")[-1]
    assert (record["round"], record["param_hash"]) == (trainer.progress.round, applied.param_hash)
    return record


def stepper(trainer: Trainer) -> OuterStepper:
    """Steps a copy of an outer state with a round's mean, as the loop hands it to the swarm
    (``JoinRequest.stepper``)."""
    return lambda mean, start: trainer.diloco.stepped(mean, start=start)


def held(trainer: Trainer) -> Stepped:
    """The (global params, outer momentum) ``trainer`` holds."""
    return trainer.diloco.global_params, trainer.diloco.momentum_buffer()


@pytest.mark.timeout(120)
def test_adopter_becomes_the_source_and_trains_on_bit_identically(corpus_file: Path, tmp_path: Path) -> None:
    source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=1))
    source.run()  # 2 inner steps and one outer step: the outer momentum exists now
    source.batches.reshard(1, 2)  # as after a round in a group of two
    live_momentum = source.diloco.momentum_buffer()
    assert live_momentum is not None and bool(live_momentum.abs().sum() > 0)
    source_momentum = live_momentum.clone()  # the optimizer updates its buffer in place

    snapshot = source.round.snapshot()
    source_hash = source.diloco.param_hash()
    global_bytes = source.diloco.global_params.detach().numpy().tobytes()
    assert snapshot.state_id == source_hash == hashlib.sha256(global_bytes).hexdigest()
    assert snapshot.sha256(GLOBAL_PARAMS).hex() == source_hash  # what a fetcher verifies
    assert snapshot.round_id == 1 and set(snapshot.tensors) == {GLOBAL_PARAMS, OUTER_MOMENTUM}

    handover = ScriptedSwarm()
    joiner = Trainer(small_config(corpus_file, tmp_path / "joiner", seed=1, data_seed=5), swarm=handover)
    assert joiner.diloco.param_hash() != source_hash
    state = adopted_state(
        snapshot, num_elements=joiner.diloco.num_elements, corpus_sha256=joiner.corpus.sha256
    )
    handover.hand(state)
    joiner.round.start()  # what Trainer.run does first: join the swarm, which answers with its state

    assert joiner.diloco.param_hash() == source_hash
    assert [served.state_id for served in handover.served] == [source_hash]  # served once loaded
    assert torch.equal(flatten_params(joiner.diloco.params, device="cpu"), source.diloco.global_params)
    joiner_momentum = joiner.diloco.momentum_buffer()
    assert joiner_momentum is not None and torch.equal(joiner_momentum, source_momentum)
    assert (
        (joiner.progress.step, joiner.progress.round)
        == (source.progress.step, source.progress.round)
        == (2, 1)
    )
    # The lineage's data position comes along, the source's shard does not (the snapshot's metadata
    # must be the same on every member); the joiner reads shard 0 until the next round assigns its own.
    assert {**joiner.batches.state_dict(), "shard_index": 1} == source.batches.state_dict()
    assert (joiner.batches.seed, joiner.batches.shard_index, joiner.batches.num_shards) == (0, 0, 2)
    joiner.batches.reshard(1, 2)  # read what the source reads, to compare trajectories below
    assert joiner.schedule.lr(joiner.progress.step) == source.schedule.lr(source.progress.step)
    assert joiner.evaluate() == source.evaluate()

    # The inner AdamW state is the node's own (kept by adoption); hand over the source's to compare
    # trajectories. Everything else the next round depends on came with the snapshot.
    joiner.replica.load_optimizer_state(copy.deepcopy(source.replica.optimizer_state()))
    source_steps = [source.inner_step() for _ in range(2)]
    joiner_steps = [joiner.inner_step() for _ in range(2)]
    assert [s["loss"] for s in joiner_steps] == [s["loss"] for s in source_steps]
    assert [s["lr"] for s in joiner_steps] == [s["lr"] for s in source_steps]
    assert [s["step"] for s in joiner_steps] == [3, 4]
    # The outer Nesterov step reads the momentum: equal hashes after it need the adopted momentum.
    source_round, joiner_round = round_record(source), round_record(joiner)
    assert joiner_round["param_hash"] == source_round["param_hash"] != source_hash
    assert joiner_round["round"] == source_round["round"] == 2
    assert joiner_round["eval_loss"] == source_round["eval_loss"]

    # The adopter copied the snapshot's tensors: training on did not write into them.
    assert hashlib.sha256(snapshot.tensors[GLOBAL_PARAMS].numpy().tobytes()).hexdigest() == source_hash
    assert torch.equal(snapshot.tensors[OUTER_MOMENTUM], source_momentum)
    assert not torch.equal(joiner_momentum, source_momentum)  # the joiner's own buffer moved on


@pytest.mark.timeout(120)
def test_adopted_state_rejects_another_model_or_corpus(corpus_file: Path, tmp_path: Path) -> None:
    nano = Trainer(small_config(corpus_file, tmp_path / "nano"))
    snapshot = nano.round.snapshot()  # before any outer step: no momentum
    state = adopted_state(snapshot, num_elements=nano.diloco.num_elements, corpus_sha256=nano.corpus.sha256)
    assert state.outer_momentum is None and state.round == 0 and state.param_hash == nano.diloco.param_hash()

    tiny = Trainer(small_config(corpus_file, tmp_path / "tiny", model="tiny"))
    with pytest.raises(ValueError, match="parameters"):
        adopted_state(snapshot, num_elements=tiny.diloco.num_elements, corpus_sha256=tiny.corpus.sha256)

    other_file = tmp_path / "other.txt"
    other_file.write_text(inspect.getsource(os) * 2)
    other_corpus = load_corpus(str(other_file), val_fraction=nano.config.corpus.val_fraction)
    assert other_corpus.sha256 != nano.corpus.sha256
    with pytest.raises(ValueError, match="corpus"):
        adopted_state(snapshot, num_elements=nano.diloco.num_elements, corpus_sha256=other_corpus.sha256)

    # Metadata that fits but tensors that do not: the tensors are checked too.
    metadata = json.loads(snapshot.metadata)
    wrong_dtype = Snapshot(
        round_id=0,
        state_id=snapshot.state_id,
        tensors={GLOBAL_PARAMS: snapshot.tensors[GLOBAL_PARAMS].to(torch.float64)},
        metadata=json.dumps(metadata).encode(),
    )
    with pytest.raises(ValueError, match="fp32"):
        adopted_state(wrong_dtype, num_elements=nano.diloco.num_elements, corpus_sha256=nano.corpus.sha256)
    short_momentum = Snapshot(
        round_id=0,
        state_id=snapshot.state_id,
        tensors={GLOBAL_PARAMS: snapshot.tensors[GLOBAL_PARAMS], OUTER_MOMENTUM: torch.zeros(3)},
        metadata=snapshot.metadata,
    )
    with pytest.raises(ValueError, match="outer_momentum"):
        adopted_state(short_momentum, num_elements=nano.diloco.num_elements, corpus_sha256=nano.corpus.sha256)
    not_an_object = Snapshot(round_id=0, state_id="x", tensors={}, metadata=b"[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        adopted_state(not_an_object, num_elements=nano.diloco.num_elements, corpus_sha256=nano.corpus.sha256)


@pytest.mark.timeout(30)
def test_load_global_state_without_momentum_restarts_nesterov() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)  # 15 parameters
    diloco = DiLoCo(model, outer_lr=0.7, outer_momentum=0.9)
    with torch.no_grad():
        for param in diloco.params:
            param.sub_(0.1)
    diloco.outer_step(diloco.pseudo_gradient())  # a swarm of one: the mean is our own Δ
    kept_momentum = diloco.momentum_buffer()
    assert kept_momentum is not None and bool(kept_momentum.abs().sum() > 0)

    generator = torch.Generator().manual_seed(1)
    global_params = torch.randn(15, generator=generator)
    diloco.load_global_state(global_params, None)
    assert diloco.momentum_buffer() is None
    assert torch.equal(diloco.global_params, global_params)
    assert torch.equal(flatten_params(diloco.params, device="cpu"), global_params)  # the model follows

    # Next outer step from fresh momentum: buf = Δ, update = Δ + 0.9 buf (torch's Nesterov SGD),
    # computed here by hand; a kept buffer would add 0.9 x 0.9 x the old one.
    local = global_params - torch.randn(15, generator=generator)
    with torch.no_grad():
        offset = 0
        for param in diloco.params:
            param.copy_(local[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
    delta = global_params - local
    assert torch.equal(diloco.pseudo_gradient(), delta)
    diloco.outer_step(delta)
    expected = global_params - 0.7 * (delta + 0.9 * delta)
    torch.testing.assert_close(diloco.global_params.detach(), expected)
    momentum = diloco.momentum_buffer()
    assert momentum is not None and torch.equal(momentum, delta)

    with pytest.raises(ValueError, match="momentum"):
        diloco.load_global_state(global_params, torch.zeros(14))
    with pytest.raises(ValueError, match="global params"):
        diloco.load_global_state(torch.zeros(16), None)


class RecordingAverager:
    """A swarm of one whose mean went through the wire codec ``codec`` in chunks, as an all-reduce
    hands it back; it keeps each round's mean, the bytes it was decoded from and the lineage the
    round stepped from (a ``RoundMean``)."""

    def __init__(self, codec: str = "int8", chunk: int = 10_000, density: float | None = None) -> None:
        self.codec, self.chunk = get_codec(codec, density=density), chunk
        self.means: list[RoundMean] = []

    def average(self, vector: torch.Tensor, request: RoundRequest) -> RoundOutcome:
        chunks, mean = [], torch.empty_like(vector)
        for offset in range(0, vector.numel(), self.chunk):
            piece = vector[offset : offset + self.chunk]
            payload = self.codec.encode(piece).numpy().tobytes()
            self.codec.decode_into(payload, mean[offset : offset + piece.numel()])
            chunks.append(EncodedChunk(offset, piece.numel(), payload))
        self.means.append(
            RoundMean(
                previous=request.lineage, mean=mean, encoded=tuple(chunks), codec=self.codec.name,
                block_size=self.codec.block_size, kept_per_block=self.codec.spec().kept_per_block,
            )
        )  # fmt: skip
        return RoundOutcome(Averaged(mean))


def one_round(trainer: Trainer, recorder: RecordingAverager) -> RoundMean:
    """An inner phase and its outer round averaged by ``recorder``; the round's mean."""
    trainer.round.averager = recorder
    applied = end_phase(trainer)
    assert isinstance(applied.decision, Averaged)
    return recorder.means[-1]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("codec", "encoded"),
    [("int8", True), ("int8", False), ("topk", True)],
    ids=["int8-bytes", "fp32", "topk-bytes"],
)
def test_a_member_one_round_behind_steps_to_the_swarms_state_with_the_round_mean(
    corpus_file: Path, tmp_path: Path, codec: str, encoded: bool
) -> None:
    source = Trainer(small_config(corpus_file, tmp_path / "source", max_rounds=1))
    source.run()  # round 1: the outer momentum exists from here on
    handover = ScriptedSwarm()
    behind = Trainer(small_config(corpus_file, tmp_path / "behind", seed=1, data_seed=5), swarm=handover)
    handover.hand(adopted_state(source.round.snapshot(), num_elements=behind.diloco.num_elements,
                                corpus_sha256=behind.corpus.sha256))  # fmt: skip
    behind.round.start()  # joins on the swarm's state after round 1
    previous = (1, source.diloco.param_hash())
    assert (behind.progress.round, behind.diloco.param_hash()) == previous

    # topk at 3%, not the default 1.5%: the served bytes must say how many numbers a block kept.
    recorder = RecordingAverager(codec, density=0.03 if codec == "topk" else None)
    round_mean = one_round(source, recorder)  # round 2, without `behind`
    assert round_mean.previous == previous
    if not encoded:
        round_mean = dataclasses.replace(round_mean, encoded=None)
    state = source.round.snapshot()
    mean = round_mean_snapshot(state, round_mean)
    assert mean.state_id == round_mean_id(state.state_id) and mean.round_id == 2
    if encoded:  # int8: one byte per number plus a 4-byte scale per 256-number block, and the chunk table
        assert set(mean.tensors) == {ROUND_MEAN_PAYLOAD, ROUND_MEAN_CHUNKS}
        assert mean.num_bytes < state.num_bytes / 7
        payload_bytes = sum(
            recorder.codec.encoded_num_bytes(c.num_elements) for c in round_mean.encoded or ()
        )
        assert mean.tensors[ROUND_MEAN_PAYLOAD].numel() == payload_bytes
        if codec == "topk":  # 123 of 4096: 2 bits + ~7.9 of Elias-Fano position each, 8 bytes of scales
            assert mean.num_bytes < state.num_bytes / 100
    else:
        assert set(mean.tensors) == {ROUND_MEAN} and mean.num_bytes * 2 == state.num_bytes

    target = (2, state.state_id)
    caught_up = caught_up_state(
        stepper(behind), mean, previous=previous, target=target, start=held(behind),
        num_elements=behind.diloco.num_elements, corpus_sha256=behind.corpus.sha256,
    )  # fmt: skip
    assert caught_up.caught_up
    handover.hand(caught_up)  # behind's next round (which it missed) answers with it
    applied = end_phase(behind)
    assert applied.kind == "adopted" and applied.caught_up and applied.param_hash == state.state_id
    # Now the same as the source as far as the swarm can tell, and as a full fetch would have made it.
    assert behind.diloco.param_hash() == source.diloco.param_hash() == state.state_id
    assert torch.equal(behind.diloco.momentum_buffer(), source.diloco.momentum_buffer())
    assert (
        (behind.progress.step, behind.progress.round)
        == (source.progress.step, source.progress.round)
        == (4, 2)
    )
    assert behind.batches.state_dict() == {**source.batches.state_dict(), "shard_index": 0}
    assert behind.round.snapshot().metadata == state.metadata  # it serves the same bytes on
    assert handover.served[-1].metadata == state.metadata
    assert caught_up.round_mean is not None
    again = round_mean_snapshot(behind.round.snapshot(), caught_up.round_mean)
    assert again.metadata == mean.metadata
    assert all(torch.equal(again.tensors[name], tensor) for name, tensor in mean.tensors.items())


def test_the_served_codec_is_the_one_the_round_encoded_with() -> None:
    topk = served_codec({"name": "topk", "block_size": 4096, "kept_per_block": 123})
    assert topk.spec().kept_per_block == 123 and topk.block_size == 4096
    topk4 = served_codec({"name": "topk4", "block_size": 4096, "kept_per_block": 36})
    assert topk4.spec() == pb.CodecSpec(kind=pb.CODEC_KIND_TOPK4, block_size=4096, kept_per_block=36)
    assert served_codec({"name": "int8", "block_size": 256, "kept_per_block": 0}).block_size == 256
    for spec in (
        {"name": "topk", "block_size": 4096},  # kept_per_block unsaid: the default density would misread it
        {"name": "topk", "block_size": 4096, "kept_per_block": 4097},
        {"name": "topk", "block_size": 0, "kept_per_block": 3},
        {"name": "topk4", "block_size": 4096, "kept_per_block": 0},
        {"name": "int8", "block_size": 256, "kept_per_block": 3},
        {"name": "zip", "block_size": 256},
    ):
        with pytest.raises(ValueError, match="codec"):
            served_codec(spec)


@pytest.mark.timeout(120)
def test_a_round_mean_that_does_not_lead_to_the_swarms_state_is_refused(
    corpus_file: Path, tmp_path: Path
) -> None:
    source = Trainer(small_config(corpus_file, tmp_path / "source"))
    good = one_round(source, RecordingAverager("none"))
    previous = good.previous
    state = source.round.snapshot()
    target = (1, state.state_id)
    behind = Trainer(small_config(corpus_file, tmp_path / "behind"))  # the same seed: the same start
    assert behind.diloco.param_hash() == previous[1]

    def attempt(round_mean: RoundMean, *, of: Snapshot = state) -> None:
        fetched = round_mean_snapshot(of, round_mean)
        caught_up_state(
            stepper(behind), fetched, previous=previous, target=target, start=held(behind),
            num_elements=behind.diloco.num_elements, corpus_sha256=behind.corpus.sha256,
        )  # fmt: skip

    def with_mean(change: Callable[[torch.Tensor], None]) -> RoundMean:
        mean = good.mean.clone()
        change(mean)
        return dataclasses.replace(good, mean=mean, encoded=None)

    attempt(good)  # the honest mean passes, from its bytes
    attempt(dataclasses.replace(good, encoded=None))  # and as fp32
    with pytest.raises(ValueError, match="param_hash"):
        attempt(with_mean(lambda mean: mean.__setitem__(7, mean[7] + 1e-3)))
    # One ulp in one number can round away in the params but not in the momentum (Δ̄ goes into it
    # as is): the momentum's hash is checked too.
    with pytest.raises(ValueError, match="param_hash|outer momentum"):
        attempt(with_mean(lambda mean: mean.__setitem__(7, torch.nextafter(mean[7], torch.tensor(1.0)))))
    with pytest.raises(ValueError, match="another state"):
        attempt(dataclasses.replace(good, previous=(0, "0" * 64)))
    with pytest.raises(ValueError, match="non-finite"):
        attempt(with_mean(lambda mean: mean.__setitem__(3, float("nan"))))
    with pytest.raises(ValueError, match="model's size"):
        attempt(dataclasses.replace(good, mean=good.mean[:-1], encoded=None))
    # Bytes that do not decode to the model's numbers: a gap, a chunk too short, another codec.
    assert good.encoded is not None and len(good.encoded) > 2
    with pytest.raises(ValueError, match="tile"):
        attempt(dataclasses.replace(good, encoded=good.encoded[:1] + good.encoded[2:]))
    with pytest.raises(ValueError, match="cover exactly|tile"):
        attempt(dataclasses.replace(good, encoded=good.encoded[:-1]))
    short = dataclasses.replace(good.encoded[1], payload=good.encoded[1].payload[:-4])
    with pytest.raises(ValueError):
        attempt(dataclasses.replace(good, encoded=(good.encoded[0], short, *good.encoded[2:])))
    with pytest.raises(ValueError, match="codec"):
        attempt(dataclasses.replace(good, codec="zip"))
    # Right params but another momentum (e.g. a member that restarted Nesterov): refused too.
    other_momentum = Snapshot(
        round_id=state.round_id,
        state_id=state.state_id,
        tensors={
            GLOBAL_PARAMS: state.tensors[GLOBAL_PARAMS],
            OUTER_MOMENTUM: state.tensors[OUTER_MOMENTUM] * 2,
        },
        metadata=state.metadata,
    )
    with pytest.raises(ValueError, match="outer momentum"):
        attempt(good, of=other_momentum)
    assert behind.diloco.param_hash() == previous[1]  # every attempt left the node's own state alone
