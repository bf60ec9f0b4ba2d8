"""Tokenization throughput against the inner step's token rate: does tokenizing starve training?

    .venv/bin/python scripts/bench/bench_tokenize.py [--vocab-sizes 4096 32768] [--models tiny small]

Part 1 tokenizes the embedded corpus (~31 MB of Python, 1,762 files) the way a node does at start-up
(``load_corpus``: read, encode in batches of 1,024 documents, split, hash), once with byte tokens and once
per BPE vocabulary (trained first by ``train_bpe``, not timed), and once more from a ``.jsonl`` copy of
the corpus (the record path: JSON parsing included). Part 2 times inner steps (forward, backward, AdamW,
batch 16 at the preset's seq_len, as ``dtnode join`` runs them) of each preset on this CPU. Rates are
tokens per second of wall time; the ratio says how many times faster the tokenizer produces tokens
than one node's training consumes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from node.config import NodeConfig
from node.data.corpus import load_corpus
from node.data.documents import iter_texts
from node.data.tokenizer import Tokenizer, load_tokenizer, train_bpe
from node.model.gpt import GPT, cross_entropy_loss, model_config
from node.model.replica import build_inner_optimizer


def tokenize_rate(data: str | None, tokenizer: Tokenizer | None) -> tuple[float, int, float]:
    """(seconds, tokens, tokens per second) of loading ``data`` with ``tokenizer``."""
    start = time.perf_counter()
    corpus = load_corpus(data, tokenizer=tokenizer)
    seconds = time.perf_counter() - start
    num_tokens = corpus.train.size + corpus.val.size
    return seconds, num_tokens, num_tokens / seconds


def step_rate(preset: str, batch_size: int, num_steps: int, vocab_size: int) -> float:
    """Tokens per second of inner steps of ``preset`` (after one warm-up step)."""
    config = model_config(preset, vocab_size=vocab_size)
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = build_inner_optimizer(model, NodeConfig())
    tokens = torch.randint(0, vocab_size, (batch_size, config.seq_len + 1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    start = 0.0
    for step in range(num_steps + 1):
        if step == 1:
            start = time.perf_counter()
        cross_entropy_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return num_steps * batch_size * config.seq_len / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab-sizes", type=int, nargs="+", default=[4096, 32768], help="BPE sizes to time")
    parser.add_argument("--models", nargs="+", default=["tiny", "small"], help="presets whose steps to time")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per inner step")
    parser.add_argument("--steps", type=int, default=3, help="timed inner steps per preset")
    args = parser.parse_args()
    print(f"torch threads {torch.get_num_threads()}")
    rows: list[tuple[str, float, int, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        seconds, num_tokens, rate = tokenize_rate(None, None)
        rows.append(("bytes (260)", seconds, num_tokens, rate))
        bpe: Tokenizer | None = None
        for vocab_size in args.vocab_sizes:
            train_start = time.perf_counter()
            out = Path(scratch) / f"bpe{vocab_size}.json"
            train_bpe(iter_texts(None), vocab_size=vocab_size, out=out)
            print(f"trained BPE {vocab_size} in {time.perf_counter() - train_start:.1f} s")
            bpe = load_tokenizer(out)
            seconds, num_tokens, rate = tokenize_rate(None, bpe)
            rows.append((f"BPE {vocab_size}", seconds, num_tokens, rate))
        if bpe is not None:
            jsonl = Path(scratch) / "corpus.jsonl"
            with jsonl.open("w") as handle:
                for text in iter_texts(None):
                    handle.write(json.dumps({"text": text}) + "\n")
            seconds, num_tokens, rate = tokenize_rate(str(jsonl), bpe)
            rows.append((f"BPE {bpe.vocab_size}, .jsonl", seconds, num_tokens, rate))
    print("\n| tokenizer (embedded corpus, 31.5 MB) | load s | tokens | tokens/s |")
    print("|---|---:|---:|---:|")
    for name, seconds, num_tokens, rate in rows:
        print(f"| {name} | {seconds:.1f} | {num_tokens:,} | {rate:,.0f} |")
    slowest = min(rate for _, _, _, rate in rows)
    print("\n| preset | inner-step tokens/s (batch 16) | slowest tokenizer / step rate |")
    print("|---|---:|---:|")
    for preset in args.models:
        vocab_size = max(args.vocab_sizes, default=260)
        rate = step_rate(preset, args.batch_size, args.steps, vocab_size)
        print(f"| {preset} (vocab {vocab_size}) | {rate:,.0f} | {slowest / rate:,.0f}x |")


if __name__ == "__main__":
    main()
