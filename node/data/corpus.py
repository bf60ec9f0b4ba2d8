"""The training corpus: what every peer must agree it is training on.

Corpus
------
``load_corpus`` turns a ``--data`` source (``node/data/documents.py``: the embedded stdlib, a text file, a
folder, a record data set) or a pre-tokenized ``.bin`` file into two flat token streams, ``train`` and
``val``, and a digest of them (``Corpus.sha256``) that checkpoints and the swarm compare. Each document
becomes its token ids followed by the tokenizer's end-of-text id (``EOS`` for byte tokens), so the model
sees where one document ends.

* byte-token text sources (no ``--tokenizer``, not records): each document's bytes are its ids
  (``node/data/tokenizer.py``), laid into one uint16 stream at once;
* a ``.bin`` file: pre-tokenized uint16 little-endian ids, as nanoGPT's ``prepare.py`` writes them
  (uint32 with a vocabulary over 65,535 ids). It is memory-mapped, never read whole, and may use any
  vocabulary: ``Corpus.vocab_size`` is ``max(VOCAB_SIZE, max id + 1)``;
* with a ``tokenizer.json`` (``--tokenizer``), and for record data sets: tokenized as it streams
  (:func:`load_tokenized`). Documents are read ``BATCH_RECORDS`` at a time and each batch is encoded at
  once (the Rust ``tokenizers`` encoder runs a batch on every core), so the text of the whole data set
  is never in memory, only its token ids. The tokenizer file's digest is part of ``Corpus.sha256``, so a
  peer or a resume with another tokenizer does not match.

The streams then feed :class:`~node.data.batches.ShardedBatches` unchanged: the windows, the disjoint shards per
node and the resumable ``(epoch, position)`` are those of every corpus. A node tokenizes when it first
starts (``BENCHMARKS.md`` compares the rate with the inner step's token rate); the streams are then kept
in its run dir and memory-mapped by later starts (``node/data/token_cache.py``).

Held-out split
--------------
The split must be identical on every peer and stable when files are added, so a document goes to
validation iff ``sha256(key) mod 10_000 < val_fraction * 10_000``, where the key is its relative path
(a record's: its index in the data set, ``file:index`` in a folder of shards): a property of the data
alone, not of the file order or of a random generator. If no document is selected the last one is used,
if all are the first one goes back to train, so both sides are non-empty. A single document and a
``.bin`` stream have nothing to split on: their last ``val_fraction`` of tokens is validation.

Loading the default corpus takes ~0.5-1 s on a 2-core machine (walking the stdlib tree dominates;
reading and tokenizing ~30 MB is ~0.1 s, hashing ~0.1 s), so byte-token sources are not cached.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from node.data.documents import (
    document_batches,
    folder_files,
    is_record_source,
    read_documents,
    stdlib_files,
    stdlib_label,
    stdlib_root,
)
from node.data.tokenizer import (
    EOS,
    TOKEN_DTYPE,
    VOCAB_SIZE,
    WIDE_TOKEN_DTYPE,
    ByteTokenizer,
    TokenArray,
    Tokenizer,
    token_dtype,
)

_SPLIT_BUCKETS: Final = 10_000
_HASH_CHUNK_TOKENS: Final = 1 << 24  # 32 MB per step: bounded memory when scanning a memmap
_HASH_FORMAT_TAG: Final = b"dtnode-corpus-v1|uint16le"


@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus split into a training and a held-out validation stream."""

    train: TokenArray
    """Training tokens, 1-D uint16: documents (each ending in ``EOS``) concatenated in path order."""
    val: TokenArray
    """Validation tokens, 1-D uint16, same layout; never overlaps ``train``'s documents."""
    sha256: str
    """Hex digest of the split sizes and the exact token bytes of ``train`` then ``val``: two peers
    train on the same data iff their digests match."""
    description: str
    """One human line, e.g. ``python-stdlib 3.11.7: 1790 files, 31.5 MB``."""
    num_documents: int
    """Documents in train + val; a ``.bin`` stream counts as one opaque document."""
    vocab_size: int
    """Smallest vocabulary covering every id: ``VOCAB_SIZE`` for text, maybe more for ``.bin``.
    With a ``tokenizer.json``, at least the tokenizer's vocabulary (ids it never produced included)."""
    tokenizer_sha256: str | None = None
    """SHA-256 of the ``tokenizer.json`` the text was tokenized with (folded into ``sha256``); None
    for byte tokens."""

    @classmethod
    def from_streams(
        cls,
        train: TokenArray,
        val: TokenArray,
        *,
        description: str,
        num_documents: int,
        tokenizer_sha256: str | None = None,
        min_vocab_size: int = VOCAB_SIZE,
    ) -> Corpus:
        """The corpus of two streams; its digest covers the tokens and, if any, the tokenizer file.

        Byte-token uint16 streams keep the original tag, so their digests (and old run dirs) are
        unchanged; a ``tokenizer.json``'s digest and a uint32 layout extend it.
        """
        assert train.ndim == 1 and val.ndim == 1 and train.dtype == val.dtype
        assert train.dtype in (TOKEN_DTYPE, WIDE_TOKEN_DTYPE)
        assert train.size > 0 and val.size > 0
        tag = _HASH_FORMAT_TAG
        if train.dtype == WIDE_TOKEN_DTYPE:
            tag += b"|uint32le"
        if tokenizer_sha256 is not None:
            tag += f"|tokenizer={tokenizer_sha256}".encode()
        digest = hashlib.sha256(tag + f"|train={train.size}|val={val.size}|".encode())
        max_id = 0
        # One chunked pass over both streams: a memmap is paged in a bounded slice at a time.
        for stream in (train, val):
            for start in range(0, stream.size, _HASH_CHUNK_TOKENS):
                chunk = np.ascontiguousarray(stream[start : start + _HASH_CHUNK_TOKENS])
                digest.update(chunk.data)
                max_id = max(max_id, int(chunk.max()))
        return cls(
            train=train,
            val=val,
            sha256=digest.hexdigest(),
            description=description,
            num_documents=num_documents,
            vocab_size=max(min_vocab_size, max_id + 1),
            tokenizer_sha256=tokenizer_sha256,
        )


