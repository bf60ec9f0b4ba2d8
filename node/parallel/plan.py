"""Choose a node's intra-node layout: data (dp) x tensor (tp) x pipeline (pp) parallelism and micro-batches.

``plan_layout`` is a pure function of the model shapes, the number of devices, their memory and the
batch. It enumerates every ``dp * tp * pp == num_devices``, estimates the memory of the busiest device,
drops layouts that do not fit, and picks one by a fixed rule. No torch, no devices: the same inputs give
the same plan on every machine, and ``dtnode plan`` can run before anything is installed on a GPU.

Constraints (what the code in ``tensor.py`` / ``pipeline.py`` accepts)
---------------------------------------------------------------------
- ``tp`` divides ``num_heads``, ``num_kv_heads`` and ``mlp_hidden_dim`` (Megatron column/row split,
  Shoeybi et al. 2019: each rank owns whole heads and whole hidden units).
- ``pp <= num_layers`` (every stage holds at least one block), and ``pp == 1`` with tied embeddings.
- ``dp`` divides ``batch_size`` (the node's sequences per inner step are split evenly over replicas), and
  the micro-batch count ``m`` divides the per-replica batch; with ``pp > 1``, ``m >= pp`` (1F1B needs it).

Memory model of one device (all fp32, 4 bytes per element; no activation recomputation)
---------------------------------------------------------------------------------------
Let ``C = dim``, ``K = num_kv_heads * head_dim``, ``F = mlp_hidden_dim``, ``V = vocab_size`` and
``L_s = ceil(num_layers / pp)`` the blocks of the largest stage. Per device:

    block_params = (2*C*C + 2*C*K + 3*C*F) / tp + 2*C     # matmuls sharded by tp, RMSNorm gains replicated
    P_dev        = L_s * block_params + 2*V*C + C         # + embedding, output head, final norm (replicated)
    params       = 4 * P_dev
    grads        = 4 * P_dev
    optimizer    = 8 * ceil(P_dev / dp)                   # AdamW exp_avg + exp_avg_sq, ZeRO-1 sharded over dp
    activations  = 4 * in_flight * b * T * (L_s * A + C + 2*V)
    A            = 4*C + (3*C + 3*K + 4*F) / tp           # saved elements per token per block

- ``P_dev`` charges both end pieces (embedding; final norm + head) to the one largest stage. That is
  exact for ``pp == 1`` and an upper bound for ``pp > 1`` (it over-counts one ``V x C`` matrix, small for
  the 260-token byte vocabulary); a plan must never promise memory it does not have.
- ZeRO-1 (Rajbhandari et al. 2020, "ZeRO", stage 1): each dp replica keeps ``1/dp`` of the optimizer
  state; parameters and gradients stay replicated.
- ``A`` counts what autograd keeps per token for one block: the two RMSNorm inputs and outputs (``4C``,
  replicated across tp), and on each tp rank its share of q, k, v (``C + 2K``), rotated q, k (``C + K``),
  the attention output entering ``wo`` (``C``), and ``w1 x``, ``w3 x``, ``silu(w1 x)`` and their product
  (``4F``). The ``T x T`` score matrix is not stored: ``scaled_dot_product_attention`` uses a fused kernel.
  ``C + 2V`` per token is the embedding output plus the logits and their log-softmax (cross-entropy).
  Rough in the spirit of Korthikanti et al. 2022 ("Reducing Activation Recomputation"), which it is not
  copied from: temporaries of the backward pass and allocator fragmentation are not modelled, hence the
  ``headroom`` fraction of device memory the plan leaves free (default 10%).
- ``b = batch_size / (dp * m)`` is the micro-batch size, ``T = seq_len``. ``in_flight`` is how many
  micro-batches have live activations at once on stage 0: ``min(pp, m)`` under 1F1B (Narayanan et al.
  2021), and ``1`` without a pipeline (micro-batches are then plain gradient accumulation).
- Not counted: DiLoCo's outer state (global params + Nesterov momentum, 2 x fp32 params), which the node
  keeps on CPU (``DiLoCo(offload=True)``); CUDA context and framework overhead (inside the headroom).

Pipeline bubble: with ``p`` stages and ``m`` micro-batches, GPipe and 1F1B idle for a fraction
``(p - 1) / (m + p - 1)`` of the step (Huang et al. 2019; Narayanan et al. 2021).

Choice rule (in order)
----------------------
1. Fit: the estimate, including ``headroom``, must fit ``device_memory_bytes``.
2. Most data parallelism (largest ``dp``): replicas need no communication inside a step except one
   gradient all-reduce, so every model-parallel split is a cost to avoid.
3. Among equal ``dp``, most tensor parallelism (largest ``tp``, so smallest ``pp``): inside one node the
   devices share a fast link, where tp's per-block all-reduces are cheap, whereas pp pays the bubble.
4. Micro-batches: for ``pp == 1`` the fewest that fit (``m = 1`` when possible: no accumulation); for
   ``pp > 1`` the fewest with ``m >= 4 * pp`` (bubble at most ~20%) that fit, else the most that fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from node.model.gpt import ModelConfig

BYTES_PER_FP32 = 4
DEFAULT_HEADROOM = 0.1
MICROBATCHES_PER_STAGE = 4  # m >= 4 * pp keeps the bubble (p-1)/(m+p-1) below 1/5


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Estimated bytes held by the busiest device, by kind (see the module docstring for the formulas)."""

    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activation_bytes


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the node's devices are split: ``dp * tp * pp`` devices."""

    dp: int
    tp: int
    pp: int

    def __str__(self) -> str:
        return f"dp={self.dp} tp={self.tp} pp={self.pp}"


