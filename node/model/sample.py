"""Text from a trained model: ``dtnode sample RUN_DIR --prompt …``.

Autoregressive sampling, one token at a time: the model reads the last ``seq_len`` tokens of the
context, the logits of the final position are divided by the temperature, all but the ``top_k``
largest are dropped, and the next token is drawn from the softmax (Holtzman et al. 2020 discuss
such truncated sampling; temperature 0 means greedy, the argmax). Generation stops after
``max_new_tokens`` or at ``EOS``, the end-of-document token the model learned from the corpus.

Tokens are bytes (``node/data/tokenizer.py``): the prompt's UTF-8 bytes go in, and the new bytes are
decoded with invalid sequences replaced (a model may stop in the middle of a multi-byte character);
a run trained with ``--tokenizer`` uses that ``tokenizer.json`` (from its ``hf/`` export) instead.
An empty prompt starts a new document: the context is a single end-of-text token, as after a file's end.

KV cache
--------
Attention at position ``t`` needs the keys and values of positions ``<= t``, and those of earlier
positions never change. So the prompt is run once (the *prefill*), each layer's keys and values
(after RoPE) are kept, and each new token costs one forward of a single position that appends its own
key and value and attends over the cache: O(T) work per token instead of a forward over the whole
context. When the cache holds ``seq_len`` positions (RoPE has no angles beyond), the context is
shifted: the last ``seq_len // 2`` tokens are prefilled again at positions 0.., and decoding goes on.
Within ``seq_len`` the cached logits equal the uncached forward's up to float summation order
(``use_cache=False`` keeps the plain path: a forward over the last ``seq_len`` tokens per token).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from node.data.tokenizer import EOS, ByteTokenizer, Tokenizer, load_tokenizer
from node.model.export import (
    BYTE_TOKENIZER,
    HF_FOLDER,
    HF_TOKENIZER,
    find_model_file,
    load_model,
    read_metadata,
)
from node.model.gpt import GPT, TransformerBlock, apply_rotary_embedding


class KVCache:
    """Each layer's keys and values after RoPE, (1, seq_len, KV heads, head_dim), filled up to ``length``."""

    def __init__(self, model: GPT) -> None:
        config = model.config
        parameter = next(model.parameters())
        shape = (1, config.seq_len, config.resolved_num_kv_heads, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=parameter.dtype, device=parameter.device) for _ in model.layers]
        self.values = [torch.zeros_like(keys) for keys in self.keys]
        self.length = 0


def forward_cached(model: GPT, tokens: Tensor, cache: KVCache) -> Tensor:
    """Logits (1, T, V) of ``tokens`` (1, T) at positions ``cache.length ..``; appends their keys/values.

    The same computation as ``GPT.forward`` (``node/model/gpt.py``) with attention over the cached
    positions as well as the new ones.
    """
    assert model.tok_embeddings is not None and model.norm is not None and model.output is not None
    start, num_new = cache.length, tokens.shape[1]
    end = start + num_new
    if end > model.config.seq_len:
        raise ValueError(f"the cache holds {model.config.seq_len} positions, asked for {end}")
    rope_cos, rope_sin = model.rope_cos[start:end], model.rope_sin[start:end]  # (T, D/2)
    # Query t (absolute position start + t) sees keys 0 .. start + t; one new token sees them all.
    mask = None
    if num_new > 1:
        positions = torch.arange(end, device=tokens.device)
        mask = (
            positions[None, :] <= (start + torch.arange(num_new, device=tokens.device))[:, None]
        )  # (T, end)
    h = model.tok_embeddings(tokens)  # (1, T, C)
    for index, module in enumerate(model.layers.values()):
        layer = cast(TransformerBlock, module)
        attention = layer.attention
        x = layer.attention_norm(h)
        q = attention.wq(x).view(1, num_new, -1, attention.head_dim)  # (1, T, H, D)
        k = attention.wk(x).view(1, num_new, -1, attention.head_dim)  # (1, T, KV, D)
        v = attention.wv(x).view(1, num_new, -1, attention.head_dim)
        cache.keys[index][:, start:end] = apply_rotary_embedding(k, rope_cos, rope_sin)
        cache.values[index][:, start:end] = v
        q = apply_rotary_embedding(q, rope_cos, rope_sin)
        keys, values = cache.keys[index][:, :end], cache.values[index][:, :end]  # (1, end, KV, D)
        num_groups = q.shape[2] // keys.shape[2]
        if num_groups > 1:  # GQA: query head h reads kv head h // num_groups
            keys = keys.repeat_interleave(num_groups, dim=2)
            values = values.repeat_interleave(num_groups, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask
        )  # (1, H, T, D)
        h = h + attention.wo(out.transpose(1, 2).reshape(1, num_new, -1))  # (1, T, C)
        h = h + layer.feed_forward(layer.ffn_norm(h))
    cache.length = end
    return model.output(model.norm(h))  # (1, T, V)


