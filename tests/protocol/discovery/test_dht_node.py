"""DhtNode: address flags, announced addresses, bounded startup against unreachable peers, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from protocol.discovery.addresses import announce_multiaddr, listen_multiaddr, parse_host_port
from protocol.discovery.dht_node import DhtConfig, DhtNode, DhtStartupError
from tests.protocol.discovery.support import live_processes_in_group, poll

# A well-formed peer id nobody in these tests owns.
NOBODY = "12D3KooWMuv7gDCCfsaTuAsYXbh7jikSCtJDwxVgxnrhuHCkbgV2"


def our_daemons() -> set[int]:
    """p2pd processes started from this test process: they share its process group and, under
    pytest-xdist (whose workers share one group and run DHT tests of their own), its worker id."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return {
        pid
        for pid in live_processes_in_group(os.getpgrp(), name="p2pd")
        if worker is None or environment_of(pid).get("PYTEST_XDIST_WORKER") == worker
    }


def environment_of(pid: int) -> dict[str, str]:
    """The environment ``pid`` started with (empty if it has exited since it was listed)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as environ:
            entries = environ.read().split(b"\0")
    except (FileNotFoundError, ProcessLookupError):
        return {}
    pairs = (entry.decode(errors="replace").partition("=") for entry in entries if entry)
    return {name: value for name, _, value in pairs}


def no_new_daemons(before: set[int]) -> set[int]:
    """Daemons started since ``before`` that are still alive (after a short grace)."""
    return poll(lambda: our_daemons() - before, lambda extra: not extra, within=timedelta(seconds=3))


@pytest.mark.timeout(10)
def test_address_flags() -> None:
    assert parse_host_port("[::1]:80", flag="--listen") == ("::1", 80)
    assert listen_multiaddr("127.0.0.1:0") == "/ip4/127.0.0.1/tcp/0"
    assert listen_multiaddr("0.0.0.0:4100") == "/ip4/0.0.0.0/tcp/4100"
    assert listen_multiaddr("[::1]:4100") == "/ip6/::1/tcp/4100"
    assert announce_multiaddr("10.1.2.3:4100") == "/ip4/10.1.2.3/tcp/4100"
    assert announce_multiaddr("peer_a.swarm:4100") == "/dns/peer_a.swarm/tcp/4100"
    for bad in ("127.0.0.1", "127.0.0.1:70000", ":80", "host:port"):
        with pytest.raises(ValueError, match="--listen"):
            listen_multiaddr(bad)
    with pytest.raises(ValueError, match="IP address"):
        listen_multiaddr("localhost:80")
    with pytest.raises(ValueError, match="not 0"):
        announce_multiaddr("10.1.2.3:0")
    with pytest.raises(ValueError, match="DNS name"):
        announce_multiaddr("bad host!:80")


@pytest.mark.timeout(10)
def test_config_rejects_bad_peers_and_timeouts() -> None:
    with pytest.raises(ValueError, match="lacks /p2p/"):
        DhtConfig(initial_peers=("/ip4/127.0.0.1/tcp/4100",))
    with pytest.raises(ValueError, match="not a multiaddr"):
        DhtConfig(initial_peers=("127.0.0.1:4100",))
    with pytest.raises(ValueError, match="not one string"):
        DhtConfig(initial_peers=f"/ip4/127.0.0.1/tcp/1/p2p/{NOBODY}")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="startup_timeout"):
        DhtConfig(startup_timeout=timedelta(0))
    config = DhtConfig(initial_peers=(f"/ip4/127.0.0.1/tcp/1/p2p/{NOBODY}",))
    assert (
        config.hivemind_kwargs()["nat_port_map"] is False and config.hivemind_kwargs()["use_relay"] is False
    )


@pytest.mark.timeout(30)
def test_announced_address_is_what_others_are_told_and_shutdown_stops_p2pd() -> None:
    before = our_daemons()
    with DhtNode(DhtConfig(listen="127.0.0.1:0", announce="127.0.0.1:4444")) as node:
        assert node.visible_multiaddrs() == [f"/ip4/127.0.0.1/tcp/4444/p2p/{node.peer_id}"]
        assert len(our_daemons() - before) == 1
    assert not node.is_alive()
    assert not no_new_daemons(before)


@pytest.mark.timeout(30)
def test_joining_a_peer_nobody_listens_for_fails_fast_and_clearly() -> None:
    with socket.socket() as probe:  # a loopback port that was free a moment ago and has no listener
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{NOBODY}"
    before = our_daemons()
    started = time.monotonic()
    with pytest.raises(DhtStartupError, match="could be reached") as failure:
        DhtNode(DhtConfig(initial_peers=(address,), startup_timeout=timedelta(seconds=10)))
    elapsed = time.monotonic() - started
    assert address in str(failure.value)
    assert elapsed < 10.0
    assert not no_new_daemons(before)


@pytest.mark.timeout(30)
def test_startup_deadline_holds_against_a_peer_that_never_answers() -> None:
    before = our_daemons()
    with socket.socket() as silent:  # accepts TCP connections (the kernel does) but never speaks
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{NOBODY}"
        started = time.monotonic()
        with pytest.raises(DhtStartupError, match="did not start within 0:00:02") as failure:
            DhtNode(DhtConfig(initial_peers=(address,), startup_timeout=timedelta(seconds=2)))
        elapsed = time.monotonic() - started
    assert address in str(failure.value)
    # The deadline, plus killing the DHT process and its daemon (seconds on a loaded machine, where
    # parallel tests share the cores); still under the default 20 s, so an ignored deadline fails.
    assert elapsed < 2.0 + 12.0
    assert not no_new_daemons(before)


HOLDER = """
import sys, time
from protocol.discovery.dht_node import DhtConfig, DhtNode
node = DhtNode(DhtConfig(listen="127.0.0.1:0"))
print(node.pid, flush=True)
time.sleep(60)  # until the test SIGKILLs us
"""


@contextlib.contextmanager
def holder_process(code: str) -> Iterator[subprocess.Popen[str]]:
    """``python -c CODE`` in a session of its own, once it printed its DHT process's pid and that process
    and its p2pd run in its group; the whole group is killed on the way out."""
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert holder.stdout is not None
        dht_pid = int(holder.stdout.readline())
        group = live_processes_in_group(holder.pid)  # the holder, its DHT process and its p2pd
        assert dht_pid in group and live_processes_in_group(holder.pid, name="p2pd")
        yield holder
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(holder.pid, signal.SIGKILL)


def left_in_group(holder: subprocess.Popen[str]) -> set[int]:
    """What still runs in the holder's group after a grace of 10 s (empty once all stopped)."""
    return poll(
        lambda: live_processes_in_group(holder.pid), lambda alive: not alive, within=timedelta(seconds=10)
    )


