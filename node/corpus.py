"""Byte-level tokens and the training corpus: what every peer must agree it is training on.

Tokens
------
dtnode tokenizes at the byte level: token ids 0..255 are the raw bytes of the text, followed by four
specials (``BOS``, ``EOS``, ``PAD`` and one reserved id), so ``VOCAB_SIZE = 260``. A byte tokenizer
has no vocabulary file and no merges table, so there is nothing to download, nothing to version and
nothing for two peers to disagree about: the same bytes give the same ids on every machine. The
price is ~4x longer sequences than BPE, which is fine for the small models a CPU swarm trains.

Corpus
------
``load_corpus`` turns one of four sources into two flat uint16 token streams, ``train`` and ``val``:

* ``None``: the embedded default, the ``.py`` sources of this interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``dist-packages``,
  ``__pycache__`` or anything under a venv). It is ~30 MB of real code present on every machine
  with Python, so a swarm can train with no download; peers must run the same Python release to
  get the same corpus, which ``Corpus.sha256`` makes checkable.
* a text file: one document.
* a folder: every regular file below it, sorted by POSIX relative path, one document per file;
  empty files and binary files (any NUL byte) are skipped.
* a ``.bin`` file: pre-tokenized uint16 little-endian ids, as nanoGPT's ``prepare.py`` writes
  them. It is memory-mapped, never read whole, and may use any vocabulary: ``Corpus.vocab_size``
  is ``max(VOCAB_SIZE, max id + 1)``.

Each document becomes its bytes followed by ``EOS``, so the model sees where one file ends.

Other tokenizers and data sets
------------------------------
With ``--tokenizer tokenizer.json`` (``node/tokenizer.py``) the same sources are tokenized by it, each
document followed by the tokenizer's end-of-text id; so are the record data sets of ``node/records.py``
(``.jsonl``, ``.parquet``, a ``datasets`` ``save_to_disk`` folder: one document per record). A
vocabulary over 65,535 ids makes the streams, and a ``.bin`` file's ids, uint32 (``token_dtype``). The
tokenizer file's digest is part of ``Corpus.sha256``, so a peer or a resume with another tokenizer
does not match.

Held-out split
--------------
The split must be identical on every peer and stable when files are added, so a document goes to
validation iff ``sha256(relative path) mod 10_000 < val_fraction * 10_000``: a property of its name
alone, not of the file order or of a random generator. If no document is selected the last one is
used, if all are the first one goes back to train, so both sides are non-empty. A single text file
and a ``.bin`` stream have no documents to split on: their last ``val_fraction`` of tokens is
validation.

Loading the default corpus takes ~0.5-1 s on a 2-core machine (walking the stdlib tree dominates;
reading and tokenizing ~30 MB is ~0.1 s, hashing ~0.1 s), so there is no on-disk cache.
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from node.tokenizer import Tokenizer

NUM_BYTE_TOKENS: Final = 256
BOS: Final = 256
"""Beginning of sequence; reserved for samplers that need an explicit start token."""
EOS: Final = 257
"""End of document: appended after every document, the separator the model learns to predict."""
PAD: Final = 258
"""Padding for ragged batches; never produced by ``load_corpus``."""
RESERVED: Final = 259
VOCAB_SIZE: Final = 260

TOKEN_DTYPE: Final = np.dtype("<u2")
"""Token streams are uint16 little-endian, the layout of nanoGPT's ``.bin`` files, unless the
tokenizer's vocabulary needs more (:func:`token_dtype`)."""
WIDE_TOKEN_DTYPE: Final = np.dtype("<u4")
"""Token streams of a vocabulary over 65,535 ids (``--tokenizer``), ``.bin`` files included."""

_EXCLUDED_DIR_NAMES: Final = frozenset({"site-packages", "dist-packages", "__pycache__"})
_SPLIT_BUCKETS: Final = 10_000
_HASH_CHUNK_TOKENS: Final = 1 << 24  # 32 MB per step: bounded memory when scanning a memmap
_HASH_FORMAT_TAG: Final = b"dtnode-corpus-v1|uint16le"

TokenArray = npt.NDArray[np.uint16] | npt.NDArray[np.uint32]


def token_dtype(vocab_size: int) -> np.dtype[np.unsignedinteger]:
    """uint16 little-endian for a vocabulary of at most 65,535 ids, else uint32."""
    return TOKEN_DTYPE if vocab_size <= 65_535 else WIDE_TOKEN_DTYPE


