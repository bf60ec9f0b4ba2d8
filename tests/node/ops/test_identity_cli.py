"""``dtnode join --identity-path``: a node restarted on the same key and DHT port prints the same
join address and records the same peer id in node.json; the compose swarm relies on it.

Both starts are forked from the preloaded server (``swarm_cluster.fork_node``: the CLI's ``main`` in a
process of its own, its output in a log): a fresh interpreter's imports cost more CPU than the run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
from pathlib import Path

import pytest

from tests.node.swarm_cluster import fork_node


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.timeout(240)
def test_a_restarted_node_keeps_its_peer_id(tmp_path: Path) -> None:
    run_dir, key = tmp_path / "run", tmp_path / "identity.key"
    dht_port = free_port()
    argv = [
        "join", "--model", "nano", "--seq-len", "32", "--batch-size", "2",
        "--inner-steps", "1", "--max-rounds", "1", "--warmup-steps", "1", "--eval-batches", "1",
        "--threads", "1", "--run-dir", str(run_dir), "--listen", "127.0.0.1:0",
        "--dht-listen", f"127.0.0.1:{dht_port}", "--identity-path", str(key),
    ]  # fmt: skip
    identities = []
    banners = []
    for start in range(2):  # the second start resumes at round 1: nothing to train, same swarm side
        log_path = tmp_path / f"start-{start}.log"
        node = fork_node(argv, log_path)
        try:
            code = node.wait(200)
        finally:
            if node.poll() is None:  # timed out: the node's session (its DHT daemon too) goes with it
                os.killpg(node.pid, signal.SIGKILL)
        output = log_path.read_text(errors="replace")
        assert code == 0, output[-2000:]
        identities.append(json.loads((run_dir / "node.json").read_text()))
        banners.append([line for line in output.splitlines() if "--peers" in line])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    first, second = identities
    assert first["peer_id"] == second["peer_id"]
    assert (
        first["multiaddrs"]
        == second["multiaddrs"]
        == [f"/ip4/127.0.0.1/tcp/{dht_port}/p2p/{first['peer_id']}"]
    )
    assert banners[0] == banners[1] and len(banners[0]) == 1
