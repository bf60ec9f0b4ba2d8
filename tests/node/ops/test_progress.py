"""Progress output: plain lines off a terminal (unchanged, scripts parse them), the rich live display
on one, and ``--log-format json`` (every stderr line of a real ``dtnode join`` is a JSON object)."""

from __future__ import annotations

import inspect
import io
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from node.config import ConfigError, NodeConfig
from node.ops.logs import JsonFormatter
from node.ops.metrics import read_metrics
from node.ops.progress import LiveProgress, PlainProgress, progress_sink, round_status

PARAM_HASH = "0123456789abcdef" * 4


def step_record(step: int, round: int, loss: float) -> dict[str, Any]:
    return {"kind": "step", "round": round, "step": step, "loss": loss, "lr": 1e-3, "tokens": 64 * step,
            "tokens_per_s": 12345.4, "time": 0.0}  # fmt: skip


def round_record(round: int, **fields: Any) -> dict[str, Any]:
    record = {"kind": "round", "round": round, "step": 3 * round, "eval_loss": 2.5, "peers": 2,
              "seconds_compute": 40.04, "seconds_comm": 1.204, "seconds_blocked": 1.5, "param_hash": PARAM_HASH,
              "utilization": 0.9639, "codec_error": 0.015, "failures_by_kind": {}, "fell_back": False,
              "adopted": False}  # fmt: skip
    record.update(fields)
    return record


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dtnode"]


