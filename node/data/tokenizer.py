"""How text becomes token ids: dtnode's byte tokens, or a Hugging Face ``tokenizer.json``.

Byte tokens
-----------
dtnode tokenizes at the byte level by default: token ids 0..255 are the raw bytes of the text, followed
by four specials (``BOS``, ``EOS``, ``PAD`` and one reserved id), so ``VOCAB_SIZE = 260``. A byte
tokenizer has no vocabulary file and no merges table, so there is nothing to download, nothing to
version and nothing for two peers to disagree about: the same bytes give the same ids on every machine.
The price is ~4x longer sequences than BPE, which is fine for the small models a CPU swarm trains.
Token streams are uint16 little-endian (nanoGPT's ``.bin`` layout); a vocabulary over 65,535 ids makes
them uint32 (:func:`token_dtype`).

Two tokenizers share one small interface (:class:`Tokenizer`):

* :class:`ByteTokenizer`, the default: ids 0..255 are a text's UTF-8 bytes, then the four specials
  above. No file, so nothing to version; its ``sha256`` is ``None``.
* :class:`HFTokenizer`: a ``tokenizer.json`` of the Hugging Face ``tokenizers`` library (``--tokenizer
  PATH``), e.g. the byte-level BPE that ``dtnode tokenizer train`` writes, or a Llama/GPT-2 one. Its
  ``sha256`` is the digest of the file's bytes: two peers tokenize alike iff their digests match, so
  the digest is folded into the corpus's identity (``Corpus.sha256``), which checkpoints and the swarm
  already compare (a resume or a joiner with another tokenizer is refused).

Every document ends with the tokenizer's end-of-text id, the separator the model learns to predict:
``EOS`` (257) for bytes, and for a ``tokenizer.json`` the first of :data:`EOS_CANDIDATES` in its
vocabulary.

Training (``dtnode tokenizer train``)
-------------------------------------
A byte-level BPE (Sennrich et al. 2016; the byte-level variant of GPT-2, Radford et al. 2019): text is
mapped to its UTF-8 bytes, each byte shown as one printable character, split at GPT-2's pre-tokenizer
boundaries (words, numbers, punctuation, whitespace runs), and the most frequent adjacent pair is merged
until the vocabulary has ``vocab_size`` entries. The 256 byte characters are always in the vocabulary,
so any text encodes, and decoding the ids gives the text back exactly. On the embedded corpus (~31 MB of
Python) a 4,096-token BPE trains in ~7 s on 2 cores. The command reads its text from any ``--data``
source (``node/data/documents.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

import numpy as np
import numpy.typing as npt

from node.config_layers import ConfigError
from node.data.documents import iter_texts

if TYPE_CHECKING:
    from tokenizers import Tokenizer as RustTokenizer

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


END_OF_TEXT: Final = "<|endoftext|>"
"""The special token ``dtnode tokenizer train`` adds, at id 0, as GPT-2 names it."""
EOS_CANDIDATES: Final = (END_OF_TEXT, "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
"""End-of-text tokens looked up, in this order, in a ``tokenizer.json``'s vocabulary."""


class Tokenizer(Protocol):
    """What the corpus, the sampler and the export need of a tokenizer."""

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def sha256(self) -> str | None: ...  # None for the byte tokenizer (no file)
    @property
    def path(self) -> Path | None: ...  # the tokenizer.json, if any

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[npt.NDArray[np.integer]]: ...
    def decode(self, ids: npt.ArrayLike) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 plus four specials (:func:`encode`, :func:`decode`)."""

    name = "dtnode-bytes-v1"
    vocab_size = VOCAB_SIZE
    eos_id = EOS
    sha256: str | None = None
    path: Path | None = None

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[npt.NDArray[np.integer]]:
        return [encode(text) for text in texts]

    def decode(self, ids: npt.ArrayLike) -> str:
        return decode(ids)


@dataclass(frozen=True)
class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (``tokenizers`` library); see the module docstring."""

    tokenizer: RustTokenizer
    path: Path
    sha256: str
    vocab_size: int
    eos_id: int
    name: str = "tokenizer.json"

    def encode_batch(self, texts: Sequence[str | bytes]) -> list[npt.NDArray[np.integer]]:
        strings = [
            text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text for text in texts
        ]
        dtype = token_dtype(self.vocab_size)
        # No special tokens added (no BOS): documents are separated by EOS alone, as with bytes.
        encodings = self.tokenizer.encode_batch_fast(strings, add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=dtype) for encoding in encodings]

    def decode(self, ids: npt.ArrayLike) -> str:
        flat = np.asarray(ids).reshape(-1)
        return str(self.tokenizer.decode([int(i) for i in flat], skip_special_tokens=True))


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """The byte tokenizer for ``None`` or ``""``; else the ``tokenizer.json`` at ``path`` (or in the
    folder ``path``). ``ValueError`` if it is missing, unreadable or has no end-of-text token."""
    if path is None or str(path) == "":
        return ByteTokenizer()
    source = Path(path)
    if source.is_dir():
        source = source / "tokenizer.json"
    if not source.is_file():
        raise ValueError(f"tokenizer file {str(source)!r} does not exist")
    try:
        from tokenizers import Tokenizer as RustTokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the tokenizers package: pip install 'dtnode[hf]'") from None
    try:
        tokenizer = RustTokenizer.from_file(str(source))
    except Exception as error:  # the Rust side raises a plain Exception on a malformed file
        raise ValueError(f"cannot read tokenizer {str(source)!r}: {error}") from None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    eos = next((vocab[token] for token in EOS_CANDIDATES if token in vocab), None)
    if eos is None:
        raise ValueError(
            f"tokenizer {str(source)!r} has none of the end-of-text tokens {', '.join(EOS_CANDIDATES)}"
        )
    return HFTokenizer(
        tokenizer=tokenizer,
        path=source,
        sha256=file_sha256(source),
        vocab_size=max(tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values()) + 1),
        eos_id=eos,
    )