def load_corpus(
    path: str | None,
    *,
    val_fraction: float = 0.01,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
) -> Corpus:
    """Load the corpus at ``path`` (see the module docstring), or the stdlib default if ``None``.

    An empty string also means the default (the config's "no data given"), never the current folder.
    With a ``tokenizer.json`` (``node/data/tokenizer.py``), or for record data sets (``.jsonl``,
    ``.parquet``, a ``save_to_disk`` folder, reading ``text_field``), documents are tokenized batch by
    batch as they are read (:func:`load_tokenized`).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if path and Path(path).suffix == ".bin" and Path(path).is_file():
        return _load_token_file(Path(path), val_fraction=val_fraction, tokenizer=tokenizer)
    if tokenized_here(path, tokenizer):
        return load_tokenized(
            path or None, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction
        )
    if path is None or path == "":
        root = stdlib_root()
        documents = read_documents(root, stdlib_files(root))
        return _corpus_from_documents(documents, label=stdlib_label(), val_fraction=val_fraction)

    source = Path(path)
    if not source.exists():
        raise ValueError(f"corpus path {path!r} does not exist")
    if source.is_dir():
        documents = read_documents(source, folder_files(source))
        if not documents:
            raise ValueError(f"corpus folder {path!r} holds no non-empty text file")
        return _corpus_from_documents(documents, label=f"folder {path}", val_fraction=val_fraction)
    if not source.is_file():
        raise ValueError(f"corpus path {path!r} is neither a regular file nor a folder")
    return _load_text_file(source, val_fraction=val_fraction)


def tokenized_here(path: str | None, tokenizer: Tokenizer | None) -> bool:
    """Whether ``load_corpus`` reads ``path`` through :func:`load_tokenized`: a ``tokenizer.json`` or a
    record data set (not a ``.bin``, whose ids are already tokens, nor byte-token text sources)."""
    if path and Path(path).suffix == ".bin" and Path(path).is_file():
        return False
    has_tokenizer_file = tokenizer is not None and tokenizer.sha256 is not None
    return has_tokenizer_file or bool(path and is_record_source(Path(path)))


def load_tokenized(
    path: str | None, *, tokenizer: Tokenizer | None, text_field: str, val_fraction: float
) -> Corpus:
    """The corpus of ``path`` tokenized by ``tokenizer`` as it is read (see the module docstring)."""
    tokenizer = tokenizer or ByteTokenizer()
    dtype = token_dtype(tokenizer.vocab_size)
    label, batches = document_batches(path, text_field=text_field)
    train: list[TokenArray] = []
    val: list[TokenArray] = []
    num_bytes = 0
    for batch in batches:
        encoded = tokenizer.encode_batch([text for _, text in batch])
        for (key, text), ids in zip(batch, encoded, strict=True):
            if ids.size == 0:
                continue  # an empty record: nothing to learn, and no lone EOS
            num_bytes += len(text) if isinstance(text, bytes) else len(text.encode("utf-8"))
            (val if _is_validation(key, val_fraction) else train).append(ids.astype(dtype, copy=False))
    num_documents = len(train) + len(val)
    if num_documents == 0:
        raise ValueError(f"{label}: no non-empty document")
    name = tokenizer.name if tokenizer.sha256 is None else f"{tokenizer.name} {tokenizer.sha256[:12]}"
    description = f"{label}: {num_documents} documents, {num_bytes / 1e6:.1f} MB, tokenizer {name}"
    if num_documents == 1:  # one document cannot go to both sides: split its tokens
        return _split_stream(
            _join(train + val, tokenizer.eos_id, dtype),
            label=description,
            num_documents=1,
            val_fraction=val_fraction,
            tokenizer_sha256=tokenizer.sha256,
            min_vocab_size=tokenizer.vocab_size,
        )
    if not val:
        val.append(train.pop())
    if not train:
        train.append(val.pop(0))
    return Corpus.from_streams(
        _join(train, tokenizer.eos_id, dtype),
        _join(val, tokenizer.eos_id, dtype),
        description=description,
        num_documents=num_documents,
        tokenizer_sha256=tokenizer.sha256,
        min_vocab_size=tokenizer.vocab_size,
    )


def _join(documents: list[TokenArray], eos_id: int, dtype: np.dtype[Any]) -> TokenArray:
    """Each document's ids followed by ``eos_id``, concatenated."""
    ends = np.cumsum([document.size + 1 for document in documents], dtype=np.int64)
    tokens = np.empty(int(ends[-1]) if documents else 0, dtype=dtype)
    for document, end in zip(documents, ends, strict=True):
        tokens[int(end) - document.size - 1 : int(end) - 1] = document
    tokens[ends - 1] = eos_id
    return tokens


