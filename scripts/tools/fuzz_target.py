"""The target of ``scripts/tools/fuzz_rpcs.py``: a live node in its own process, and the campaign's handle on it.

``python scripts/tools/fuzz_target.py`` runs the node (a real ``SwarmNode``: DHT peer, one gRPC server with the
all-reduce, state sync, membership and health services, the round driver), prints its address as a JSON
line, then obeys ``publish`` / ``round`` / ``quit`` commands read as JSON lines on stdin. ``Target`` starts
it and talks to it with a deadline on every reply. The shared round helpers (the swarm config, the
deterministic vectors, the lineage hashes) live here too, so both processes use the same ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

# Run as a file, so its folder and not the checkout is on sys.path: the `scripts` package needs the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from protocol.allreduce.config import AllReduceConfig
from protocol.allreduce.slices import HeldSlice, SliceKey
from protocol.codecs import fp32_view, get_codec
from protocol.discovery.dht_node import DhtConfig
from protocol.membership.config import RoundConfig
from protocol.statesync.config import StateSyncConfig
from protocol.statesync.snapshot import Snapshot
from protocol.swarm.config import SwarmConfig
from protocol.swarm.node import RoundResult, SwarmNode
from protocol.swarm.result import GroupAveraged, result_name
from protocol.swarm.streams import to_allreduce_group
from scripts.common import REPO_ROOT

NUM_ELEMENTS = 10_007
"""Length of the averaged vector (odd, so the two parts differ in size)."""
SNAPSHOT_TENSOR = "params"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""The target's gRPC message limit (all-reduce and state sync both set it; membership needs 4 MiB)."""
CHUNK_NUM_ELEMENTS = 4096
NUM_TOKENS = {"target": 1000, "partner": 3000}
SEEDS = {"target": 11, "partner": 22}
FAILING_CODES = frozenset({"UNKNOWN", "INTERNAL"})
"""Statuses that mean an exception escaped a servicer (or broke the transport)."""


def swarm_config(initial_peers: tuple[str, ...]) -> SwarmConfig:
    """A loopback node with exact averaging, short waits (fuzzed calls end fast) and 4 MiB messages."""
    return SwarmConfig(
        run_name="fuzz-rpcs",
        listen="127.0.0.1:0",
        dht=DhtConfig(listen="127.0.0.1:0", initial_peers=initial_peers),
        rounds=RoundConfig(
            min_peers=2,
            join_window=timedelta(seconds=1),
            max_wait=timedelta(seconds=30),
            proposal_timeout=timedelta(seconds=2),
            begin_timeout=timedelta(seconds=4),
        ),
        allreduce=AllReduceConfig(
            chunk_num_elements=CHUNK_NUM_ELEMENTS,
            max_message_bytes=MAX_MESSAGE_BYTES,
            stall_timeout=timedelta(seconds=2),
            heartbeat_interval=timedelta(milliseconds=400),
            max_early_wait=timedelta(milliseconds=300),
            max_slice_wait=timedelta(milliseconds=300),
            linger=timedelta(minutes=30),  # round 1 stays servable for the whole campaign
        ),
        statesync=StateSyncConfig(
            max_chunk_bytes=256 * 1024, max_range_bytes=1 << 20, max_message_bytes=MAX_MESSAGE_BYTES
        ),
        codec="none",
        round_deadline=timedelta(seconds=20),
        heartbeat=timedelta(seconds=0.5),
        record_ttl=timedelta(seconds=8),
        dht_call_timeout=timedelta(seconds=2),
        view_refresh=timedelta(seconds=0.25),
    )


def lineage_hash(round: int) -> str:
    """The param_hash both nodes publish before round ``round + 1`` (any agreed SHA-256 will do)."""
    return hashlib.sha256(f"fuzz-lineage-{round}".encode()).hexdigest()


def round_vector(who: str, round: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEEDS[who] * 1000 + round)
    return torch.randn(NUM_ELEMENTS, generator=generator)  # (E,)


