"""The trained model as a file: ``RUN_DIR/model.safetensors`` and :func:`load_model`.

What is exported
----------------
In DiLoCo every node holds two copies of the parameters: its local replica, which drifts during the
H inner steps of a phase, and the *global* params, which the outer step moves and every member of a
round holds identically (same ``param_hash``; see ``node/outer/diloco.py``). The global params are the
swarm's model, so they are what a run exports, whether it stopped at ``--max-rounds`` or on SIGTERM
in the middle of a phase (the local progress since the last round is not part of the swarm's model).

Format
------
``model.safetensors`` holds the model's parameters keyed by their ``named_parameters`` names (a tied
weight once, as ``tok_embeddings.weight``), fp32, plus string metadata that is enough to rebuild the
model with no other file:

- ``format``: ``dtnode-gpt-v1``;
- ``preset`` and ``model_config``: the preset name and the full :class:`~node.model.gpt.ModelConfig` as
  JSON (the preset with the run's overrides, e.g. ``seq_len`` and ``vocab_size``);
- ``tokenizer``: JSON, ``{"name": "dtnode-bytes-v1", "vocab_size", "bos", "eos", "pad"}`` for text
  corpora (``node/data/tokenizer.py``), ``{"name": "token-ids", "vocab_size"}`` for a pre-tokenized ``.bin``;
- ``param_hash`` (SHA-256 of the params in canonical order, as in ``metrics.jsonl``), ``round``,
  ``step``, ``tokens``.

``model.json`` beside it repeats the metadata for people and scripts. Both files are written to a
temporary name and renamed into place, so a crash leaves the previous export or none.

``RUN_DIR/hf/`` holds the same parameters as a Hugging Face Llama checkpoint (``node/model/hf.py``):
``config.json`` and ``model.safetensors`` that ``transformers.AutoModelForCausalLM.from_pretrained``
loads, and ``tokenizer.json`` + ``tokenizer_config.json`` for ``AutoTokenizer``: the run's
``--tokenizer``, or for byte tokens a ``tokenizer.json`` that encodes text to the same byte ids
(``node/data/tokenizer.py``). A pre-tokenized ``.bin`` with no ``--tokenizer`` has no tokenizer files.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from node.data.tokenizer import BOS, EOS, PAD, write_byte_tokenizer_json
from node.model.gpt import GPT, ModelConfig
from node.model.hf import write_hf_folder
from node.outer.diloco import flatten_params
from node.outer.state import tensor_hash

if TYPE_CHECKING:
    from node.data.tokenizer import Tokenizer

MODEL_FILE = "model.safetensors"
MODEL_JSON = "model.json"
HF_FOLDER = "hf"
FORMAT = "dtnode-gpt-v1"
BYTE_TOKENIZER = "dtnode-bytes-v1"
HF_TOKENIZER = "tokenizer.json"


def tokenizer_info(data: str, vocab_size: int, tokenizer: Tokenizer | None = None) -> dict[str, Any]:
    """How text becomes the model's token ids: a ``tokenizer.json`` (``--tokenizer``: its digest, its
    end-of-text id and its path, copied into the ``hf/`` export), else bytes, unless the corpus was a
    pre-tokenized ``.bin``."""
    if tokenizer is not None and tokenizer.path is not None:
        return {
            "name": HF_TOKENIZER,
            "vocab_size": vocab_size,
            "eos": tokenizer.eos_id,
            "sha256": tokenizer.sha256,
            "path": str(tokenizer.path.resolve()),
        }
    if data and Path(data).suffix == ".bin":
        return {"name": "token-ids", "vocab_size": vocab_size}
    return {"name": BYTE_TOKENIZER, "vocab_size": vocab_size, "bos": BOS, "eos": EOS, "pad": PAD}


def named_global_params(model: GPT, global_params: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split DiLoCo's flat global params into the model's named parameters (CPU, fp32, contiguous).

    The flat vector is the concatenation of ``[p for p in model.parameters() if p.requires_grad]``
    (``DiLoCo.params``); ``named_parameters`` walks the same parameters in the same order.
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    num_elements = sum(p.numel() for _, p in named)
    if global_params.numel() != num_elements:
        raise ValueError(f"got {global_params.numel()} global params, the model has {num_elements}")
    flat = global_params.detach().to("cpu", torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    offset = 0
    for name, p in named:
        tensors[name] = flat[offset : offset + p.numel()].view(p.shape).clone()
        offset += p.numel()
    return tensors


def export_model(
    run_dir: Path,
    model: GPT,
    global_params: torch.Tensor,
    *,
    preset: str,
    tokenizer: dict[str, Any],
    round_index: int,
    step: int,
    tokens: int,
) -> Path:
    """Write ``run_dir/model.safetensors`` (+ ``model.json``) holding ``global_params``; return its path."""
    tensors = named_global_params(model, global_params)
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "preset": preset,
        "model_config": dataclasses.asdict(model.config),
        "tokenizer": tokenizer,
        "param_hash": tensor_hash(global_params),
        "round": round_index,
        "step": step,
        "tokens": tokens,
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MODEL_FILE
    tmp = run_dir / f"{MODEL_FILE}.tmp-{os.getpid()}"
    # safetensors metadata is str -> str: nested values as JSON, numbers as their decimal text.
    text_metadata = {
        key: value if isinstance(value, str) else json.dumps(value) for key, value in metadata.items()
    }
    save_file(tensors, str(tmp), metadata=text_metadata)
    os.replace(tmp, path)
    json_tmp = run_dir / f"{MODEL_JSON}.tmp-{os.getpid()}"
    json_tmp.write_text(json.dumps(metadata, indent=2) + "\n")
    os.replace(json_tmp, run_dir / MODEL_JSON)
    export_hf(run_dir / HF_FOLDER, model.config, tensors, tokenizer)
    return path


def export_hf(
    folder: Path, config: ModelConfig, tensors: dict[str, torch.Tensor], tokenizer: dict[str, Any]
) -> Path:
    """The Hugging Face folder of the export (see the module docstring)."""
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer_file: Path | None = None
        bos = pad = None
        eos = tokenizer.get("eos")
        if tokenizer["name"] == HF_TOKENIZER:
            tokenizer_file = Path(tokenizer["path"])
        elif tokenizer["name"] == BYTE_TOKENIZER and importlib.util.find_spec("tokenizers") is not None:
            # Without the hf extra the folder still loads in transformers, with no tokenizer files.
            tokenizer_file = write_byte_tokenizer_json(Path(scratch) / "tokenizer.json")
            bos, pad = BOS, PAD
        return write_hf_folder(
            folder, config, tensors, tokenizer_file=tokenizer_file, bos_id=bos, eos_id=eos, pad_id=pad
        )


def find_model_file(run_dir: Path) -> Path:
    """The export of a node's run dir, or of a ``dtnode swarm`` dir (its node-<i> with the newest step).

    Every member of a round holds the same global params, so in a swarm any node's export is the
    swarm's model; the one trained furthest is taken (ties: the lowest node index).
    """
    direct = run_dir / MODEL_FILE
    if direct.is_file():
        return direct
    candidates = sorted(run_dir.glob(f"node-*/{MODEL_FILE}"), key=lambda p: _node_index(p.parent))
    if not candidates:
        raise ValueError(f"no {MODEL_FILE} in {run_dir} or its node-<i>/ dirs: a run exports it when it ends")
    return max(candidates, key=lambda p: int(read_metadata(p)["step"]))  # max keeps the first of ties


def _node_index(node_dir: Path) -> int:
    suffix = node_dir.name.removeprefix("node-")
    return int(suffix) if suffix.isdigit() else 1 << 30


def read_metadata(path: Path) -> dict[str, Any]:
    """The metadata of an exported model file, JSON values decoded."""
    with safe_open(str(path), framework="pt") as handle:
        raw = handle.metadata() or {}
    if raw.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dtnode model export (format {raw.get('format')!r})")
    text_keys = ("format", "preset", "param_hash")
    return {key: value if key in text_keys else json.loads(value) for key, value in raw.items()}


def load_model(run_dir: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> GPT:
    """The model a run exported (see :func:`find_model_file`), in eval mode on ``device``.

    The loaded parameters are checked against the export's ``param_hash``; the export's metadata
    (tokenizer, round, step …) is ``read_metadata(find_model_file(run_dir))``.
    """
    path = find_model_file(Path(run_dir))
    metadata = read_metadata(path)
    config = ModelConfig(**metadata["model_config"])
    model = GPT(config)
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # A tied output projection is the embedding matrix itself: exported once, under the embedding's name.
    tied = {"output.weight"} if config.tie_embeddings else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{path} does not fit its model config: missing {missing}, unexpected {unexpected}")
    params = [p for p in model.parameters() if p.requires_grad]
    if tensor_hash(flatten_params(params, device="cpu")) != metadata["param_hash"]:
        raise ValueError(f"{path}: the parameters do not match the export's param_hash")
    return model.to(device).eval()
