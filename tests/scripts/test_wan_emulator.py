"""The WAN emulator against the kernel: connectivity, the tbf cap, partitions, and leaving no trace.

Throughput is checked twice: by the receiver's own clock (from the emulator's probe) and by an
independent wall-clock lower bound here, which no correct cap lets a transfer beat.
"""

from __future__ import annotations

import datetime
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.scripts.script_loader import SCRIPTS_DIR, load_script, script_path

wan_emulator = load_script("wan_emulator")
WanEmulator = wan_emulator.WanEmulator  # loaded by path, so helpers below take it as `Any`

_reason = wan_emulator.unavailable_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")

# Accepts connections forever and answers each with the bytes it received, upper-cased.
_ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        connection, _ = server.accept()
        connection.settimeout(5)
        connection.sendall(connection.recv(1024).upper())
        connection.close()
    """
)
# Exit 0 iff "ping" comes back as "PING" within the timeout.
_ECHO_CLIENT = textwrap.dedent(
    """
    import socket, sys
    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as c:
            c.sendall(b"ping")
            sys.exit(0 if c.recv(1024) == b"PING" else 2)
    except OSError:
        sys.exit(1)
    """
)
ECHO_PORT = 7000


def unique_prefix() -> str:
    return f"dtwt{secrets.token_hex(3)}"


def namespaces_with_prefix(prefix: str) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"{prefix}-")]


def start_echo_server(wan: Any, host: int) -> None:
    """Start the echo server on ``host`` and return once it listens (it prints a line then)."""
    server = wan.popen(
        host,
        [sys.executable, "-c", _ECHO_SERVER, wan.address(host), str(ECHO_PORT)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"


def can_reach(wan: Any, source: int, destination: int, timeout_seconds: float = 1.5) -> bool:
    """One echo round trip from ``source`` to ``destination``'s server within the timeout."""
    client = wan.popen(
        source,
        [sys.executable, "-c", _ECHO_CLIENT, wan.address(destination), str(ECHO_PORT), str(timeout_seconds)],
    )
    return client.wait(timeout=timeout_seconds + 10) == 0


@pytest.mark.timeout(60)
def test_two_hosts_connect_and_have_distinct_addresses() -> None:
    with WanEmulator(2, link_mbit=100, name_prefix=unique_prefix()) as wan:
        assert wan.addresses() == ["10.213.0.1", "10.213.0.2"]
        start_echo_server(wan, 1)
        assert can_reach(wan, 0, 1)


@pytest.mark.timeout(60)
def test_throughput_under_20_mbit_cap_and_after_changing_it() -> None:
    num_bytes = 5_000_000
    with WanEmulator(2, link_mbit=20, name_prefix=unique_prefix()) as wan:
        started = time.monotonic()
        measured = wan_emulator.measure_tcp_mbit(wan, 0, 1, num_bytes)
        wall_seconds = time.monotonic() - started
        assert 0.7 * 20 <= measured <= 1.1 * 20
        # Independent of the probe's clock: 5 MB cannot cross a 20 Mbit/s link faster than this.
        assert wall_seconds >= num_bytes * 8 / (1.1 * 20e6)

        wan.set_link_mbit(0, 40)
        assert 0.7 * 40 <= wan_emulator.measure_tcp_mbit(wan, 0, 1, num_bytes) <= 1.1 * 40
        wan.set_link_mbit(0, None)  # uncapped: far above any cap we use
        assert wan_emulator.measure_tcp_mbit(wan, 0, 1, num_bytes) > 200


@pytest.mark.timeout(60)
def test_only_the_uplink_is_capped_by_default() -> None:
    with WanEmulator(2, link_mbit=20, name_prefix=unique_prefix()) as wan:
        wan.set_link_mbit(1, None)
        assert wan_emulator.measure_tcp_mbit(wan, 1, 0, 5_000_000) > 100  # host 1 -> 0: 1's uplink
        assert wan_emulator.measure_tcp_mbit(wan, 0, 1, 2_500_000) <= 1.1 * 20  # 0's uplink


@pytest.mark.timeout(60)
def test_partition_blocks_traffic_and_heal_restores_it() -> None:
    with WanEmulator(3, link_mbit=None, name_prefix=unique_prefix()) as wan:
        for host in range(3):
            start_echo_server(wan, host)
        assert can_reach(wan, 0, 1) and can_reach(wan, 1, 0)

        wan.isolate({0}, {1})
        assert not can_reach(wan, 0, 1)
        assert not can_reach(wan, 1, 0)
        assert can_reach(wan, 0, 2) and can_reach(wan, 1, 2) and can_reach(wan, 2, 0)

        wan.heal()
        assert can_reach(wan, 0, 1) and can_reach(wan, 1, 0)