@dataclass(frozen=True, kw_only=True)
class RejectedLayout:
    """A layout the planner considered and did not choose, with the reason in a few words."""

    layout: Layout
    reason: str
    memory: MemoryEstimate | None = None  # None when the layout is invalid before memory matters


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The chosen layout, its micro-batching, its memory estimate per device and the reasons for it."""

    layout: Layout
    num_microbatches: int
    microbatch_size: int  # sequences per micro-batch, batch_size / (dp * num_microbatches)
    memory: MemoryEstimate
    bubble_fraction: float
    device_memory_bytes: int
    reasons: tuple[str, ...]
    rejected: tuple[RejectedLayout, ...]  # every other layout, best first


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of a pipelined step, ``(p - 1) / (m + p - 1)`` (GPipe and 1F1B alike)."""
    if num_stages < 1 or num_microbatches < 1:
        raise ValueError(
            f"need num_stages >= 1 and num_microbatches >= 1, got {num_stages}, {num_microbatches}"
        )
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def estimate_memory(
    config: ModelConfig, layout: Layout, *, seq_len: int, microbatch_size: int, num_microbatches: int
) -> MemoryEstimate:
    """Bytes on the busiest device of ``layout`` (formulas in the module docstring); assumes a valid layout."""
    dim, kv_dim, hidden = (
        config.dim,
        config.resolved_num_kv_heads * config.head_dim,
        config.resolved_mlp_hidden_dim,
    )
    vocab, tp = config.vocab_size, layout.tp
    assert (2 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden) % tp == 0, "tp must divide the block matmuls"
    layers_per_stage = math.ceil(config.num_layers / layout.pp)
    block_params = (2 * dim * dim + 2 * dim * kv_dim + 3 * dim * hidden) // tp + 2 * dim
    params_per_device = layers_per_stage * block_params + 2 * vocab * dim + dim
    activation_per_token_per_block = 4 * dim + (3 * dim + 3 * kv_dim + 4 * hidden) // tp
    in_flight = min(layout.pp, num_microbatches) if layout.pp > 1 else 1
    tokens_in_flight = in_flight * microbatch_size * seq_len
    activation_per_token = layers_per_stage * activation_per_token_per_block + dim + 2 * vocab
    return MemoryEstimate(
        params_bytes=BYTES_PER_FP32 * params_per_device,
        grads_bytes=BYTES_PER_FP32 * params_per_device,
        optimizer_bytes=2 * BYTES_PER_FP32 * math.ceil(params_per_device / layout.dp),
        activation_bytes=BYTES_PER_FP32 * tokens_in_flight * activation_per_token,
    )


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def invalid_reason(config: ModelConfig, layout: Layout, batch_size: int) -> str | None:
    """Why ``layout`` cannot run this model at all, or None when it can."""
    for name, size in (
        ("num_heads", config.num_heads),
        ("num_kv_heads", config.resolved_num_kv_heads),
        ("mlp_hidden_dim", config.resolved_mlp_hidden_dim),
    ):
        if size % layout.tp != 0:
            return f"tp={layout.tp} does not divide {name}={size}"
    if layout.pp > config.num_layers:
        return f"pp={layout.pp} exceeds num_layers={config.num_layers}"
    if layout.pp > 1 and config.tie_embeddings:
        return "tied embeddings cannot be split into pipeline stages"
    if batch_size % layout.dp != 0:
        return f"dp={layout.dp} does not divide batch_size={batch_size}"
    if layout.pp > 1 and batch_size // layout.dp < layout.pp:
        return f"per-replica batch {batch_size // layout.dp} < pp={layout.pp} micro-batches needed by 1F1B"
    return None


