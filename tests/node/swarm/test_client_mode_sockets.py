"""A ``--client-mode`` node accepts no connections, so it listens on nothing: none of its processes
(the node, its DHT process, their p2p daemon) holds a TCP socket in LISTEN state, from its start to
its rounds, while the ordinary node it joined listens on its gRPC and DHT ports (the check sees
sockets where there are some); `dtnode health` answers for it from its run dir's liveness file. Listening sockets are read from /proc: each process's socket fds
matched against its network namespace's TCP tables (``tests/scripts/processes.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from node.ops.cli import main
from node.ops.liveness import LIVENESS_FILE
from node.ops.status import address_from_run_dir
from tests.node.swarm_cluster import Cluster, tail, wait_for
from tests.scripts.processes import listening_tcp_sockets, processes_in_groups

ROUNDS = 20  # 3 steps each: seconds of training after the first round, where `dtnode health` asks


@pytest.mark.timeout(150)
def test_a_client_mode_node_listens_on_no_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with Cluster(tmp_path, forked=True) as cluster:
        flags = ["--max-rounds", str(ROUNDS), "--inner-steps", "3", "--start-peers", "2"]
        server = cluster.start([*flags, "--listen", "127.0.0.1:0", "--dht-listen", "127.0.0.1:0"])
        peers = cluster.first_multiaddr(server)
        client = cluster.start([*flags, "--client-mode"], peers=peers)  # --listen 0.0.0.0:0 by default
        wait_for(lambda: "in client mode" in client.log(), 60, "the client's banner", client)

        def listening(node_pid: int) -> list[str]:
            return listening_tcp_sockets(processes_in_groups([node_pid]))  # a node leads its group

        server_ports = listening(server.process.pid)
        grpc_port = server.identity()["grpc_address"].rpartition(":")[2]
        assert f"127.0.0.1:{grpc_port}" in server_ports, server_ports
        assert len(server_ports) >= 2, server_ports  # the gRPC server and the p2p daemon
        assert listening(client.process.pid) == [], tail(client)
        assert client.identity()["grpc_address"] is None and client.identity()["client_mode"] is True
        with pytest.raises(ValueError, match="--client-mode node's: it listens on no port"):
            address_from_run_dir(client.run_dir)  # what `dtnode status` without an address reads

        wait_for(lambda: len(client.records()) >= 1, 90, "the client's first round", client)
        assert listening(client.process.pid) == [], tail(client)
        # `dtnode health` without ADDR (the image's HEALTHCHECK): no port to ask, so its liveness file
        # answers; its first round was with its peer (a moment ago) and rounds 2..ROUNDS are still to
        # come (with 2 rounds, the node had stopped before the check on a quiet machine once).
        monkeypatch.setenv("DTNODE_RUN_DIR", str(client.run_dir))
        assert main(["health"]) == 0, capsys.readouterr().out + tail(client)
        healthy = capsys.readouterr().out
        assert re.search(
            r": training at round \d+ step \d+; .* round with a peer \d+ s ago$", healthy.strip()
        ), healthy
        codes = cluster.wait_all(90)
    assert codes == [0, 0], tail(client)
    assert main(["health"]) == 1  # the node stopped
    assert (
        capsys.readouterr().out.strip()
        == f"{client.run_dir / LIVENESS_FILE}: stopped at round {ROUNDS} step {3 * ROUNDS}"
    )
    rounds = [record for record in client.records()]
    assert [record["round"] for record in rounds] == list(range(1, ROUNDS + 1))
    assert all(record["peers"] == 2 for record in rounds), rounds