@torch.no_grad()
def generate(
    model: GPT,
    prompt: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    generator: torch.Generator | None = None,
    stop_token: int | None = EOS,
    use_cache: bool = True,
) -> torch.Tensor:
    """The new token ids (1-D, int64) after ``prompt`` (1-D token ids); see the module docstring."""
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(
            f"prompt must be a non-empty 1-D tensor of token ids, got shape {tuple(prompt.shape)}"
        )
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}")
    device = next(model.parameters()).device
    seq_len = model.config.seq_len
    context = prompt.to(device=device, dtype=torch.long).unsqueeze(0)  # (1, T)
    new_tokens: list[torch.Tensor] = []
    cache = KVCache(model) if use_cache else None
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(context[:, -seq_len:])[0, -1].float()  # (V,) for the last position
        elif cache.length == 0 or cache.length == seq_len:  # prefill, or shift a full cache
            window = context[:, -seq_len:] if cache.length == 0 else context[:, -(seq_len // 2) :]
            cache.length = 0
            logits = forward_cached(model, window, cache)[0, -1].float()
        else:
            logits = forward_cached(model, context[:, -1:], cache)[0, -1].float()
        if temperature == 0:
            next_token = logits.argmax().reshape(1)
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth_largest = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth_largest, float("-inf"))
            probabilities = torch.softmax(logits, dim=-1)
            # Drawn on the CPU generator: the same seed gives the same text on every device.
            next_token = torch.multinomial(probabilities.cpu(), 1, generator=generator).to(device)
        new_tokens.append(next_token)
        if stop_token is not None and int(next_token) == stop_token:
            break
        context = torch.cat([context, next_token.unsqueeze(0)], dim=1)  # (1, T + 1)
    if not new_tokens:
        return torch.empty(0, dtype=torch.long)
    return torch.cat(new_tokens).cpu()


def sample_text(
    run_dir: str | os.PathLike[str],
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> str:
    """The text the model of ``run_dir`` writes after ``prompt`` (the prompt itself not included)."""
    model_file = find_model_file(Path(run_dir))
    name = read_metadata(model_file)["tokenizer"]["name"]
    tokenizer: Tokenizer
    if name == BYTE_TOKENIZER:
        tokenizer = ByteTokenizer()
    elif name == HF_TOKENIZER:
        tokenizer = load_tokenizer(model_file.parent / HF_FOLDER / "tokenizer.json")
    else:
        raise ValueError(
            f"{run_dir}: the model was trained on pre-tokenized ids ({name}), "
            "not on text: dtnode cannot turn a prompt into its tokens"
        )
    model = load_model(run_dir, device=device)
    encoded = tokenizer.encode_batch([prompt])[0]
    prompt_ids = torch.from_numpy(encoded.astype("int64")) if prompt else torch.tensor([tokenizer.eos_id])
    generator = torch.Generator().manual_seed(seed)
    new_ids = generate(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
        stop_token=tokenizer.eos_id,
    )
    return tokenizer.decode(new_ids.numpy())
