"""The variants of ``bench_convergence.py`` and how each one trains.

``BenchSettings`` is the training setup every variant shares; a ``Variant`` (``parse_variant``) is one
way of combining the workers. A ``Worker`` is one replica: the node's GPT, AdamW and LR schedule on
its own data shard (``build_worker``, ``inner_step``). ``run_diloco`` runs N DiLoCo workers in one
process, their outer rounds through ``SimulatedAllReduce``; ``ddp_rank_main`` is one rank of the DDP
baseline over gloo. ``RUNNERS`` maps each kind to its in-process runner; ``PENDING_KINDS`` are
announced but not run yet. The method is described in ``bench_convergence.py``'s docstring.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from node.config import NodeConfig
from node.data.batches import ShardedBatches, eval_batches, load_corpus
from node.data.corpus import Corpus
from node.model.gpt import GPT, cross_entropy_loss, model_config
from node.model.replica import build_inner_optimizer
from node.outer.diloco import DiLoCo, flatten_params
from node.outer.fragments import FragmentedDiLoCo, due_fragments, model_fragment_plan
from node.outer.state import tensor_hash
from node.train.schedule import LRSchedule
from protocol.allreduce.config import AllReduceConfig
from protocol.codecs import CODEC_NAMES, DEFAULT_TOPK_DENSITY, Codec, get_codec, takes_density
from scripts.bench.simulated_allreduce import (
    SimulatedAllReduce,
    ddp_bytes_per_step,
    is_sparse,
    payload_bytes,
    sends_per_payload,
)

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""Longest a DDP rank waits in the rendezvous or one all_reduce before gloo raises."""
PENDING_KINDS: dict[str, str] = {}  # kinds announced but not runnable yet, and why
_NODE = NodeConfig()  # the node's defaults, which the benchmark's settings default to


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """One benchmark's shared training setup (identical for every variant)."""

    preset: str
    """Model preset of ``node.model.gpt.MODEL_PRESETS``."""
    seq_len: int
    """Context length in tokens."""
    batch_size: int
    """Sequences per worker per inner step."""
    num_workers: int
    """N: DDP ranks and DiLoCo workers."""
    steps: int
    """Inner steps per worker (a multiple of every DiLoCo H)."""
    warmup_steps: int
    """Linear LR warmup; then cosine decay to ``min_lr_ratio`` at ``steps``."""
    inner_lr: float = _NODE.inner.lr
    """Peak AdamW learning rate (the node's default)."""
    min_lr_ratio: float = _NODE.inner.min_lr_ratio
    """Final LR as a fraction of the peak."""
    weight_decay: float = _NODE.inner.weight_decay
    """AdamW weight decay on matrices (norm gains are not decayed), as the node."""
    beta1: float = _NODE.inner.beta1
    """AdamW beta1."""
    beta2: float = _NODE.inner.beta2
    """AdamW beta2."""
    grad_clip: float = _NODE.inner.grad_clip
    """Clip the (averaged, for DDP) gradient norm to this before every AdamW step."""
    outer_lr: float = _NODE.outer.lr
    """DiLoCo outer Nesterov learning rate (the node's default)."""
    outer_momentum: float = _NODE.outer.momentum
    """DiLoCo outer Nesterov momentum (the node's default; 0 = plain SGD)."""
    error_feedback_decay: float = _NODE.rounds.error_feedback_decay
    """β of the error feedback (``--error-feedback-decay``): each round sends Δ + β · residual."""
    seed: int = 0
    """Seed of the model initialisation (every worker starts from the same params)."""
    data_seed: int = 0
    """Seed of the data order; worker i reads shard i of N."""
    eval_every: int = 25
    """DDP evaluates every this many steps; also the window of ``final_train_loss``."""
    eval_batch_size: int = 16
    """Sequences per held-out batch."""
    num_eval_batches: int = 8
    """Held-out batches, evenly spaced over the validation stream; the same for every variant."""
    threads: int = 1
    """torch intra-op threads per process."""
    chunk_num_elements: int = AllReduceConfig().chunk_num_elements
    """Streamed chunk size of the simulated all-reduce (the swarm's default)."""
    warm_start_steps: int = 0
    """Steps of the one-worker warm start every variant starts from (0: from the seeded init)."""
    warm_start_lr: float = _NODE.inner.lr
    """Peak AdamW learning rate of the warm start (the node's default), whatever ``inner_lr`` the
    variants then use: a sweep of ``inner_lr`` starts every point from the same params."""
    warm_start_path: str | None = None
    """The warm-start params (``torch.save`` of the model's state dict), written by ``warm_start``."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "num_workers", "steps", "eval_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 2:
            raise ValueError(f"num_workers must be >= 2 (one worker sends nothing), got {self.num_workers}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")
        if self.warm_start_steps < 0:
            raise ValueError(f"warm_start_steps must be >= 0, got {self.warm_start_steps}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens all workers together train on per inner step."""
        return self.num_workers * self.batch_size * self.seq_len


