"""Record data sets (``.jsonl``, ``.parquet``, ``datasets`` ``save_to_disk``) become the same corpus, in
disjoint shards per node with a resumable position.

The reference is built here from the records themselves: each record's byte ids (``encode``) and ``EOS``,
train or validation by the hash of its index (sha256 mod 10,000, written out again below), in record
order. The three formats must give exactly those streams; then two nodes' shards over an epoch must
not share a window, and a loader restored from ``state_dict`` must continue with the same batches.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from node.config import NodeConfig
from node.data.batches import ShardedBatches
from node.data.corpus import load_corpus
from node.data.node_corpus import load_node_corpus
from node.data.tokenizer import EOS, encode, load_tokenizer, train_bpe

pyarrow = pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")

VAL_FRACTION = 0.2
SEQ_LEN = 16
BATCH_SIZE = 2


def texts() -> list[str]:
    """Records of different lengths with non-ASCII text (so bytes != characters) and one empty."""
    rows = [f"record {i}: {'é✓ ' * (i % 5)}{'lorem ipsum ' * (1 + i % 7)}" for i in range(120)]
    rows[17] = ""  # an empty record is skipped, not a lone EOS
    return rows


def write_all(directory: Path, rows: list[str]) -> dict[str, Path]:
    """The same records as .jsonl (with an extra field), .parquet and a save_to_disk folder."""
    jsonl = directory / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": text}) + "\n" for i, text in enumerate(rows)))
    parquet = directory / "data.parquet"
    import pyarrow.parquet as pq

    pq.write_table(pyarrow.table({"body": rows, "id": list(range(len(rows)))}), parquet, row_group_size=50)
    folder = directory / "saved"
    datasets.Dataset.from_dict({"body": rows, "id": list(range(len(rows)))}).save_to_disk(str(folder))
    return {"jsonl": jsonl, "parquet": parquet, "save_to_disk": folder}


def expected_streams(rows: list[str]) -> tuple[np.ndarray, np.ndarray]:
    train: list[int] = []
    val: list[int] = []
    for index, text in enumerate(rows):
        if not text:
            continue
        bucket = int.from_bytes(hashlib.sha256(str(index).encode()).digest(), "big") % 10_000
        (val if bucket < VAL_FRACTION * 10_000 else train).extend([*encode(text).tolist(), EOS])
    return np.array(train), np.array(val)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_all(tmp_path_factory.mktemp("records"), texts())


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk"])
def test_each_format_gives_the_reference_streams(sources: dict[str, Path], kind: str) -> None:
    corpus = load_corpus(str(sources[kind]), val_fraction=VAL_FRACTION, text_field="body")
    train, val = expected_streams(texts())
    assert 0 < val.size < train.size
    assert np.array_equal(corpus.train, train) and np.array_equal(corpus.val, val)
    assert corpus.num_documents == len(texts()) - 1


def test_the_formats_are_one_corpus(sources: dict[str, Path]) -> None:
    digests = {
        load_corpus(str(path), val_fraction=VAL_FRACTION, text_field="body").sha256
        for path in sources.values()
    }
    assert len(digests) == 1


def window_sets(batches: ShardedBatches) -> set[int]:
    return {int(window) for window in batches.window_indices(epoch=0).reshape(-1)}


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk"])
def test_shards_are_disjoint_and_resume_where_they_stood(
    sources: dict[str, Path], kind: str, tmp_path: Path
) -> None:
    tokenizer = train_bpe((text for text in texts()), vocab_size=300, out=tmp_path / "tokenizer.json")
    corpus = load_corpus(
        str(sources[kind]), val_fraction=VAL_FRACTION, text_field="body", tokenizer=tokenizer
    )
    assert corpus.tokenizer_sha256 == tokenizer.sha256 and corpus.vocab_size == 300

    def shard(index: int) -> ShardedBatches:
        return ShardedBatches(
            corpus.train, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=7, shard_index=index, num_shards=2
        )

    first, second = shard(0), shard(1)
    assert window_sets(first) and not window_sets(first) & window_sets(second)
    # What each shard actually reads over the epoch is its windows, cut from the stream here.
    tokens = torch.from_numpy(corpus.train.astype(np.int64))
    for loader in (first, second):
        for windows in loader.window_indices(epoch=0):
            x, y = loader.next_batch()
            for row, window in enumerate(windows.tolist()):
                assert torch.equal(x[row], tokens[window * SEQ_LEN : window * SEQ_LEN + SEQ_LEN])
                assert torch.equal(y[row], tokens[window * SEQ_LEN + 1 : window * SEQ_LEN + SEQ_LEN + 1])

    # Resume: a fresh loader given the state after 3 batches continues with the same batches.
    loader = shard(1)
    for _ in range(3):
        loader.next_batch()
    resumed = shard(1)
    resumed.load_state_dict(loader.state_dict())
    for _ in range(2 * loader.batches_per_epoch):  # across an epoch boundary too
        for got, want in zip(resumed.next_batch(), loader.next_batch(), strict=True):
            assert torch.equal(got, want)


def test_missing_fields_are_named(sources: dict[str, Path]) -> None:
    for path in sources.values():
        with pytest.raises(ValueError, match="'text'"):
            load_corpus(str(path))  # the default --text-field is text; these records call it body


def test_a_bpe_tokenizes_records_like_the_tokenizer_itself(sources: dict[str, Path], tmp_path: Path) -> None:
    tokenizer = train_bpe(iter(texts()), vocab_size=300, out=tmp_path / "tokenizer.json")
    corpus = load_corpus(
        str(sources["jsonl"]), val_fraction=VAL_FRACTION, text_field="body", tokenizer=tokenizer
    )
    reloaded = load_tokenizer(tmp_path / "tokenizer.json")
    train: list[int] = []
    for index, text in enumerate(texts()):
        bucket = int.from_bytes(hashlib.sha256(str(index).encode()).digest(), "big") % 10_000
        if text and bucket >= VAL_FRACTION * 10_000:
            train.extend([*reloaded.tokenizer.encode(text, add_special_tokens=False).ids, reloaded.eos_id])
    assert np.array_equal(corpus.train, np.array(train))


def test_a_restart_reads_the_token_cache_and_a_changed_file_misses_it(tmp_path: Path) -> None:
    rows = texts()
    sources = write_all(tmp_path, rows)
    config = NodeConfig.from_flat(
        data=str(sources["jsonl"]),
        text_field="body",
        val_fraction=VAL_FRACTION,
        run_dir=str(tmp_path / "run"),
    )
    _, first = load_node_corpus(config)
    _, again = load_node_corpus(config)
    assert "token cache" not in first.description and again.description.endswith("(token cache)")
    assert isinstance(again.train, np.memmap)
    assert again.sha256 == first.sha256 and np.array_equal(again.train, first.train)
    assert np.array_equal(again.val, first.val)
    # One more record: another key, tokenized afresh, and the old entry removed.
    with sources["jsonl"].open("a") as handle:
        handle.write(json.dumps({"body": "one more record"}) + "\n")
    _, changed = load_node_corpus(config)
    assert "token cache" not in changed.description and changed.sha256 != first.sha256
    assert len(list((tmp_path / "run" / "token-cache").glob("*.json"))) == 1
    # A damaged cache is not trusted: its digest no longer matches, so the data is tokenized again.
    cached_train = next((tmp_path / "run" / "token-cache").glob("*.train.bin"))
    damaged = np.fromfile(cached_train, dtype=changed.train.dtype)
    damaged[0] += 1
    damaged.tofile(cached_train)
    _, reread = load_node_corpus(config)
    assert "token cache" not in reread.description and reread.sha256 == changed.sha256


def test_a_folder_of_record_shards_reads_every_file_in_path_order(tmp_path: Path) -> None:
    rows = texts()
    folder = tmp_path / "shards"
    folder.mkdir()
    import pyarrow.parquet as pq

    parts = {"a.jsonl": rows[:40], "b.parquet": rows[40:90], "c/d.jsonl": rows[90:]}
    for name, part in parts.items():
        (folder / name).parent.mkdir(exist_ok=True)
        if name.endswith(".jsonl"):
            (folder / name).write_text("".join(json.dumps({"body": text}) + "\n" for text in part))
        else:
            pq.write_table(pyarrow.table({"body": part}), folder / name)
    corpus = load_corpus(str(folder), val_fraction=VAL_FRACTION, text_field="body")
    train: list[int] = []
    val: list[int] = []
    for name, part in parts.items():
        for index, text in enumerate(part):
            if text:
                bucket = int.from_bytes(hashlib.sha256(f"{name}:{index}".encode()).digest(), "big") % 10_000
                (val if bucket < VAL_FRACTION * 10_000 else train).extend([*encode(text).tolist(), EOS])
    assert np.array_equal(corpus.train, np.array(train)) and np.array_equal(corpus.val, np.array(val))
