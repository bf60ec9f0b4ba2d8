"""A run on the user's own tokenizer, data and model config ends in an export ``transformers`` loads;
``--init-from`` starts a run from such a checkpoint.

References: ``transformers``' ``LlamaForCausalLM`` and ``AutoTokenizer`` on the export folder, against
dtnode's own ``load_model`` and tokenizer; and the exported weights themselves for ``--init-from``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import node
from node.data.tokenizer import encode, load_tokenizer, train_bpe
from node.model.export import HF_FOLDER
from node.outer.diloco import flatten_params
from node.outer.state import tensor_hash
from node.train.trainer import Trainer
from tests.node.run_support import one_torch_thread
from tests.node.train.test_trainer import small_config

transformers = pytest.importorskip("transformers")

HF_CONFIG = {
    "model_type": "llama",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def user_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import inspect

    root = tmp_path_factory.mktemp("user")
    texts = [inspect.getsource(module) for module in (inspect, json, np.lib)]
    texts = [part for text in texts for part in text.split("\n\n\n") if part.strip()]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    train_bpe(iter(texts), vocab_size=300, out=root / "tokenizer.json")
    (root / "config.json").write_text(json.dumps(HF_CONFIG))
    return {"data": data, "tokenizer": root / "tokenizer.json", "config": root / "config.json", "root": root}


def params_of(model: torch.nn.Module) -> torch.Tensor:
    return flatten_params([p for p in model.parameters() if p.requires_grad], device="cpu")


@pytest.mark.timeout(180)
def test_a_run_on_own_tokenizer_data_and_config_exports_for_transformers(user_files: dict[str, Path]) -> None:
    run_dir = user_files["root"] / "run"
    config = small_config(
        user_files["data"], run_dir, max_rounds=2, swarm=False, seq_len=0,
        tokenizer=str(user_files["tokenizer"]), model_config=str(user_files["config"]),
    )  # fmt: skip
    with one_torch_thread():
        trainer = Trainer(config)
        assert trainer.model_config.seq_len == 64 and trainer.model_config.num_kv_heads == 2
        assert trainer.model_config.vocab_size == 320 and trainer.corpus.tokenizer_sha256 is not None
        trainer.run()
    folder = run_dir / HF_FOLDER
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ours = load_tokenizer(user_files["tokenizer"])
    text = "def f(x):\n    return x  # é"
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode_batch([text])[0].tolist() and hf_tokenizer.decode(ids) == text
    assert hf_tokenizer.eos_token_id == ours.eos_id
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = node.load_model(run_dir)(tokens)
        torch.testing.assert_close(model(input_ids=tokens).logits, expected, rtol=0.0, atol=1e-4)

    # --init-from the export: the new run's global params are the exported ones.
    again = Trainer(small_config(user_files["data"], user_files["root"] / "again", swarm=False, seq_len=0,
                                 tokenizer=str(user_files["tokenizer"]), init_from=str(folder)))  # fmt: skip
    exported = params_of(node.load_model(run_dir))
    assert tensor_hash(again.diloco.global_params.cpu()) == tensor_hash(exported)
    assert torch.equal(params_of(again.model), exported)


@pytest.mark.timeout(120)
def test_a_byte_token_export_has_a_byte_tokenizer(tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text("héllo wörld, " * 400)
    with one_torch_thread():
        Trainer(small_config(corpus, tmp_path / "run", max_rounds=1, swarm=False)).run()
    folder = tmp_path / "run" / HF_FOLDER
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    text = "naïve ✓ text\n"
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == encode(text).tolist()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.from_numpy(encode(text).astype(np.int64))[None]
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=tokens).logits, node.load_model(tmp_path / "run")(tokens), rtol=0.0, atol=1e-4
        )
