"""scripts/tools/port_forward.py: bytes go both ways through the forward, each connection is logged,
a malformed pair is refused, SIGTERM stops it with exit 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading

import pytest

from tests.scripts.script_loader import load_script, script_path

port_forward = load_script("port_forward")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_malformed_pairs_are_refused() -> None:
    assert port_forward.parse_pair("10.0.0.1:40100=127.0.0.1:7000") == (
        ("10.0.0.1", 40100),
        ("127.0.0.1", 7000),
    )
    for bad in ("10.0.0.1:40100", "10.0.0.1:0=127.0.0.1:7000", "10.0.0.1:40100=127.0.0.1", ":1=a:2"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            port_forward.parse_pair(bad)


@pytest.mark.timeout(30)
def test_bytes_go_both_ways_through_the_forward() -> None:
    target = socket.create_server(("127.0.0.1", 0))
    target.settimeout(10)
    target_port = target.getsockname()[1]

    def echo_reversed() -> None:
        connection, _ = target.accept()
        with connection:
            connection.settimeout(10)
            received = b""
            while chunk := connection.recv(65536):  # until the client half-closes
                received += chunk
            connection.sendall(received[::-1])

    server = threading.Thread(target=echo_reversed, daemon=True)
    server.start()
    outside = free_port()
    forward = subprocess.Popen(
        [sys.executable, str(script_path("port_forward")), f"127.0.0.1:{outside}=127.0.0.1:{target_port}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert forward.stdout is not None
        assert (
            forward.stdout.readline().strip() == f"forwarding 127.0.0.1:{outside} -> 127.0.0.1:{target_port}"
        )
        payload = bytes(range(256)) * 4096  # 1 MiB
        with socket.create_connection(("127.0.0.1", outside), timeout=10) as client:
            client.sendall(payload)
            client.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := client.recv(65536):
                answer += chunk
            local_port = client.getsockname()[1]
        assert answer == payload[::-1]
        line = forward.stdout.readline().strip()
        assert line == f"127.0.0.1:{outside}: 127.0.0.1:{local_port} -> 127.0.0.1:{target_port}"
        forward.send_signal(signal.SIGTERM)
        assert forward.wait(10) == 0
    finally:
        if forward.poll() is None:
            forward.kill()
            forward.wait(10)
        target.close()