def train_bpe(texts: Iterable[str], *, vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``texts``; write it to ``out`` (tokenizer.json)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    num_bytes = len(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for the bytes
    if vocab_size < num_bytes + 1:
        raise ValueError(f"vocab_size must be at least {num_bytes + 1} (the bytes and {END_OF_TEXT})")
    tokenizer = RustTokenizer(models.BPE())
    # No prefix space and no normaliser: decode(encode(text)) == text, byte for byte.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    tokenizer.save(str(tmp))
    os.replace(tmp, out)
    loaded = load_tokenizer(out)
    assert isinstance(loaded, HFTokenizer)
    return loaded


def _byte_characters() -> list[str]:
    """The printable character byte-level BPE shows for each byte 0..255 (GPT-2's convention): printable
    Latin-1 bytes stand for themselves, the others take the code points from 256 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    characters: list[str] = []
    extra = 0
    for byte in range(256):
        if byte in printable:
            characters.append(chr(byte))
        else:
            characters.append(chr(256 + extra))
            extra += 1
    return characters


BYTE_SPECIALS: Final = ("<|bos|>", END_OF_TEXT, "<|pad|>", "<|reserved|>")
"""Names of the byte tokenizer's ids 256..259 (BOS, EOS, PAD, reserved) in its ``tokenizer.json``."""


def write_byte_tokenizer_json(out: Path) -> Path:
    """A ``tokenizer.json`` that encodes text to dtnode's byte ids (256 byte tokens, no merges, then the
    four specials), so ``transformers.AutoTokenizer`` reads an export of a byte-token model."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {character: byte for byte, character in enumerate(_byte_characters())}
    tokenizer = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(BYTE_SPECIALS))  # ids 256..259, in this order
    assert [tokenizer.token_to_id(token) for token in BYTE_SPECIALS] == list(range(256, VOCAB_SIZE))
    tokenizer.save(str(out))
    return out


def add_tokenizer_command(commands: argparse._SubParsersAction[Any]) -> None:
    """``dtnode tokenizer train``: the parser of the ``tokenizer`` command."""
    tokenizer = commands.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer.json for --tokenizer",
        description="Tokenizer tools (node/data/tokenizer.py).",
    )
    actions = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    train = actions.add_parser(
        "train",
        help="train a byte-level BPE on a corpus (the embedded one by default)",
        description="Train a byte-level BPE of --vocab-size tokens (bytes + merges + <|endoftext|>) on "
        "--data (any source `dtnode join --data` reads; empty: the embedded corpus) and write it as a "
        "Hugging Face tokenizer.json to --out.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--vocab-size", type=int, required=True, help="tokens in the vocabulary (>= 257)")
    train.add_argument("--out", required=True, help="the tokenizer.json to write")
    train.add_argument("--data", default="", help="training text (empty: the embedded corpus)")
    train.add_argument("--text-field", default="text", help="text column of .jsonl/.parquet/datasets data")


def run_tokenizer(args: argparse.Namespace) -> int:
    """Train and write the tokenizer; a bad setting or source is one line on stderr and exit 2."""
    start = time.perf_counter()
    try:
        if args.data and not Path(args.data).exists():
            raise ValueError(f"data path does not exist: {args.data}")
        tokenizer = train_bpe(
            iter_texts(args.data or None, text_field=args.text_field),
            vocab_size=args.vocab_size,
            out=Path(args.out),
        )
    except ValueError as error:  # the CLI prints it as its one line (node/ops/cli_errors.py), exit 2
        raise ConfigError(str(error)) from None
    print(
        f"wrote {args.out}: a byte-level BPE of {tokenizer.vocab_size} tokens trained on "
        f"{args.data or 'the embedded corpus'} in {time.perf_counter() - start:.1f} s (sha256 "
        f"{tokenizer.sha256[:12]}); use it with --tokenizer {args.out}"
    )
    return 0