@pytest.mark.timeout(60)
def test_a_sigkilled_owner_takes_its_dht_process_and_p2pd_with_it() -> None:
    """Nothing of a crashed node keeps serving: its DHT process and p2p daemon stop within seconds."""
    with holder_process(HOLDER) as holder:
        holder.kill()
        holder.wait(10)
        left = left_in_group(holder)
        assert not left, f"still running after their owner was SIGKILLed: {left}"


SIGNALLED_HOLDER = """
import signal, sys, threading, time
from datetime import timedelta
from hivemind.utils import get_dht_time
from protocol.discovery.dht_node import DhtConfig, DhtNode
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *_: stop.set())
node = DhtNode(DhtConfig(listen="127.0.0.1:0"))
print(node.pid, flush=True)
stop.wait(50)
time.sleep(0.5)  # the signal has reached every process of the group by now
started = time.monotonic()
stored = node.store("left", "tombstone", expiration_time=get_dht_time() + 60, timeout=timedelta(seconds=10))
print(stored, time.monotonic() - started, flush=True)
node.shutdown()
"""


@pytest.mark.timeout(60)
def test_a_sigterm_to_the_whole_group_leaves_the_dht_up_until_its_owner_shuts_it_down() -> None:
    """systemd, a terminal or the launcher signal a node's whole process group: the DHT process and its
    p2p daemon must outlive the signal, so the node can still store its 'left' tombstone through them."""
    with holder_process(SIGNALLED_HOLDER) as holder:
        assert holder.stdout is not None
        os.killpg(holder.pid, signal.SIGTERM)
        stored, seconds = holder.stdout.readline().split()
        assert stored == "True" and float(seconds) < 5, (stored, seconds)
        assert holder.wait(20) == 0
        left = left_in_group(holder)
        assert not left, f"still running after their owner shut them down: {left}"


@pytest.mark.timeout(60)
def test_a_call_to_a_dead_dht_process_fails_at_once_not_at_its_deadline() -> None:
    from hivemind.utils import get_dht_time

    from protocol.discovery.dht_node import DhtCallTimeout

    before = our_daemons()
    node = DhtNode(DhtConfig(listen="127.0.0.1:0"))
    daemons = our_daemons() - before
    try:
        assert node.pid is not None and len(daemons) == 1
        os.kill(node.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(DhtCallTimeout, match="the DHT process is gone"):
            node.store("k", "v", expiration_time=get_dht_time() + 60, timeout=timedelta(seconds=30))
        assert time.monotonic() - started < 5
    finally:
        node.shutdown()
        for pid in daemons:  # orphaned with its DHT process gone: not a child of anyone we hold
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
