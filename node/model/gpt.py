"""A GPT-style decoder-only transformer in plain torch: the model every dtnode replica trains.

Architecture (LLaMA-flavoured GPT)
----------------------------------
tokens (B, T) -> ``tok_embeddings`` -> ``num_layers`` x ``TransformerBlock`` -> ``norm`` -> ``output``
-> logits (B, T, V). Each block is pre-norm with residual connections, as in GPT-2 (Radford et al. 2019):

    h = x + attention(attention_norm(x))        # causal multi-head self-attention
    out = h + feed_forward(ffn_norm(h))         # SwiGLU MLP

- Normalisation is RMSNorm (Zhang & Sennrich 2019), as in LLaMA (Touvron et al. 2023).
- Positions are encoded with rotary embeddings, RoPE (Su et al. 2021, "RoFormer"): query and key
  channels are taken in pairs ``(x[2i], x[2i+1])``, read as the complex number ``x[2i] + j x[2i+1]``,
  and multiplied by ``exp(j * t * theta**(-2i/head_dim))`` at position ``t``. A rotation by ``t*w`` of
  ``q`` and by ``s*w`` of ``k`` makes their dot product depend only on ``t - s``, so attention scores see
  relative positions. There are no learned position embeddings.
- The MLP is SwiGLU (Shazeer 2020, "GLU Variants Improve Transformer"): ``w2(silu(w1 x) * w3 x)``,
  with hidden width ``~8/3 * dim`` so the parameter count matches a 4x GELU MLP.
- Grouped-query attention (Ainslie et al. 2023) is optional: ``num_kv_heads < num_heads`` shares each
  key/value head among ``num_heads // num_kv_heads`` query heads.
- Attention is causal, computed by ``F.scaled_dot_product_attention(is_causal=True)``.

Friendliness to parallelism applied from outside (torchtitan-style)
-------------------------------------------------------------------
The model holds no distributed code. Tensor parallelism may later shard ``wq/wk/wv/w1/w3`` by rows and
``wo/w2`` by columns: attention derives its local head counts from the projected tensors' shapes at run
time (``view(B, T, -1, head_dim)``), so a module that holds half the heads just works. Pipeline
parallelism may delete entries of ``layers`` (an ``nn.ModuleDict`` keyed ``"0".."n-1"``, so the
surviving layers keep their names and checkpoint keys) and set ``tok_embeddings``, ``norm`` or
``output`` to ``None``; ``GPT.forward`` then takes hidden states in and/or gives hidden states out.
Initialisation seeds each parameter from its name, so a stage initialised alone matches the same
parameters of the full model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shapes and initialisation of a ``GPT``. Validated on construction; see each field's help."""

    vocab_size: int = field(
        default=260, metadata={"help": "Number of token ids (byte vocab: 256 + specials)."}
    )
    seq_len: int = field(metadata={"help": "Maximum sequence length; the RoPE table is built this long."})
    dim: int = field(metadata={"help": "Model (residual stream) width C."})
    num_layers: int = field(metadata={"help": "Number of transformer blocks."})
    num_heads: int = field(metadata={"help": "Number of query heads; head_dim = dim // num_heads."})
    num_kv_heads: int | None = field(
        default=None,
        metadata={"help": "Number of key/value heads for grouped-query attention; None = num_heads."},
    )
    mlp_hidden_dim: int | None = field(
        default=None,
        metadata={"help": "SwiGLU hidden width; None = round_up(int(8 * dim / 3), 64)."},
    )
    rope_theta: float = field(
        default=10000.0, metadata={"help": "RoPE base: frequencies are theta**(-2i/d)."}
    )
    norm_eps: float = field(default=1e-5, metadata={"help": "Epsilon inside RMSNorm's square root."})
    tie_embeddings: bool = field(
        default=False, metadata={"help": "Share the token embedding matrix with the output projection."}
    )
    init_std: float = field(
        default=0.02,
        metadata={"help": "Std of normal init; residual projections use init_std / sqrt(2 * num_layers)."},
    )

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("num_kv_heads", "mlp_hidden_dim"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {value}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name} must be positive, got {getattr(self, name)}")
        if self.dim % self.num_heads != 0:
            raise ValueError(f"dim ({self.dim}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.resolved_num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.resolved_num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"head_dim = dim // num_heads = {self.head_dim} must be even for rotary embeddings"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def resolved_mlp_hidden_dim(self) -> int:
        if self.mlp_hidden_dim is not None:
            return self.mlp_hidden_dim
        return _round_up(int(8 * self.dim / 3), 64)

    def architecture(self) -> str:
        """The shapes this config gives a model, as text (part of a node's identity, which only nodes
        that can average share: ``node/swarm/state.py``): every field but the sequence length (the
        RoPE table's only) and the init's scale (an init the swarm's replaces)."""
        ignored = ("seq_len", "init_std")
        return repr(
            [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in ignored]
        )

    def num_params(self) -> int:
        """Analytic parameter count of ``GPT(self)``, embeddings included (tied weights counted once)."""
        dim, kv_dim = self.dim, self.resolved_num_kv_heads * self.head_dim
        attention = 2 * dim * dim + 2 * dim * kv_dim  # wq, wo + wk, wv
        feed_forward = 3 * dim * self.resolved_mlp_hidden_dim  # w1, w2, w3
        norms = 2 * dim  # attention_norm, ffn_norm
        embeddings = self.vocab_size * dim * (1 if self.tie_embeddings else 2)
        return self.num_layers * (attention + feed_forward + norms) + embeddings + dim  # + final norm


# Nominal sizes are in the names; counts include both embedding matrices (vocab 260). The 7b preset has
# LLaMA-7B's shapes (its 32k vocab is replaced by bytes, hence ~6.5B rather than 6.7B parameters).
MODEL_PRESETS: dict[str, ModelConfig] = {
    "nano": ModelConfig(seq_len=128, dim=128, num_layers=4, num_heads=4),  # ~0.92M
    "tiny": ModelConfig(seq_len=256, dim=384, num_layers=6, num_heads=6),  # ~10.8M
    "small": ModelConfig(seq_len=512, dim=640, num_layers=10, num_heads=10),  # ~49.9M
    "350m": ModelConfig(seq_len=2048, dim=1024, num_layers=28, num_heads=16),  # ~355M
    "1b": ModelConfig(seq_len=2048, dim=2048, num_layers=20, num_heads=16),  # ~1.01B
    "7b": ModelConfig(seq_len=2048, dim=4096, num_layers=32, num_heads=32, mlp_hidden_dim=11008),  # ~6.48B
}


def model_config(preset: str, **overrides: object) -> ModelConfig:
    """The named preset with fields replaced by ``overrides`` (e.g. ``seq_len=64``), re-validated."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(MODEL_PRESETS)}")
    valid_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(overrides) - valid_fields)
    if unknown:
        raise ValueError(f"unknown ModelConfig fields {unknown}; valid fields: {sorted(valid_fields)}")
    return dataclasses.replace(MODEL_PRESETS[preset], **overrides)  # type: ignore[arg-type]


def estimate_flops_per_token(config: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token, for throughput / MFU reporting.

    ``6 * N + 12 * num_layers * dim * seq_len`` (Kaplan et al. 2020; PaLM appendix B, Chowdhery et al.
    2022). ``N`` counts the parameters that take part in matrix multiplies, i.e. all but the RMSNorm
    weights and the token embedding lookup (unless tied to the output): each does a multiply-add (2 FLOPs) forward and two
    backward (grad wrt input and wrt weight). The attention term is the ``Q K^T`` and ``A V`` matmuls,
    ``2 * 2 * T * dim`` forward per token per layer, tripled for backward. It counts the full ``T x T``
    score matrix although causal masking makes half of it useless, the usual convention for MFU.
    """
    seq_len = config.seq_len if seq_len is None else seq_len
    embedding_params = 0 if config.tie_embeddings else config.vocab_size * config.dim
    norm_params = (2 * config.num_layers + 1) * config.dim
    num_matmul_params = config.num_params() - embedding_params - norm_params
    return 6.0 * num_matmul_params + 12.0 * config.num_layers * config.dim * seq_len


def precompute_rope(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin of the RoPE angles ``t * theta**(-2i/head_dim)``, each (seq_len, head_dim // 2), fp32."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (D/2,)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)  # (T, D/2)
    return angles.cos().float(), angles.sin().float()


def apply_rotary_embedding(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs ``(x[..., 2i], x[..., 2i+1])`` of x (B, T, H, D) by the angles of (T, D/2).

    Equivalent to ``x_complex * exp(j * angle)``; done in real fp32 arithmetic (no complex dtype, which
    some parallel/compiled paths handle poorly) and cast back. Works for any number of heads H.
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    real, imag = pairs.unbind(-1)  # each (B, T, H, D/2)
    cos = cos.float()[None, :, None, :]  # (1, T, 1, D/2)
    sin = sin.float()[None, :, None, :]
    rotated = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)  # (B, T, H, D/2, 2)
    return rotated.flatten(-2).type_as(x)  # (B, T, H, D)


class Attention(nn.Module):
    """Causal multi-head (optionally grouped-query) self-attention with RoPE on queries and keys."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        kv_dim = config.resolved_num_kv_heads * config.head_dim
        self.wq = nn.Linear(config.dim, config.num_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, kv_dim, bias=False)
        self.wv = nn.Linear(config.dim, kv_dim, bias=False)
        self.wo = nn.Linear(config.num_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
        batch_size, seq_len, _ = x.shape  # (B, T, C)
        # Head counts come from the projections' output widths (-1), not from the config, so a module whose
        # weights were split by heads for tensor parallelism computes its local heads unchanged.
        q = self.wq(x).view(batch_size, seq_len, -1, self.head_dim)  # (B, T, H, D)
        k = self.wk(x).view(batch_size, seq_len, -1, self.head_dim)  # (B, T, KV, D)
        v = self.wv(x).view(batch_size, seq_len, -1, self.head_dim)  # (B, T, KV, D)
        q = apply_rotary_embedding(q, rope_cos, rope_sin)
        k = apply_rotary_embedding(k, rope_cos, rope_sin)
        num_groups = q.shape[2] // k.shape[2]
        if num_groups > 1:  # GQA: query head h reads kv head h // num_groups
            k = k.repeat_interleave(num_groups, dim=2)  # (B, T, H, D)
            v = v.repeat_interleave(num_groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(batch_size, seq_len, -1)  # (B, T, H * D)
        return self.wo(out)  # (B, T, C)


class FeedForward(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``w2(silu(w1 x) * w3 x)``; w1 is the gate, w3 the up projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden_dim = config.resolved_mlp_hidden_dim
        self.w1 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, F) -> (B, T, C)


class TransformerBlock(nn.Module):
    """Pre-norm residual block: ``h = x + attn(norm(x)); out = h + ffn(norm(h))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, rope_cos: Tensor, rope_sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), rope_cos, rope_sin)  # (B, T, C)
        return h + self.feed_forward(self.ffn_norm(h))  # (B, T, C)


_RESIDUAL_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")


def _parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, parameter name), stable across processes, machines and torch versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class GPT(nn.Module):
    """Decoder-only transformer; see the module docstring for the architecture.

    Pipeline stages are built by deleting entries of ``layers`` and setting submodules to ``None``:
    with ``tok_embeddings is None`` the input is hidden states (B, T, C) instead of token ids (B, T);
    with ``norm is None`` / ``output is None`` those steps are skipped and hidden states come out.
    With ``tie_embeddings`` the two ends share one matrix and cannot go to different stages.
    """

    rope_cos: Tensor  # (seq_len, head_dim // 2) buffer
    rope_sin: Tensor  # (seq_len, head_dim // 2) buffer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            output.weight = tok_embeddings.weight
        self.tok_embeddings: nn.Embedding | None = tok_embeddings
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.num_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output: nn.Linear | None = output
        # Non-persistent: derived from the config, so not part of checkpoints. Kept fp32; casting the
        # whole module with .to(bfloat16) would round them too, so prefer autocast / mixed-precision policies.
        rope_cos, rope_sin = precompute_rope(config.head_dim, config.seq_len, config.rope_theta)
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # (T_max, D/2)
        self.register_buffer("rope_sin", rope_sin, persistent=False)  # (T_max, D/2)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialise parameters and RoPE buffers deterministically.

        Linear and embedding weights ~ N(0, init_std); the residual output projections ``wo`` and ``w2``
        ~ N(0, init_std / sqrt(2 * num_layers)) so the residual stream's variance does not grow with
        depth (GPT-2); RMSNorm weights = 1. Each parameter is drawn on CPU from a generator seeded by
        ``(seed, parameter name)``: values are independent of device and of which other parameters
        exist, so every replica and every pipeline stage agrees. ``seed=None`` draws the seed from
        torch's global RNG, so ``torch.manual_seed`` makes construction reproducible. Parameters on the
        meta device are skipped; call this again after ``to_empty``.
        """
        if seed is None:
            # Explicit CPU device: construction under `with torch.device("meta")` must still get a seed.
            seed = int(torch.randint(0, 2**62, (), dtype=torch.int64, device="cpu"))
        self.init_seed = seed  # to initialise the same values again after to_empty (node/model/meta_init.py)
        residual_std = self.config.init_std / math.sqrt(2 * self.config.num_layers)
        for name, param in self.named_parameters():  # a tied weight appears once, as tok_embeddings.weight
            if param.is_meta:
                continue
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            std = residual_std if name.endswith(_RESIDUAL_PROJECTIONS) else self.config.init_std
            generator = torch.Generator().manual_seed(_parameter_seed(seed, name))
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values)
        if not self.rope_cos.is_meta:
            rope_cos, rope_sin = precompute_rope(
                self.config.head_dim, self.config.seq_len, self.config.rope_theta
            )
            self.rope_cos.copy_(rope_cos)
            self.rope_sin.copy_(rope_sin)

    def num_params(self) -> int:
        """Number of parameters held by this module (shared tensors counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor) -> Tensor:
        """Token ids (B, T) int64 -> logits (B, T, V); see the class docstring for pipeline stages."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)  # (B, T) -> (B, T, C)
        else:
            h = tokens  # a later pipeline stage: already hidden states (B, T, C)
        seq_len = tokens.shape[1]  # T of the input, also when a sequence-parallel embedding shards h
        if seq_len > self.rope_cos.shape[0]:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's seq_len {self.rope_cos.shape[0]}"
            )
        rope_cos, rope_sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]  # (T, D/2)
        for layer in self.layers.values():
            h = layer(h, rope_cos, rope_sin)  # (B, T, C)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)  # (B, T, C) -> (B, T, V)
        return h


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy over all B*T positions; logits (B, T, V) upcast to fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))  # scalar
