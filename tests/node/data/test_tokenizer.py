"""Tokenizers: ``dtnode tokenizer train`` round-trips the embedded corpus; another tokenizer is another
corpus (a resume with it exits 2 in one line, a joiner's check refuses it); wide vocabularies use uint32.

References are independent of the code under test: the embedded corpus's documents read straight from
the stdlib folder, a word-level ``tokenizer.json`` built by hand with a known id per word, and the byte
ids of ``node.data.tokenizer.encode``.
"""

from __future__ import annotations

import inspect
import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from node.data.corpus import load_corpus
from node.data.documents import read_documents, stdlib_files
from node.data.tokenizer import EOS, ByteTokenizer, encode, load_tokenizer, write_byte_tokenizer_json
from node.ops.cli import main
from node.swarm.state import adopted_state
from node.train.trainer import Trainer
from tests.node.run_support import write_corpus
from tests.node.train.test_trainer import small_config

tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def train_cli(out: Path, vocab_size: int, data: Path | None = None) -> Path:
    argv = ["tokenizer", "train", "--vocab-size", str(vocab_size), "--out", str(out)]
    assert main(argv + (["--data", str(data)] if data else [])) == 0
    return out


@pytest.mark.timeout(240)
def test_a_trained_bpe_round_trips_the_embedded_corpus(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(train_cli(tmp_path / "tokenizer.json", 1024))
    assert tokenizer.vocab_size == 1024 and tokenizer.eos_id == 0  # <|endoftext|> first
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = read_documents(root, stdlib_files(root))
    assert len(documents) > 1000  # the whole embedded corpus, not a sample
    texts = [data.decode("utf-8", errors="replace") for _, data in documents]
    num_tokens = 0
    for start in range(0, len(texts), 256):
        batch = texts[start : start + 256]
        for text, ids in zip(batch, tokenizer.encode_batch(batch), strict=True):
            assert tokenizer.decode(ids) == text
            num_tokens += ids.size
    # A real BPE: merges make far fewer tokens than bytes.
    assert num_tokens < 0.5 * sum(len(data) for _, data in documents)


def word_level_tokenizer(path: Path, vocab_size: int) -> Path:
    """A tokenizer.json mapping word ``w{i}`` to id ``i`` (and ``<|endoftext|>`` to the last id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 1)} | {"<|endoftext|>": vocab_size - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def test_a_vocabulary_over_65535_makes_uint32_streams(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(word_level_tokenizer(tmp_path / "wide.json", 70_000))
    lines = [" ".join(f"w{(i * 7919 + j * 104_729) % 69_999}" for j in range(50)) for i in range(40)]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": line}) + "\n" for line in lines))
    corpus = load_corpus(str(data), val_fraction=0.1, tokenizer=tokenizer)
    assert corpus.train.dtype == np.dtype("<u4") and corpus.vocab_size == 70_000
    assert int(corpus.train.max()) > 65_535  # ids that uint16 would have wrapped
    # Every document is its words' ids and the end-of-text id, whichever side it went to.
    expected = {tuple([int(word[1:]) for word in line.split()] + [69_999]) for line in lines}
    streams = np.concatenate([corpus.train, corpus.val])
    ends = np.flatnonzero(streams == 69_999)
    found = {
        tuple(int(i) for i in streams[a + 1 : b + 1]) for a, b in zip([-1, *ends[:-1]], ends, strict=True)
    }
    assert found == expected
    # A .bin of the same ids is read as uint32 with this tokenizer.
    token_file = tmp_path / "ids.bin"
    streams.astype("<u4").tofile(token_file)
    from_file = load_corpus(str(token_file), val_fraction=0.1, tokenizer=tokenizer)
    assert from_file.train.dtype == np.dtype("<u4")
    assert np.array_equal(np.concatenate([from_file.train, from_file.val]), streams)


def test_the_byte_tokenizer_json_gives_byte_ids(tmp_path: Path) -> None:
    text = "héllo\twörld ✓ 😀\n  def f(): return 0\n"
    as_json = load_tokenizer(write_byte_tokenizer_json(tmp_path / "bytes.json"))
    ids = as_json.encode_batch([text])[0]
    assert np.array_equal(ids, encode(text)) and as_json.eos_id == EOS == ByteTokenizer.eos_id
    assert as_json.decode(ids) == text


def test_the_tokenizer_is_part_of_the_corpus_identity(corpus_file: Path, tmp_path: Path) -> None:
    first = load_tokenizer(train_cli(tmp_path / "a.json", 300, corpus_file))
    second = load_tokenizer(train_cli(tmp_path / "b.json", 320, corpus_file))
    digests = {
        load_corpus(str(corpus_file), tokenizer=tokenizer).sha256 for tokenizer in (None, first, second)
    }
    assert len(digests) == 3
    # The byte corpus keeps its digest whether the byte tokenizer is named or not.
    assert (
        load_corpus(str(corpus_file), tokenizer=ByteTokenizer()).sha256
        == load_corpus(str(corpus_file)).sha256
    )


@pytest.mark.timeout(120)
def test_a_resume_or_a_joiner_with_another_tokenizer_is_refused(
    corpus_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two tokenizers of one size (so one model shape) trained on different text.
    other_text = tmp_path / "other.txt"
    other_text.write_text(inspect.getsource(os) * 2)
    first = train_cli(tmp_path / "a.json", 300, corpus_file)
    second = train_cli(tmp_path / "b.json", 300, other_text)
    run_dir = tmp_path / "run"
    argv = [
        "join", "--no-swarm", "--model", "nano", "--seq-len", "32", "--batch-size", "4", "--inner-steps", "2",
        "--max-rounds", "1", "--eval-batches", "1", "--data", str(corpus_file), "--run-dir", str(run_dir),
        "--device", "cpu",
    ]  # fmt: skip
    assert main([*argv, "--tokenizer", str(first)]) == 0
    assert "tokenizer_sha256 = " in (run_dir / "corpus.txt").read_text()
    capsys.readouterr()
    assert main([*argv, "--max-rounds", "2", "--tokenizer", str(second)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("dtnode join: error: --tokenizer: ") and "\n" not in error

    # A joiner: the swarm's state (trained with the first tokenizer) does not fit the second's corpus.
    source = Trainer(small_config(corpus_file, tmp_path / "source", tokenizer=str(first), swarm=False))
    joiner = Trainer(small_config(corpus_file, tmp_path / "joiner", tokenizer=str(second), swarm=False))
    assert (
        joiner.diloco.num_elements == source.diloco.num_elements
    )  # the same model: only the tokenizer differs
    with pytest.raises(ValueError, match="--tokenizer"):
        adopted_state(
            source.round.snapshot(),
            num_elements=joiner.diloco.num_elements,
            corpus_sha256=joiner.corpus.sha256,
        )


def test_tokenizer_train_mistakes_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tokenizer", "train", "--vocab-size", "100", "--out", str(tmp_path / "t.json")]) == 2
    assert main(["tokenizer", "train", "--vocab-size", "300", "--out", str(tmp_path / "t.json"),
                 "--data", str(tmp_path / "missing.jsonl")]) == 2  # fmt: skip
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(line.startswith("dtnode tokenizer: error: ") for line in errors)
    assert not (tmp_path / "t.json").exists()