def encode(text: str | bytes) -> TokenArray:
    """Token ids of ``text``: its UTF-8 bytes as uint16, with no specials added."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(TOKEN_DTYPE)


def decode(ids: npt.ArrayLike) -> str:
    """Text of token ids: specials (and ids above the byte range) are skipped, bad UTF-8 replaced."""
    flat = np.asarray(ids).reshape(-1)
    if flat.size and not np.issubdtype(flat.dtype, np.integer):
        raise ValueError(f"token ids must be integers, got dtype {flat.dtype}")
    if flat.size and int(flat.min()) < 0:
        raise ValueError(f"token ids must be non-negative, got {int(flat.min())}")
    byte_ids = flat[flat < NUM_BYTE_TOKENS].astype(np.uint8)
    return byte_ids.tobytes().decode("utf-8", errors="replace")


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


def load_corpus(
    path: str | None,
    *,
    val_fraction: float = 0.01,
    tokenizer: Tokenizer | None = None,
    text_field: str = "text",
) -> Corpus:
    """Load the corpus at ``path`` (see the module docstring), or the stdlib default if ``None``.

    An empty string also means the default (the config's "no data given"), never the current folder.
    With a ``tokenizer.json`` (``node/tokenizer.py``), or for record data sets (``.jsonl``,
    ``.parquet``, a ``save_to_disk`` folder: ``node/records.py``, reading ``text_field``), documents
    are tokenized batch by batch as they are read (``node/records.py``).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    from node import records  # records builds on this module's helpers

    if path and Path(path).suffix == ".bin" and Path(path).is_file():
        return _load_token_file(Path(path), val_fraction=val_fraction, tokenizer=tokenizer)
    if records.tokenized_here(path, tokenizer):
        return records.load_tokenized(
            path or None, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction
        )
    if path is None or path == "":
        root = Path(sysconfig.get_paths()["stdlib"])
        documents = _read_documents(root, _stdlib_files(root))
        label = f"python-stdlib {platform.python_version()}"
        return _corpus_from_documents(documents, label=label, val_fraction=val_fraction)

    source = Path(path)
    if not source.exists():
        raise ValueError(f"corpus path {path!r} does not exist")
    if source.is_dir():
        documents = _read_documents(source, _folder_files(source))
        if not documents:
            raise ValueError(f"corpus folder {path!r} holds no non-empty text file")
        return _corpus_from_documents(documents, label=f"folder {path}", val_fraction=val_fraction)
    if not source.is_file():
        raise ValueError(f"corpus path {path!r} is neither a regular file nor a folder")
    return _load_text_file(source, val_fraction=val_fraction)


def _stdlib_files(root: Path) -> list[str]:
    """POSIX relative paths of the stdlib's ``.py`` files, pruning third-party and venv trees."""
    venv = Path(sys.prefix).resolve() if sys.prefix != sys.base_prefix else None
    found: list[str] = []
    for directory, subdirectories, file_names in os.walk(root):
        # Prune in place so os.walk never descends into site-packages (it can dwarf the stdlib).
        subdirectories[:] = [
            name
            for name in subdirectories
            if name not in _EXCLUDED_DIR_NAMES
            and not (venv is not None and (Path(directory) / name).resolve().is_relative_to(venv))
        ]
        for name in file_names:
            full = Path(directory) / name
            if name.endswith(".py") and full.is_file():
                found.append(full.relative_to(root).as_posix())
    if not found:
        raise ValueError(f"no standard-library sources under {root}; pass a corpus path instead")
    return sorted(found)


def _folder_files(root: Path) -> list[str]:
    """POSIX relative paths of every regular file below ``root``."""
    found = [
        (Path(directory) / name).relative_to(root).as_posix()
        for directory, _, file_names in os.walk(root)
        for name in file_names
        if (Path(directory) / name).is_file()
    ]
    return sorted(found)


def _read_documents(root: Path, relative_paths: list[str]) -> list[tuple[str, bytes]]:
    """``(relative path, bytes)`` in path order, skipping empty and binary (NUL-holding) files."""
    documents = []
    for relative in sorted(relative_paths):
        data = (root / relative).read_bytes()
        if data and b"\0" not in data:
            documents.append((relative, data))
    return documents


def _is_validation(relative_path: str, val_fraction: float) -> bool:
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
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
    return _make_corpus(train, val, description=description, num_documents=len(documents))


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
    return _make_corpus(
        tokens[:split],
        tokens[split:],
        description=label,
        num_documents=num_documents,
        tokenizer_sha256=tokenizer_sha256,
        min_vocab_size=min_vocab_size,
    )


def _make_corpus(
    train: TokenArray,
    val: TokenArray,
    *,
    description: str,
    num_documents: int,
    tokenizer_sha256: str | None = None,
    min_vocab_size: int = VOCAB_SIZE,
) -> Corpus:
    """The corpus of two streams; its digest covers the tokens and, if any, the tokenizer file.

    Byte-token uint16 streams keep the original tag, so their digests (and old run dirs) are unchanged;
    a ``tokenizer.json``'s digest and a uint32 layout extend it.
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
    return Corpus(
        train=train,
        val=val,
        sha256=digest.hexdigest(),
        description=description,
        num_documents=num_documents,
        vocab_size=max(min_vocab_size, max_id + 1),
        tokenizer_sha256=tokenizer_sha256,
    )
