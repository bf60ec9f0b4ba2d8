"""A node behind NAT (``--client-mode``) trains with two ordinary nodes: it contributes to every
round and all three end on one param_hash, although nobody can connect to it.

Three hosts in the WAN emulator (network namespaces); the client's host drops every SYN-ACK it
would send (a u32 filter on its uplink), so no TCP connection toward it can ever open (gRPC, DHT
or metrics port alike), while the connections it opens itself work: a firewall that refuses
inbound connections, or a NAT without forwarded ports. The test first checks that this is so.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.node.swarm_cluster import Cluster, Node, tail, wait_for
from tests.scripts.script_loader import load_script

wan_emulator = load_script("wan_emulator")
_reason = wan_emulator.unavailable_reason()

# IPv4 without options (IHL 5: TCP's flags byte is at 20 + 13 = 33), TCP, SYN and ACK both set.
REFUSE_INBOUND = ["match", "ip", "protocol", "6", "0xff", "match", "u8", "0x05", "0x0f", "at", "0",
                  "match", "u8", "0x12", "0x12", "at", "33"]  # fmt: skip
LISTENER = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen(); s.settimeout(8)\n"
    "print(s.getsockname()[1], flush=True)\n"
    "try:\n    s.accept()\nexcept OSError:\n    pass\n"
)
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"


def refuse_inbound(wan: object, index: int) -> None:
    """Host ``index`` sends no SYN-ACK: the packets go to the emulator's black-hole class 1:2."""
    namespace = wan.namespace(index)  # type: ignore[attr-defined]
    subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", "filter", "add", "dev", "eth0", "parent", "1:",
         "protocol", "ip", "prio", "5", "u32", *REFUSE_INBOUND, "flowid", "1:2"],
        check=True, timeout=20,
    )  # fmt: skip


def tcp_connects(wan: object, source: int, destination: int) -> bool:
    """Whether a process on host ``source`` can open a TCP connection to one listening on ``destination``."""
    address = wan.address(destination)  # type: ignore[attr-defined]
    listener = subprocess.Popen(
        ["ip", "netns", "exec", wan.namespace(destination), sys.executable, "-c", LISTENER, address],  # type: ignore[attr-defined]
        stdout=subprocess.PIPE,
    )
    try:
        assert listener.stdout is not None
        port = listener.stdout.readline().decode().strip()
        probe = subprocess.run(
            ["ip", "netns", "exec", wan.namespace(source), sys.executable, "-c", CONNECT, address, port],  # type: ignore[attr-defined]
            capture_output=True, timeout=20,
        )  # fmt: skip
        return probe.returncode == 0
    finally:
        listener.kill()
        listener.wait(10)


@pytest.mark.timeout(180)
@pytest.mark.skipif(_reason is not None, reason=_reason or "")
def test_a_client_mode_node_nobody_can_reach_contributes_to_every_round(tmp_path: Path) -> None:
    with (
        wan_emulator.WanEmulator(3, None, name_prefix="dtnat") as wan,
        Cluster(tmp_path, forked=True) as cluster,
    ):
        refuse_inbound(wan, 2)
        assert tcp_connects(wan, 2, 0), "the client's host must still open connections itself"
        assert not tcp_connects(wan, 0, 2), "the client's host must refuse inbound connections"
        assert tcp_connects(wan, 0, 1)

        nodes: list[Node] = []
        peers: str | None = None
        for index in range(3):
            address = wan.address(index)
            flags = ["--inner-steps", "3", "--max-rounds", "3", "--start-peers", "3",
                     "--listen", f"{address}:0", "--dht-listen", f"{address}:0"]  # fmt: skip
            if index == 2:
                flags.append("--client-mode")
            nodes.append(cluster.start(flags, peers=peers, netns=wan.namespace(index)))
            if index == 0:
                peers = cluster.first_multiaddr(nodes[0], prefix=f"/ip4/{wan.address(0)}/")
        client = nodes[2]
        wait_for(lambda: (client.run_dir / "node.json").exists(), 60, "the client to start", client)
        client_id = client.identity()["peer_id"]
        wait_for(lambda: "in client mode" in client.log(), 30, "the client's banner", client)
        assert "To join it from another machine" not in client.log()  # nobody can join through it
        try:
            codes = cluster.wait_all(150)
        finally:
            for node in nodes:
                node.signal(signal.SIGTERM)
        assert codes == [0, 0, 0], "\n".join(tail(node) for node in nodes)

        by_node = [node.records() for node in nodes]
        for node, records in zip(nodes, by_node, strict=True):
            assert [r["round"] for r in records] == [1, 2, 3], f"{node.name}: {records}\n{tail(node)}"
            for record in records:
                assert record["peers"] == 3 and not record["fell_back"] and not record["adopted"], (
                    f"{node.name} round {record['round']}: {record}\n{tail(node)}"
                )
                assert client_id in record["members"], record  # the client contributed to the round
                assert not record["failures_by_kind"], record  # nobody failed to reach anybody
        hashes = [[r["param_hash"] for r in records] for records in by_node]
        assert hashes[0] == hashes[1] == hashes[2]
