"""The node's tokenizer and corpus, from its settings: ``--tokenizer``, ``--data``, ``--text-field``,
``--val-fraction``.

The tokenizer is ``node/data/tokenizer.py``'s; the corpus is ``node/data/corpus.py``'s ``load_corpus`` of the
``--data`` source (``node/data/documents.py``). What is tokenized as it streams (a ``tokenizer.json``, a
record data set) is tokenized once per run dir: later starts memory-map the streams
(``node/data/token_cache.py``). Byte-token text sources and ``.bin`` files load in about a second and are
not cached. A bad setting or source is a ``ConfigError``.
"""

from __future__ import annotations

from node.config import ConfigError, NodeConfig
from node.data.corpus import Corpus, load_corpus, load_tokenized, tokenized_here
from node.data.token_cache import CACHE_FOLDER, cache_key, load_cached, save_cached
from node.data.tokenizer import Tokenizer, load_tokenizer


def load_node_corpus(config: NodeConfig) -> tuple[Tokenizer, Corpus]:
    """The node's tokenizer and corpus from ``--tokenizer``, ``--data`` and ``--text-field``."""
    path = config.corpus.path or None
    try:
        tokenizer = load_tokenizer(config.corpus.tokenizer or None)
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
        raise ConfigError(str(error)) from None
    save_cached(folder, key, corpus, min_vocab_size=tokenizer.vocab_size)
    return tokenizer, corpus