def test_plain_lines_every_log_every_steps_and_every_round(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dtnode")
    plain = PlainProgress(inner_steps=3, log_every=2)
    for step in (1, 2, 3):
        plain.write(step_record(step, 1, 2.0 + step / 8))
    plain.write(round_record(1))
    plain.write(step_record(4, 2, 1.75))
    assert messages(caplog) == [
        "round 1 | step 2 (2/3) | loss 2.2500 | lr 1.00e-03 | 12,345 tok/s",
        "round 1 done | eval_loss 2.5000 | peers 2 | compute 40.0s comm 1.20s (blocked 1.50s) | param_hash 0123456789ab",
        "round 2 | step 4 (1/3) | loss 1.7500 | lr 1.00e-03 | 12,345 tok/s",
    ]


def test_a_round_with_an_all_reduce_shows_its_bytes_density_and_share(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="dtnode")
    sparse = round_record(1, bytes_sent=1_523_456, bytes_recv=812, density=62 / 4096, allreduce_share=0.0312)
    dense = round_record(2, bytes_sent=2_040_000_000, bytes_recv=12_345, density=1.0, allreduce_share=0.5)
    PlainProgress(inner_steps=3, log_every=2).write(sparse)
    PlainProgress(inner_steps=3, log_every=2).write(dense)
    assert messages(caplog) == [
        "round 1 done | eval_loss 2.5000 | peers 2 | compute 40.0s comm 1.20s (blocked 1.50s) | sent 1.52 MB "
        "recv 812 B at density 1.51% | all-reduce 3% of the round | param_hash 0123456789ab",
        "round 2 done | eval_loss 2.5000 | peers 2 | compute 40.0s comm 1.20s (blocked 1.50s) | sent 2.04 GB "
        "recv 12.3 kB at density 100% | all-reduce 50% of the round | param_hash 0123456789ab",
    ]
    assert round_status(sparse).endswith("| utilization 96% | sent 1.52 MB at density 1.51% | all-reduce 3%")


@pytest.mark.timeout(60)
def test_trainer_logs_the_same_lines_as_its_metrics(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Off a terminal (pytest captures stderr), a real trainer's lines are the plain ones, one per
    step with log_every=1 and one per round, with the numbers of metrics.jsonl."""
    from node.train.trainer import Trainer

    caplog.set_level(logging.INFO, logger="dtnode")
    corpus = tmp_path / "text.txt"
    corpus.write_text(inspect.getsource(inspect))
    config = NodeConfig.from_flat(
        model="nano", seq_len=32, batch_size=4, inner_steps=2, eval_batches=1, warmup_steps=1, total_steps=10,
        data=str(corpus), run_dir=str(tmp_path / "run"), log_every=1, max_rounds=2, threads=1,
    )  # fmt: skip
    Trainer(config).run()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    expected = []
    for r in records:  # the format the trainer has always printed, written out here independently
        if r["kind"] == "step":
            expected.append(
                f"round {r['round']} | step {r['step']} ({(r['step'] - 1) % 2 + 1}/2) | loss {r['loss']:.4f} | "
                f"lr {r['lr']:.2e} | {r['tokens_per_s']:,.0f} tok/s"
            )
        else:
            loss = "-" if r["eval_loss"] is None else f"{r['eval_loss']:.4f}"  # round 1: no eval (auto)
            expected.append(
                f"round {r['round']} done | eval_loss {loss} | peers {r['peers']} | compute "
                f"{r['seconds_compute']:.1f}s comm {r['seconds_comm']:.2f}s (blocked {r['seconds_blocked']:.2f}s) "
                f"| param_hash {r['param_hash'][:12]}"
            )
    assert [r["kind"] for r in records] == ["step", "step", "round"] * 2
    shown = [m for m in messages(caplog) if m.startswith("round ")]
    assert shown == expected


def test_live_display_renders_steps_and_rounds(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dtnode")
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=160, color_system=None)
    live = LiveProgress(console, inner_steps=3, log_every=1, max_rounds=4)
    for step in (1, 2, 3):
        live.write(step_record(step, 1, 2.0))
    live.write(round_record(1, failures_by_kind={"peer": 2}))
    live.write(step_record(4, 2, 1.875))
    live.close()
    live.close()  # idempotent
    text = screen.getvalue()
    assert (
        "round 2 inner steps" in text and "1/3" in text and "loss 1.8750" in text and "12,345 tok/s" in text
    )
    assert "outer rounds" in text and "1/4" in text
    assert "eval_loss 2.5000 | peers 2 | comm 1.20s | codec error 1.50% | utilization 96%" in text
    assert "failures peer 2" in text
    # The round line is still logged (it scrolls above the display); step lines are not.
    assert messages(caplog) == [
        "round 1 done | eval_loss 2.5000 | peers 2 | compute 40.0s comm 1.20s (blocked 1.50s) | param_hash 0123456789ab"
    ]


def test_live_display_only_for_text_on_a_terminal() -> None:
    assert isinstance(progress_sink(NodeConfig(), is_terminal=True), LiveProgress)
    assert isinstance(progress_sink(NodeConfig(), is_terminal=False), PlainProgress)
    assert isinstance(progress_sink(NodeConfig.from_flat(log_format="json"), is_terminal=True), PlainProgress)
    with pytest.raises(ConfigError, match="log_format"):
        NodeConfig.from_flat(log_format="xml")


def test_json_formatter_writes_one_object_per_record() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("dtnode.test_json")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("round %d fell back", 3, extra={"round": 3, "loss": float("nan"), "path": Path("/x")})
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "round 3 fell back" and first["level"] == "WARNING"
    assert first["logger"] == "dtnode.test_json" and first["time"].endswith("+00:00")
    assert (first["round"], first["loss"], first["path"]) == (3, "nan", "/x")
    assert second["message"] == "failed" and "RuntimeError: boom" in second["exception"]


@pytest.mark.timeout(60)
def test_join_with_json_logs_writes_only_json_on_stderr(tmp_path: Path) -> None:
    corpus = tmp_path / "text.txt"
    corpus.write_text(inspect.getsource(inspect))
    command = [
        sys.executable, "-m", "node.ops.cli", "join", "--no-swarm", "--log-format", "json", "--model", "nano",
        "--seq-len", "32", "--batch-size", "4", "--inner-steps", "2", "--max-steps", "2", "--log-every", "1",
        "--eval-batches", "1", "--threads", "1", "--data", str(corpus), "--run-dir", str(tmp_path / "run"),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=50, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    objects = [json.loads(line) for line in lines]  # every line, or this raises
    assert all({"time", "level", "logger", "message"} <= set(o) for o in objects)
    shown = [o["message"] for o in objects]
    assert any(m.startswith("config: ") for m in shown)
    assert sum(m.startswith("round 1 | step ") for m in shown) == 2
    assert any(m.startswith("round 1 done | eval_loss ") for m in shown)


def test_a_round_without_eval_shows_a_dash(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dtnode")
    PlainProgress(inner_steps=3, log_every=2).write(round_record(2, eval_loss=None))  # --eval-every
    assert messages(caplog) == [
        "round 2 done | eval_loss - | peers 2 | compute 40.0s comm 1.20s (blocked 1.50s) | param_hash 0123456789ab"
    ]
    assert round_status(round_record(2, eval_loss=None)).startswith("eval_loss - | peers 2")


@pytest.mark.timeout(60)
def test_a_fragment_round_names_its_fragment_and_hash(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dtnode")
    record = round_record(5, eval_loss=None, fragment=1, fragment_hash="fedcba987654321")  # --fragments
    PlainProgress(inner_steps=8, log_every=2).write(record)
    assert messages(caplog) == [
        "round 5 done | eval_loss - | peers 2 | compute 40.0s comm 1.20s (blocked 1.50s) | fragment 1 fedcba987654 "
        "| param_hash 0123456789ab"
    ]
    assert round_status(record).startswith("fragment 1 | eval_loss - | peers 2")
    assert "fragment" not in round_status(round_record(5))  # whole-model rounds: as before