def run_round(node: SwarmNode, who: str, round: int) -> RoundResult:
    """Round ``round`` from lineage ``(round - 1, lineage_hash(round - 1))``."""
    return node.run_round(
        round_vector(who, round),
        round=round - 1,
        param_hash=lineage_hash(round - 1),
        num_tokens=NUM_TOKENS[who],
        tokens_per_s=1000.0,
        error_feedback=None,
    )


def tensor_sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


# --- the target: a live node in its own process, driven by JSON lines on stdin -----------------------


def hold_slice(node: SwarmNode, result: GroupAveraged) -> None:
    """Hold round 1's mean as slice 0 of a tiered round 1 named by the group's digest, for the
    partner: fuzzed PullSlice calls then reach a held slice (served, refused to another peer id)."""
    group = to_allreduce_group(result.group)
    averaged = result.allreduce.averaged
    starts = range(0, NUM_ELEMENTS, CHUNK_NUM_ELEMENTS)
    sizes = [min(CHUNK_NUM_ELEMENTS, NUM_ELEMENTS - start) for start in starts]
    held = HeldSlice(
        codec=get_codec("none"),
        chunk_sizes=tuple(sizes),
        payloads=tuple(
            fp32_view(averaged[start : start + size]) for start, size in zip(starts, sizes, strict=True)
        ),
        weight_sum=float(sum(NUM_TOKENS.values())),
    )
    key = SliceKey(round_id=1, plan_digest=group.digest, slice_index=0)
    partner = frozenset(m.peer_id for m in group.members if m.peer_id != node.peer_id)

    async def hold() -> None:  # (on the node's loop, where its server reads the slices)
        node.server.allreduce.hold_slice(key, held, pullers=partner, linger=timedelta(minutes=30))

    node._run(hold(), timedelta(seconds=5))


def serve() -> int:
    """Run the target node: print its address, then obey ``round`` / ``publish`` / ``quit`` commands."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    node = SwarmNode(swarm_config(()))
    params = torch.arange(64 * 1024, dtype=torch.float32)  # (N,) 256 KiB: FetchRange has bytes to serve
    snapshot = Snapshot(
        round_id=0,
        state_id=lineage_hash(0),
        tensors={SNAPSHOT_TENSOR: params},
        metadata=b"{}",
        block_bytes=4096,
    )
    node.publish(round=0, param_hash=lineage_hash(0), tokens_per_s=1000.0, snapshot=snapshot)
    ready = {"address": node.server.address, "multiaddrs": node.multiaddrs(), "peer_id": node.peer_id}
    print(json.dumps(ready), flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "publish":
                round = int(command["round"])
                node.publish(round=round, param_hash=lineage_hash(round), tokens_per_s=1000.0, snapshot=None)
                print(json.dumps({"published": round}), flush=True)
            elif command["op"] == "round":
                result = run_round(node, "target", int(command["round"]))
                reply: dict[str, Any] = {"kind": result_name(result), "reason": getattr(result, "reason", "")}
                if isinstance(result, GroupAveraged):
                    reply["sha256"] = tensor_sha256(result.allreduce.averaged)
                    reply["fell_back"] = result.allreduce.fell_back
                    if int(command["round"]) == 1:
                        hold_slice(node, result)
                print(json.dumps(reply), flush=True)
            else:
                break
    finally:
        node.leave()
        node.close()
    return 0


class Target:
    """The target process: started with ``--serve``, its stderr (the node's log) kept in a file."""

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.process = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
        )  # fmt: skip
        self.ready = self.reply(timedelta(seconds=60))
        self.address: str = self.ready["address"]

    def reply(self, timeout: timedelta) -> dict[str, Any]:
        """The next JSON line of the target (a reader thread, so the wait has a deadline)."""
        assert self.process.stdout is not None
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(self.process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout.total_seconds())
        if not lines or not lines[0]:
            raise RuntimeError(f"the target did not answer in {timeout}:\n{self.log_tail()}")
        return json.loads(lines[0])

    def send(self, command: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, num_chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def num_tracebacks(self) -> int:
        return self.log_path.read_text(errors="replace").count("Traceback")

    def stop(self) -> None:
        if self.alive():
            try:
                self.send({"op": "quit"})
                self.process.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


# --- generation: hypothesis strategies on the message descriptors -------------------------------------


if __name__ == "__main__":
    sys.exit(serve())