def _is_validation(key: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest, "big") % _SPLIT_BUCKETS < val_fraction * _SPLIT_BUCKETS


def _concatenate(documents: list[bytes]) -> TokenArray:
    """Each document's bytes followed by ``EOS``, concatenated into one uint16 stream."""
    lengths = np.array([len(document) + 1 for document in documents], dtype=np.int64)
    ends = np.cumsum(lengths)
    tokens = np.empty(int(ends[-1]) if documents else 0, dtype=TOKEN_DTYPE)
    for document, end in zip(documents, ends, strict=True):
        start = int(end) - len(document) - 1
        tokens[start : int(end) - 1] = np.frombuffer(document, dtype=np.uint8)
    tokens[ends - 1] = EOS
    return tokens


def _corpus_from_documents(documents: list[tuple[str, bytes]], *, label: str, val_fraction: float) -> Corpus:
    if len(documents) < 2:
        # One document cannot go to both sides; split its tokens like a single text file.
        tokens = _concatenate([data for _, data in documents])
        return _split_stream(tokens, label=f"{label}: 1 file", num_documents=1, val_fraction=val_fraction)
    is_val = [_is_validation(relative, val_fraction) for relative, _ in documents]
    if not any(is_val):
        is_val[-1] = True
    if all(is_val):
        is_val[0] = False
    train = _concatenate([data for (_, data), val in zip(documents, is_val, strict=True) if not val])
    val = _concatenate([data for (_, data), val in zip(documents, is_val, strict=True) if val])
    num_bytes = sum(len(data) for _, data in documents)
    description = f"{label}: {len(documents)} files, {num_bytes / 1e6:.1f} MB"
    return Corpus.from_streams(train, val, description=description, num_documents=len(documents))


def _load_text_file(source: Path, *, val_fraction: float) -> Corpus:
    data = source.read_bytes()
    if not data:
        raise ValueError(f"corpus file {str(source)!r} is empty")
    tokens = _concatenate([data])
    description = f"text file {source}: {len(data) / 1e6:.1f} MB"
    return _split_stream(tokens, label=description, num_documents=1, val_fraction=val_fraction)


def _load_token_file(source: Path, *, val_fraction: float, tokenizer: Tokenizer | None) -> Corpus:
    vocab_size = VOCAB_SIZE if tokenizer is None else tokenizer.vocab_size
    dtype = token_dtype(vocab_size)
    num_bytes = source.stat().st_size
    width = f"uint{8 * dtype.itemsize}"
    if num_bytes % dtype.itemsize:
        raise ValueError(f"token file {str(source)!r} has {num_bytes} bytes, not a whole number of {width}")
    if num_bytes < 2 * dtype.itemsize:
        raise ValueError(f"token file {str(source)!r} holds fewer than 2 tokens")
    tokens = np.memmap(source, dtype=dtype, mode="r")
    description = f"token file {source}: {tokens.size:,} {width} tokens"
    return _split_stream(
        tokens,
        label=description,
        num_documents=1,
        val_fraction=val_fraction,
        tokenizer_sha256=None if tokenizer is None else tokenizer.sha256,
        min_vocab_size=vocab_size,
    )


def _split_stream(
    tokens: TokenArray,
    *,
    label: str,
    num_documents: int,
    val_fraction: float,
    tokenizer_sha256: str | None = None,
    min_vocab_size: int = VOCAB_SIZE,
) -> Corpus:
    """Validation is the last ``val_fraction`` of ``tokens`` (at least one token on each side)."""
    if tokens.size < 2:
        raise ValueError(f"{label}: need at least 2 tokens to split into train and val")
    num_val = min(max(math.ceil(val_fraction * tokens.size), 1), tokens.size - 1)
    split = tokens.size - num_val
    return Corpus.from_streams(
        tokens[:split],
        tokens[split:],
        description=label,
        num_documents=num_documents,
        tokenizer_sha256=tokenizer_sha256,
        min_vocab_size=min_vocab_size,
    )
