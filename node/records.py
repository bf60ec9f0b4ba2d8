"""Record data sets and tokenized corpora: ``.jsonl``, ``.parquet``, ``datasets`` folders, any tokenizer.

Sources
-------
Besides the text sources of ``node/corpus.py`` (the embedded stdlib, a folder, a text file), ``--data``
reads record data sets, one document per record, its text in the ``--text-field`` column (``text``):

* ``.jsonl``: one JSON object per line (blank lines skipped), read line by line;
* ``.parquet``: read in record batches of the text column only (``pyarrow``), never whole;
* a folder holding only ``.jsonl`` / ``.parquet`` files (a data set's shards): each in path order;
* a folder written by ``datasets.Dataset.save_to_disk`` (it holds ``state.json`` and
  ``dataset_info.json``; a ``DatasetDict``'s folder, with ``dataset_dict.json``, gives its ``train``
  split): memory-mapped Arrow files, read in batches.

Tokenized as it streams
-----------------------
Documents are read :data:`BATCH_RECORDS` at a time and each batch is encoded at once (the Rust
``tokenizers`` encoder runs a batch on every core), so the text of the whole data set is never in memory,
only its token ids. The ids of each document plus the tokenizer's end-of-text id go to train or to
validation by the same rule as text files: validation iff ``sha256(key) mod 10_000 < val_fraction *
10_000``, where a record's key is its index in the data set (``file:index`` in a folder of shards; a
text file's key is its relative path), so the split is a property of the data alone. The streams then
feed :class:`~node.data.ShardedBatches` unchanged: the windows, the disjoint shards per node and the
resumable ``(epoch, position)`` are those of every other corpus. Tokenizing happens when the node first starts (``BENCHMARKS.md`` compares its
rate with the inner step's token rate); the streams are then kept in the run dir and memory-mapped by
later starts (``node/token_cache.py``).
"""

from __future__ import annotations

import json
import platform
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np

from node.config import ConfigError, NodeConfig
from node.corpus import (
    Corpus,
    TokenArray,
    _folder_files,
    _is_validation,
    _make_corpus,
    _read_documents,
    _split_stream,
    _stdlib_files,
    load_corpus,
    token_dtype,
)
from node.token_cache import CACHE_FOLDER, cache_key, load_cached, save_cached
from node.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

BATCH_RECORDS: Final = 1024
"""Documents read and encoded together."""

Document = tuple[str, str | bytes]  # (key: relative path or record index, text)


RECORD_SUFFIXES: Final = (".jsonl", ".parquet")


def is_record_source(path: Path) -> bool:
    """``.jsonl`` / ``.parquet`` files, folders of only such files, ``datasets`` ``save_to_disk`` folders."""
    if path.is_file():
        return path.suffix in RECORD_SUFFIXES
    return path.is_dir() and (_is_saved_dataset(path) or bool(_record_files(path)))


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _record_files(folder: Path) -> list[str]:
    """The folder's files if every one is a ``.jsonl`` or ``.parquet`` (a data set's shards), else []."""
    files = _folder_files(folder)
    return files if files and all(Path(name).suffix in RECORD_SUFFIXES for name in files) else []


def tokenized_here(path: str | None, tokenizer: Tokenizer | None) -> bool:
    """Whether ``load_corpus`` reads ``path`` through :func:`load_tokenized`: a ``tokenizer.json`` or a
    record data set (not a ``.bin``, whose ids are already tokens, nor byte-token text sources)."""
    if path and Path(path).suffix == ".bin" and Path(path).is_file():
        return False
    has_tokenizer_file = tokenizer is not None and tokenizer.sha256 is not None
    return has_tokenizer_file or bool(path and is_record_source(Path(path)))


def document_batches(path: str | None, *, text_field: str = "text") -> tuple[str, Iterator[list[Document]]]:
    """A label for the source and its documents in batches of at most :data:`BATCH_RECORDS`."""
    if path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        return f"python-stdlib {platform.python_version()}", _batched(
            _read_documents(root, _stdlib_files(root))
        )
    source = Path(path)
    if not source.exists():
        raise ValueError(f"corpus path {path!r} does not exist")
    if source.is_dir() and _record_files(source):
        return f"{len(_record_files(source))} record files in {path}", _shard_batches(source, text_field)
    if source.is_dir() and not is_record_source(source):
        documents = _read_documents(source, _folder_files(source))
        if not documents:
            raise ValueError(f"corpus folder {path!r} holds no non-empty text file")
        return f"folder {path}", _batched(documents)
    if source.suffix == ".jsonl":
        return f"jsonl {path}", _jsonl_batches(source, text_field)
    if source.suffix == ".parquet":
        return f"parquet {path}", _parquet_batches(source, text_field)
    if source.is_dir():
        return f"dataset {path}", _dataset_batches(source, text_field)
    data = source.read_bytes()
    if not data:
        raise ValueError(f"corpus file {path!r} is empty")
    return f"text file {path}", iter([[(source.name, data)]])


