"""``--device`` decides the local ranks' device kind and backend, also on a machine with CUDA.

CUDA is faked as present (``torch.cuda.is_available`` / ``device_count`` patched): these are the
decisions made before any device is touched, so no GPU is needed to check them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from node.config import NodeConfig
from node.parallel import tensor
from node.parallel.layout import device_memory_bytes, num_local_workers
from node.parallel.pipeline import pipeline_device

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def four_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "2")
    yield
    tensor.use_device("auto")  # the module default for the tests that follow


def test_auto_on_a_cuda_machine_uses_one_nccl_rank_per_gpu(four_gpus: None) -> None:
    tensor.use_device("auto")
    assert tensor.device_type() == "cuda" and tensor.distributed_backend() == "nccl"
    assert pipeline_device() == torch.device("cuda", 2)
    assert num_local_workers(NodeConfig.from_flat(device="auto")) == 4


def test_device_cpu_on_a_cuda_machine_keeps_every_rank_on_the_cpu_with_gloo(four_gpus: None) -> None:
    tensor.use_device("cpu")
    assert tensor.device_type() == "cpu" and tensor.distributed_backend() == "gloo"
    assert pipeline_device() == torch.device("cpu")
    assert num_local_workers(NodeConfig.from_flat(device="cpu")) == 1  # not one per GPU
    assert num_local_workers(NodeConfig.from_flat(device="cpu", local_workers=3)) == 3
    host_share = device_memory_bytes(2, "cpu")
    assert host_share > 0 and host_share < 2**50  # the host's RAM halved, not a GPU's memory query


def test_an_unknown_device_is_refused() -> None:
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        tensor.use_device("tpu")