@dataclass(frozen=True)
class Variant:
    """One way of combining the workers: ``kind`` (a key of RUNNERS or PENDING_KINDS), H, codec (with
    its density for top-k), an optional outer LR, outer momentum and error-feedback decay replacing
    ``BenchSettings``' (DiLoCo kinds), and an optional peak inner LR replacing ``BenchSettings.inner_lr``
    (DDP: the baseline at another LR than the shared one)."""

    kind: str
    inner_steps: int = 1
    codec: str = "none"
    outer_lr: float | None = None
    inner_lr: float | None = None
    density: float | None = None  # top-k: the fraction of numbers sent (always set for top-k)
    outer_momentum: float | None = None
    error_feedback_decay: float | None = None
    num_fragments: int = 1  # streaming: F, the fragments synchronised in turn
    mix: float | None = None  # streaming: α, the share of the local fragment kept when its round lands
    overlap_steps: int | None = None  # streaming: τ, inner steps a fragment's round overlaps
    owner_sparsifies: bool = False  # top-k: issue 30's design (b) (``design=owner``), not the relay (a)

    @property
    def error_feedback(self) -> bool:
        return self.kind != "ddp" and self.codec != "none"  # as the swarm: feedback for lossy codecs

    @property
    def name(self) -> str:
        if self.kind == "ddp":
            return "ddp" if self.inner_lr is None else f"ddp-lr{self.inner_lr:g}"
        # topk0.03, but topk4-0.03: a dash where the codec's name ends in a digit
        dash = "-" if self.codec[-1].isdigit() else ""
        codec = self.codec if self.density is None else f"{self.codec}{dash}{self.density:g}"
        lr = "" if self.outer_lr is None else f"-olr{self.outer_lr:g}"
        momentum = "" if self.outer_momentum is None else f"-m{self.outer_momentum:g}"
        decay = "" if self.error_feedback_decay is None else f"-d{self.error_feedback_decay:g}"
        feedback = "-ef" if self.error_feedback else ""
        feedback += "-owner" if self.owner_sparsifies else ""
        stream = ""
        if self.kind == "streaming":
            stream = f"-F{self.num_fragments}-mix{self.fragment_mix:g}-tau{self.fragment_overlap_steps}"
        return f"{self.kind}-H{self.inner_steps}{stream}-{codec}{feedback}{decay}{momentum}{lr}"

    @property
    def fragment_mix(self) -> float:
        return DEFAULT_FRAGMENT_MIX if self.mix is None else self.mix

    @property
    def fragment_overlap_steps(self) -> int:
        return DEFAULT_OVERLAP_STEPS if self.overlap_steps is None else self.overlap_steps

    def spec(self) -> str:
        if self.kind == "ddp":
            return "ddp" if self.inner_lr is None else f"ddp:{self.inner_lr!r}"
        fields = [self.kind, str(self.inner_steps), self.codec]
        if self.kind == "streaming":
            fields.insert(2, str(self.num_fragments))
        if self.density is not None:
            fields.append(repr(self.density))
        if self.outer_lr is not None:
            fields.append(repr(self.outer_lr))
        if self.outer_momentum is not None:
            fields.append(f"momentum={self.outer_momentum!r}")
        if self.error_feedback_decay is not None:
            fields.append(f"decay={self.error_feedback_decay!r}")
        if self.mix is not None:
            fields.append(f"mix={self.mix!r}")
        if self.overlap_steps is not None:
            fields.append(f"tau={self.overlap_steps}")
        if self.owner_sparsifies:
            fields.append("design=owner")
        return ":".join(fields)

    def settings(self, shared: BenchSettings) -> BenchSettings:
        """The settings this variant trains with: the shared ones, with its own where it has them."""
        own: dict[str, Any] = {"inner_lr": self.inner_lr, "outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum,
               "error_feedback_decay": self.error_feedback_decay}  # fmt: skip
        return dataclasses.replace(shared, **{k: v for k, v in own.items() if v is not None})

    def wire_codec(self) -> Codec:
        """The codec its rounds encode with (top-k at its density)."""
        return (
            get_codec(self.codec, density=self.density)
            if takes_density(self.codec)
            else get_codec(self.codec)
        )


