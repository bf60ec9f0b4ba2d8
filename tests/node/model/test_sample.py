"""``dtnode sample``'s KV cache: cached decoding is the uncached forward, token for token.

Reference: ``GPT.forward`` over the whole context (``generate(use_cache=False)``), which the cache must
reproduce within ``seq_len`` up to float summation order; with weights of std 0.1 the logits are
spread far wider than that, so greedy (argmax) decoding must give the same ids.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from node.model.gpt import GPT, ModelConfig
from node.model.sample import KVCache, forward_cached, generate
from tests.node.run_support import one_torch_thread


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Token-by-token decoding is many tiny forwards: one thread is faster, and kinder to a busy machine."""
    with one_torch_thread():
        yield


CONFIG = ModelConfig(
    vocab_size=97, seq_len=40, dim=48, num_layers=2, num_heads=4, num_kv_heads=2, init_std=0.1
)


def model() -> GPT:
    torch.manual_seed(5)
    return GPT(CONFIG).eval()


def prompt(length: int) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (length,), generator=torch.Generator().manual_seed(length))


@torch.no_grad()
def test_cached_logits_equal_the_full_forward() -> None:
    gpt = model()
    tokens = prompt(30).unsqueeze(0)  # (1, 30)
    expected = gpt(tokens)  # (1, 30, V)
    cache = KVCache(gpt)
    # A prefill of 12, then 3 positions at once, then one at a time.
    pieces = [forward_cached(gpt, tokens[:, :12], cache), forward_cached(gpt, tokens[:, 12:15], cache)]
    pieces += [forward_cached(gpt, tokens[:, t : t + 1], cache) for t in range(15, 30)]
    assert cache.length == 30
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=0.0, atol=1e-5)


def test_cached_greedy_decoding_equals_uncached() -> None:
    gpt = model()
    for length in (1, 7, 20):
        start = prompt(length)
        new = CONFIG.seq_len - length  # fill the context exactly: the cache never shifts
        cached = generate(gpt, start, max_new_tokens=new, temperature=0, stop_token=None)
        uncached = generate(gpt, start, max_new_tokens=new, temperature=0, stop_token=None, use_cache=False)
        assert cached.numel() == new and torch.equal(cached, uncached)


def test_cached_sampling_equals_uncached_under_one_seed() -> None:
    gpt = model()

    def sample(use_cache: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(3)
        return generate(
            gpt, prompt(5), max_new_tokens=30, temperature=1.0, top_k=20, generator=generator,
            stop_token=None, use_cache=use_cache,
        )  # fmt: skip

    assert torch.equal(sample(True), sample(False))


def test_decoding_past_the_context_shifts_the_cache() -> None:
    gpt = model()
    start = prompt(10)
    long = generate(gpt, start, max_new_tokens=3 * CONFIG.seq_len, temperature=0, stop_token=None)
    assert long.numel() == 3 * CONFIG.seq_len and int(long.max()) < CONFIG.vocab_size
    # Until the context is full, it is the uncached decoding.
    within = CONFIG.seq_len - start.numel()
    uncached = generate(gpt, start, max_new_tokens=within, temperature=0, stop_token=None, use_cache=False)
    assert torch.equal(long[:within], uncached)
    # A prompt longer than the context is cut to its last seq_len tokens, like the uncached path.
    longer = generate(gpt, prompt(50), max_new_tokens=1, temperature=0, stop_token=None)
    assert torch.equal(longer, generate(gpt, prompt(50), max_new_tokens=1, temperature=0, use_cache=False))
