"""Convergence per byte: DiLoCo (and its compressed all-reduce) against synchronous data parallelism.

Every variant trains the same GPT preset on the embedded corpus with N workers, each reading its own
shard (``ShardedBatches(shard_index=i, num_shards=N)``, the same shards in every variant) for the same
number of inner steps, from the same seeded initialisation, with the node's AdamW (weight decay on
matrices only) and the same inner LR schedule (linear warmup, cosine decay over the run). So every
variant sees exactly the same tokens; only how the workers combine what they learned differs.

Variants (``--variants``, comma-separated; the list is open: add a kind to ``RUNNERS``):

    ddp                 N processes, torch.distributed (gloo, FileStore rendezvous). Every step the
                        gradients are averaged (one flat fp32 all_reduce, divided by N) before the
                        clip and the AdamW step, so the N replicas stay identical.
    diloco:H:CODEC      DiLoCo (Douillard et al. 2023, arXiv:2311.08105): H inner AdamW steps per worker,
                        then the node's own outer step (``node.diloco.DiLoCo``: Nesterov SGD, lr 0.7,
                        momentum 0.9) on the mean pseudo-gradient. Codecs other than none use error
                        feedback, as the swarm does.
    overlap:H:CODEC     the overlapped / delayed outer update (Streaming DiLoCo, Douillard et al. 2025,
                        arXiv:2501.18512). PENDING: the node has no ``--overlap`` yet, so it is listed,
                        announced and skipped.

How DiLoCo is run: an in-process simulation of the swarm's arithmetic, not the swarm. The N workers
live in one process and step one after another; every H steps ``SimulatedAllReduce`` does what the
butterfly all-reduce of ``protocol.allreduce`` does to the pseudo-gradients, with the same code where
it can: the vector is split into N equal parts (``split_by_weight``) and those into streamed chunks;
each member encodes its error-feedback-compensated contribution to every other member's part with the
real codec (``ErrorFeedback.encode``); each part's owner folds its own fp32 slice and the decoded
contributions, token-weighted, with the real ``PartReducer`` (fp32, member order), encodes the mean
once (with its own residual) and every member decodes those same bytes. Each worker's ``DiLoCo`` gets
that mean through its ``Averager``, so the outer step is the node's own code. Round formation,
gRPC, failures and timing are not simulated; the real swarm's wire bytes are measured by the CLI
tests and ``bench_allreduce.py``.

Bytes sent per worker (codec payloads; protobuf framing and control messages are not counted):

    ddp:     steps x 2 (N - 1) / N x 4 x num_params        (a ring all-reduce of the fp32 gradients,
                                                            Patarasuk & Yuan 2009; gloo may pick another
                                                            algorithm, this is the bandwidth optimum)
    diloco:  rounds x 2 (N - 1) / N x payload, payload = sum over parts and chunks of the codec's
             encoded_num_bytes (int8/int4 include one fp32 scale per block): each member sends its
             contribution to the N - 1 other parts, and its part's encoded mean to the N - 1 others.

``reduction_vs_ddp`` = DDP's bytes / the variant's. Since DDP sends 4 bytes per number per step and
int4 (blocks of 64) 0.5625 bytes per number per round, the reduction is H x 7.1: the issue's ">= 1000x
fewer bytes" needs H >= 141 with int4, hence the default ``diloco:200:int4``.

Evaluation: the same fixed held-out batches (``eval_batches``) for every variant, on the model before
training, every ``--eval-every`` steps for DDP and after every outer round for DiLoCo (the global
params); ``eval_loss`` is the value at the end. ``final_train_loss`` is the mean training loss of the
last ``--eval-every`` steps over all workers. Target (issue 5): DiLoCo int4 within 2 % of DDP's eval
loss while sending >= 1000x fewer bytes per worker.

    python scripts/bench_convergence.py --quick
    python scripts/bench_convergence.py --variants ddp,diloco:100:int4 --steps 2000

Prints one JSON object per variant, then a one-line summary; writes ``results.json`` (with each
variant's eval history), ``convergence.png`` and per-process logs to ``--out-dir``. Variants run as
separate processes, ``--jobs`` at a time (DDP counts as one job of N processes). Exit code 0 if every
variant completed (the verdict is in the output), 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch import nn

from node.config import NodeConfig
from node.corpus import Corpus
from node.data import ShardedBatches, eval_batches, load_corpus
from node.diloco import AveragingOutcome, DiLoCo, flatten_params, tensor_hash
from node.model import GPT, cross_entropy_loss, model_config
from node.schedule import LRSchedule
from node.trainer import build_inner_optimizer
from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.group import split_by_weight
from protocol.allreduce.reducer import PartReducer, chunk_sizes
from protocol.codecs import CODEC_NAMES, Codec, get_codec
from protocol.error_feedback import ErrorFeedback

COLLECTIVE_TIMEOUT = timedelta(minutes=30)
"""Longest a DDP rank waits in the rendezvous or one all_reduce before gloo raises."""
FP32_BYTES = 4
DEFAULT_VARIANTS = (
    "ddp,diloco:25:none,diloco:100:none,diloco:100:int8,diloco:100:int4,diloco:200:int4,overlap:100:int4"
)
PENDING_KINDS = {"overlap": "the node has no --overlap (delayed outer update) yet: issue 5, item 2"}
TARGET_LOSS_GAP = 0.02
TARGET_REDUCTION = 1000.0


@dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """One benchmark's shared training setup (identical for every variant)."""

    preset: str
    """Model preset of ``node.model.MODEL_PRESETS``."""
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
    inner_lr: float = 1e-3
    """Peak AdamW learning rate (the node's default)."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (norm gains are not decayed), as the node."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the (averaged, for DDP) gradient norm to this before every AdamW step."""
    outer_lr: float = 0.7
    """DiLoCo outer Nesterov learning rate (the node's default)."""
    outer_momentum: float = 0.9
    """DiLoCo outer Nesterov momentum (the node's default)."""
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

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "num_workers", "steps", "eval_every", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 2:
            raise ValueError(f"num_workers must be >= 2 (one worker sends nothing), got {self.num_workers}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")

    @property
    def tokens_per_step(self) -> int:
        """Tokens all workers together train on per inner step."""
        return self.num_workers * self.batch_size * self.seq_len


