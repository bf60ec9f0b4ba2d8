"""Hugging Face Llama checkpoints: dtnode's GPT equals ``transformers``' ``LlamaForCausalLM``.

The reference is ``transformers``' own implementation, run on the same weights: a random small Llama
(GQA: 4 query heads over 2 key/value heads) saved by ``save_pretrained`` and read by ``--init-from``'s
code path (import), and a dtnode GPT written as an HF folder and read by
``AutoModelForCausalLM.from_pretrained`` (export). Both are fp32 on CPU; the only differences left are
the summation order of the two attention implementations and of RoPE's cos/sin (float64 vs float32
angles), ~1e-6, so logits must agree within 1e-4. A wrong RoPE permutation or a swapped projection
gives errors of order 1 (the check ``test_an_unpermuted_checkpoint_differs`` makes that visible).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from node.model.gpt import GPT, ModelConfig
from node.model.hf import from_hf_state, load_hf_checkpoint, read_hf_config, read_hf_weights, write_hf_folder

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
SEQ_LEN = 24


def llama_config(*, tie: bool) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tie,
        initializer_range=0.05,
    )


def random_tokens(vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


@pytest.mark.parametrize("tie", [False, True])
def test_import_an_hf_checkpoint_gives_the_same_logits(tmp_path: Path, tie: bool) -> None:
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(llama_config(tie=tie)).eval()
    reference.save_pretrained(tmp_path)
    config = read_hf_config(tmp_path)
    assert (config.dim, config.num_layers, config.num_heads, config.num_kv_heads) == (64, 2, 4, 2)
    assert (config.mlp_hidden_dim, config.vocab_size, config.seq_len) == (112, 301, 64)
    assert (config.rope_theta, config.norm_eps, config.tie_embeddings) == (5000.0, 1e-5, tie)
    model = GPT(config).eval()
    model.load_state_dict(load_hf_checkpoint(tmp_path, config))
    tokens = random_tokens(config.vocab_size)
    with torch.no_grad():
        ours = model(tokens)
    expected = hf_logits(reference, tokens)
    assert expected.abs().max() > 0.1  # real logits, not a degenerate all-zero model
    torch.testing.assert_close(ours, expected, rtol=0.0, atol=TOLERANCE)


def test_an_unpermuted_checkpoint_differs(tmp_path: Path) -> None:
    """The RoPE row permutation matters: loading q/k rows as they are gives other logits."""
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(llama_config(tie=False)).eval()
    reference.save_pretrained(tmp_path)
    config = read_hf_config(tmp_path)
    raw = read_hf_weights(tmp_path)
    state = from_hf_state(config, raw)
    for name in state:
        if name.endswith(("wq.weight", "wk.weight")):
            layer = name.split(".")[1]
            projection = "q_proj" if "wq" in name else "k_proj"
            state[name] = raw[f"model.layers.{layer}.self_attn.{projection}.weight"]
    model = GPT(config).eval()
    model.load_state_dict(state)
    tokens = random_tokens(config.vocab_size)
    with torch.no_grad():
        error = (model(tokens) - hf_logits(reference, tokens)).abs().max()
    assert error > 100 * TOLERANCE


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path: Path, tie: bool) -> None:
    config = ModelConfig(
        vocab_size=300, seq_len=48, dim=64, num_layers=2, num_heads=4, num_kv_heads=2,
        mlp_hidden_dim=96, rope_theta=20000.0, norm_eps=1e-6, tie_embeddings=tie, init_std=0.05,
    )  # fmt: skip
    torch.manual_seed(2)
    model = GPT(config).eval()
    with torch.no_grad():  # norm gains away from 1, so a misplaced norm weight shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    write_hf_folder(
        tmp_path / "hf",
        config,
        model.state_dict(),
        tokenizer_file=None,
        bos_id=None,
        eos_id=None,
        pad_id=None,
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    tokens = random_tokens(config.vocab_size, seed=3)
    with torch.no_grad():
        ours = model(tokens)
    torch.testing.assert_close(hf_logits(loaded, tokens), ours, rtol=0.0, atol=TOLERANCE)
    # And back: reading the export reproduces the model's own parameters exactly.
    again = from_hf_state(read_hf_config(tmp_path / "hf"), read_hf_weights(tmp_path / "hf"))
    for name, tensor in model.state_dict().items():
        assert torch.equal(again[name], tensor), name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"attention_bias": True}, "biases"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE scaling"),
        ({"head_dim": 32}, "head_dim"),
    ],
)
def test_unsupported_configs_are_refused(tmp_path: Path, change: dict[str, object], message: str) -> None:
    raw = llama_config(tie=False).to_dict()
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        read_hf_config(tmp_path / "config.json")