@pytest.mark.timeout(60)
def test_isolate_rejects_a_host_on_both_sides() -> None:
    with WanEmulator(2, link_mbit=None, name_prefix=unique_prefix()) as wan:
        with pytest.raises(ValueError):
            wan.isolate({0, 1}, {1})


@pytest.mark.timeout(60)
def test_close_stops_processes_and_removes_namespaces() -> None:
    prefix = unique_prefix()
    wan = WanEmulator(2, link_mbit=10, name_prefix=prefix)
    assert len(namespaces_with_prefix(prefix)) == 3  # two hosts and the switch
    # A shell that ignores SIGTERM and has a child: close() must still get rid of both.
    sleeper = wan.popen(1, ["sh", "-c", "trap '' TERM; sleep 300 & wait"])
    time.sleep(0.3)
    wan.close(grace=datetime.timedelta(seconds=0.5))
    assert sleeper.poll() is not None
    assert namespaces_with_prefix(prefix) == []
    with pytest.raises(RuntimeError):
        wan.popen(0, ["true"])


@pytest.mark.timeout(60)
def test_cli_runs_command_on_every_host_and_cleans_up(tmp_path: Path) -> None:
    prefix = unique_prefix()
    command = (
        'echo "$WAN_HOST_INDEX $WAN_NUM_HOSTS $WAN_ADDRESSES $WAN_HOST_ADDRESS" > "$OUT/$WAN_HOST_INDEX"'
    )
    cli = [sys.executable, str(script_path("wan_emulator")), "--prefix", prefix, "--hosts", "3"]
    completed = subprocess.run(
        [*cli, "--link-mbit", "10", "--", "sh", "-c", command],
        env=dict(os.environ, OUT=str(tmp_path)),
        timeout=50,
    )
    assert completed.returncode == 0
    addresses = "10.213.0.1,10.213.0.2,10.213.0.3"
    for index in range(3):
        assert (tmp_path / str(index)).read_text().split() == [
            str(index),
            "3",
            addresses,
            f"10.213.0.{index + 1}",
        ]
    assert namespaces_with_prefix(prefix) == []


@pytest.mark.timeout(60)
def test_cli_propagates_the_first_failure_and_stops_the_rest() -> None:
    prefix = unique_prefix()
    # Host 1 fails at once; host 0 would sleep far past the test's timeout unless it is killed.
    command = '[ "$WAN_HOST_INDEX" = 1 ] && exit 3; sleep 300'
    cli = [sys.executable, str(script_path("wan_emulator")), "--prefix", prefix, "--hosts", "2"]
    completed = subprocess.run([*cli, "--", "sh", "-c", command], timeout=50)
    assert completed.returncode == 3
    assert namespaces_with_prefix(prefix) == []


@pytest.mark.timeout(60)
def test_sigterm_cleans_up_namespaces_and_processes(tmp_path: Path) -> None:
    prefix = unique_prefix()
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(SCRIPTS_DIR.parent)!r})
        from scripts.tools.wan_emulator import WanEmulator
        wan = WanEmulator(2, 10, name_prefix={prefix!r})
        child = wan.popen(0, ["sleep", "300"])
        print(child.pid, flush=True)
        time.sleep(300)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    child_pid = int(owner.stdout.readline())
    assert len(namespaces_with_prefix(prefix)) == 3
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) == 128 + signal.SIGTERM
    assert namespaces_with_prefix(prefix) == []
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


@pytest.mark.timeout(60)
def test_cleanup_removes_only_dead_runs() -> None:
    prefix = unique_prefix()
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = f"{prefix}-{finished.pid}-abc123-sw"
    live = f"{prefix}-{os.getpid()}-abc123-sw"
    for name in (dead, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert wan_emulator.cleanup_leftovers(prefix) == [dead]
        assert namespaces_with_prefix(prefix) == [live]
        assert wan_emulator.cleanup_leftovers(prefix, force=True) == [live]
    finally:
        for name in namespaces_with_prefix(prefix):
            subprocess.run(["ip", "netns", "del", name], check=True)


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        WanEmulator(0, link_mbit=10)
    with pytest.raises(ValueError):
        WanEmulator(2, link_mbit=-1)
    with pytest.raises(ValueError):
        WanEmulator(2, link_mbit=10, name_prefix="Bad-Prefix")


@pytest.mark.timeout(60)
def test_cli_ctrl_c_stops_hosts_and_cleans_up(tmp_path: Path) -> None:
    prefix = unique_prefix()
    started_flag = tmp_path / "started"
    command = f"touch {started_flag}; sleep 300"
    cli = [sys.executable, str(script_path("wan_emulator")), "--prefix", prefix, "--hosts", "2"]
    launcher = subprocess.Popen([*cli, "--", "sh", "-c", command])
    deadline = time.monotonic() + 30
    while not started_flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started_flag.exists()
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=30) == 128 + signal.SIGINT
    assert namespaces_with_prefix(prefix) == []
