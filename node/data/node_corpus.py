"""The node's tokenizer and corpus, from its settings: ``--tokenizer``, ``--data``, ``--text-field``,
``--val-fraction``.

The tokenizer is ``node/data/tokenizer.py``'s; the corpus is ``node/data/corpus.py``'s ``load_corpus`` of the
``--data`` source (``node/data/documents.py``). What is tokenized as it streams (a ``tokenizer.json``, a
record data set) is tokenized once per run dir: later starts memory-map the streams
(``node/data/token_cache.py``). Byte-token text sources and ``.bin`` files load in about a second and are
not cached. A bad setting or source is a ``ConfigError`` that names its flag.
"""

from __future__ import annotations

from node.config import ConfigError, NodeConfig
from node.data.corpus import Corpus, load_corpus, load_tokenized, tokenized_here
from node.data.token_cache import CACHE_FOLDER, cache_key, load_cached, save_cached
from node.data.tokenizer import Tokenizer, load_tokenizer


def node_tokenizer(config: NodeConfig) -> Tokenizer:
    """The tokenizer of ``--tokenizer`` (byte tokens if unset); ``ConfigError`` naming the flag."""
    try:
        return load_tokenizer(config.corpus.tokenizer or None)
    except ValueError as error:
        raise ConfigError(_named("--tokenizer", str(error))) from None


def load_node_corpus(config: NodeConfig, tokenizer: Tokenizer | None = None) -> tuple[Tokenizer, Corpus]:
    """The node's tokenizer (``tokenizer`` if already loaded) and corpus from ``--tokenizer``, ``--data``
    and ``--text-field``; ``ConfigError`` naming the flag."""
    path = config.corpus.path or None
    tokenizer = node_tokenizer(config) if tokenizer is None else tokenizer
    try:
        if not tokenized_here(path, tokenizer):
            corpus = load_corpus(path, val_fraction=config.corpus.val_fraction, tokenizer=tokenizer)
            return tokenizer, corpus
        # Tokenized once per run dir: a restart memory-maps the streams (node/data/token_cache.py).
        folder = config.resolved_run_dir / CACHE_FOLDER
        text_field, val_fraction = config.corpus.text_field, config.corpus.val_fraction
        key = cache_key(path, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction)
        cached = load_cached(folder, key)
        if cached is not None:
            return tokenizer, cached
        corpus = load_tokenized(path, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction)
    except ValueError as error:
        raise ConfigError(_named("--data", str(error))) from None
    save_cached(folder, key, corpus, min_vocab_size=tokenizer.vocab_size)
    return tokenizer, corpus


def _named(flag: str, message: str) -> str:
    """``message`` as the flag's error (``--data: …``), unless it names its flag first already."""
    return message if message.startswith("--") else f"{flag}: {message}"
