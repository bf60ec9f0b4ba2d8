"""Shared helpers: real peers on loopback (in this process or as worker processes) and reference means."""

from __future__ import annotations

import json
import multiprocessing.process
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path

import torch

from protocol.allreduce import AllReduceConfig, AllReducePeer, AllReduceResult, GroupSpec, Member
from protocol.allreduce.client import PeerClient
from protocol.allreduce.round import RoundState
from protocol.auth.channels import SwarmAuth
from protocol.codecs import Codec, get_codec
from protocol.error_feedback import ErrorFeedback
from tests.forking import enter_child, forkserver

REPO_ROOT = Path(__file__).resolve().parents[3]
WORKER = REPO_ROOT / "scripts" / "workers" / "allreduce_worker.py"

FAST_CONFIG = AllReduceConfig(
    chunk_num_elements=4096,
    max_message_bytes=1 << 20,
    stall_timeout=timedelta(seconds=2),
    heartbeat_interval=timedelta(milliseconds=400),
    max_early_wait=timedelta(seconds=2),
)


@asynccontextmanager
async def local_peers(
    num_peers: int, config: AllReduceConfig = FAST_CONFIG, *, auth: SwarmAuth | None = None
) -> AsyncIterator[list[AllReducePeer]]:
    """`num_peers` servers on 127.0.0.1 with port 0 (of a closed swarm with `auth`), stopped gracefully on exit."""
    peers = [
        await AllReducePeer.start(host="127.0.0.1", port=0, config=config, auth=auth)
        for _ in range(num_peers)
    ]
    try:
        yield peers
    finally:
        for peer in peers:
            await peer.stop(timedelta(milliseconds=100))


def members_of(peers: Sequence[AllReducePeer]) -> list[Member]:
    return [Member(peer_id=f"p{i}", address=peer.address) for i, peer in enumerate(peers)]


async def allreduce_all(
    peers: Sequence[AllReducePeer],
    vectors: Sequence[torch.Tensor],
    group: GroupSpec,
    codec: Codec,
    *,
    weights: Sequence[float] | None = None,
    feedbacks: Sequence[ErrorFeedback | None] | None = None,
    deadline: timedelta = timedelta(seconds=20),
    in_place: bool = False,
    send_rate: float | None = None,
) -> list[AllReduceResult]:
    """Run one round on every peer at once (`in_place`: each writes the average into its vector;
    `send_rate`: each paces its writes at that many bytes per second)."""
    import asyncio

    return list(
        await asyncio.gather(
            *(
                peer.allreduce(
                    vectors[i],
                    group=group,
                    my_peer_id=group.members[i].peer_id,
                    weight=1.0 if weights is None else weights[i],
                    codec=codec,
                    error_feedback=None if feedbacks is None else feedbacks[i],
                    deadline=deadline,
                    in_place=in_place,
                    send_rate=send_rate,
                )
                for i, peer in enumerate(peers)
            )
        )
    )


def socket_free_round_state(num_members: int, num_elements: int, config: AllReduceConfig) -> RoundState:
    """Member 0's state of a round of `num_members` (addresses never dialled), fp32 codec, zeros."""
    members = [Member(peer_id=f"p{i}", address=f"127.0.0.1:{i + 1}") for i in range(num_members)]
    return RoundState(
        group=GroupSpec.build(round_id=0, members=members, num_elements=num_elements),
        my_index=0,
        codec=get_codec("none"),
        weight=1.0,
        vector=torch.zeros(num_elements),
        error_feedback=None,
        config=config,
        deadline=timedelta(seconds=30),
        executor=ThreadPoolExecutor(max_workers=1),
        client=PeerClient(config.grpc_options(server=False)),
        fault_plan=None,
    )


def exact_mean(
    vectors: Sequence[torch.Tensor], weights: Sequence[float], group: GroupSpec, contributors: list[list[str]]
) -> torch.Tensor:
    """Per part, sum(w_i x_i) / sum(w_i) over that part's contributors, summed in member order in fp32."""
    result = torch.empty_like(vectors[0])
    index = {m.peer_id: i for i, m in enumerate(group.members)}
    for part, peer_ids in enumerate(contributors):
        piece = group.part_slice(part)
        total = torch.zeros(group.part_num_elements(part))
        weight_sum = torch.zeros(())
        for i in sorted(index[p] for p in peer_ids):
            total = total + vectors[i][piece] * weights[i]
            weight_sum = weight_sum + weights[i]
        result[piece] = total / weight_sum
    return result


