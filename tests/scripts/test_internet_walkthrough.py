"""README's "Two machines over the internet" walkthrough, run as written on two hosts of the WAN emulator.

The commands are read from README.md (the ``console`` block between the walkthrough markers) and run
verbatim, each on its machine and in that machine's own directory; the only substitutions are the
documentation's addresses: 203.0.113.7 (A's public address) becomes host A's emulated address, and
the placeholder peer id ``12D3KooWA…`` in B's ``--peers`` the one A printed. The size of the run
(a nano model for 2 rounds of a few steps on a small text file) and the run dirs come from
``DTNODE_*`` variables, which flags outrank, so no flag of the walkthrough is changed.

The network is what the walkthrough describes, with the kernel's NAT (iptables in the namespaces):

- A's provider maps public ports 40100 and 40101 to A's 7000 and 7001: DNAT rules on A's uplink, and
  A's 7000 and 7001 drop every connection from outside that did not come through them, so every byte
  B exchanges with A goes through the outside ports A announces;
- B is a laptop behind a home router: B's namespace has a private address (192.168.77.2) behind host
  1 of the emulator, which masquerades it and forwards nothing in, so nobody has a route to B at
  all; B's node listens on no port anyway (checked from /proc).

Both nodes must be in both rounds (B's peer id among the members of each of A's rounds), end on one
param_hash each round, and A's DNAT rules must have carried connections to both outside ports.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.node.swarm_cluster import REPO_ROOT, Node, fork_node, tail, wait_for
from tests.scripts.processes import listening_tcp_sockets, processes_in_groups
from tests.scripts.script_loader import load_script

wan_emulator = load_script("wan_emulator")
IPTABLES = shutil.which("iptables", path="/usr/sbin:/sbin:/usr/bin:/bin")
_reason = wan_emulator.unavailable_reason() or (None if IPTABLES else "the walkthrough's NAT needs iptables")
LAN = ("192.168.77.1", "192.168.77.2")  # B's home network: its router's side, the laptop

DOC_ADDRESS = "203.0.113.7"
DOC_PEER_ID = "12D3KooWA…"
WALKTHROUGH = re.compile(
    r"<!-- walkthrough:.*?-->\s*```console\n(?P<block>.*?)```\s*<!-- /walkthrough -->", re.S
)
FORWARDED = {40100: 7000, 40101: 7001}  # A's provider: outside port -> A's port
# A small, quick run (flags outrank these, so the walkthrough's own flags stay as written).
RUN_SIZE = {
    "DTNODE_MODEL": "nano", "DTNODE_SEQ_LEN": "32", "DTNODE_BATCH_SIZE": "4", "DTNODE_THREADS": "1",
    "DTNODE_INNER_STEPS": "5", "DTNODE_MAX_ROUNDS": "2", "DTNODE_EVAL_BATCHES": "1",
    "DTNODE_CHECKPOINT_EVERY": "0", "DTNODE_LOG_EVERY": "1000", "DTNODE_JOIN_WINDOW": "5",
    "DTNODE_HEARTBEAT": "2", "DTNODE_RECORD_TTL": "16",
}  # fmt: skip


def walkthrough_commands() -> dict[str, list[str]]:
    """README's walkthrough: each machine's commands (``$ `` lines, prompt removed), in order."""
    match = WALKTHROUGH.search((REPO_ROOT / "README.md").read_text())
    assert match is not None, "README.md has no walkthrough block between its markers"
    commands: dict[str, list[str]] = {}
    machine = None
    for line in match["block"].splitlines():
        if on := re.fullmatch(r"# on (\w+)", line.strip()):
            machine = on[1]
        elif line.startswith("$ "):
            assert machine is not None, f"a command before any '# on X' line: {line}"
            commands.setdefault(machine, []).append(line[2:])
    return commands


def test_the_walkthrough_block_is_what_the_run_below_expects() -> None:
    commands = walkthrough_commands()
    assert sorted(commands) == ["A", "B"]
    assert [shlex.split(c)[:2] for c in commands["A"]] == [["dtnode", "keygen"], ["dtnode", "join"]]
    assert [shlex.split(c)[:2] for c in commands["B"]] == [["dtnode", "join"]]
    assert f"--announce {DOC_ADDRESS}:40100" in commands["A"][1]
    assert f"--dht-announce {DOC_ADDRESS}:40101" in commands["A"][1]
    assert "--client-mode" in commands["B"][0] and DOC_PEER_ID in commands["B"][0]


def netns_run(namespace: str, *argv: str) -> str:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, *argv], capture_output=True, text=True, timeout=20
    )
    assert done.returncode == 0, f"{argv}: {done.stderr}"
    return done.stdout


def provider_port_mapping(namespace: str, address: str) -> None:
    """``address`` (the host in ``namespace``) is reached at FORWARDED's outside ports through DNAT on
    its uplink, and from outside not at the inside ports themselves."""
    assert IPTABLES is not None
    for outside, inside in FORWARDED.items():
        netns_run(namespace, IPTABLES, "-t", "nat", "-A", "PREROUTING", "-i", "eth0", "-p", "tcp", "-d", address,
                  "--dport", str(outside), "-j", "DNAT", "--to-destination", f"{address}:{inside}")  # fmt: skip
    inside_ports = ",".join(str(port) for port in FORWARDED.values())
    netns_run(namespace, IPTABLES, "-A", "INPUT", "-i", "eth0", "-p", "tcp", "-m", "multiport", "--dports",
              inside_ports, "-m", "conntrack", "!", "--ctstate", "DNAT", "-j", "DROP")  # fmt: skip


def home_router(router: str, lan: str) -> None:
    """Put the new namespace ``lan`` behind ``router`` on a private network that ``router`` masquerades
    on its uplink and forwards nothing into."""
    assert IPTABLES is not None
    subprocess.run(["ip", "netns", "add", lan], check=True, timeout=20)
    for argv in (
        ["ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", lan],
        ["ip", "-n", router, "addr", "add", f"{LAN[0]}/24", "dev", "lan0"],
        ["ip", "-n", router, "link", "set", "lan0", "up"],
        ["ip", "-n", lan, "addr", "add", f"{LAN[1]}/24", "dev", "eth0"],
        ["ip", "-n", lan, "link", "set", "eth0", "up"],
        ["ip", "-n", lan, "link", "set", "lo", "up"],
        ["ip", "-n", lan, "route", "add", "default", "via", LAN[0]],
    ):
        subprocess.run(argv, check=True, timeout=20, capture_output=True)
    netns_run(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    netns_run(
        router,
        IPTABLES,
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-o",
        "eth0",
        "-s",
        f"{LAN[1]}/32",
        "-j",
        "MASQUERADE",
    )


def remove_namespace(name: str) -> None:
    """Kill what still runs in namespace ``name`` and delete it (its veth goes with it)."""
    listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=20)
    for pid in listed.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            continue  # exited meanwhile
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


LISTEN_ONCE = (
    "import socket, sys\n"
    "s = socket.create_server(('0.0.0.0', int(sys.argv[1]))); s.settimeout(8)\n"
    "print('listening', flush=True)\n"
    "try:\n    s.accept()\nexcept OSError:\n    pass\n"
)
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"


def connects(source: str, target: str, listen_port: int, host: str, port: int) -> bool:
    """Whether a process in namespace ``source`` opens a TCP connection to ``host:port`` while one in
    namespace ``target`` listens on ``listen_port``."""
    listener = subprocess.Popen(
        ["ip", "netns", "exec", target, sys.executable, "-c", LISTEN_ONCE, str(listen_port)],
        stdout=subprocess.PIPE,
    )
    try:
        assert listener.stdout is not None and listener.stdout.readline().strip() == b"listening"
        probe = subprocess.run(
            ["ip", "netns", "exec", source, sys.executable, "-c", CONNECT, host, str(port)],
            capture_output=True, timeout=20,
        )  # fmt: skip
        return probe.returncode == 0
    finally:
        listener.kill()
        listener.wait(10)


def dnat_connections(namespace: str) -> dict[int, int]:
    """Connections each DNAT rule of ``namespace`` let in (the nat table sees a connection's first packet)."""
    assert IPTABLES is not None
    listing = netns_run(namespace, IPTABLES, "-t", "nat", "-L", "PREROUTING", "-v", "-n", "-x")
    counts = {}
    for line in listing.splitlines():
        if "DNAT" in line and (port := re.search(r"dpt:(\d+)", line)):
            counts[int(port[1])] = int(line.split()[0])
    return counts


@pytest.mark.timeout(240)
@pytest.mark.skipif(_reason is not None, reason=_reason or "")
def test_the_readme_walkthrough_runs_as_written_behind_a_port_mapping_and_a_nat(tmp_path: Path) -> None:
    commands = walkthrough_commands()
    corpus = tmp_path / "text.txt"
    corpus.write_text((REPO_ROOT / "node" / "config.py").read_text() * 8)
    machines = {name: tmp_path / f"machine-{name}" for name in ("A", "B")}
    for directory in machines.values():
        directory.mkdir()
    nodes: list[Node] = []
    with wan_emulator.WanEmulator(2, None, name_prefix="dtwalk") as wan:
        a_namespace, a_address, router = wan.namespace(0), wan.address(0), wan.namespace(1)
        laptop = f"{wan.run_name}-lan"  # B's namespace behind its router (host 1)
        namespaces = {"A": a_namespace, "B": laptop}
        try:
            provider_port_mapping(a_namespace, a_address)
            home_router(router, laptop)
            # The network is as described, before any node runs:
            assert connects(laptop, a_namespace, 7000, a_address, 40100), "A's mapped port must be reachable"
            assert not connects(laptop, a_namespace, 7000, a_address, 7000), "A's inside port must be closed"
            assert not connects(a_namespace, laptop, 7000, LAN[1], 7000), "nobody may have a route to B"
            assert not connects(a_namespace, laptop, 7000, wan.address(1), 7000), (
                "B's router forwards nothing"
            )
            netns_run(a_namespace, str(IPTABLES), "-t", "nat", "-Z", "PREROUTING")  # count the run's only

            def run(machine: str, command: str, log_name: str) -> Node:
                command = command.replace(DOC_ADDRESS, a_address)
                argv = shlex.split(command)
                assert argv[0] == "dtnode"
                env = dict(os.environ, **RUN_SIZE, DTNODE_DATA=str(corpus))
                env["DTNODE_RUN_DIR"] = str(machines[machine] / "run")
                log_path = tmp_path / log_name
                process = fork_node(
                    argv[1:], log_path, netns=namespaces[machine], env=env, cwd=machines[machine]
                )
                node = Node(name=f"{machine}: {command}", run_dir=machines[machine] / "run",
                            process=process, log_path=log_path, argv=argv)  # fmt: skip
                nodes.append(node)
                return node

            keygen = run("A", commands["A"][0], "a-keygen.log")
            assert keygen.wait(60) == 0, tail(keygen)
            a_node = run("A", commands["A"][1], "a.log")
            join_line = re.compile(r"dtnode join --name demo --peers (\S+)")
            wait_for(lambda: join_line.search(a_node.log()) is not None, 60, "A's join command", a_node)
            printed = join_line.search(a_node.log())
            assert printed is not None
            multiaddr = printed[1].split(",")[0]
            peer_id = a_node.identity()["peer_id"]
            assert multiaddr == f"/ip4/{a_address}/tcp/40101/p2p/{peer_id}", a_node.log()
            assert a_node.identity()["grpc_address"] == f"{a_address}:40100"

            shutil.copy2(machines["A"] / "swarm.key", machines["B"] / "swarm.key")  # "over a secure channel"
            b_command = commands["B"][0].replace(DOC_PEER_ID, peer_id)
            b_node = run("B", b_command, "b.log")
            wait_for(lambda: "in client mode" in b_node.log(), 60, "B's banner", b_node)
            assert listening_tcp_sockets(processes_in_groups([b_node.process.pid])) == [], tail(b_node)

            deadline = time.monotonic() + 180
            codes = [node.wait(max(deadline - time.monotonic(), 0.1)) for node in (a_node, b_node)]
            assert codes == [0, 0], f"{tail(a_node)}\n{tail(b_node)}"
            mapped = dnat_connections(a_namespace)
        finally:
            for node in nodes:
                node.signal(signal.SIGKILL)
            remove_namespace(laptop)

    b_id = b_node.identity()["peer_id"]
    a_rounds, b_rounds = a_node.records(), b_node.records()
    assert [r["round"] for r in a_rounds] == [r["round"] for r in b_rounds] == [1, 2], (a_rounds, b_rounds)
    for a_round, b_round in zip(a_rounds, b_rounds, strict=True):
        assert a_round["peers"] == b_round["peers"] == 2, (a_round, b_round)
        assert b_id in a_round["members"] and not a_round["fell_back"] and not b_round["adopted"]
        assert a_round["param_hash"] == b_round["param_hash"]
    assert all(mapped.get(outside, 0) > 0 for outside in FORWARDED), mapped  # B came in through both
    print(f"walkthrough: A {peer_id} at {a_address}:40100/40101, B {b_id} (client, behind a NAT)")
    for a_round in a_rounds:  # B's are equal (asserted above)
        print(
            f"round {a_round['round']}: peers {a_round['peers']}, param_hash {a_round['param_hash'][:12]} on both"
        )
    print(f"connections through A's port mapping: {mapped}")
