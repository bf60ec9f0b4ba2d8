"""The trained model as a file: a run exports its global params, load_model gives the same outputs,
sampling is deterministic under a seed and greedy sampling is the argmax of the model's logits."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import node
from node.model.export import MODEL_FILE, export_model, find_model_file, read_metadata
from node.model.gpt import GPT, model_config
from node.model.sample import generate, sample_text
from node.ops.cli import main
from node.ops.metrics import read_metrics
from node.outer.diloco import flatten_params
from node.outer.state import tensor_hash
from node.train.trainer import Trainer
from tests.node.run_support import one_torch_thread, train_short_run, write_corpus
from tests.node.train.test_trainer import small_config

# One xdist worker takes the whole module: its tests share a trained run (a module fixture).
pytestmark = pytest.mark.xdist_group("node.test_export")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Token-by-token sampling is many tiny forwards: one thread is faster, and kinder to a busy machine."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def trained(corpus_file: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path]:
    """Two rounds of H=3 on the nano preset (a few seconds)."""
    run_dir = tmp_path_factory.mktemp("run")
    return train_short_run(corpus_file, run_dir), run_dir


def params_of(model: torch.nn.Module) -> torch.Tensor:
    return flatten_params([p for p in model.parameters() if p.requires_grad], device="cpu")


def tokens(seed: int, vocab_size: int = 260, shape: tuple[int, int] = (3, 32)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.timeout(60)
def test_export_then_load_gives_identical_logits(trained: tuple[Trainer, Path]) -> None:
    trainer, run_dir = trained
    # The run ended on a round boundary: the in-memory model holds the global params.
    assert torch.equal(params_of(trainer.model), trainer.diloco.global_params.cpu())
    loaded = node.load_model(run_dir)
    assert not loaded.training and loaded is not trainer.model
    trainer.model.eval()
    x = tokens(0)
    with torch.no_grad():
        assert torch.equal(loaded(x), trainer.model(x))
    metadata = read_metadata(run_dir / MODEL_FILE)
    last_round = read_metrics(run_dir / "metrics.jsonl", "round")[-1]
    assert metadata["param_hash"] == last_round["param_hash"] == tensor_hash(params_of(loaded))
    assert (metadata["round"], metadata["step"], metadata["preset"]) == (2, 6, "nano")
    assert metadata["model_config"]["seq_len"] == 32 and metadata["tokenizer"]["name"] == "dtnode-bytes-v1"
    assert (run_dir / "model.json").is_file()


@pytest.mark.timeout(60)
def test_a_run_stopped_mid_phase_exports_the_global_params(corpus_file: Path, tmp_path: Path) -> None:
    # H=3 and a stop after step 4: the local replica is one step past round 1's global params.
    trainer = Trainer(small_config(corpus_file, tmp_path, max_steps=4, swarm=False))
    trainer.run()
    loaded = node.load_model(tmp_path)
    round_1 = read_metrics(tmp_path / "metrics.jsonl", "round")[-1]
    assert round_1["round"] == 1 and tensor_hash(params_of(loaded)) == round_1["param_hash"]
    assert not torch.equal(params_of(trainer.model), params_of(loaded))  # not the local replica
    trainer.diloco.load_global_into_model()  # reference: the trainer's model on its global params
    trainer.model.eval()
    x = tokens(1)
    with torch.no_grad():
        assert torch.equal(loaded(x), trainer.model(x))


@pytest.mark.timeout(60)
def test_a_swarm_dir_loads_the_node_trained_furthest(trained: tuple[Trainer, Path], tmp_path: Path) -> None:
    _, run_dir = trained
    with pytest.raises(ValueError, match="no model.safetensors"):
        find_model_file(tmp_path)
    (tmp_path / "node-0").mkdir()
    shutil.copy(run_dir / MODEL_FILE, tmp_path / "node-0" / MODEL_FILE)
    # node-1 holds an earlier export (step 3): node-0's, at step 6, is the one loaded.
    early = GPT(model_config("nano", seq_len=32))
    export_model(
        tmp_path / "node-1", early, params_of(early), preset="nano",
        tokenizer={"name": "dtnode-bytes-v1"}, round_index=1, step=3, tokens=1,
    )  # fmt: skip
    assert find_model_file(tmp_path) == tmp_path / "node-0" / MODEL_FILE
    assert (
        tensor_hash(params_of(node.load_model(tmp_path))) == read_metadata(run_dir / MODEL_FILE)["param_hash"]
    )


@pytest.mark.timeout(60)
def test_tied_embeddings_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = GPT(model_config("nano", seq_len=16, tie_embeddings=True)).eval()
    export_model(
        tmp_path, model, params_of(model), preset="nano", tokenizer={"name": "dtnode-bytes-v1"},
        round_index=0, step=0, tokens=0,
    )  # fmt: skip
    loaded = node.load_model(tmp_path)
    assert loaded.output is not None and loaded.tok_embeddings is not None
    assert loaded.output.weight is loaded.tok_embeddings.weight  # still one matrix
    x = tokens(2, shape=(2, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.timeout(60)
def test_a_tampered_export_is_refused(trained: tuple[Trainer, Path], tmp_path: Path) -> None:
    _, run_dir = trained
    with safe_open(str(run_dir / MODEL_FILE), framework="pt") as handle:
        raw_metadata = handle.metadata()
    tensors = load_file(str(run_dir / MODEL_FILE))
    tensors["norm.weight"][0] += 1.0  # one parameter changed, the recorded param_hash kept
    save_file(tensors, str(tmp_path / MODEL_FILE), metadata=raw_metadata)
    with pytest.raises(ValueError, match="param_hash"):
        node.load_model(tmp_path)


@pytest.mark.timeout(60)
def test_sampling_is_deterministic_under_a_seed(trained: tuple[Trainer, Path]) -> None:
    _, run_dir = trained
    first = sample_text(run_dir, "def ", max_new_tokens=30, seed=7)
    assert first == sample_text(run_dir, "def ", max_new_tokens=30, seed=7)
    assert first != sample_text(run_dir, "def ", max_new_tokens=30, seed=8)
    assert isinstance(sample_text(run_dir, "", max_new_tokens=5, seed=0), str)  # empty prompt: new document


@pytest.mark.timeout(60)
def test_greedy_sampling_is_the_argmax_of_the_logits(trained: tuple[Trainer, Path]) -> None:
    _, run_dir = trained
    model = node.load_model(run_dir)
    prompt = torch.tensor(list(b"import "), dtype=torch.long)
    # Reference: extend the sequence by the argmax of the last position, one full forward each time.
    context = prompt.clone()
    with torch.no_grad():
        for _ in range(12):
            context = torch.cat([context, model(context[None])[0, -1].argmax().reshape(1)])
    expected = context[len(prompt) :]
    greedy = generate(model, prompt, max_new_tokens=12, temperature=0, stop_token=None)
    top_1 = generate(model, prompt, max_new_tokens=12, temperature=1.0, top_k=1, stop_token=None)
    assert torch.equal(greedy, expected) and torch.equal(top_1, expected)
    with pytest.raises(ValueError):
        generate(model, prompt, max_new_tokens=1, temperature=-1)


@pytest.mark.timeout(60)
def test_cli_sample(
    trained: tuple[Trainer, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, run_dir = trained
    assert main(["sample", str(run_dir), "--prompt", "class ", "--max-new-tokens", "20", "--seed", "3"]) == 0
    expected = "class " + sample_text(run_dir, "class ", max_new_tokens=20, seed=3)
    assert capsys.readouterr().out == expected + "\n"
    assert main(["sample", str(tmp_path), "--prompt", "x"]) == 2
    assert "no model.safetensors" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_sample_refuses_a_model_of_pre_tokenized_ids(tmp_path: Path) -> None:
    model = GPT(model_config("nano", seq_len=16, vocab_size=300))
    export_model(
        tmp_path, model, params_of(model), preset="nano", tokenizer={"name": "token-ids", "vocab_size": 300},
        round_index=0, step=0, tokens=0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="pre-tokenized"):
        sample_text(tmp_path, "hello")
