"""The worker script end to end: separate processes agree bit for bit on torch's exact mean."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.protocol.allreduce.support import WORKER, Workers


def load_worker_module() -> object:
    spec = importlib.util.spec_from_file_location("allreduce_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_worker_processes_compute_torch_mean_exactly(tmp_path: Path) -> None:
    num_peers, num_elements, seed = 3, 150_001, 7
    workers = Workers(
        tmp_path,
        num_peers,
        [
            "--elements", str(num_elements), "--codec", "none", "--seed", str(seed), "--rounds", "2",
            "--chunk-elements", "20000", "--deadline-seconds", "30", "--save-dir", str(tmp_path / "results"),
        ],
    )  # fmt: skip
    workers.start({0: ["--bandwidth", "3.0"]})  # peer 0 owns a bigger part
    try:
        records = [workers.read_records(i, 2, timeout=90) for i in range(num_peers)]
        for i in range(num_peers):
            assert workers.wait(i, timeout=30) == 0, workers.stderr(i)[-3000:]
    finally:
        workers.stop()
    worker = load_worker_module()
    for round_id in range(2):
        vectors = [worker.make_vector(seed, i, round_id, num_elements) for i in range(num_peers)]  # type: ignore[attr-defined]
        expected = torch.stack(vectors).mean(dim=0)
        for i in range(num_peers):
            record = records[i][round_id]
            assert record["fell_back"] is False and record["max_abs_error"] == 0.0
            assert record["sha256"] == records[0][round_id]["sha256"]
            assert int(record["bytes_sent"]) > 0 and int(record["peak_rss_bytes"]) > 0  # type: ignore[call-overload]
            result = torch.load(tmp_path / "results" / f"result-r{round_id}-i{i}.pt")
            assert torch.equal(result, expected)
