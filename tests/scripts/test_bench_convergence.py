"""bench_convergence: the simulated all-reduce against exact means and byte formulas, and a tiny real run.

The tiny run checks the DDP baseline for real: both gloo ranks end with the same params, and those
are bit-identical to an independent single-process reference that averages the two shards' gradients
by hand (two addends sum the same in any order, so gloo's sum must match it exactly).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from node.config import NodeConfig
from node.data.batches import ShardedBatches, load_corpus
from node.model.gpt import GPT, cross_entropy_loss, model_config
from node.model.replica import build_inner_optimizer
from node.outer.diloco import flatten_params
from node.outer.state import tensor_hash
from node.train.schedule import LRSchedule
from protocol.allreduce.config import AllReduceConfig
from protocol.codecs import TopK2Codec, TopK4Codec, TopKCodec, get_codec
from tests.scripts.script_loader import load_script, script_path

simulated = load_script("simulated_allreduce")
variants = load_script("convergence_variants")
bench = load_script("bench_convergence")

TINY = {"preset": "nano", "seq_len": 32, "batch_size": 2, "num_workers": 2, "steps": 4, "warmup_steps": 1}
REQUIRED_FIELDS = (
    "variant", "workers", "inner_steps", "codec", "tokens", "eval_loss", "bytes_sent_per_worker",
    "reduction_vs_ddp", "final_train_loss", "wall_seconds",
)  # fmt: skip


def _vectors(num_members: int, num_elements: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randn(num_elements, generator=generator) for _ in range(num_members)]


def _part_payloads(
    codec_name: str, num_elements: int, num_members: int, chunk: int, density: float | None = None
) -> list[int]:
    """Payload bytes of each member's part, from the codec's size formula, split by hand."""
    codec = get_codec(codec_name, density=density)
    base, extra = divmod(num_elements, num_members)
    sizes = [base + (1 if i < extra else 0) for i in range(num_members)]
    return [
        sum(codec.encoded_num_bytes(min(chunk, size - start)) for start in range(0, size, chunk))
        for size in sizes
    ]


def test_none_codec_averages_exactly() -> None:
    vectors = _vectors(3, 1001)
    allreduce = simulated.SimulatedAllReduce(
        num_members=3,
        num_elements=1001,
        codec=get_codec("none"),
        error_feedback=False,
        chunk_num_elements=100,
    )
    torch.testing.assert_close(allreduce.reduce(vectors, [1.0, 1.0, 1.0]), torch.stack(vectors).mean(0))
    weights = [1.0, 2.0, 5.0]
    exact = torch.stack([w * v.double() for w, v in zip(weights, vectors, strict=True)]).sum(0) / sum(weights)
    torch.testing.assert_close(allreduce.reduce(vectors, weights), exact.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("codec_name", ["none", "int8", "int4"])
def test_bytes_follow_the_allreduce_formula(codec_name: str) -> None:
    num_members, num_elements, chunk = 3, 1001, 100
    allreduce = simulated.SimulatedAllReduce(
        num_members=num_members, num_elements=num_elements, codec=get_codec(codec_name),
        error_feedback=codec_name != "none", chunk_num_elements=chunk,
    )  # fmt: skip
    for _ in range(2):
        averaged = allreduce.reduce(_vectors(num_members, num_elements), [3.0, 1.0, 2.0])
        assert torch.isfinite(averaged).all()
    parts = _part_payloads(codec_name, num_elements, num_members, chunk)
    # Member m sends its slice of every other part, and its own part's mean to the N - 1 others.
    expected = [2 * (sum(parts) - parts[m] + (num_members - 1) * parts[m]) for m in range(num_members)]
    assert allreduce.bytes_sent == expected
    mean_sent = sum(allreduce.bytes_sent) / num_members
    assert mean_sent == pytest.approx(2 * 2 * (num_members - 1) / num_members * sum(parts))
    assert sum(parts) == simulated.payload_bytes(get_codec(codec_name), num_elements, num_members, chunk)
    if codec_name == "none":
        assert mean_sent == pytest.approx(2 * 2 * (num_members - 1) / num_members * 4 * num_elements)


def _sparse_vectors(num_members: int, num_blocks: int) -> list[torch.Tensor]:
    """Blocks of 8 whose two largest magnitudes are exactly 3 and 5 (random places and signs), the rest
    below 1: top-2 of 8 sends exactly those two (they are its lo and hi, 2-bit or 4-bit alike)."""
    generator = torch.Generator().manual_seed(11)
    vectors = []
    for _ in range(num_members):
        blocks = torch.rand(num_blocks, 8, generator=generator) * 1.8 - 0.9  # (blocks, 8)
        places = torch.rand(num_blocks, 8, generator=generator).argsort(dim=1)[:, :2]  # (blocks, 2)
        signs = torch.randint(0, 2, (num_blocks, 2), generator=generator).float() * 2 - 1
        blocks.scatter_(1, places, signs * torch.tensor([3.0, 5.0]))
        vectors.append(blocks.view(-1))
    return vectors


def _top2_of_8(vector: torch.Tensor) -> torch.Tensor:
    """The reference: each block of 8 keeps its 2 largest magnitudes (torch.topk), zeros elsewhere."""
    blocks = vector.view(-1, 8)
    places = blocks.abs().topk(2, dim=1).indices
    return torch.zeros_like(blocks).scatter_(1, places, blocks.gather(1, places)).view(-1)


@pytest.mark.parametrize("codec_type", [TopK2Codec, TopK4Codec], ids=["topk", "topk4"])
def test_sparse_round_sums_every_members_top_k_and_keeps_the_rest_in_its_residual(
    codec_type: type[TopKCodec],
) -> None:
    num_members, num_elements, chunk = 3, 960, 160  # parts of 320 in chunks of 160: whole blocks of 8
    codec = codec_type(block_size=8, kept_per_block=2)
    vectors = _sparse_vectors(num_members, num_elements // 8)
    allreduce = simulated.SimulatedAllReduce(
        num_members=num_members, num_elements=num_elements, codec=codec, error_feedback=True,
        chunk_num_elements=chunk, error_feedback_decay=0.5,
    )  # fmt: skip
    weights = [3.0, 1.0, 2.0]
    sent = [_top2_of_8(v) for v in vectors]
    exact = sum(w * s.double() for w, s in zip(weights, sent, strict=True)) / sum(weights)
    averaged = allreduce.reduce(vectors, weights)
    torch.testing.assert_close(averaged, exact.float(), rtol=1e-6, atol=1e-6)
    assert allreduce.feedback is not None
    for member, (vector, kept) in enumerate(zip(vectors, sent, strict=True)):
        assert torch.equal(allreduce.feedback[member].residual, vector - kept)
    # Round 2 sends nothing new: each member's top-k of 0.5 x its residual (the decay), all below 1.
    zeros = [torch.zeros(num_elements) for _ in range(num_members)]
    resent = [_top2_of_8(0.5 * (v - s)) for v, s in zip(vectors, sent, strict=True)]
    exact = sum(w * s.double() for w, s in zip(weights, resent, strict=True)) / sum(weights)
    torch.testing.assert_close(allreduce.reduce(zeros, weights), exact.float(), rtol=1e-5, atol=1e-6)
    # Bytes: member m sends its top-k of the other parts to their owners, then relays its own part's
    # three payloads (one per member, itself included) to the two others; 2 rounds.
    part = 2 * codec.encoded_num_bytes(chunk)  # each part's payload, the same for every part
    expected = 2 * ((num_members - 1) * part + (num_members - 1) * num_members * part)
    assert allreduce.bytes_sent == [expected] * num_members
    assert 3 * part == simulated.payload_bytes(codec, num_elements, num_members, chunk)
    assert expected == pytest.approx(2 * simulated.sends_per_payload(codec, num_members) * 3 * part)
    assert simulated.sends_per_payload(codec, 4) == pytest.approx(3 * 5 / 4)  # relayed, as the swarm does
    assert simulated.sends_per_payload(get_codec("int8"), 4) == pytest.approx(2 * 3 / 4)


def test_owner_sparsified_round_is_design_b_by_hand() -> None:
    """Issue 30's design (b): members send their top-k of the other parts to the owners; each owner
    takes the top-k of the weighted mean (its own slice exact) and keeps what it dropped in its own
    residual; bytes 2 (N - 1) / N payloads a member, where the relay sends (N - 1)(N + 1) / N."""
    num_members, num_elements, chunk = 3, 960, 160
    codec = TopK2Codec(block_size=8, kept_per_block=2)
    vectors = _sparse_vectors(num_members, num_elements // 8)
    allreduce = simulated.SimulatedAllReduce(
        num_members=num_members, num_elements=num_elements, codec=codec, error_feedback=True,
        chunk_num_elements=chunk, owner_sparsifies=True,
    )  # fmt: skip
    weights = [3.0, 1.0, 2.0]
    averaged = allreduce.reduce(vectors, weights)
    assert allreduce.feedback is not None
    expected_mean = torch.empty(num_elements)
    for part in range(num_members):
        span = slice(part * 320, (part + 1) * 320)
        contributions = [v[span] if m == part else _top2_of_8(v[span]) for m, v in enumerate(vectors)]
        mean = sum(w * c.double() for w, c in zip(weights, contributions, strict=True)) / sum(weights)
        sent = codec.decode(codec.encode(mean.float()), 320)  # the owner's 2-bit top-2 of 8 of the mean
        expected_mean[span] = sent
        torch.testing.assert_close(
            allreduce.feedback[part].residual[span], mean.float() - sent, rtol=1e-5, atol=1e-6
        )
        for member in set(range(num_members)) - {part}:  # what each member's top-k left of this part
            assert torch.equal(
                allreduce.feedback[member].residual[span], vectors[member][span] - contributions[member]
            )
    torch.testing.assert_close(averaged, expected_mean, rtol=1e-5, atol=1e-6)
    part = 2 * codec.encoded_num_bytes(chunk)
    expected = (num_members - 1) * part + (num_members - 1) * part  # its slices out, its part's mean out
    assert allreduce.bytes_sent == [expected] * num_members
    assert simulated.sends_per_payload(codec, 4, owner_sparsifies=True) == pytest.approx(2 * 3 / 4)
    variant = variants.parse_variant("diloco:15:topk:0.03:design=owner")
    assert variant.owner_sparsifies and variants.parse_variant(variant.spec()) == variant
    assert not variants.parse_variant("diloco:15:topk:design=relay").owner_sparsifies
    with pytest.raises(ValueError, match="named fields"):
        variants.parse_variant("diloco:15:int8:design=owner")  # a dense codec has only one design


def test_the_simulated_sparse_round_refuses_what_it_does_not_simulate() -> None:
    codec = TopK2Codec(block_size=8, kept_per_block=2)
    with pytest.raises(ValueError, match="error feedback"):
        simulated.SimulatedAllReduce(num_members=2, num_elements=16, codec=codec, error_feedback=False,
                                     chunk_num_elements=8)  # fmt: skip


def _reference_ddp_hash(warm_start_path: Path, **overrides: float) -> str:
    """Single process, from the warm start: each step, the mean of both shards' gradients, then clip and
    AdamW (as DDP must)."""
    settings = variants.BenchSettings(**(TINY | overrides))
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)  # the ranks' thread count: the same matmul reduction order
    try:
        corpus = load_corpus(None, val_fraction=NodeConfig().corpus.val_fraction)
        torch.manual_seed(settings.seed)
        model = GPT(model_config("nano", vocab_size=corpus.vocab_size, seq_len=settings.seq_len))
        model.load_state_dict(torch.load(warm_start_path, weights_only=True))
        optimizer = build_inner_optimizer(model, NodeConfig.from_flat(inner_lr=settings.inner_lr))
        schedule = LRSchedule(
            kind="cosine", peak_lr=settings.inner_lr, warmup_steps=settings.warmup_steps,
            horizon_steps=settings.steps, min_lr_ratio=settings.min_lr_ratio,
        )  # fmt: skip
        shards = [
            ShardedBatches(corpus.train, seq_len=settings.seq_len, batch_size=settings.batch_size, seed=0,
                           shard_index=i, num_shards=settings.num_workers)
            for i in range(settings.num_workers)
        ]  # fmt: skip
        params = list(model.parameters())
        for step in range(settings.steps):
            grads = []
            for shard in shards:
                x, y = shard.next_batch()
                grads.append(torch.autograd.grad(cross_entropy_loss(model(x), y), params))
            for p, g0, g1 in zip(params, *grads, strict=True):
                p.grad = (g0 + g1) / 2
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr(step)
            torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return tensor_hash(flatten_params(params, device="cpu"))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.timeout(180)
def test_tiny_run(tmp_path: Path) -> None:
    # Both DDP variants first, so that they run at once (each rendezvous in its own store).
    argv = ["--variants", "ddp,ddp:0.003,diloco:2:none,diloco:2:int4,overlap:2:int4,diloco:2:topk:0.05:1.0:momentum=0:decay=0.95", "--out-dir", str(tmp_path), "--jobs", "3",
            "--eval-every", "2", "--num-eval-batches", "1", "--eval-batch-size", "4", "--warm-start-steps", "3"]  # fmt: skip
    for name, value in TINY.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    # As a user runs it: a script forks its 7 variant processes from one server that imported it once.
    completed = subprocess.run([sys.executable, str(script_path("bench_convergence")), *argv],
                               capture_output=True, text=True, timeout=170)  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.splitlines()
    printed = {r["variant"]: r for r in (json.loads(line) for line in lines if line.startswith("{"))}
    names = ["ddp", "ddp-lr0.003", "diloco-H2-none", "diloco-H2-int4-ef", "overlap-H2-int4-ef",
             "diloco-H2-topk0.05-ef-d0.95-m0-olr1"]  # fmt: skip
    assert list(printed) == names
    assert lines[-2].startswith("summary:") and (tmp_path / "convergence.png").stat().st_size > 0
    results: dict[str, Any] = json.loads((tmp_path / "results.json").read_text())
    records = {r["variant"]: r for r in results["variants"]}
    warm = results["warm_start"]
    assert warm["tokens"] == 3 * 2 * 32 and warm["eval_loss"] < warm["initial_eval_loss"]
    assert "shared warm start 3 steps" in lines[-2]
    for name, record in printed.items():
        assert all(field in record for field in REQUIRED_FIELDS), name
        assert record["tokens"] == 4 * 2 * 2 * 32 and record["workers"] == 2
        assert record["warm_start_tokens"] == warm["tokens"]
        assert math.isfinite(record["eval_loss"]) and math.isfinite(record["final_train_loss"])
        history = records[name]["history"]
        assert history[0] == [0, 0.0, warm["eval_loss"]]  # every variant starts from the warm start
        assert history[-1][2] == record["eval_loss"] < history[0][2]  # it trained
        hashes = records[name]["param_hashes"]
        assert len(hashes) == 2 and hashes[0] == hashes[1], f"{name}: workers ended with different params"

    ddp = printed["ddp"]
    num_params = ddp["num_params"]
    ddp_bytes = 4 * 2 * (2 - 1) / 2 * 4 * num_params  # steps x ring all-reduce of fp32 grads
    assert ddp["bytes_sent_per_worker"] == pytest.approx(ddp_bytes) and ddp["reduction_vs_ddp"] == 1.0
    assert records["ddp"]["param_hashes"][0] == _reference_ddp_hash(tmp_path / "warm_start.pt")
    # DDP at its own LR: trained with that LR, and every gap is to plain ddp, plus one to the best DDP.
    tuned = printed["ddp-lr0.003"]
    assert tuned["inner_lr"] == 0.003 and ddp["inner_lr"] == variants.BenchSettings(**TINY).inner_lr
    assert records["ddp-lr0.003"]["param_hashes"][0] == _reference_ddp_hash(
        tmp_path / "warm_start.pt", inner_lr=0.003
    )
    best = min((ddp, tuned), key=lambda r: r["eval_loss"])
    for record in printed.values():
        assert record["ddp_baseline"] == "ddp" and record["best_ddp"] == best["variant"]
        assert record["eval_gap_vs_ddp"] == pytest.approx(record["eval_loss"] / ddp["eval_loss"] - 1)
        assert record["eval_gap_vs_best_ddp"] == pytest.approx(record["eval_loss"] / best["eval_loss"] - 1)
    int4_gap = printed["diloco-H2-int4-ef"]["eval_gap_vs_best_ddp"]
    assert f"vs the best DDP ({best['variant']}): diloco-H2-int4-ef {int4_gap:+.2%}" in lines[-2]
    for name, codec_name in (
        ("diloco-H2-none", "none"),
        ("diloco-H2-int4-ef", "int4"),
        ("overlap-H2-int4-ef", "int4"),
    ):
        record = printed[name]
        parts = _part_payloads(codec_name, num_params, 2, AllReduceConfig().chunk_num_elements)
        expected = 2 * 2 * (2 - 1) / 2 * sum(parts)  # 2 rounds x 2 (N - 1) / N x payload
        assert record["bytes_sent_per_worker"] == pytest.approx(expected)
        assert record["reduction_vs_ddp"] == pytest.approx(ddp_bytes / expected)
    assert printed["diloco-H2-none"]["reduction_vs_ddp"] == pytest.approx(2.0)  # H = 2, both fp32
    sparse = printed["diloco-H2-topk0.05-ef-d0.95-m0-olr1"]
    assert (sparse["density"], sparse["outer_momentum"], sparse["error_feedback_decay"]) == (0.05, 0.0, 0.95)
    parts = _part_payloads("topk", num_params, 2, AllReduceConfig().chunk_num_elements, density=0.05)
    expected = 2 * (2 - 1) * (2 + 1) / 2 * sum(parts)  # 2 rounds x (N - 1)(N + 1) / N x payload
    assert sparse["bytes_sent_per_worker"] == pytest.approx(expected)
    # The delayed update: round 1's eval is of the initial params (round 1 lands during phase 2), and
    # a last point, at the same tokens, once round 2 has landed; the synchronous run's round-1 eval
    # has round 1 applied, so the two differ there.
    delayed, synchronous = records["overlap-H2-int4-ef"]["history"], records["diloco-H2-int4-ef"]["history"]
    assert len(delayed) == len(synchronous) + 1 and delayed[-1][0] == delayed[-2][0]
    assert delayed[1][2] == delayed[0][2] != synchronous[1][2]


def test_parse_variant_ddp_inner_lr() -> None:
    variant = variants.parse_variant("ddp:2e-3")
    assert (variant.kind, variant.inner_lr, variant.name) == ("ddp", 0.002, "ddp-lr0.002")
    assert variants.parse_variant(variant.spec()) == variant
    plain, shared = variants.parse_variant("ddp"), variants.BenchSettings(**TINY)
    assert plain.inner_lr is None and plain.settings(shared) == shared
    assert variant.settings(shared).inner_lr == 0.002
    for bad in ("ddp:x", "ddp:0", "ddp:-1e-3", "ddp:1e-3:2"):
        with pytest.raises(ValueError):
            variants.parse_variant(bad)


def test_parse_variant_outer_lr() -> None:
    variant = variants.parse_variant("diloco:150:int4:0.9")
    assert (variant.inner_steps, variant.codec, variant.outer_lr) == (150, "int4", 0.9)
    assert variant.name == "diloco-H150-int4-ef-olr0.9"
    assert variants.parse_variant(variant.spec()) == variant
    assert variants.parse_variant("diloco:150:int4").outer_lr is None
    for bad in ("diloco:150:int4:x", "diloco:150:int4:0", "diloco:150"):
        with pytest.raises(ValueError):
            variants.parse_variant(bad)


def test_parse_sparse_variants() -> None:
    variant = variants.parse_variant("diloco:150:topk:0.03")
    assert (variant.codec, variant.density, variant.outer_lr, variant.name) == (
        "topk",
        0.03,
        None,
        "diloco-H150-topk0.03-ef",
    )
    assert variant.wire_codec().spec().kept_per_block == 123  # ceil(0.03 x 4096)
    assert variants.parse_variant("diloco:150:topk").density == 0.015
    four = variants.parse_variant("diloco:5:topk4:0.00875:decay=0.95")
    assert (four.codec, four.density, four.name) == ("topk4", 0.00875, "diloco-H5-topk4-0.00875-ef-d0.95")
    assert isinstance(four.wire_codec(), TopK4Codec) and four.wire_codec().spec().kept_per_block == 36
    assert variants.parse_variant(four.spec()) == four
    sparseloco = variants.parse_variant("diloco:150:topk:0.015:1.0:momentum=0:decay=0.95")
    assert (sparseloco.outer_lr, sparseloco.outer_momentum, sparseloco.error_feedback_decay) == (
        1.0,
        0.0,
        0.95,
    )
    assert sparseloco.name == "diloco-H150-topk0.015-ef-d0.95-m0-olr1"
    for parsed in (variant, sparseloco, variants.parse_variant("diloco:150:int8:momentum=0")):
        assert variants.parse_variant(parsed.spec()) == parsed
    own = sparseloco.settings(variants.BenchSettings(**TINY))
    assert (own.outer_lr, own.outer_momentum, own.error_feedback_decay) == (1.0, 0.0, 0.95)
    assert variants.parse_variant("diloco:150:int8:0.9").density is None  # int8's field is OUTER_LR
    for bad in (
        "diloco:150:topk:0", "diloco:150:topk:1.5", "diloco:150:topk:0.03:1:2", "diloco:150:int8:0.9:0.5",
        "diloco:150:int8:momentum=1.5", "diloco:150:topk:decay=-1", "diloco:150:int8:foo=1",
        "diloco:150:int8:momentum=0:momentum=0.5",
    ):  # fmt: skip
        with pytest.raises(ValueError):
            variants.parse_variant(bad)


def test_parse_streaming_variants() -> None:
    variant = variants.parse_variant("streaming:30:4:int8:mix=0.25:tau=3")
    assert (variant.kind, variant.inner_steps, variant.num_fragments, variant.codec) == (
        "streaming",
        30,
        4,
        "int8",
    )
    assert (variant.fragment_mix, variant.fragment_overlap_steps) == (0.25, 3)
    assert variant.name == "streaming-H30-F4-mix0.25-tau3-int8-ef"
    assert variants.parse_variant(variant.spec()) == variant
    default = variants.parse_variant("streaming:30:2:topk:0.03:momentum=0")
    assert (default.num_fragments, default.density, default.outer_momentum) == (2, 0.03, 0.0)
    assert (default.fragment_mix, default.fragment_overlap_steps) == (variants.DEFAULT_FRAGMENT_MIX, 0)
    assert variants.parse_variant(default.spec()) == default
    for bad in (
        "streaming:30:int8", "streaming:30:0:int8", "streaming:30:4:int8:mix=1", "streaming:30:4:int8:tau=30",
        "streaming:30:4:int8:tau=x", "diloco:30:int8:mix=0.5", "streaming:30:4:foo",
    ):  # fmt: skip
        with pytest.raises(ValueError):
            variants.parse_variant(bad)


@pytest.mark.timeout(120)
def test_one_fragment_streaming_without_overlap_or_mix_is_diloco() -> None:
    """F = 1, τ = 0, α = 0 trains as the synchronous DiLoCo runner does: the same eval after every
    round and the same bytes (an independent path: ``run_diloco`` steps ``DiLoCo`` directly)."""
    settings = variants.BenchSettings(**TINY, eval_every=2, num_eval_batches=1, eval_batch_size=4)
    diloco = variants.run_diloco(settings, variants.parse_variant("diloco:2:int4"))
    streaming = variants.run_streaming(settings, variants.parse_variant("streaming:2:1:int4:mix=0:tau=0"))
    assert streaming["history"] == diloco["history"]
    assert streaming["bytes_sent_per_worker"] == diloco["bytes_sent_per_worker"]
    assert streaming["fragment_rounds"] == [2]


@pytest.mark.timeout(120)
def test_streaming_fragments_round_in_turn_and_count_their_bytes() -> None:
    settings = variants.BenchSettings(**TINY, eval_every=2, num_eval_batches=1, eval_batch_size=4)
    record = variants.run_streaming(settings, variants.parse_variant("streaming:2:2:int8:mix=0.5:tau=1"))
    # H = 2, F = 2 over 4 steps: fragment 0 after steps 2 and 4, fragment 1 after steps 1 and 3, then
    # once more at the end for step 4 (its round in flight from step 3 landed first).
    assert record["fragment_rounds"] == [2, 3]
    sizes = record["fragment_elements"]
    assert sum(sizes) == record["num_params"] and len(record["fragments"]) == 2
    payloads = [sum(_part_payloads("int8", size, 2, AllReduceConfig().chunk_num_elements)) for size in sizes]
    expected = (2 * payloads[0] + 3 * payloads[1]) * 2 * (2 - 1) / 2  # rounds x 2 (N - 1) / N x payload
    assert (
        record["bytes_sent_per_worker"] == pytest.approx(expected) == record["bytes_sent_per_worker_formula"]
    )
    history = record["history"]
    assert [point[0] for point in history] == [0, 2 * settings.tokens_per_step, 4 * settings.tokens_per_step]
    assert math.isfinite(history[-1][2]) and len(set(record["param_hashes"])) == 1


def test_sparse_verdict_compares_top_k_with_int8_of_the_same_kind_and_h() -> None:
    def record(variant: str, codec: str, inner_steps: int, loss: float, sent: float) -> dict[str, Any]:
        return {"variant": variant, "kind": "diloco", "codec": codec, "inner_steps": inner_steps,
                "eval_loss": loss, "bytes_sent_per_worker": sent}  # fmt: skip

    int8 = record("int8", "int8", 150, 2.0, 1000.0)
    close = record("topk-close", "topk", 150, 2.0 * 1.004, 30.0)  # +0.4% at 33.3x
    far = record("topk-far", "topk", 150, 2.0 * 1.01, 10.0)  # +1% at 100x
    other_h = record("topk-h50", "topk", 50, 1.0, 1.0)  # no int8 at H=50: not compared
    four = record("topk4-far", "topk4", 150, 2.0 * 1.02, 20.0)  # 4-bit top-k: +2% at 50x
    met, text = bench.sparse_verdict([int8, close, far, other_h, four])
    assert met is True and text.startswith("sparse target MET by topk-close:")
    assert "topk-far +1.00% vs int8 at 100.0x fewer bytes" in text and "topk-h50" not in text
    assert "topk4-far +2.00% vs int8 at 50.0x fewer bytes" in text
    assert bench.sparse_verdict([int8, record("topk4-close", "topk4", 150, 2.0, 25.0)])[0] is True
    assert bench.sparse_verdict([int8, far])[0] is False
    assert bench.sparse_verdict([int8])[0] is None


def test_fragments_verdict_compares_each_streaming_run_with_diloco_of_the_same_h_and_codec() -> None:
    def record(variant: str, kind: str, fragments: int, inner_steps: int, loss: float) -> dict[str, Any]:
        return {"variant": variant, "kind": kind, "num_fragments": fragments, "codec": "int8",
                "density": None, "inner_steps": inner_steps, "eval_loss": loss}  # fmt: skip

    whole = record("diloco", "diloco", 1, 30, 2.0)
    close = record("f4", "streaming", 4, 30, 2.0 * 1.004)  # +0.4%
    far = record("f2", "streaming", 2, 30, 2.0 * 1.01)  # +1%
    one = record("f1", "streaming", 1, 30, 3.0)  # F = 1: not a fragments run
    other_h = record("f4-h10", "streaming", 4, 10, 1.0)  # no diloco at H=10: not compared
    met, text = bench.fragments_verdict([whole, close, one, other_h])
    assert met is True and text == "fragments target MET by f4: f4 +0.40% vs diloco"
    met, text = bench.fragments_verdict([whole, close, far])
    assert met is True and text.startswith("fragments target MET by f4:") and "f2 +1.00% vs diloco" in text
    met, text = bench.fragments_verdict([whole, far])
    assert met is False and text == "fragments target NOT MET: f2 +1.00% vs diloco"
    assert bench.fragments_verdict([whole, one])[0] is None


@pytest.mark.timeout(180)
def test_a_saved_warm_start_is_reused_only_with_the_same_warm_start_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--variants", "diloco:2:none", "--out-dir", str(tmp_path), "--jobs", "1", "--eval-every", "2",
            "--num-eval-batches", "1", "--eval-batch-size", "4", "--warm-start-steps", "3", "--reuse-warm-start"]  # fmt: skip
    for name, value in TINY.items():
        base += ["--" + name.replace("_", "-"), str(value)]

    def run(*extra: str) -> dict[str, Any]:
        assert bench.main([*base, *extra]) == 0
        capsys.readouterr()
        return json.loads((tmp_path / "results.json").read_text())

    first = run()
    trained = (tmp_path / "warm_start.pt").read_bytes()
    assert "reused" not in first["warm_start"]
    # The variants' inner LR is not the warm start's: the saved params are taken as they are.
    second = run("--inner-lr", "2e-3")
    assert second["warm_start"]["reused"] == str((tmp_path / "warm_start.pt").resolve())
    assert second["warm_start"]["eval_loss"] == first["warm_start"]["eval_loss"]
    assert (tmp_path / "warm_start.pt").read_bytes() == trained
    assert second["variants"][0]["history"][0][2] == first["warm_start"]["eval_loss"]
    # Another warm-start LR: trained anew, from other params.
    third = run("--warm-start-lr", "3e-3")
    assert "reused" not in third["warm_start"]
    assert third["warm_start"]["eval_loss"] != first["warm_start"]["eval_loss"]
