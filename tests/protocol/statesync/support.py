"""Shared helpers: snapshots with known contents, providers on loopback, exact comparisons."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta

import torch

from protocol.statesync import FetchOptions, ServeFaultPlan, Snapshot, StateSyncConfig, StateSyncServer

MiB = 1 << 20

# Small chunks and blocks so a few MB make many ranges; limits as tight as the sizes allow.
TEST_CONFIG = StateSyncConfig(
    max_chunk_bytes=256 * 1024,
    max_range_bytes=8 * MiB,
    max_message_bytes=2 * MiB,
    stall_timeout=timedelta(seconds=5),
    server_grace=timedelta(milliseconds=100),
)
FETCH_OPTIONS = FetchOptions(
    max_parallel=4, chunk_bytes=256 * 1024, range_bytes=2 * MiB, stall_timeout=timedelta(seconds=5)
)


def make_snapshot(
    *, seed: int = 0, round_id: int = 7, num_params: int = 4 * MiB, state_id: str | None = None
) -> Snapshot:
    """A daemon-like state: fp32 params (num_params), fp32 momentum (num_params // 4), a small bf16
    tensor and JSON metadata; by default 16 MiB + 4 MiB + 2 KB, about 21 MB. The state id is the
    params' SHA-256 computed here independently (numpy, explicit little-endian fp32), as the
    daemon's param_hash."""
    generator = torch.Generator().manual_seed(seed)
    params = torch.randn(num_params, generator=generator)
    momentum = torch.randn(num_params // 4, generator=generator)
    scales = torch.randn(1000, generator=generator).to(torch.bfloat16)
    param_hash = hashlib.sha256(params.numpy().astype("<f4").tobytes()).hexdigest()
    return Snapshot(
        round_id=round_id,
        state_id=state_id or param_hash,
        tensors={"global_params": params, "outer_momentum": momentum, "scales": scales},
        metadata=f'{{"round": {round_id}, "schedule_step": {round_id * 500}, "loader": [1, 2, 3]}}'.encode(),
        block_bytes=MiB,
    )


def assert_identical(fetched: Snapshot, reference: Snapshot) -> None:
    """Same round, id, metadata, tensor names and dtypes, and bit-identical tensors."""
    assert (fetched.round_id, fetched.state_id, fetched.metadata) == (
        reference.round_id,
        reference.state_id,
        reference.metadata,
    )
    assert list(fetched.tensors) == list(reference.tensors)
    for name, tensor in reference.tensors.items():
        got = fetched.tensors[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        # Compare bytes, not values: NaN payloads and -0.0 must survive too.
        assert torch.equal(got.view(torch.uint8), tensor.view(torch.uint8)), name


@asynccontextmanager
async def providers(
    num_providers: int,
    snapshot: Snapshot | None,
    *,
    config: StateSyncConfig = TEST_CONFIG,
    fault_plans: Sequence[ServeFaultPlan | None] | None = None,
) -> AsyncIterator[list[StateSyncServer]]:
    """`num_providers` servers on 127.0.0.1 with port 0, each serving `snapshot`; stopped on exit."""
    plans = list(fault_plans) if fault_plans is not None else [None] * num_providers
    servers = [
        await StateSyncServer.start(host="127.0.0.1", port=0, config=config, fault_plan=plan)
        for plan in plans
    ]
    try:
        if snapshot is not None:
            for server in servers:
                server.provider.publish(snapshot)
        yield servers
    finally:
        for server in servers:
            await server.stop(timedelta(0))