def iter_texts(path: str | None, *, text_field: str = "text") -> Iterator[str]:
    """Every document of ``path`` as text (for training a tokenizer)."""
    _, batches = document_batches(path, text_field=text_field)
    for batch in batches:
        for _, text in batch:
            yield text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text


def _batched(documents: list[tuple[str, bytes]]) -> Iterator[list[Document]]:
    for start in range(0, len(documents), BATCH_RECORDS):
        yield list(documents[start : start + BATCH_RECORDS])


def _text_of(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict) or text_field not in record:
        raise ValueError(f"{where}: no field {text_field!r} (set --text-field)")
    text = record[text_field]
    if not isinstance(text, str):
        raise ValueError(f"{where}: field {text_field!r} is {type(text).__name__}, not text")
    return text


def _jsonl_batches(source: Path, text_field: str) -> Iterator[list[Document]]:
    batch: list[Document] = []
    with source.open(encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{source}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{where}: not JSON ({error.msg})") from None
            batch.append((str(line_number - 1), _text_of(record, text_field, where)))
            if len(batch) == BATCH_RECORDS:
                yield batch
                batch = []
    if batch:
        yield batch


def _parquet_batches(source: Path, text_field: str) -> Iterator[list[Document]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError("reading .parquet needs pyarrow: pip install 'dtnode[hf]'") from None
    parquet = pq.ParquetFile(source)
    if text_field not in parquet.schema_arrow.names:
        raise ValueError(f"{source}: no column {text_field!r} (set --text-field)")
    index = 0
    for record_batch in parquet.iter_batches(batch_size=BATCH_RECORDS, columns=[text_field]):
        texts = record_batch.column(0).to_pylist()
        yield [(str(index + offset), text or "") for offset, text in enumerate(texts)]
        index += len(texts)


def _shard_batches(folder: Path, text_field: str) -> Iterator[list[Document]]:
    """Every record file of ``folder`` in path order; a record's key is ``relative path:index``."""
    for relative in _record_files(folder):
        source = folder / relative
        reader = _jsonl_batches if source.suffix == ".jsonl" else _parquet_batches
        for batch in reader(source, text_field):
            yield [(f"{relative}:{key}", text) for key, text in batch]


def _dataset_batches(source: Path, text_field: str) -> Iterator[list[Document]]:
    try:
        import datasets
    except ImportError:
        raise ValueError("reading a save_to_disk folder needs datasets: pip install 'dtnode[hf]'") from None
    loaded = datasets.load_from_disk(str(source))
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ValueError(f"{source}: a DatasetDict without a train split ({', '.join(loaded)})")
        loaded = loaded["train"]
    if text_field not in loaded.column_names:
        raise ValueError(f"{source}: no column {text_field!r} (set --text-field)")
    index = 0
    for batch in loaded.select_columns([text_field]).iter(batch_size=BATCH_RECORDS):
        texts = batch[text_field]
        yield [(str(index + offset), text or "") for offset, text in enumerate(texts)]
        index += len(texts)


def _join(documents: list[TokenArray], eos_id: int, dtype: np.dtype[Any]) -> TokenArray:
    """Each document's ids followed by ``eos_id``, concatenated."""
    ends = np.cumsum([document.size + 1 for document in documents], dtype=np.int64)
    tokens = np.empty(int(ends[-1]) if documents else 0, dtype=dtype)
    for document, end in zip(documents, ends, strict=True):
        tokens[int(end) - document.size - 1 : int(end) - 1] = document
    tokens[ends - 1] = eos_id
    return tokens


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
    return _make_corpus(
        _join(train, tokenizer.eos_id, dtype),
        _join(val, tokenizer.eos_id, dtype),
        description=description,
        num_documents=num_documents,
        tokenizer_sha256=tokenizer.sha256,
        min_vocab_size=tokenizer.vocab_size,
    )


def load_node_corpus(config: NodeConfig) -> tuple[Tokenizer, Corpus]:
    """The node's tokenizer and corpus from ``--tokenizer``, ``--data`` and ``--text-field``."""
    path = config.data or None
    try:
        tokenizer = load_tokenizer(config.tokenizer or None)
        if not tokenized_here(path, tokenizer):
            corpus = load_corpus(path, val_fraction=config.val_fraction, tokenizer=tokenizer)
            return tokenizer, corpus
        # Tokenized once per run dir: a restart memory-maps the streams (node/token_cache.py).
        folder = config.resolved_run_dir / CACHE_FOLDER
        text_field, val_fraction = config.text_field, config.val_fraction
        key = cache_key(path, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction)
        cached = load_cached(folder, key)
        if cached is not None:
            return tokenizer, cached
        corpus = load_tokenized(path, tokenizer=tokenizer, text_field=text_field, val_fraction=val_fraction)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    save_cached(folder, key, corpus, min_vocab_size=tokenizer.vocab_size)
    return tokenizer, corpus
