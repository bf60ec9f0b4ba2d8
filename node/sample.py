"""Text from a trained model: ``dtnode sample RUN_DIR --prompt …``.

Autoregressive sampling, one token at a time: the model reads the last ``seq_len`` tokens of the
context, the logits of the final position are divided by the temperature, all but the ``top_k``
largest are dropped, and the next token is drawn from the softmax (Holtzman et al. 2020 discuss
such truncated sampling; temperature 0 means greedy, the argmax). Generation stops after
``max_new_tokens`` or at ``EOS``, the end-of-document token the model learned from the corpus.

Tokens are bytes (``node/corpus.py``): the prompt's UTF-8 bytes go in, and the new bytes are
decoded with invalid sequences replaced (a model may stop in the middle of a multi-byte character).
An empty prompt starts a new document: the context is a single ``EOS``, as after a file's end.

There is no KV cache: each new token costs one forward pass over at most ``seq_len`` tokens, which
is fast enough for the small models dtnode trains on CPUs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from node.corpus import EOS, decode, encode
from node.export import BYTE_TOKENIZER, find_model_file, load_model, read_metadata
from node.model import GPT


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
    for _ in range(max_new_tokens):
        logits = model(context[:, -seq_len:])[0, -1].float()  # (V,) for the last position
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
    metadata = read_metadata(find_model_file(Path(run_dir)))
    if metadata["tokenizer"]["name"] != BYTE_TOKENIZER:
        raise ValueError(
            f"{run_dir}: the model was trained on pre-tokenized ids ({metadata['tokenizer']['name']}), "
            "not on text: dtnode cannot turn a prompt into its tokens"
        )
    model = load_model(run_dir, device=device)
    prompt_ids = torch.from_numpy(encode(prompt).astype("int64")) if prompt else torch.tensor([EOS])
    generator = torch.Generator().manual_seed(seed)
    new_ids = generate(
        model,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
    )
    return decode(new_ids.numpy())
