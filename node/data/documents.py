"""Where a corpus's documents come from: every ``--data`` source, read as ``(key, text)`` documents.

Text sources
------------
* ``None``: the embedded default, the ``.py`` sources of this interpreter's standard library
  (``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``dist-packages``,
  ``__pycache__`` or anything under a venv). It is ~30 MB of real code present on every machine
  with Python, so a swarm can train with no download; peers must run the same Python release to
  get the same corpus, which ``Corpus.sha256`` makes checkable.
* a text file: one document.
* a folder: every regular file below it, sorted by POSIX relative path, one document per file;
  empty files and binary files (any NUL byte) are skipped.

A document's key is its POSIX relative path (a text file's: its name).

Record data sets
----------------
One document per record, its text in the ``--text-field`` column (``text``):

* ``.jsonl``: one JSON object per line (blank lines skipped), read line by line;
* ``.parquet``: read in record batches of the text column only (``pyarrow``), never whole;
* a folder holding only ``.jsonl`` / ``.parquet`` files (a data set's shards): each in path order;
* a folder written by ``datasets.Dataset.save_to_disk`` (it holds ``state.json`` and
  ``dataset_info.json``; a ``DatasetDict``'s folder, with ``dataset_dict.json``, gives its ``train``
  split): memory-mapped Arrow files, read in batches.

A record's key is its index in the data set (``file:index`` in a folder of shards). Documents come in
batches of :data:`BATCH_RECORDS`, so the text of a whole data set is never in memory at once.

What becomes of the documents (token ids, the held-out split by key, the digest) is ``node/data/corpus.py``'s;
a pre-tokenized ``.bin`` file has no documents and is read there.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

BATCH_RECORDS: Final = 1024
"""Documents read and encoded together."""

Document = tuple[str, str | bytes]  # (key: relative path or record index, text)

RECORD_SUFFIXES: Final = (".jsonl", ".parquet")

_EXCLUDED_DIR_NAMES: Final = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> Path:
    """The standard library folder of this interpreter: the embedded corpus's source."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_label() -> str:
    """The embedded corpus's name, with the Python release that decides its contents."""
    return f"python-stdlib {platform.python_version()}"


def stdlib_files(root: Path) -> list[str]:
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


def folder_files(root: Path) -> list[str]:
    """POSIX relative paths of every regular file below ``root``."""
    found = [
        (Path(directory) / name).relative_to(root).as_posix()
        for directory, _, file_names in os.walk(root)
        for name in file_names
        if (Path(directory) / name).is_file()
    ]
    return sorted(found)


def read_documents(root: Path, relative_paths: list[str]) -> list[tuple[str, bytes]]:
    """``(relative path, bytes)`` in path order, skipping empty and binary (NUL-holding) files."""
    documents = []
    for relative in sorted(relative_paths):
        data = (root / relative).read_bytes()
        if data and b"\0" not in data:
            documents.append((relative, data))
    return documents


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
    files = folder_files(folder)
    return files if files and all(Path(name).suffix in RECORD_SUFFIXES for name in files) else []


def document_batches(path: str | None, *, text_field: str = "text") -> tuple[str, Iterator[list[Document]]]:
    """A label for the source and its documents in batches of at most :data:`BATCH_RECORDS`."""
    if path is None:
        root = stdlib_root()
        return stdlib_label(), _batched(read_documents(root, stdlib_files(root)))
    source = Path(path)
    if not source.exists():
        raise ValueError(f"corpus path {path!r} does not exist")
    if source.is_dir() and _record_files(source):
        return f"{len(_record_files(source))} record files in {path}", _shard_batches(source, text_field)
    if source.is_dir() and not is_record_source(source):
        documents = read_documents(source, folder_files(source))
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
