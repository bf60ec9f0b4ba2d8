"""Tests of byte tokens and corpus loading, checked against hand-built expected streams."""

from __future__ import annotations

import hashlib
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from node.data.corpus import Corpus, load_corpus
from node.data.tokenizer import BOS, EOS, PAD, VOCAB_SIZE, decode, encode


def _documents(tokens: np.ndarray) -> list[bytes]:
    """Split a token stream at EOS into the documents' bytes (reference for the layout)."""
    ends = np.flatnonzero(tokens == EOS)
    assert ends.size and ends[-1] == tokens.size - 1, "stream must end with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[start:end].astype(np.uint8).tobytes() for start, end in zip(starts, ends, strict=True)]


def _goes_to_val(relative_path: str, val_fraction: float) -> bool:
    bucket = int(hashlib.sha256(relative_path.encode()).hexdigest(), 16) % 10_000
    return bucket < val_fraction * 10_000


# --- tokens ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld — 日本語 🚀\n\ttabs\x7f"])
def test_encode_decode_roundtrip(text: str) -> None:
    ids = encode(text)
    assert ids.dtype == np.uint16
    assert ids.tolist() == list(text.encode("utf-8"))
    assert decode(ids) == text
    assert np.array_equal(encode(text.encode("utf-8")), ids)


def test_decode_skips_specials_and_replaces_bad_utf8() -> None:
    ids = [BOS, ord("h"), EOS, ord("i"), PAD, 0xFF]  # 0xFF alone is not valid UTF-8
    assert decode(ids) == "hi\ufffd"
    assert decode(torch.tensor([ord("o"), EOS, ord("k")])) == "ok"
    assert VOCAB_SIZE == 260 and (BOS, EOS, PAD) == (256, 257, 258)
    with pytest.raises(ValueError, match="non-negative"):
        decode([-1])


# --- the default corpus ---------------------------------------------------------------------------


def test_stdlib_corpus_is_deterministic_and_splits_by_path() -> None:
    first, second = load_corpus(None), load_corpus(None)
    assert first.sha256 == second.sha256
    assert np.array_equal(first.train, second.train) and np.array_equal(first.val, second.val)
    assert first.vocab_size == VOCAB_SIZE and first.description.startswith("python-stdlib 3.")

    # Independent reference: rglob instead of os.walk, then the documented filter and split rule.
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        (path.relative_to(root).as_posix(), path)
        for path in root.rglob("*.py")
        if path.is_file() and not excluded & set(path.relative_to(root).parts)
    )
    contents = [(relative, path.read_bytes()) for relative, path in files]
    contents = [(relative, data) for relative, data in contents if data and b"\0" not in data]
    expected_val = [data for relative, data in contents if _goes_to_val(relative, 0.01)]
    expected_train = [data for relative, data in contents if not _goes_to_val(relative, 0.01)]

    assert expected_val, "the stdlib should put some files in val at 1%"
    assert _documents(first.val) == expected_val
    assert _documents(first.train) == expected_train
    assert first.num_documents == len(contents)
    assert first.val.dtype == first.train.dtype == np.uint16


def test_empty_string_means_default_corpus() -> None:
    assert load_corpus("").sha256 == load_corpus(None).sha256


# --- text files and folders -----------------------------------------------------------------------


def test_text_file_is_one_document_with_token_split(tmp_path: Path) -> None:
    text = "ünïcode line\n" * 100
    path = tmp_path / "input.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load_corpus(str(path), val_fraction=0.1)
    stream = np.concatenate([encode(text), np.array([EOS], dtype=np.uint16)])
    num_val = math.ceil(0.1 * stream.size)
    assert np.array_equal(corpus.train, stream[:-num_val])
    assert np.array_equal(corpus.val, stream[-num_val:])
    assert corpus.num_documents == 1 and corpus.vocab_size == VOCAB_SIZE