PROFILES: dict[str, dict[str, Any]] = {
    # quick: ~810 CPU seconds in all (~0.08 s per nano step of 4 x 128 tokens), so ~7 min on an idle
    # 2-core machine; with other work on the cores it takes longer (26 min at a load average of 9).
    # full: ~10x the tokens per variant; not calibrated here.
    "quick": {"preset": "nano", "seq_len": 128, "batch_size": 4, "num_workers": 4, "steps": 400, "warmup_steps": 40},
    "full": {"preset": "nano", "seq_len": 128, "batch_size": 8, "num_workers": 4, "steps": 4000, "warmup_steps": 200},
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    """One way of combining the workers: ``kind`` (a key of RUNNERS or PENDING_KINDS), H and codec."""

    kind: str
    inner_steps: int = 1
    codec: str = "none"

    @property
    def error_feedback(self) -> bool:
        return self.kind != "ddp" and self.codec != "none"  # as the swarm: feedback for lossy codecs

    @property
    def name(self) -> str:
        if self.kind == "ddp":
            return "ddp"
        return f"{self.kind}-H{self.inner_steps}-{self.codec}" + ("-ef" if self.error_feedback else "")

    def spec(self) -> str:
        return "ddp" if self.kind == "ddp" else f"{self.kind}:{self.inner_steps}:{self.codec}"


def parse_variant(text: str) -> Variant:
    """``ddp`` or ``KIND:H:CODEC`` (e.g. ``diloco:100:int4``)."""
    if text == "ddp":
        return Variant("ddp")
    fields = text.split(":")
    if len(fields) != 3 or fields[0] not in (*RUNNERS, *PENDING_KINDS) or not fields[1].isdigit():
        raise ValueError(f"bad variant {text!r}: use ddp or KIND:H:CODEC with KIND in diloco, overlap")
    if fields[2] not in CODEC_NAMES or int(fields[1]) < 1:
        raise ValueError(f"bad variant {text!r}: H must be >= 1 and CODEC one of {', '.join(CODEC_NAMES)}")
    return Variant(fields[0], int(fields[1]), fields[2])


# --- bytes -----------------------------------------------------------------------------------------


def ddp_bytes_per_step(num_workers: int, num_params: int) -> float:
    """Bytes one rank sends in a ring all-reduce of the fp32 gradients: 2 (N - 1) / N x 4 x params."""
    return 2 * (num_workers - 1) / num_workers * FP32_BYTES * num_params


def payload_bytes(codec: Codec, num_elements: int, num_members: int, chunk_num_elements: int) -> int:
    """The encoded vector as the all-reduce cuts it: sum over equal parts and their chunks."""
    bounds = split_by_weight(num_elements, [1.0] * num_members)
    return sum(
        codec.encoded_num_bytes(size)
        for low, high in zip(bounds[:-1], bounds[1:], strict=True)
        for size in chunk_sizes(high - low, chunk_num_elements)
    )


# --- the simulated swarm all-reduce ----------------------------------------------------------------


class SimulatedAllReduce:
    """The swarm's reduce-scatter + all-gather arithmetic for N members in one process (no sockets).

    Member m owns part m. Phase 1 (reduce-scatter): every member encodes its slice of every other
    part (with its error feedback) and the owner folds them with its own fp32 slice in a
    ``PartReducer``. Phase 2 (all-gather): the owner encodes the weighted mean once (with its
    residual) and every member decodes those bytes. ``bytes_sent[m]`` counts the payloads m sends.
    """

    def __init__(
        self,
        *,
        num_members: int,
        num_elements: int,
        codec: Codec,
        error_feedback: bool,
        chunk_num_elements: int,
    ) -> None:
        self.num_members = num_members
        self.codec = codec
        self.chunk_num_elements = chunk_num_elements
        self.bounds = split_by_weight(num_elements, [1.0] * num_members)
        self.feedback = [ErrorFeedback(num_elements) for _ in range(num_members)] if error_feedback else None
        self.bytes_sent = [0] * num_members  # cumulative over rounds

    def _encode(self, member: int, values: torch.Tensor, offset: int) -> bytes:
        if self.feedback is None:
            return self.codec.encode(values).numpy().tobytes()
        return self.feedback[member].encode(self.codec, values, offset).numpy().tobytes()

    def reduce(self, vectors: list[torch.Tensor], weights: list[float]) -> torch.Tensor:
        """The token-weighted mean of ``vectors`` as every member decodes it: (E,) fp32."""
        if len(vectors) != self.num_members or len(weights) != self.num_members:
            raise ValueError(f"need {self.num_members} vectors and weights")
        averaged = torch.empty_like(vectors[0])  # (E,)
        for part in range(self.num_members):
            low, high = self.bounds[part], self.bounds[part + 1]
            reducer = PartReducer(
                part_index=part, producer_index=part, num_elements=high - low, num_members=self.num_members,
                codec=self.codec, chunk_num_elements=self.chunk_num_elements,
            )  # fmt: skip
            # Phase 1: the owner's slice stays fp32; every other member's crosses the wire encoded.
            for member, (vector, weight) in enumerate(zip(vectors, weights, strict=True)):
                if member == part:
                    reducer.add_local(member, weight, vector[low:high])
                    continue
                reducer.begin(member, weight)
                offset = 0
                for size in chunk_sizes(high - low, self.chunk_num_elements):
                    payload = self._encode(member, vector[low + offset : low + offset + size], low + offset)
                    reducer.add_chunk(member, offset, size, payload)
                    self.bytes_sent[member] += len(payload)
                    offset += size
                reducer.complete(member)
            reducer.finalize()
            jobs = reducer.plan_folds()
            reducer.run_folds(jobs)
            reducer.folds_done(jobs)
            assert reducer.is_done() and len(reducer.contributors) == self.num_members
            owner_feedback = None if self.feedback is None else self.feedback[part]
            reduced = reducer.encode_average(error_feedback=owner_feedback, part_offset=low)
            # Phase 2: the owner serves its encoded mean to the N - 1 others; all decode the same bytes.
            self.bytes_sent[part] += (self.num_members - 1) * sum(len(p) for p in reduced.payloads)
            offset = low
            for size, payload in zip(reduced.chunk_sizes, reduced.payloads, strict=True):
                self.codec.decode_into(payload, averaged[offset : offset + size])
                offset += size
        return averaged


class _RoundAverager:
    """One member's ``Averager``: hands ``DiLoCo.outer_step`` the mean the simulated group computed."""

    def __init__(self) -> None:
        self._expected: torch.Tensor | None = None
        self._outcome: AveragingOutcome | None = None

    def prepare(self, vector: torch.Tensor, outcome: AveragingOutcome) -> None:
        self._expected, self._outcome = vector, outcome

    def average(self, vector: torch.Tensor, *, round_index: int, weight: float) -> AveragingOutcome:
        outcome, expected = self._outcome, self._expected
        assert outcome is not None and expected is not None, "prepare() the round first"
        assert torch.equal(vector, expected), "DiLoCo averaged another Δ than the group reduced"
        self._outcome = self._expected = None
        return outcome


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
    model.train()
    node_config = NodeConfig(
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
    corpus = load_corpus(None, val_fraction=NodeConfig().val_fraction)
    val = eval_batches(corpus.val, settings.seq_len, settings.eval_batch_size, settings.num_eval_batches)
    return corpus, val


# --- variant runners -------------------------------------------------------------------------------


def run_diloco(settings: BenchSettings, variant: Variant) -> dict[str, Any]:
    """N DiLoCo workers in this process, outer rounds through ``SimulatedAllReduce``."""
    start = time.perf_counter()
    num_workers, inner_steps = settings.num_workers, variant.inner_steps
    if settings.steps % inner_steps:
        raise ValueError(f"steps ({settings.steps}) must be a multiple of H ({inner_steps})")
    corpus, eval_set = load_data(settings)
    workers = [build_worker(settings, corpus, i) for i in range(num_workers)]
    averagers = [_RoundAverager() for _ in workers]
    outer = [
        DiLoCo(
            w.model,
            averager=a,
            outer_lr=settings.outer_lr,
            outer_momentum=settings.outer_momentum,
            nesterov=settings.outer_momentum > 0,  # torch refuses Nesterov without momentum
        )
        for w, a in zip(workers, averagers, strict=True)
    ]
    allreduce = SimulatedAllReduce(
        num_members=num_workers, num_elements=outer[0].num_elements, codec=get_codec(variant.codec),
        error_feedback=variant.error_feedback, chunk_num_elements=settings.chunk_num_elements,
    )  # fmt: skip
    schedule = schedule_of(settings)
    history = [(0, 0.0, evaluate(workers[0].model, eval_set))]  # (tokens, bytes per worker, eval loss)
    hashes: list[str] = []
    for step in range(settings.steps):
        lr = schedule.lr(step)
        for worker in workers:  # the inner phase: each worker alone on its shard
            inner_step(worker, settings, lr)
        if (step + 1) % inner_steps:
            continue
        round_index = (step + 1) // inner_steps
        # As in the node, a worker's weight is the number of tokens of its round.
        weight = float(inner_steps * settings.batch_size * settings.seq_len)
        deltas = [o.pseudo_gradient() for o in outer]
        sent_before = list(allreduce.bytes_sent)
        averaged = allreduce.reduce(deltas, [weight] * num_workers)
        for m, (o, averager, delta) in enumerate(zip(outer, averagers, deltas, strict=True)):
            sent = allreduce.bytes_sent[m] - sent_before[m]
            averager.prepare(
                delta, AveragingOutcome(averaged=averaged.clone(), num_peers=num_workers, bytes_sent=sent)
            )
            o.outer_step(round_index=round_index, weight=weight)
        hashes = [o.param_hash() for o in outer]
        assert len(set(hashes)) == 1, "the workers' global params diverged"
        bytes_per_worker = sum(allreduce.bytes_sent) / num_workers
        tokens = (step + 1) * settings.tokens_per_step
        history.append((tokens, bytes_per_worker, evaluate(workers[0].model, eval_set)))
        _progress(step + 1, settings.steps, history[-1][2])
    num_rounds = settings.steps // inner_steps
    payload = payload_bytes(allreduce.codec, outer[0].num_elements, num_workers, settings.chunk_num_elements)
    return {
        "num_params": outer[0].num_elements,
        "rounds": num_rounds,
        "history": history,
        "final_train_loss": recent_train_loss(workers, settings.eval_every),
        "bytes_sent_per_worker": sum(allreduce.bytes_sent) / num_workers,
        "bytes_sent_per_worker_formula": num_rounds * 2 * (num_workers - 1) / num_workers * payload,
        "bytes_formula": "rounds * 2*(N-1)/N * sum over parts and chunks of codec.encoded_num_bytes (scales included)",
        "param_hashes": hashes,
        "simulated": True,
        "accounting": "in-process simulation of the swarm all-reduce's arithmetic (real codecs, error "
        "feedback and PartReducer) and of its wire payload bytes; no sockets, framing not counted",
        "wall_seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time(),
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
}


# --- orchestration ---------------------------------------------------------------------------------


@dataclass
class _Job:
    variant: Variant
    processes: list[subprocess.Popen[bytes]]
    results: list[Path]
    started: float


def _launch(variant: Variant, settings_path: Path, work_dir: Path, num_workers: int) -> _Job:
    script = [sys.executable, str(Path(__file__).resolve()), "--settings-file", str(settings_path)]
    if variant.kind == "ddp":
        store = work_dir / "ddp.store"
        store.unlink(missing_ok=True)  # a FileStore must start empty
        roles = [["--ddp-rank", str(r), "--store", str(store)] for r in range(num_workers)]
    else:
        roles = [["--run-variant", variant.spec()]]
    processes, results = [], []
    for index, role in enumerate(roles):
        results.append(work_dir / f"{variant.name}-{index}.json")
        log = (work_dir / f"{variant.name}-{index}.log").open("wb")
        argv = [*script, *role, "--result-file", str(results[-1])]
        processes.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        log.close()  # the child holds its own descriptor
    return _Job(variant, processes, results, time.perf_counter())


def _collect(job: _Job, settings: BenchSettings) -> dict[str, Any]:
    """The variant's record from its processes' result files (or an ``error``)."""
    variant = job.variant
    record: dict[str, Any] = {"variant": variant.name, "kind": variant.kind, "workers": settings.num_workers,
                              "inner_steps": variant.inner_steps, "codec": variant.codec,
                              "error_feedback": variant.error_feedback,
                              "tokens": settings.steps * settings.tokens_per_step, "steps_per_worker": settings.steps}  # fmt: skip
    codes = [p.returncode for p in job.processes]
    if any(code != 0 for code in codes) or not all(path.exists() for path in job.results):
        return record | {"error": f"exit codes {codes}; see {job.results[0].with_suffix('.log')}"}
    parts = [json.loads(path.read_text()) for path in job.results]
    if variant.kind != "ddp":
        return record | parts[0] | {"wall_seconds": time.perf_counter() - job.started}
    num_params = parts[0]["num_params"]
    return record | {
        "num_params": num_params,
        "rounds": settings.steps,
        "history": parts[0]["history"],
        "final_train_loss": sum(p["final_train_loss"] for p in parts) / len(parts),
        "bytes_sent_per_worker": settings.steps * ddp_bytes_per_step(settings.num_workers, num_params),
        "bytes_formula": "steps * 2*(N-1)/N * 4 * num_params (ring all-reduce of fp32 gradients)",
        "param_hashes": [p["param_hash"] for p in sorted(parts, key=lambda p: p["rank"])],
        "simulated": False,
        "accounting": "real torch.distributed gloo all_reduce every step; bytes from the ring formula",
        "wall_seconds": time.perf_counter() - job.started,
        "cpu_seconds": sum(p["cpu_seconds"] for p in parts),
    }


def run_variants(
    settings: BenchSettings, variants: list[Variant], out_dir: Path, *, jobs: int, timeout: timedelta
) -> list[dict[str, Any]]:
    """Run each variant as its own process(es), ``jobs`` variants at a time; records in input order."""
    work_dir = (out_dir / "logs").resolve()  # absolute: the FileStore URL and the children need it
    work_dir.mkdir(parents=True, exist_ok=True)
    settings_path = work_dir / "settings.json"
    settings_path.write_text(json.dumps(dataclasses.asdict(settings)))
    waiting, running, done = list(variants), list[_Job](), dict[Variant, dict[str, Any]]()
    try:
        while waiting or running:
            while waiting and len(running) < jobs:
                running.append(_launch(waiting.pop(0), settings_path, work_dir, settings.num_workers))
            time.sleep(0.2)
            for job in list(running):
                if time.perf_counter() - job.started > timeout.total_seconds():
                    for process in job.processes:
                        process.kill()  # only the processes this benchmark started
                if all(p.poll() is not None for p in job.processes):
                    running.remove(job)
                    done[job.variant] = _collect(job, settings)
                    print(f"bench_convergence: {job.variant.name} done", file=sys.stderr, flush=True)
    finally:
        for job in running:  # interrupted: stop what is still running
            for process in job.processes:
                process.kill()
                process.wait()
    records = [done[v] for v in variants]
    finished = [r for r in records if "error" not in r]
    for record in finished:
        record["eval_loss"] = record["history"][-1][2]
        ddp_bytes = settings.steps * ddp_bytes_per_step(settings.num_workers, record["num_params"])
        record["reduction_vs_ddp"] = ddp_bytes / record["bytes_sent_per_worker"]
    ddp = next((r for r in finished if r["kind"] == "ddp"), None)
    for record in finished:
        if ddp is not None:
            record["eval_gap_vs_ddp"] = record["eval_loss"] / ddp["eval_loss"] - 1
    return records


# --- report ----------------------------------------------------------------------------------------


def target_verdict(records: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """Whether some DiLoCo int4 variant is within 2 % of DDP's eval loss at >= 1000x fewer bytes."""
    int4 = [r for r in records if r["kind"] == "diloco" and r["codec"] == "int4" and "eval_gap_vs_ddp" in r]
    if not int4:
        return None, "target not evaluated (needs ddp and a diloco int4 variant)"
    met = [
        r["variant"]
        for r in int4
        if r["eval_gap_vs_ddp"] <= TARGET_LOSS_GAP and r["reduction_vs_ddp"] >= TARGET_REDUCTION
    ]
    if met:
        return True, f"target MET by {', '.join(met)}"
    return False, "target NOT MET: " + "; ".join(
        f"{r['variant']} {r['eval_gap_vs_ddp']:+.2%} loss at {r['reduction_vs_ddp']:,.0f}x" for r in int4
    )


def summary_line(records: list[dict[str, Any]]) -> str:
    parts = []
    for r in records:
        if "error" in r:
            parts.append(f"{r['variant']} FAILED")
        elif r["kind"] == "ddp":
            parts.append(f"ddp {r['eval_loss']:.4f}")
        else:
            gap = f" {r['eval_gap_vs_ddp']:+.1%}" if "eval_gap_vs_ddp" in r else ""
            parts.append(f"{r['variant']} {r['eval_loss']:.4f}{gap} @ {r['reduction_vs_ddp']:,.0f}x")
    return f"summary: eval loss | {' | '.join(parts)} | {target_verdict(records)[1]}"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Eval loss against training tokens (linear) and against bytes sent per worker (log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_tokens, by_bytes) = plt.subplots(1, 2, figsize=(13, 5))
    for record in records:
        if "error" in record:
            continue
        tokens, sent, loss = zip(*record["history"], strict=True)
        style = {
            "marker": ".",
            "label": record["variant"],
            "linestyle": "--" if record["kind"] == "ddp" else "-",
        }
        by_tokens.plot(tokens, loss, **style)
        by_bytes.plot(sent[1:], loss[1:], **style)  # the initial eval sent 0 bytes: off a log axis
    by_tokens.set(xlabel="training tokens (all workers)", ylabel="eval loss", title="eval loss vs tokens")
    by_bytes.set(
        xscale="log", xlabel="bytes sent per worker", ylabel="eval loss", title="eval loss vs bytes sent"
    )
    for axis in (by_tokens, by_bytes):
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- command line ----------------------------------------------------------------------------------

_SETTING_FLAGS: list[tuple[str, type, str]] = [
    ("preset", str, "model preset (nano ~0.9M params, tiny ~10.8M)"),
    ("seq_len", int, "context length in tokens"),
    ("batch_size", int, "sequences per worker per step"),
    ("num_workers", int, "N: DDP ranks / DiLoCo workers"),
    ("steps", int, "inner steps per worker (a multiple of every H)"),
    ("warmup_steps", int, "linear LR warmup steps, then cosine decay to 0.1 x peak"),
    ("inner_lr", float, "peak AdamW learning rate (default 1e-3, the node's)"),
    ("outer_lr", float, "DiLoCo outer Nesterov learning rate (default 0.7, the node's)"),
    ("outer_momentum", float, "DiLoCo outer Nesterov momentum (default 0.9, the node's; 0 = plain SGD)"),
    ("seed", int, "seed of the model initialisation"),
    ("data_seed", int, "seed of the data order"),
    ("eval_every", int, "DDP eval interval in steps, and the train-loss window (default 25)"),
    ("eval_batch_size", int, "sequences per held-out batch (default 16)"),
    ("num_eval_batches", int, "held-out batches (default 8)"),
    ("threads", int, "torch threads per process (default 1)"),
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the quick profile (< 15 min here): " + json.dumps(PROFILES["quick"]),
    )
    parser.add_argument(
        "--variants", default=DEFAULT_VARIANTS, help="comma-separated: ddp, diloco:H:CODEC, overlap:H:CODEC"
    )
    parser.add_argument(
        "--out-dir", type=Path, default=Path("runs/bench_convergence"), help="results.json, plot, logs"
    )
    parser.add_argument(
        "--jobs", type=int, default=2, help="variants run at once (DDP = one job of N processes)"
    )
    parser.add_argument(
        "--timeout-minutes", type=float, default=240.0, help="a variant still running then is killed"
    )
    for name, kind, text in _SETTING_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)
    for hidden in ("--settings-file", "--result-file", "--store"):
        parser.add_argument(hidden, type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-variant", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ddp-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _child_main(args: argparse.Namespace) -> int:
    """A variant's process: one DDP rank, or a whole in-process variant."""
    settings = BenchSettings(**json.loads(args.settings_file.read_text()))
    if args.ddp_rank is not None:
        ddp_rank_main(settings, args.ddp_rank, args.store, args.result_file)
        return 0
    variant = parse_variant(args.run_variant)
    runner = RUNNERS[variant.kind]
    assert runner is not None, f"{variant.kind} is not run in one process"
    args.result_file.write_text(json.dumps(runner(settings, variant)))
    return 0


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds run_variants, which kills the processes it started


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    previous_handler = signal.signal(signal.SIGTERM, _raise_system_exit)
    try:
        return _main(args)
    finally:
        signal.signal(signal.SIGTERM, previous_handler)


def _main(args: argparse.Namespace) -> int:
    if args.settings_file is not None:
        return _child_main(args)
    profile = dict(PROFILES["quick" if args.quick else "full"])
    profile.update(
        {name: getattr(args, name) for name, _, _ in _SETTING_FLAGS if getattr(args, name) is not None}
    )
    try:
        settings = BenchSettings(**profile)
        variants = [parse_variant(text.strip()) for text in args.variants.split(",") if text.strip()]
        if args.jobs < 1:
            raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
        for variant in variants:
            if settings.steps % variant.inner_steps:
                raise ValueError(f"--steps {settings.steps} is not a multiple of {variant.name}'s H")
    except ValueError as error:
        print(f"bench_convergence: {error}", file=sys.stderr)
        return 2
    pending = [v for v in variants if v.kind in PENDING_KINDS]
    for variant in pending:
        print(f"note: {variant.name} is pending and skipped: {PENDING_KINDS[variant.kind]}", flush=True)
    runnable = [v for v in variants if v.kind not in PENDING_KINDS]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    records = run_variants(
        settings, runnable, args.out_dir, jobs=args.jobs, timeout=timedelta(minutes=args.timeout_minutes)
    )
    for record in records:
        print(
            json.dumps({k: v for k, v in record.items() if k not in ("history", "param_hashes")}), flush=True
        )
    met, verdict = target_verdict(records)
    results = {"settings": dataclasses.asdict(settings), "variants": records,
               "pending": [v.name for v in pending], "target_met": met, "target": verdict}  # fmt: skip
    (args.out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(records, args.out_dir / "convergence.png")
    print(summary_line(records), flush=True)
    print(f"plot: {args.out_dir / 'convergence.png'}", flush=True)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
