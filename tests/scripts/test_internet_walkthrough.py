"""README's "Two machines over the internet" walkthrough, run as written on two hosts of the WAN emulator.

The commands are read from README.md (the ``console`` block between the walkthrough markers) and run
verbatim, each on its machine and in that machine's own directory; the only substitutions are the
documentation's addresses: 203.0.113.7 (A's public address) becomes host A's emulated address, and
the placeholder peer id ``12D3KooWA…`` in B's ``--peers`` the one A printed. The size of the run
(a nano model for 2 rounds of a few steps on a small text file) and the run dirs come from
``DTNODE_*`` variables, which flags outrank, so no flag of the walkthrough is changed.

The network is what the walkthrough describes:

- A's provider maps public ports 40100 and 40101 to A's 7000 and 7001: a user-space port forward
  (``scripts/tools/port_forward.py``) on A, and B's uplink drops every packet to A's 7000 and 7001,
  so every byte B exchanges with A goes through the outside ports A announces;
- B is a laptop nobody can connect to: its uplink drops every SYN-ACK it would send (no TCP
  connection toward it can open), and its node listens on no port anyway (checked from /proc).

Both nodes must be in both rounds (B's peer id among the members of each of A's rounds), end on one
param_hash each round, and the forward must have carried B's connections to both outside ports.
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

from tests.node.swarm.test_client_mode_nat import refuse_inbound, tcp_connects
from tests.node.swarm_cluster import REPO_ROOT, Node, fork_node, tail, wait_for
from tests.scripts.processes import listening_tcp_sockets, processes_in_groups
from tests.scripts.script_loader import load_script, script_path

wan_emulator = load_script("wan_emulator")
_reason = wan_emulator.unavailable_reason()

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


def block_ports(wan: object, source: int, destination: int, ports: list[int]) -> None:
    """Host ``source`` drops every packet it sends to ``destination``'s TCP ``ports`` (the black hole)."""
    address = wan.address(destination)  # type: ignore[attr-defined]
    for port in ports:
        match = ["match", "ip", "dst", f"{address}/32", "match", "ip", "protocol", "6", "0xff",
                 "match", "ip", "dport", str(port), "0xffff"]  # fmt: skip
        subprocess.run(
            ["ip", "netns", "exec", wan.namespace(source), "tc", "filter", "add", "dev", "eth0",  # type: ignore[attr-defined]
             "parent", "1:", "protocol", "ip", "prio", "6", "u32", *match, "flowid", "1:2"],
            check=True, timeout=20,
        )  # fmt: skip


def connects_to_port(wan: object, source: int, destination: int, port: int) -> bool:
    """Whether host ``source`` opens a TCP connection to ``destination:port`` within 2 s."""
    probe = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2)"
    done = subprocess.run(
        ["ip", "netns", "exec", wan.namespace(source), sys.executable, "-c", probe,  # type: ignore[attr-defined]
         wan.address(destination), str(port)],  # type: ignore[attr-defined]
        capture_output=True, timeout=20,
    )  # fmt: skip
    return done.returncode == 0


@pytest.mark.timeout(240)
@pytest.mark.skipif(_reason is not None, reason=_reason or "")
def test_the_readme_walkthrough_runs_as_written_behind_a_port_forward_and_a_nat(tmp_path: Path) -> None:
    commands = walkthrough_commands()
    corpus = tmp_path / "text.txt"
    corpus.write_text((REPO_ROOT / "node" / "config.py").read_text() * 8)
    machines = {name: tmp_path / f"machine-{name}" for name in ("A", "B")}
    for directory in machines.values():
        directory.mkdir()
    nodes: list[Node] = []
    with wan_emulator.WanEmulator(2, None, name_prefix="dtwalk") as wan:
        a_address = wan.address(0)
        forward = wan.popen(
            0,
            [sys.executable, str(script_path("port_forward")),
             *(f"{a_address}:{outside}=127.0.0.1:{inside}" for outside, inside in FORWARDED.items())],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        try:
            assert forward.stdout is not None
            for _ in FORWARDED:
                assert forward.stdout.readline().startswith("forwarding "), "the port forward did not start"
            block_ports(wan, 1, 0, list(FORWARDED.values()))  # B reaches A through the outside ports only
            refuse_inbound(wan, 1)  # nobody can connect to B
            assert not tcp_connects(wan, 0, 1), "B must refuse inbound connections"
            assert tcp_connects(wan, 1, 0), "B must still open connections itself"

            def run(machine: str, index: int, command: str, log_name: str) -> Node:
                command = command.replace(DOC_ADDRESS, wan.address(0))
                argv = shlex.split(command)
                assert argv[0] == "dtnode"
                env = dict(os.environ, **RUN_SIZE, DTNODE_DATA=str(corpus))
                env["DTNODE_RUN_DIR"] = str(machines[machine] / "run")
                log_path = tmp_path / log_name
                process = fork_node(
                    argv[1:], log_path, netns=wan.namespace(index), env=env, cwd=machines[machine]
                )
                node = Node(name=f"{machine}: {command}", run_dir=machines[machine] / "run",
                            process=process, log_path=log_path, argv=argv)  # fmt: skip
                nodes.append(node)
                return node

            keygen = run("A", 0, commands["A"][0], "a-keygen.log")
            assert keygen.wait(60) == 0, tail(keygen)
            a_node = run("A", 0, commands["A"][1], "a.log")
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
            b_node = run("B", 1, b_command, "b.log")
            wait_for(lambda: "in client mode" in b_node.log(), 60, "B's banner", b_node)
            assert listening_tcp_sockets(processes_in_groups([b_node.process.pid])) == [], tail(b_node)

            deadline = time.monotonic() + 180
            codes = [node.wait(max(deadline - time.monotonic(), 0.1)) for node in (a_node, b_node)]
            assert codes == [0, 0], f"{tail(a_node)}\n{tail(b_node)}"
        finally:
            for node in nodes:
                node.signal(signal.SIGKILL)
            forward.send_signal(signal.SIGTERM)
            forwarded, _ = forward.communicate(timeout=20)

    b_id = b_node.identity()["peer_id"]
    a_rounds, b_rounds = a_node.records(), b_node.records()
    assert [r["round"] for r in a_rounds] == [r["round"] for r in b_rounds] == [1, 2], (a_rounds, b_rounds)
    for a_round, b_round in zip(a_rounds, b_rounds, strict=True):
        assert a_round["peers"] == b_round["peers"] == 2, (a_round, b_round)
        assert b_id in a_round["members"] and not a_round["fell_back"] and not b_round["adopted"]
        assert a_round["param_hash"] == b_round["param_hash"]
    b_address = wan.address(1)
    for outside in FORWARDED:  # B's connections came in through both outside ports
        assert re.search(rf"{re.escape(a_address)}:{outside}: {re.escape(b_address)}:\d+ ->", forwarded), (
            forwarded
        )
    print(f"walkthrough: A {a_node.identity()['peer_id']} at {a_address}:40100/40101, B {b_id} (client)")
    for a_round in a_rounds:  # B's are equal (asserted above)
        print(
            f"round {a_round['round']}: peers {a_round['peers']}, param_hash {a_round['param_hash'][:12]} on both"
        )
    print(f"forwarded connections from B: {len(re.findall(re.escape(b_address) + ':', forwarded))}")
