"""A node's tokenized corpus kept in its run dir, so a restart does not tokenize its data again.

Tokenizing with a ``tokenizer.json``, or a record data set, as it streams (``node/data/corpus.py``'s
``load_tokenized``) costs seconds per ten megabytes of text; a resumed node would pay it at every start. After the first start the two
token streams are written to ``RUN_DIR/token-cache/<key>.{train,val}.bin`` (the tokens' dtype, raw)
with ``<key>.json`` beside them (description, document count, tokenizer digest), and later starts
memory-map them: nothing is held in RAM but the pages training touches.

The key is the SHA-256 of everything the streams depend on: the format version, the source's path
and, for each of its files, relative path, size and modification time (so editing, adding or
removing a file misses the cache), the tokenizer's digest, the text field and the validation
fraction. The corpus digest is recomputed from the cached tokens, so a cache that somehow held other
tokens would give another ``Corpus.sha256``, which checkpoints and the swarm refuse. Only the newest
entry is kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Final

import numpy as np

from node.data.corpus import Corpus
from node.data.documents import folder_files, stdlib_files, stdlib_root
from node.data.tokenizer import Tokenizer, token_dtype

CACHE_FOLDER: Final = "token-cache"
_FORMAT: Final = "dtnode-token-cache-v1"


def cache_key(path: str | None, *, tokenizer: Tokenizer, text_field: str, val_fraction: float) -> str:
    """The SHA-256 naming the streams of ``path`` under these settings (see the module docstring)."""
    digest = hashlib.sha256(f"{_FORMAT}|{tokenizer.sha256}|{text_field}|{val_fraction!r}|".encode())
    if path is None:
        root = stdlib_root()
        digest.update(f"stdlib {platform.python_version()} {root}|".encode())
        files = stdlib_files(root)
    else:
        root = Path(path).resolve()
        digest.update(f"{root}|".encode())
        files = folder_files(root) if root.is_dir() else [""]
    for relative in files:
        stat = (root / relative).stat() if relative else root.stat()
        digest.update(f"{relative}:{stat.st_size}:{stat.st_mtime_ns}|".encode())
    return digest.hexdigest()


def load_cached(folder: Path, key: str) -> Corpus | None:
    """The cached corpus of ``key``, memory-mapped; None if there is none (or it is incomplete)."""
    meta_file = folder / f"{key}.json"
    if not meta_file.is_file():
        return None
    meta = json.loads(meta_file.read_text())
    dtype = token_dtype(meta["min_vocab_size"])
    train, val = (np.memmap(folder / f"{key}.{side}.bin", dtype=dtype, mode="r") for side in ("train", "val"))
    corpus = Corpus.from_streams(
        train,
        val,
        description=meta["description"] + " (token cache)",
        num_documents=meta["num_documents"],
        tokenizer_sha256=meta["tokenizer_sha256"],
        min_vocab_size=meta["min_vocab_size"],
    )
    return corpus if corpus.sha256 == meta["sha256"] else None  # damaged: tokenize again


def save_cached(folder: Path, key: str, corpus: Corpus, *, min_vocab_size: int) -> None:
    """Write ``corpus``'s streams under ``key`` (the metadata last: it marks the entry complete) and
    remove every other entry."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.iterdir():
        if not old.name.startswith(key):
            old.unlink()
    for side, tokens in (("train", corpus.train), ("val", corpus.val)):
        tmp = folder / f"{key}.{side}.bin.tmp-{os.getpid()}"
        np.asarray(tokens).tofile(tmp)
        os.replace(tmp, folder / f"{key}.{side}.bin")
    meta = {
        "description": corpus.description,
        "num_documents": corpus.num_documents,
        "tokenizer_sha256": corpus.tokenizer_sha256,
        "min_vocab_size": min_vocab_size,
        "sha256": corpus.sha256,
    }
    tmp = folder / f"{key}.json.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, folder / f"{key}.json")