def _positive(text: str, field: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"bad variant {spec!r}: {field} must be a number") from None
    if not value > 0:
        raise ValueError(f"bad variant {spec!r}: {field} must be > 0")
    return value


def _fraction(text: str, field: str, spec: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"bad variant {spec!r}: {field} must be a number") from None
    if not ((0 <= value if zero_ok else 0 < value) and value <= 1):
        raise ValueError(f"bad variant {spec!r}: {field} must be in {'[0' if zero_ok else '(0'}, 1]")
    return value


VARIANT_SYNTAX = (
    "ddp[:INNER_LR], KIND:H:CODEC[:DENSITY][:OUTER_LR][:momentum=M][:decay=B] with KIND diloco or overlap, "
    "or streaming:H:F:CODEC[...][:mix=A][:tau=T]; DENSITY and design=owner|relay for topk and topk4 only (default 0.015, relay)"
)
DEFAULT_FRAGMENT_MIX = (
    0.0  # α: 0 measured best (--quick, H=30, F=4); the paper's 0.5 was +0.9% (BENCHMARKS.md)
)
DEFAULT_OVERLAP_STEPS = 0


def parse_variant(text: str) -> Variant:
    """``ddp[:INNER_LR]`` or ``KIND:H:CODEC[:DENSITY][:OUTER_LR][:momentum=M][:decay=B]`` (e.g.
    ``ddp:2e-3``, ``diloco:100:int4``, ``diloco:150:int4:0.9``, ``diloco:150:topk:0.03``,
    ``diloco:150:topk:0.03:1.0:momentum=0:decay=0.95``: SparseLoCo's outer SGD and error feedback).
    DENSITY is top-k's only (``topk``, ``topk4``), and then comes first: ``diloco:150:topk:0.9`` is top-k at
    90%, ``diloco:5:topk4:0.00875:decay=0.95`` 4-bit top-k at 36 of 4096.
    ``streaming:H:F:CODEC[...][:mix=A][:tau=T]``: F fragments (``streaming:30:4:int8:mix=0.5:tau=3``)."""
    fields = text.split(":")
    if fields[0] == "ddp" and len(fields) <= 2:
        return Variant("ddp", inner_lr=_positive(fields[1], "INNER_LR", text) if len(fields) == 2 else None)
    if len(fields) < 3 or fields[0] not in (*RUNNERS, *PENDING_KINDS) or not fields[1].isdigit():
        raise ValueError(f"bad variant {text!r}: use {VARIANT_SYNTAX}")
    kind, inner_steps = fields[0], int(fields[1])
    num_fragments = 1
    if kind == "streaming":  # streaming:H:F:CODEC...
        if len(fields) < 4 or not fields[2].isdigit() or int(fields[2]) < 1:
            raise ValueError(f"bad variant {text!r}: use {VARIANT_SYNTAX} (F >= 1)")
        num_fragments = int(fields.pop(2))
    if fields[2] not in CODEC_NAMES or inner_steps < 1:
        raise ValueError(f"bad variant {text!r}: H must be >= 1 and CODEC one of {', '.join(CODEC_NAMES)}")
    codec = fields[2]
    keywords = dict(field.split("=", 1) for field in fields[3:] if "=" in field)
    positional = [field for field in fields[3:] if "=" not in field]
    names = {"momentum", "decay"} | ({"mix", "tau"} if kind == "streaming" else set())
    names |= {"design"} if takes_density(codec) else set()
    if set(keywords) - names or len(keywords) != sum("=" in f for f in fields[3:]):
        raise ValueError(f"bad variant {text!r}: the named fields are {', '.join(sorted(names))}=, once each")
    density = None
    if takes_density(codec):
        density = (
            _fraction(positional.pop(0), "DENSITY", text, zero_ok=False)
            if positional
            else DEFAULT_TOPK_DENSITY
        )
    if len(positional) > 1:
        raise ValueError(f"bad variant {text!r}: use {VARIANT_SYNTAX}")
    momentum = keywords.get("momentum")
    decay = keywords.get("decay")
    mix = None if "mix" not in keywords else _fraction(keywords["mix"], "mix", text, zero_ok=True)
    if mix == 1.0:
        raise ValueError(f"bad variant {text!r}: mix must be < 1 (1 would never take the swarm's params)")
    tau = keywords.get("tau")
    if keywords.get("design", "relay") not in ("relay", "owner"):
        raise ValueError(f"bad variant {text!r}: design must be relay (issue 30's (a)) or owner ((b))")
    if tau is not None and not (tau.isdigit() and int(tau) < inner_steps):
        raise ValueError(f"bad variant {text!r}: tau must be an integer in [0, H)")
    return Variant(
        kind, inner_steps, codec,
        outer_lr=_positive(positional[0], "OUTER_LR", text) if positional else None,
        density=density,
        outer_momentum=None if momentum is None else _fraction(momentum, "momentum", text, zero_ok=True),
        error_feedback_decay=None if decay is None else _fraction(decay, "decay", text, zero_ok=True),
        num_fragments=num_fragments, mix=mix, overlap_steps=None if tau is None else int(tau),
        owner_sparsifies=keywords.get("design") == "owner",
    )  # fmt: skip