def _microbatch_candidates(layout: Layout, replica_batch: int) -> list[int]:
    """Micro-batch counts to try, in order of preference (rule 4 of the module docstring)."""
    counts = _divisors(replica_batch)
    if layout.pp == 1:
        return counts  # fewest first: m = 1 means no accumulation at all
    preferred = [m for m in counts if m >= MICROBATCHES_PER_STAGE * layout.pp]
    fallback = sorted(
        (m for m in counts if layout.pp <= m < MICROBATCHES_PER_STAGE * layout.pp), reverse=True
    )
    return preferred + fallback


def plan_layout(
    config: ModelConfig,
    *,
    num_devices: int,
    device_memory_bytes: int,
    seq_len: int,
    batch_size: int,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """The layout of ``num_devices`` devices chosen by the module docstring's rule, with its reasons.

    ``batch_size`` is the node's sequences per inner step (split over the dp replicas), ``seq_len`` the
    tokens per sequence, ``headroom`` the fraction of ``device_memory_bytes`` left unplanned. Raises
    ValueError for bad arguments and when no layout fits, naming the smallest estimate.
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    if device_memory_bytes <= 0:
        raise ValueError(f"device_memory_bytes must be positive, got {device_memory_bytes}")
    if seq_len < 1 or batch_size < 1:
        raise ValueError(f"seq_len and batch_size must be positive, got {seq_len} and {batch_size}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be in [0, 1), got {headroom}")
    budget = int(device_memory_bytes * (1 - headroom))

    # Rules 2 and 3 as a sort key: most dp, then most tp (fewest pipeline stages).
    layouts = [
        Layout(dp=num_devices // (tp * pp), tp=tp, pp=pp)
        for tp in _divisors(num_devices)
        for pp in _divisors(num_devices // tp)
    ]
    layouts.sort(key=lambda layout: (-layout.dp, -layout.tp))

    chosen: tuple[Layout, int, MemoryEstimate] | None = None
    rejected: list[RejectedLayout] = []
    for layout in layouts:
        invalid = invalid_reason(config, layout, batch_size)
        if invalid is not None:
            rejected.append(RejectedLayout(layout=layout, reason=invalid))
            continue
        replica_batch = batch_size // layout.dp
        smallest: MemoryEstimate | None = None
        fit: tuple[int, MemoryEstimate] | None = None
        for num_microbatches in _microbatch_candidates(layout, replica_batch):
            memory = estimate_memory(
                config,
                layout,
                seq_len=seq_len,
                microbatch_size=replica_batch // num_microbatches,
                num_microbatches=num_microbatches,
            )
            if smallest is None or memory.total_bytes < smallest.total_bytes:
                smallest = memory
            if memory.total_bytes <= budget:
                fit = (num_microbatches, memory)
                break
        if fit is None:
            assert smallest is not None, "every valid layout has at least one micro-batch count"
            reason = f"needs {_gib(smallest.total_bytes)} > budget {_gib(budget)} per device"
            rejected.append(RejectedLayout(layout=layout, reason=reason, memory=smallest))
        elif chosen is None:
            chosen = (layout, fit[0], fit[1])
        else:
            reason = _lost_to(layout, chosen[0])
            rejected.append(RejectedLayout(layout=layout, reason=reason, memory=fit[1]))

    if chosen is None:
        fitting = [r.memory.total_bytes for r in rejected if r.memory is not None]
        smallest_text = f"; the smallest estimate is {_gib(min(fitting))}" if fitting else ""
        raise ValueError(
            f"no layout of {num_devices} device(s) fits {_gib(budget)} per device "
            f"({_gib(device_memory_bytes)} minus {headroom:.0%} headroom) for batch_size={batch_size}, "
            f"seq_len={seq_len}{smallest_text}; add devices, or lower batch_size or seq_len"
        )
    layout, num_microbatches, memory = chosen
    bubble = bubble_fraction(layout.pp, num_microbatches)
    reasons = _reasons(layout, num_microbatches, memory, budget, bubble, rejected)
    return Plan(
        layout=layout,
        num_microbatches=num_microbatches,
        microbatch_size=batch_size // (layout.dp * num_microbatches),
        memory=memory,
        bubble_fraction=bubble,
        device_memory_bytes=device_memory_bytes,
        reasons=reasons,
        rejected=tuple(rejected),
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def _lost_to(layout: Layout, winner: Layout) -> str:
    if layout.dp < winner.dp:
        return f"fits, but fewer data-parallel replicas ({layout.dp} < {winner.dp})"
    return f"fits, but more pipeline stages than the winner (pp {layout.pp} > {winner.pp})"


def _reasons(
    layout: Layout,
    num_microbatches: int,
    memory: MemoryEstimate,
    budget: int,
    bubble: float,
    rejected: list[RejectedLayout],
) -> tuple[str, ...]:
    reasons = [f"fits: {_gib(memory.total_bytes)} of a {_gib(budget)} budget per device"]
    too_big = [r for r in rejected if r.memory is not None and r.layout.dp > layout.dp]
    if layout.dp > 1 or not too_big:
        reasons.append(f"dp={layout.dp}: the most data parallelism that fits")
    if too_big:
        best = too_big[0]
        reasons.append(f"more replicas do not fit: {best.layout} {best.reason}")
    if layout.tp > 1:
        reasons.append(
            f"tp={layout.tp} before pipeline stages: tensor parallelism rides the fast intra-node link"
        )
    if layout.pp > 1:
        reasons.append(
            f"pp={layout.pp} with {num_microbatches} micro-batches: bubble {bubble:.1%}"
            + (
                " (m >= 4 pp)"
                if num_microbatches >= MICROBATCHES_PER_STAGE * layout.pp
                else " (m < 4 pp: batch too small)"
            )
        )
    elif num_microbatches > 1:
        reasons.append(
            f"{num_microbatches} gradient-accumulation micro-batches keep activations within memory"
        )
    return tuple(reasons)


def render_plan(plan: Plan, *, max_rejected: int = 6) -> str:
    """The plan as a short text table for ``dtnode plan``: layout, memory breakdown, bubble, reasons."""
    memory = plan.memory
    lines = [
        f"layout          {plan.layout}  ({plan.num_microbatches} micro-batch(es) of {plan.microbatch_size})",
        f"params          {_gib(memory.params_bytes):>12}",
        f"grads           {_gib(memory.grads_bytes):>12}",
        f"optimizer       {_gib(memory.optimizer_bytes):>12}  (AdamW, ZeRO-1 over dp={plan.layout.dp})",
        f"activations     {_gib(memory.activation_bytes):>12}",
        f"total/device    {_gib(memory.total_bytes):>12}  of {_gib(plan.device_memory_bytes)}",
        f"pipeline bubble {plan.bubble_fraction:>12.1%}",
        "why:",
        *(f"  - {reason}" for reason in plan.reasons),
    ]
    if plan.rejected:
        lines.append("also considered:")
        lines.extend(f"  {str(r.layout):<18} {r.reason}" for r in plan.rejected[:max_rejected])
        if len(plan.rejected) > max_rejected:
            lines.append(f"  ... and {len(plan.rejected) - max_rejected} more")
    return "\n".join(lines)