def test_folder_reads_text_files_in_path_order_and_skips_binary(tmp_path: Path) -> None:
    files = {f"doc{i:02d}.txt": f"document {i} ✓\n" * (i + 1) for i in range(20)}
    files["sub/deeper/nested.md"] = "# nested\n"
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text, encoding="utf-8")
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\0\0\x01")  # NUL bytes: binary, skipped
    (tmp_path / "empty.txt").write_bytes(b"")

    corpus = load_corpus(str(tmp_path), val_fraction=0.3)
    ordered = sorted(files)
    expected_val = [files[name].encode() for name in ordered if _goes_to_val(name, 0.3)]
    expected_train = [files[name].encode() for name in ordered if not _goes_to_val(name, 0.3)]
    assert expected_val and expected_train, "fixture should exercise both sides"
    assert _documents(corpus.val) == expected_val
    assert _documents(corpus.train) == expected_train
    assert corpus.num_documents == len(files)
    assert corpus.sha256 == load_corpus(str(tmp_path), val_fraction=0.3).sha256

    (tmp_path / "doc00.txt").write_text("changed", encoding="utf-8")
    assert load_corpus(str(tmp_path), val_fraction=0.3).sha256 != corpus.sha256


def test_folder_split_is_never_empty_on_either_side(tmp_path: Path) -> None:
    names = ["a.txt", "b.txt", "c.txt"]
    assert not any(_goes_to_val(name, 1e-4) for name in names), "precondition: nothing selected"
    for name in names:
        (tmp_path / name).write_text(name, encoding="utf-8")
    few = load_corpus(str(tmp_path), val_fraction=1e-4)
    assert _documents(few.val) == [b"c.txt"]  # nothing hashed into val: the last document goes there
    assert _documents(few.train) == [b"a.txt", b"b.txt"]

    assert all(_goes_to_val(name, 0.9999) for name in names), "precondition: everything selected"
    most = load_corpus(str(tmp_path), val_fraction=0.9999)
    assert _documents(most.train) == [b"a.txt"]  # everything hashed into val: the first comes back
    assert _documents(most.val) == [b"b.txt", b"c.txt"]


def test_hash_covers_the_split(tmp_path: Path) -> None:
    path = tmp_path / "input.txt"
    path.write_text("x" * 1000, encoding="utf-8")
    assert load_corpus(str(path), val_fraction=0.1).sha256 != load_corpus(str(path), val_fraction=0.2).sha256


# --- pre-tokenized .bin ---------------------------------------------------------------------------


def test_bin_file_is_memory_mapped_with_tail_validation(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=10_000).astype(np.uint16)
    tokens[1234] = 50_256  # GPT-2's end of text, the largest id in the file
    path = tmp_path / "train.bin"
    tokens.tofile(path)

    corpus = load_corpus(str(path), val_fraction=0.05)
    assert isinstance(corpus.train, np.memmap) and isinstance(corpus.val, np.memmap)
    assert np.array_equal(corpus.train, tokens[:9_500])
    assert np.array_equal(corpus.val, tokens[9_500:])
    assert corpus.vocab_size == 50_257
    assert corpus.num_documents == 1

    small = tmp_path / "small.bin"
    np.array([1, 2, 3, 255], dtype=np.uint16).tofile(small)
    assert load_corpus(str(small), val_fraction=0.5).vocab_size == VOCAB_SIZE


def test_same_tokens_from_text_and_bin_hash_equal(tmp_path: Path) -> None:
    text_path = tmp_path / "input.txt"
    text_path.write_text("same stream either way\n" * 50, encoding="utf-8")
    text_corpus: Corpus = load_corpus(str(text_path), val_fraction=0.1)
    bin_path = tmp_path / "input.bin"
    np.concatenate([text_corpus.train, text_corpus.val]).tofile(bin_path)
    assert load_corpus(str(bin_path), val_fraction=0.1).sha256 == text_corpus.sha256


# --- user mistakes --------------------------------------------------------------------------------


def test_bad_paths_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(str(tmp_path / "missing.txt"))
    with pytest.raises(ValueError, match="no non-empty text file"):
        load_corpus(str(tmp_path))  # empty folder
    (tmp_path / "blob.dat").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match="no non-empty text file"):
        load_corpus(str(tmp_path))  # only binary files
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(str(empty))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\1\2\3")
    with pytest.raises(ValueError, match="whole number"):
        load_corpus(str(odd))
    for bad_fraction in (0.0, 1.0, -0.5):
        with pytest.raises(ValueError, match="val_fraction"):
            load_corpus(str(odd), val_fraction=bad_fraction)