# --- one worker's training -------------------------------------------------------------------------


@dataclass
class Worker:
    """One worker's replica: its model, its AdamW, its data shard and its training losses."""

    model: GPT
    optimizer: torch.optim.Optimizer
    batches: ShardedBatches
    losses: list[float] = dataclasses.field(default_factory=list)

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]


def build_worker(settings: BenchSettings, corpus: Corpus, shard_index: int) -> Worker:
    config = model_config(settings.preset, vocab_size=corpus.vocab_size, seq_len=settings.seq_len)
    torch.manual_seed(settings.seed)  # the same initial params on every worker and in every variant
    model = GPT(config)
    if settings.warm_start_path is not None:  # or all from the same warm-started params
        model.load_state_dict(torch.load(settings.warm_start_path, weights_only=True))
    model.train()
    node_config = NodeConfig.from_flat(
        inner_lr=settings.inner_lr,
        weight_decay=settings.weight_decay,
        beta1=settings.beta1,
        beta2=settings.beta2,
    )
    batches = ShardedBatches(
        corpus.train, seq_len=settings.seq_len, batch_size=settings.batch_size, seed=settings.data_seed,
        shard_index=shard_index, num_shards=settings.num_workers,
    )  # fmt: skip
    return Worker(model=model, optimizer=build_inner_optimizer(model, node_config), batches=batches)


def schedule_of(settings: BenchSettings) -> LRSchedule:
    return LRSchedule(
        kind="cosine", peak_lr=settings.inner_lr, warmup_steps=settings.warmup_steps,
        horizon_steps=settings.steps, min_lr_ratio=settings.min_lr_ratio,
    )  # fmt: skip


def inner_step(
    worker: Worker,
    settings: BenchSettings,
    lr: float,
    sync: Callable[[Worker, torch.Tensor], float] | None = None,
) -> float:
    """One AdamW step on the worker's next batch; ``sync`` averages the grads (DDP) and returns the loss."""
    x, y = worker.batches.next_batch()  # (B, T), (B, T)
    for group in worker.optimizer.param_groups:
        group["lr"] = lr
    loss = cross_entropy_loss(worker.model(x), y)
    loss.backward()
    loss_value = loss.item() if sync is None else sync(worker, loss.detach())
    if settings.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(worker.params, settings.grad_clip)
    worker.optimizer.step()
    worker.optimizer.zero_grad(set_to_none=True)
    worker.losses.append(loss_value)
    return loss_value


def recent_train_loss(workers: list[Worker], window: int) -> float:
    """Mean training loss of the last ``window`` steps over all workers."""
    return sum(sum(w.losses[-window:]) / len(w.losses[-window:]) for w in workers) / len(workers)


def _progress(step: int, num_steps: int, eval_loss: float) -> None:
    """A line in the process's log, to follow a long run."""
    print(f"step {step}/{num_steps} eval_loss {eval_loss:.4f} cpu {time.process_time():.0f}s", flush=True)


