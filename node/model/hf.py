"""Hugging Face Llama checkpoints in and out: ``--model-config``, ``--init-from`` and the ``hf/`` export.

dtnode's ``GPT`` (``node/model/gpt.py``) is a Llama: pre-norm RMSNorm blocks, RoPE, SwiGLU, optional GQA,
no biases. So a Llama-family ``config.json`` maps onto :class:`~node.model.gpt.ModelConfig` field by field,
and the weights map name by name:

    HF LlamaForCausalLM                          dtnode GPT
    model.embed_tokens.weight                    tok_embeddings.weight
    model.layers.i.input_layernorm.weight        layers.i.attention_norm.weight
    model.layers.i.self_attn.{q,k,v,o}_proj      layers.i.attention.{wq,wk,wv,wo}
    model.layers.i.post_attention_layernorm      layers.i.ffn_norm
    model.layers.i.mlp.{gate,up,down}_proj       layers.i.feed_forward.{w1,w3,w2}
    model.norm.weight / lm_head.weight           norm.weight / output.weight (absent when tied)

One difference is the RoPE channel order. dtnode rotates adjacent pairs ``(x[2i], x[2i+1])`` of a head
(the original Llama release's layout); Hugging Face rotates ``(x[i], x[i + D/2])`` ("rotate_half").
Both rotate pair ``i`` by ``t * theta**(-2i/D)``, so the models are equal once the rows of ``wq`` and
``wk`` are permuted inside each head: dtnode row ``2i + j`` is HF row ``j * D/2 + i`` (the permutation
of Hugging Face's own Llama conversion script). Attention scores ``q . k`` are unchanged because q and k
are permuted alike, and ``wv``/``wo`` are untouched.

Supported: ``model_type`` llama or mistral (no sliding window), SiLU, no attention/MLP biases, default
RoPE (no scaling), ``head_dim == hidden_size / num_attention_heads``. Anything else is refused
(``ValueError``) rather than silently trained as something it is not.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Final

import torch
from safetensors.torch import load_file, save_file

from node.config import ConfigError, NodeConfig
from node.model.gpt import ModelConfig
from node.model.gpt import model_config as preset_config

CONFIG_FILE: Final = "config.json"
WEIGHTS_FILE: Final = "model.safetensors"
SUPPORTED_MODEL_TYPES: Final = ("llama", "mistral")


def config_path(path: str | os.PathLike[str]) -> Path:
    """``path`` itself if it is a file, else its ``config.json``."""
    source = Path(path)
    return source / CONFIG_FILE if source.is_dir() else source


def read_hf_config(path: str | os.PathLike[str], *, seq_len: int = 0) -> ModelConfig:
    """The :class:`ModelConfig` of a Llama-family ``config.json`` (``seq_len`` 0: its max positions)."""
    source = config_path(path)
    try:
        raw: dict[str, Any] = json.loads(source.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read the model config {str(source)!r}: {error}") from None

    def need(key: str) -> Any:
        if key not in raw:
            raise ValueError(f"{source}: no {key!r}")
        return raw[key]

    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    refusals = {
        "hidden_act": (raw.get("hidden_act", "silu") != "silu", "only silu (SwiGLU) is supported"),
        "attention_bias": (bool(raw.get("attention_bias")), "attention biases are not supported"),
        "mlp_bias": (bool(raw.get("mlp_bias")), "MLP biases are not supported"),
        "sliding_window": (
            raw.get("sliding_window") is not None,
            "sliding-window attention is not supported",
        ),
    }
    for key, (refused, reason) in refusals.items():
        if refused:
            raise ValueError(f"{source}: {key} = {raw[key]!r}: {reason}")
    rope = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling")
    if (scaling and scaling.get("rope_type", scaling.get("type")) != "default") or rope.get(
        "rope_type", "default"
    ) != "default":
        raise ValueError(f"{source}: RoPE scaling is not supported ({scaling or rope})")
    dim, num_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) * num_heads != dim:
        raise ValueError(f"{source}: head_dim {head_dim} != hidden_size / num_attention_heads")
    return ModelConfig(
        vocab_size=int(need("vocab_size")),
        seq_len=seq_len or int(need("max_position_embeddings")),
        dim=dim,
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        mlp_hidden_dim=int(need("intermediate_size")),
        rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
        norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        init_std=float(raw.get("initializer_range", 0.02)),
    )


def hf_config_dict(
    config: ModelConfig, *, bos_id: int | None, eos_id: int | None, pad_id: int | None
) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``GPT(config)``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.resolved_mlp_hidden_dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.resolved_num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,  # transformers < 5 reads this
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # transformers >= 5
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": config.init_std,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _rope_rows_to_hf(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection, adjacent RoPE pairs per head -> halves per head: (H*D, C) -> (H*D, C)."""
    rows, columns = weight.shape
    return weight.reshape(rows // head_dim, head_dim // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def _rope_rows_from_hf(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of :func:`_rope_rows_to_hf`."""
    rows, columns = weight.shape
    return weight.reshape(rows // head_dim, 2, head_dim // 2, columns).transpose(1, 2).reshape(rows, columns)


_LAYER_NAMES: Final = {  # dtnode name inside layers.i -> HF name inside model.layers.i
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_ROPE_PERMUTED: Final = ("attention.wq.weight", "attention.wk.weight")


def to_hf_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """dtnode parameter names and layouts -> ``LlamaForCausalLM``'s (``lm_head`` omitted when tied)."""
    out = {
        "model.embed_tokens.weight": state["tok_embeddings.weight"],
        "model.norm.weight": state["norm.weight"],
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["output.weight"]
    for layer in range(config.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            tensor = state[f"layers.{layer}.{ours}"]
            if ours in _ROPE_PERMUTED:
                tensor = _rope_rows_to_hf(tensor, config.head_dim)
            out[f"model.layers.{layer}.{theirs}"] = tensor
    return {name: tensor.detach().to("cpu", torch.float32).contiguous() for name, tensor in out.items()}


def from_hf_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``LlamaForCausalLM`` names and layouts -> a full ``GPT(config).state_dict()`` (fp32)."""

    def get(name: str) -> torch.Tensor:
        for candidate in (name, name.removeprefix("model.")):  # a bare LlamaModel has no "model." prefix
            if candidate in state:
                return state[candidate].to(torch.float32)
        raise ValueError(f"the checkpoint has no {name!r}")

    out = {"tok_embeddings.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if config.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    else:
        out["output.weight"] = get("lm_head.weight")
    for layer in range(config.num_layers):
        for ours, theirs in _LAYER_NAMES.items():
            tensor = get(f"model.layers.{layer}.{theirs}")
            if ours in _ROPE_PERMUTED:
                tensor = _rope_rows_from_hf(tensor, config.head_dim)
            out[f"layers.{layer}.{ours}"] = tensor
    return out


def read_hf_weights(folder: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's ``model.safetensors`` or its shards (``*.safetensors``)."""
    root = Path(folder)
    single = root / WEIGHTS_FILE
    files = [single] if single.is_file() else sorted(root.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {str(root)!r}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    return state


def load_hf_checkpoint(folder: str | os.PathLike[str], config: ModelConfig) -> dict[str, torch.Tensor]:
    """``--init-from``: the folder's weights as a ``GPT(config)`` state dict, shapes checked."""
    from node.model.gpt import GPT

    state = from_hf_state(config, read_hf_weights(folder))
    with torch.device("meta"):
        expected = GPT(config).state_dict()
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise ValueError(
                f"{folder}: {name} has shape {tuple(state[name].shape)}, the model needs {tuple(tensor.shape)}"
            )
    return state


def write_hf_folder(
    folder: Path,
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    tokenizer_file: Path | None,
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None,
) -> Path:
    """Write a folder ``transformers.AutoModelForCausalLM.from_pretrained`` loads, with ``AutoTokenizer``'s
    files if ``tokenizer_file`` (a ``tokenizer.json``) is given; built beside and renamed into place."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf_config = hf_config_dict(config, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    (tmp / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(to_hf_state(config, state), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        (tmp / "tokenizer_config.json").write_text(
            json.dumps(tokenizer_config(tokenizer_file, config.seq_len), indent=2) + "\n"
        )
    if folder.exists():
        old = folder.with_name(f"{folder.name}.old-{os.getpid()}")
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old)
    else:
        os.replace(tmp, folder)
    return folder


def tokenizer_config(tokenizer_file: Path, seq_len: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for a ``tokenizer.json``: the fast tokenizer class and its specials."""
    from node.data.tokenizer import EOS_CANDIDATES

    vocab = json.loads(tokenizer_file.read_text()).get("added_tokens", [])
    specials = [token["content"] for token in vocab if token.get("special")]

    def first(candidates: tuple[str, ...]) -> str | None:
        return next((token for token in candidates if token in specials), None)

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_len,
        "eos_token": first(EOS_CANDIDATES),
        "bos_token": first(("<|bos|>", "<s>", "<|begin_of_text|>", "<bos>")),
        "pad_token": first(("<|pad|>", "<pad>")),
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }


def node_model_config(config: NodeConfig, corpus_vocab_size: int) -> ModelConfig | None:
    """The model of ``--model-config`` (else ``--init-from``'s ``config.json``), or None: the preset's.

    ``--seq-len`` overrides the config's ``max_position_embeddings``; the vocabulary must cover the
    corpus's ids (a tokenizer larger than the model's embedding is a user mistake).
    """
    source = config.architecture.hf_config or config.architecture.init_from
    if not source:
        return None
    try:
        model_config = read_hf_config(source, seq_len=config.architecture.seq_len)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if model_config.vocab_size < corpus_vocab_size:
        raise ConfigError(
            f"{config_path(source)}: vocab_size {model_config.vocab_size} is smaller than the data's "
            f"{corpus_vocab_size} token ids (see --tokenizer)"
        )
    return model_config


def node_model(config: NodeConfig, corpus_vocab_size: int) -> ModelConfig:
    """The model the node trains: :func:`node_model_config`'s, else ``--model``'s preset sized to the
    corpus's vocabulary (and ``--seq-len``)."""
    overrides: dict[str, Any] = {"vocab_size": corpus_vocab_size}
    if config.architecture.seq_len:
        overrides["seq_len"] = config.architecture.seq_len
    return node_model_config(config, corpus_vocab_size) or preset_config(
        config.architecture.preset, **overrides
    )


def init_state(config: NodeConfig, model_config: ModelConfig) -> dict[str, torch.Tensor] | None:
    """``--init-from``'s weights for ``GPT(model_config)``, or None when the run starts from random."""
    if not config.architecture.init_from:
        return None
    try:
        return load_hf_checkpoint(config.architecture.init_from, model_config)
    except ValueError as error:
        raise ConfigError(f"--init-from: {error}") from None