# Worker processes forked from one pre-imported server (tests/forking.py) instead of started as fresh
# interpreters: importing torch and gRPC costs more than a fault case's own rounds. Each worker is
# still its own process with its own sockets, killed or frozen by its own fault plan.
WORKER_PRELOAD = ("tests.protocol.allreduce.support", "scripts.workers.allreduce_worker")


def _run_forked_worker(argv: list[str], stdout_path: Path, stderr_path: Path, env: dict[str, str]) -> None:
    """In the forked child: the worker script's main() with its stdout and stderr in files."""
    enter_child(env, REPO_ROOT, stdout_path, stderr_path)
    from scripts.workers import allreduce_worker

    sys.exit(allreduce_worker.main(argv))


class Workers:
    """Runs scripts/workers/allreduce_worker.py peers on loopback and collects their JSON lines.

    By default each peer is `python allreduce_worker.py ...`, as a user runs it; ``forked=True``
    forks it from a server that imported torch and gRPC once (the fault tests start dozens).
    """

    def __init__(
        self, tmp_path: Path, num_peers: int, common_args: Sequence[str], *, forked: bool = False
    ) -> None:
        self.rendezvous = tmp_path / "rendezvous"
        self.num_peers = num_peers
        self.common_args = list(common_args)
        self.forked = forked
        self.processes: list[subprocess.Popen[str]] = []
        self.forked_processes: list[multiprocessing.process.BaseProcess] = []
        self.stdout_paths = [tmp_path / f"worker-{i}.out" for i in range(num_peers)]
        self.stderr_paths = [tmp_path / f"worker-{i}.err" for i in range(num_peers)]

    def start(self, extra_args: dict[int, Sequence[str]] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        for index in range(self.num_peers):
            arguments = [
                "--index",
                str(index),
                "--num-peers",
                str(self.num_peers),
                "--rendezvous",
                str(self.rendezvous),
                *self.common_args,
                *((extra_args or {}).get(index, [])),
            ]
            if self.forked:
                process = forkserver(WORKER_PRELOAD).Process(
                    target=_run_forked_worker,
                    args=(arguments, self.stdout_paths[index], self.stderr_paths[index], env),
                    daemon=False,
                )
                process.start()
                self.forked_processes.append(process)
                continue
            stderr = self.stderr_paths[index].open("w")
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *arguments],
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    cwd=REPO_ROOT,
                    env=env,
                )
            )

    def read_records(self, index: int, num_rounds: int, timeout: float) -> list[dict[str, object]]:
        """The first `num_rounds` JSON lines of worker `index` (fewer if it exits first)."""
        if self.forked:
            return self._read_forked_records(index, num_rounds, timeout)
        process = self.processes[index]
        assert process.stdout is not None
        records: list[dict[str, object]] = []
        give_up = time.monotonic() + timeout
        while len(records) < num_rounds and time.monotonic() < give_up:
            line = process.stdout.readline()
            if not line:
                break
            records.append(json.loads(line))
        return records

    def _read_forked_records(self, index: int, num_rounds: int, timeout: float) -> list[dict[str, object]]:
        """Poll the forked worker's stdout file for whole lines until enough, its exit, or `timeout`."""
        process = self.forked_processes[index]
        give_up = time.monotonic() + timeout
        while True:
            exited = not process.is_alive()  # read after this: a line written before the exit is seen
            text = self.stdout_paths[index].read_text() if self.stdout_paths[index].exists() else ""
            lines = text.splitlines(keepends=True)
            complete = [line for line in lines if line.endswith("\n")]
            if len(complete) >= num_rounds or exited or time.monotonic() >= give_up:
                return [json.loads(line) for line in complete[:num_rounds]]
            time.sleep(0.05)

    def wait(self, index: int, timeout: float) -> int:
        if self.forked:
            process = self.forked_processes[index]
            process.join(timeout)
            if process.exitcode is None:
                raise subprocess.TimeoutExpired(f"forked worker {index}", timeout)
            return process.exitcode
        return self.processes[index].wait(timeout)

    def stop(self) -> None:
        """Kill whatever is still running (a frozen worker needs SIGKILL) and reap everything."""
        for forked in self.forked_processes:
            if forked.is_alive():
                forked.kill()
            forked.join(10)
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
            process.wait(10)
            if process.stdout is not None:
                process.stdout.close()

    def stderr(self, index: int) -> str:
        return self.stderr_paths[index].read_text()