@torch.no_grad()
def evaluate(model: GPT, eval_set: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()
    total = sum(cross_entropy_loss(model(x), y).item() for x, y in eval_set)
    model.train()
    return total / len(eval_set)


def load_data(settings: BenchSettings) -> tuple[Corpus, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.set_num_threads(settings.threads)
    corpus = load_corpus(None, val_fraction=_NODE.corpus.val_fraction)
    val = eval_batches(corpus.val, settings.seq_len, settings.eval_batch_size, settings.num_eval_batches)
    return corpus, val


def warm_start(settings: BenchSettings, path: Path) -> dict[str, Any]:
    """Train ONE seeded model for ``settings.warm_start_steps`` steps and save its params to ``path``.

    As the DiLoCo paper (Douillard et al. 2023, section 3), every method then starts from this same
    checkpoint: the warm start is a single worker (it sends nothing) with the node's AdamW, the same
    linear warmup, then the constant peak LR; it reads the whole train split in its own order
    (``data_seed + 1``), so its batches are not the variants' first ones. Each variant then starts
    with a fresh AdamW and its own warmup and cosine decay, and counts bytes and tokens from there.
    """
    start = time.perf_counter()
    corpus, eval_set = load_data(settings)
    worker = build_worker(dataclasses.replace(settings, warm_start_path=None), corpus, 0)
    worker.batches = ShardedBatches(
        corpus.train, seq_len=settings.seq_len, batch_size=settings.batch_size, seed=settings.data_seed + 1
    )
    schedule = LRSchedule(kind="constant", peak_lr=settings.warm_start_lr, warmup_steps=settings.warmup_steps,
                          horizon_steps=settings.warm_start_steps)  # fmt: skip
    initial_loss = evaluate(worker.model, eval_set)
    for step in range(settings.warm_start_steps):
        inner_step(worker, settings, schedule.lr(step))
    torch.save(worker.model.state_dict(), path)
    return {
        "steps": settings.warm_start_steps,
        "tokens": settings.warm_start_steps * settings.batch_size * settings.seq_len,
        "workers": 1,
        "initial_eval_loss": initial_loss,
        "eval_loss": evaluate(worker.model, eval_set),
        "wall_seconds": time.perf_counter() - start,
    }


# --- variant runners -------------------------------------------------------------------------------


@torch.no_grad()
def _global_model(flat: torch.Tensor, into: GPT) -> GPT:
    """``into`` holding the global params ``flat`` (overlap: the workers' models are mid-phase)."""
    offset = 0
    for p in (p for p in into.parameters() if p.requires_grad):
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return into


def run_diloco(settings: BenchSettings, variant: Variant) -> dict[str, Any]:
    """N DiLoCo workers in this process, outer rounds through ``SimulatedAllReduce``.

    Each worker steps its ``DiLoCo`` with the mean its simulated group computed, as the node's outer
    round (``node/outer/round.py``) does with the swarm's. ``overlap`` variants run the node's delayed
    outer update (``--overlap``), in ``OuterRound``'s order: at the end of phase k each worker takes
    its own Δ_k (``phase_delta``), restarts phase k+1 from the newest global params minus Δ_k
    (``restart_from``), and then steps the global params with round k's mean (``apply_mean``; the node
    does it on its averaging thread during phase k+1, which never reads them). Their eval at round k
    is of the global params every worker holds then (rounds up to k-1), plus a last point once the
    last round is applied.
    """
    start = time.perf_counter()
    overlap = variant.kind == "overlap"
    num_workers, inner_steps = settings.num_workers, variant.inner_steps
    if settings.steps % inner_steps:
        raise ValueError(f"steps ({settings.steps}) must be a multiple of H ({inner_steps})")
    corpus, eval_set = load_data(settings)
    workers = [build_worker(settings, corpus, i) for i in range(num_workers)]
    own = variant.settings(settings)
    outer = [DiLoCo(w.model, outer_lr=own.outer_lr, outer_momentum=own.outer_momentum) for w in workers]
    allreduce = SimulatedAllReduce(
        num_members=num_workers, num_elements=outer[0].num_elements, codec=variant.wire_codec(),
        error_feedback=variant.error_feedback, chunk_num_elements=settings.chunk_num_elements,
        error_feedback_decay=own.error_feedback_decay, owner_sparsifies=variant.owner_sparsifies,
    )  # fmt: skip
    schedule = schedule_of(settings)
    eval_model = copy.deepcopy(workers[0].model) if overlap else workers[0].model
    history = [(0, 0.0, evaluate(workers[0].model, eval_set))]  # (tokens, bytes per worker, eval loss)
    hashes: list[str] = []
    global_now = torch.empty(0)
    for step in range(settings.steps):
        lr = schedule.lr(step)
        for worker in workers:  # the inner phase: each worker alone on its shard
            inner_step(worker, settings, lr)
        if (step + 1) % inner_steps:
            continue
        # As in the node, a worker's weight is the number of tokens of its round.
        weight = float(inner_steps * settings.batch_size * settings.seq_len)
        if overlap:
            deltas = [o.phase_delta() for o in outer]  # Δ_k, while the model still holds phase k
            hashes = [o.param_hash() for o in outer]  # rounds up to k-1, before round k steps them
            global_now = outer[0].global_params.clone()
        else:
            deltas = [o.pseudo_gradient() for o in outer]
        averaged = allreduce.reduce(deltas, [weight] * num_workers)
        for o, delta in zip(outer, deltas, strict=True):
            # Each member's own copy of the mean, as each node gets one (SGD may write to its gradient).
            if overlap:
                o.restart_from(delta)  # before round k steps the global params
                o.apply_mean(averaged.clone())
            else:
                o.outer_step(averaged.clone())
        if not overlap:
            hashes = [o.param_hash() for o in outer]
        assert len(set(hashes)) == 1, "the workers' global params diverged"
        bytes_per_worker = sum(allreduce.bytes_sent) / num_workers
        tokens = (step + 1) * settings.tokens_per_step
        evaluated = _global_model(global_now, eval_model) if overlap else workers[0].model
        history.append((tokens, bytes_per_worker, evaluate(evaluated, eval_set)))
        _progress(step + 1, settings.steps, history[-1][2])
    if overlap:  # the last round landed: every worker holds the same, final, global params
        hashes = [o.param_hash() for o in outer]
        assert len(set(hashes)) == 1, "the workers' global params diverged"
        history.append(
            (
                history[-1][0],
                history[-1][1],
                evaluate(_global_model(outer[0].global_params, eval_model), eval_set),
            )
        )
    num_rounds = settings.steps // inner_steps
    payload = payload_bytes(allreduce.codec, outer[0].num_elements, num_workers, settings.chunk_num_elements)
    sends = sends_per_payload(allreduce.codec, num_workers, owner_sparsifies=variant.owner_sparsifies)
    return {
        "num_params": outer[0].num_elements,
        "rounds": num_rounds,
        "history": history,
        "final_train_loss": recent_train_loss(workers, settings.eval_every),
        "bytes_sent_per_worker": sum(allreduce.bytes_sent) / num_workers,
        "bytes_sent_per_worker_formula": num_rounds * sends * payload,
        "bytes_formula": (
            "rounds * (N-1)(N+1)/N * payload (sparse: each member's own top-k bytes to the N-1 other part "
            "owners, then each owner relays its part's N payloads to the N-1 others)"
            if allreduce.relay
            else "rounds * 2*(N-1)/N * payload"
            + (
                " (top-k, design (b): each owner re-sparsifies its part's mean)"
                if is_sparse(allreduce.codec)
                else ""
            )
        )
        + ", payload = sum over parts and chunks of codec.encoded_num_bytes (scales included)",
        **_simulated_fields(variant, own, hashes, start, what="the swarm all-reduce's"),
    }


def _simulated_fields(
    variant: Variant, own: BenchSettings, hashes: list[str], start: float, *, what: str
) -> dict[str, Any]:
    """The fields every in-process DiLoCo kind records beside its own: its outer settings, the
    workers' final hashes, how its bytes were counted, and its cost."""
    return {
        "density": variant.density,
        "outer_momentum": own.outer_momentum,
        "error_feedback_decay": own.error_feedback_decay if variant.error_feedback else None,
        "param_hashes": hashes,
        "simulated": True,
        "accounting": f"in-process simulation of {what} arithmetic (real codecs, error feedback and "
        "PartReducer) and of its wire payload bytes; no sockets, framing not counted",
        "wall_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time(),
    }


def run_streaming(settings: BenchSettings, variant: Variant) -> dict[str, Any]:
    """N Streaming DiLoCo workers in this process (``node.outer.fragments``): F fragments, fragment f's
    round after the inner steps s ≡ ⌊f·H/F⌋ (mod H), each through its own ``SimulatedAllReduce`` (its
    own payload and error feedback). A round's mean lands τ inner steps later (the workers train on
    meanwhile, as a node does while the round is in flight), then the fragment takes its outer step and
    each worker's copy of it is mixed with the new global fragment (α). At the end every fragment with
    steps since its last round has a last round (τ = 0), so the final eval is of global params that
    count every step, as a node's run end applies its round in flight. Eval every H steps and at the
    end is of the global params of every fragment, which every worker holds alike.

    F = 1, τ = 0, α = 0 is ``diloco`` bit for bit (tests/scripts/test_bench_convergence.py).
    """
    start = time.perf_counter()
    num_workers, inner_steps = settings.num_workers, variant.inner_steps
    num_fragments, mix, tau = variant.num_fragments, variant.fragment_mix, variant.fragment_overlap_steps
    if settings.steps % inner_steps:
        raise ValueError(f"steps ({settings.steps}) must be a multiple of H ({inner_steps})")
    corpus, eval_set = load_data(settings)
    workers = [build_worker(settings, corpus, i) for i in range(num_workers)]
    plan = model_fragment_plan(workers[0].model, num_fragments)
    own = variant.settings(settings)
    outer = [
        FragmentedDiLoCo(w.model, plan, outer_lr=own.outer_lr, outer_momentum=own.outer_momentum)
        for w in workers
    ]
    allreduces = [
        SimulatedAllReduce(
            num_members=num_workers,
            num_elements=outer[0].num_elements(f),
            codec=variant.wire_codec(),
            error_feedback=variant.error_feedback,
            chunk_num_elements=settings.chunk_num_elements,
            error_feedback_decay=own.error_feedback_decay,
            owner_sparsifies=variant.owner_sparsifies,
        )  # fmt: skip
        for f in range(num_fragments)
    ]
    eval_model = copy.deepcopy(workers[0].model)
    history = [(0, 0.0, evaluate(workers[0].model, eval_set))]  # (tokens, bytes per worker, eval loss)
    in_flight: dict[int, tuple[int, torch.Tensor]] = {}  # fragment -> (the step it lands after, mean)
    last_round = [0] * num_fragments  # the step each fragment's last round was taken at
    rounds = [0] * num_fragments

    def start_round(fragment: int, step: int) -> torch.Tensor:
        deltas = [o.pseudo_gradient(fragment) for o in outer]
        weight = float((step - last_round[fragment]) * settings.batch_size * settings.seq_len)
        last_round[fragment], rounds[fragment] = step, rounds[fragment] + 1
        return allreduces[fragment].reduce(deltas, [weight] * num_workers)

    def land(fragment: int, mean: torch.Tensor) -> None:
        for o in outer:  # each member's own copy of the mean, as each node gets one
            o.land(fragment, mean.clone(), mix=mix)
        hashes = {o.fragment_hash(fragment) for o in outer}
        assert len(hashes) == 1, f"the workers' global params of fragment {fragment} diverged"

    def bytes_per_worker() -> float:
        return sum(sum(a.bytes_sent) for a in allreduces) / num_workers

    schedule = schedule_of(settings)
    for step in range(1, settings.steps + 1):
        lr = schedule.lr(step - 1)
        for worker in workers:
            inner_step(worker, settings, lr)
        for fragment, (due, mean) in list(in_flight.items()):
            if due == step:
                land(fragment, mean)
                del in_flight[fragment]
        for fragment in due_fragments(step, inner_steps=inner_steps, num_fragments=num_fragments):
            assert fragment not in in_flight, "tau < H: a fragment's round lands before its next"
            mean = start_round(fragment, step)
            if tau == 0:
                land(fragment, mean)
            else:
                in_flight[fragment] = (step + tau, mean)
        if step % inner_steps == 0 and step < settings.steps:
            evaluated = _global_model(outer[0].global_params(), eval_model)
            history.append(
                (step * settings.tokens_per_step, bytes_per_worker(), evaluate(evaluated, eval_set))
            )
            _progress(step, settings.steps, history[-1][2])
    for fragment, (_, mean) in sorted(in_flight.items()):  # the run ends: the rounds in flight land
        land(fragment, mean)
    for fragment in range(num_fragments):  # and the steps since a fragment's last round get one
        if last_round[fragment] < settings.steps:
            land(fragment, start_round(fragment, settings.steps))
    evaluated = _global_model(outer[0].global_params(), eval_model)
    history.append(
        (settings.steps * settings.tokens_per_step, bytes_per_worker(), evaluate(evaluated, eval_set))
    )
    _progress(settings.steps, settings.steps, history[-1][2])
    hashes = [o.param_hash() for o in outer]
    assert len(set(hashes)) == 1, "the workers' global params diverged"
    sends = sends_per_payload(allreduces[0].codec, num_workers, owner_sparsifies=variant.owner_sparsifies)
    formula = sum(
        rounds[f] * sends * payload_bytes(allreduces[f].codec, outer[0].num_elements(f), num_workers,
                                          settings.chunk_num_elements)
        for f in range(num_fragments)
    )  # fmt: skip
    return {
        "num_params": sum(outer[0].num_elements(f) for f in range(num_fragments)),
        "rounds": sum(rounds),
        "fragment_rounds": rounds,
        "fragments": plan.describe().splitlines(),
        "fragment_elements": [outer[0].num_elements(f) for f in range(num_fragments)],
        "mix": mix,
        "overlap_steps": tau,
        "history": history,
        "final_train_loss": recent_train_loss(workers, settings.eval_every),
        "bytes_sent_per_worker": bytes_per_worker(),
        "bytes_sent_per_worker_formula": formula,
        "bytes_formula": "sum over fragments of its rounds * sends per payload * its payload",
        **_simulated_fields(variant, own, hashes, start, what="each fragment's all-reduce"),
    }


def ddp_rank_main(settings: BenchSettings, rank: int, store: Path, result_path: Path) -> None:
    """One DDP rank: gradients (and the loss, for the log) all-reduced every step over gloo."""
    import torch.distributed as dist

    start = time.perf_counter()
    corpus, eval_set = load_data(settings)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=settings.num_workers,
        timeout=COLLECTIVE_TIMEOUT,
    )
    worker = build_worker(settings, corpus, rank)
    params = worker.params
    flat = torch.empty(sum(p.numel() for p in params) + 1)  # (P + 1,): every grad, then the loss

    def average_gradients(worker: Worker, loss: torch.Tensor) -> float:
        torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None] + [loss.reshape(1)], out=flat)
        dist.all_reduce(flat)  # sum over ranks
        flat.div_(settings.num_workers)
        offset = 0
        for p in params:
            assert p.grad is not None
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        return float(flat[-1])

    schedule = schedule_of(settings)
    history = [(0, 0.0, evaluate(worker.model, eval_set))] if rank == 0 else []
    per_step = ddp_bytes_per_step(settings.num_workers, len(flat) - 1)
    for step in range(settings.steps):
        inner_step(worker, settings, schedule.lr(step), average_gradients)
        if rank == 0 and ((step + 1) % settings.eval_every == 0 or step + 1 == settings.steps):
            tokens, sent = (step + 1) * settings.tokens_per_step, (step + 1) * per_step
            history.append((tokens, sent, evaluate(worker.model, eval_set)))
            _progress(step + 1, settings.steps, history[-1][2])
    param_hash = tensor_hash(flatten_params(params, device="cpu"))
    dist.barrier()
    dist.destroy_process_group()
    record = {
        "rank": rank,
        "param_hash": param_hash,
        "history": history,
        "final_train_loss": recent_train_loss([worker], settings.eval_every),
        "num_params": len(flat) - 1,
        "wall_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time(),
    }
    result_path.write_text(json.dumps(record))


RUNNERS: dict[str, Callable[[BenchSettings, Variant], dict[str, Any]] | None] = {
    "ddp": None,  # multi-process: launched by `_launch`, its ranks run `ddp_rank_main`
    "diloco": run_diloco,
    "overlap": run_diloco,  # with the delayed outer update, as `dtnode join --overlap`
    "streaming": run_streaming,  # fragments synchronised in turn (node/outer/fragments.py)
}
