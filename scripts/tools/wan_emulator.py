"""WAN emulator: N hosts in Linux network namespaces behind one switch, each behind a capped uplink.

Topology of one run (every name carries ``<prefix>-<owner pid>-<token>`` so parallel runs never
collide and ``--cleanup`` can tell a crashed run's leftovers from a live one):

    namespace ...-sw : bridge "br0" with one port "p<i>" per host         (the switch)
    namespace ...-h<i>: "lo" and "eth0" = 10.213.0.<i+1>/24, veth peer of "p<i>"   (host i)

Nothing is created in the caller's namespace, so the host's firewall (e.g. Docker's FORWARD policy
applied to bridged traffic) cannot interfere, and deleting the namespaces removes every interface.

Shaping (the kernel here has tbf, htb, pfifo and the u32 classifier, but neither netem nor
prio/gact), on host i's ``eth0`` egress, i.e. its uplink:

    root 1: htb default 1          a classifier container; its classes are rated far above any cap
      class 1:1 -> 10: tbf rate <link_mbit>   (pfifo when uncapped): all normal traffic
      class 1:2 -> 20: pfifo limit 0          a black hole: u32 filters "dst = peer" send a
                                              partitioned pair's packets here, dropped silently,
                                              so TCP sees a real partition (retransmits, timeouts)

With ``cap_downlink=True`` the switch port ``p<i>`` gets the same tbf, capping what host i receives.
One-way latency and loss are NOT emulated (netem is missing and a user-space delay proxy is not
worth its cost yet): links have LAN latency and only bandwidth is constrained.

Used as a module (``with WanEmulator(4, link_mbit=100) as wan: wan.popen(0, [...])``) and as a CLI:

    python scripts/tools/wan_emulator.py --hosts 4 --link-mbit 100 -- python train.py
    python scripts/tools/wan_emulator.py --hosts 2 --link-mbit 20 --measure-mbytes 5
    python scripts/tools/wan_emulator.py --cleanup

The CLI runs CMD once per namespace with WAN_HOST_INDEX, WAN_NUM_HOSTS, WAN_ADDRESSES (comma list)
and WAN_HOST_ADDRESS set, fails fast (kills the others when one host's command fails) and exits with
the first failing host's status. Needs root, ``ip`` and ``tc`` (iproute2).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import datetime
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from types import FrameType, TracebackType

SUBNET_PREFIX = "10.213.0."  # a private /24 that exists only inside our own namespaces
MAX_HOSTS = 250
CLONE_NEWNET = 0x40000000  # setns(2): the descriptor names a network namespace
DEFAULT_NAME_PREFIX = "dtwan"
COMMAND_TIMEOUT = datetime.timedelta(seconds=20)
STOP_GRACE = datetime.timedelta(seconds=3)
# A tbf queue holds ~100 ms of traffic at the cap (a typical home uplink buffer), at least 64 KiB.
QUEUE_SECONDS = 0.1
MIN_QUEUE_BYTES = 64 * 1024
MIN_BURST_BYTES = 32 * 1024
UNCAPPED_FIFO_PACKETS = 1000
_NAME_PATTERN = re.compile(r"^(?P<prefix>[a-z0-9]+)-(?P<pid>\d+)-(?P<token>[0-9a-f]+)-(?P<role>sw|h\d+)$")

_live_emulators: set[WanEmulator] = set()
_registry_lock = threading.Lock()


def unavailable_reason() -> str | None:
    """Why this machine cannot run the emulator (not root, iproute2 missing), or None if it can."""
    if os.geteuid() != 0:
        return "the WAN emulator needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the WAN emulator needs `{tool}` (iproute2)"
    return None


def _run(argv: Sequence[str], timeout: datetime.timedelta = COMMAND_TIMEOUT) -> str:
    completed = subprocess.run(argv, capture_output=True, text=True, timeout=timeout.total_seconds())
    if completed.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({completed.returncode}): {completed.stderr.strip()}")
    return completed.stdout


def _ip(namespace: str, *args: str) -> None:
    _run(["ip", "-n", namespace, *args])


def _tc(namespace: str, *args: str) -> None:
    _run(["tc", "-n", namespace, *args])


def _tbf_args(mbit: float) -> list[str]:
    rate_bytes_per_second = mbit * 1e6 / 8
    burst_bytes = max(MIN_BURST_BYTES, int(rate_bytes_per_second * 0.004))  # >= 4 ms of traffic
    limit_bytes = burst_bytes + max(MIN_QUEUE_BYTES, int(rate_bytes_per_second * QUEUE_SECONDS))
    return ["tbf", "rate", f"{int(mbit * 1e6)}bit", "burst", str(burst_bytes), "limit", str(limit_bytes)]


def _list_namespaces() -> list[str]:
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).splitlines() if line.strip()]


def _kill_namespace_processes(namespace: str) -> None:
    """SIGKILL whatever still runs inside ``namespace`` (e.g. a daemon that left its process group)."""
    for pid_text in _run(["ip", "netns", "pids", namespace]).split():
        try:
            os.kill(int(pid_text), signal.SIGKILL)
        except ProcessLookupError:
            continue  # exited meanwhile


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_leftovers(name_prefix: str = DEFAULT_NAME_PREFIX, *, force: bool = False) -> list[str]:
    """Delete namespaces of runs whose owner process is gone (all runs with ``force``); returns them."""
    removed = []
    for namespace in _list_namespaces():
        match = _NAME_PATTERN.match(namespace)
        if match is None or match["prefix"] != name_prefix:
            continue
        if not force and _pid_alive(int(match["pid"])):
            continue
        _kill_namespace_processes(namespace)
        _run(["ip", "netns", "del", namespace])
        removed.append(namespace)
    return removed


def enter_network_namespace(name: str) -> None:
    """As ``ip netns exec NAME`` does for its command: this process, and whatever it starts from now
    on, opens its sockets in the named network namespace. Only for a process with one thread (a
    namespace is entered per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


class WanEmulator:
    """``num_hosts`` network namespaces on one bridge, each uplink capped at ``link_mbit`` (None: uncapped).

    Use as a context manager; ``close`` (also run at exit and on SIGTERM) stops every process started
    with ``popen`` and removes all namespaces and interfaces.
    """

    def __init__(
        self,
        num_hosts: int,
        link_mbit: float | None,
        *,
        name_prefix: str = DEFAULT_NAME_PREFIX,
        cap_downlink: bool = False,
    ) -> None:
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [1, {MAX_HOSTS}], got {num_hosts}")
        if link_mbit is not None and link_mbit <= 0:
            raise ValueError(f"link_mbit must be positive or None, got {link_mbit}")
        if not re.fullmatch(r"[a-z0-9]{1,16}", name_prefix):
            raise ValueError(f"name_prefix must be 1-16 lowercase letters/digits, got {name_prefix!r}")
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.num_hosts = num_hosts
        self.cap_downlink = cap_downlink
        self.run_name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch_namespace = f"{self.run_name}-sw"
        self.host_namespaces = [f"{self.run_name}-h{index}" for index in range(num_hosts)]
        self._link_mbit: list[float | None] = [link_mbit] * num_hosts
        self._blocked_pairs: set[tuple[int, int]] = set()
        self._processes: list[subprocess.Popen] = []
        self._closed = False
        with _registry_lock:
            _live_emulators.add(self)
        _install_exit_handlers()
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- construction -------------------------------------------------------------------------
    def _build(self) -> None:
        switch = self.switch_namespace
        _run(["ip", "netns", "add", switch])
        _ip(switch, "link", "add", "name", "br0", "type", "bridge")
        _ip(switch, "link", "set", "br0", "up")
        for index, host in enumerate(self.host_namespaces):
            port = f"p{index}"
            _run(["ip", "netns", "add", host])
            _ip(switch, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0", "netns", host)
            _ip(switch, "link", "set", port, "master", "br0", "up")
            _ip(host, "link", "set", "lo", "up")
            _ip(host, "addr", "add", f"{self.address(index)}/24", "dev", "eth0")
            _ip(host, "link", "set", "eth0", "up")
            _tc(host, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1")
            for class_id in ("1:1", "1:2"):
                htb_class = ["classid", class_id, "htb", "rate", "100gbit", "quantum", "60000"]
                _tc(host, "class", "add", "dev", "eth0", "parent", "1:", *htb_class)
            _tc(host, "qdisc", "add", "dev", "eth0", "parent", "1:2", "handle", "20:", "pfifo", "limit", "0")
            self._apply_cap(index, self._link_mbit[index], replace=False)

    def _apply_cap(self, index: int, mbit: float | None, *, replace: bool) -> None:
        host, leaf = self.host_namespaces[index], ["dev", "eth0", "parent", "1:1", "handle", "10:"]
        if replace:
            _tc(host, "qdisc", "del", *leaf)  # tc cannot `replace` a leaf by one of another kind
        shaper = _tbf_args(mbit) if mbit is not None else ["pfifo", "limit", str(UNCAPPED_FIFO_PACKETS)]
        _tc(host, "qdisc", "add", *leaf, *shaper)
        if self.cap_downlink:
            port = ["dev", f"p{index}", "root"]
            if replace and self._link_mbit[index] is not None:
                _tc(self.switch_namespace, "qdisc", "del", *port)
            if mbit is not None:
                _tc(self.switch_namespace, "qdisc", "add", *port, *_tbf_args(mbit))

    # ---- public API ---------------------------------------------------------------------------
    def address(self, index: int) -> str:
        """IPv4 address of host ``index`` (only reachable from the emulator's own namespaces)."""
        self._check_index(index)
        return f"{SUBNET_PREFIX}{index + 1}"

    def addresses(self) -> list[str]:
        return [self.address(index) for index in range(self.num_hosts)]

    def namespace(self, index: int) -> str:
        self._check_index(index)
        return self.host_namespaces[index]

    def link_mbit(self, index: int) -> float | None:
        self._check_index(index)
        return self._link_mbit[index]

    def popen(self, index: int, argv: Sequence[str], **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside host ``index``'s namespace in its own process group (killed on close)."""
        self._check_open()
        if "start_new_session" in popen_kwargs or "process_group" in popen_kwargs:
            raise ValueError("popen always starts a new session so close() can kill the whole group")
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(index), *argv], start_new_session=True, **popen_kwargs
        )
        self._processes.append(process)
        return process

    def set_link_mbit(self, index: int, mbit: float | None) -> None:
        """Change host ``index``'s cap while traffic flows (None removes it)."""
        self._check_open()
        if mbit is not None and mbit <= 0:
            raise ValueError(f"mbit must be positive or None, got {mbit}")
        self._check_index(index)
        if self._link_mbit[index] is not None and mbit is not None:
            leaf = ["dev", "eth0", "parent", "1:1", "handle", "10:"]
            _tc(self.host_namespaces[index], "qdisc", "change", *leaf, *_tbf_args(mbit))
            if self.cap_downlink:
                _tc(self.switch_namespace, "qdisc", "change", "dev", f"p{index}", "root", *_tbf_args(mbit))
        else:
            self._apply_cap(index, mbit, replace=True)
        self._link_mbit[index] = mbit

    def isolate(self, group_a: Iterable[int], group_b: Iterable[int]) -> None:
        """Partition: every packet between a host of ``group_a`` and one of ``group_b`` is dropped
        silently (both directions); traffic inside each group is unaffected. Cumulative until heal()."""
        self._check_open()
        hosts_a, hosts_b = set(group_a), set(group_b)
        for index in hosts_a | hosts_b:
            self._check_index(index)
        if hosts_a & hosts_b:
            raise ValueError(f"a host cannot be on both sides of a partition: {sorted(hosts_a & hosts_b)}")
        pairs = [(a, b) for a in hosts_a for b in hosts_b]
        for source, destination in pairs + [(b, a) for a, b in pairs]:
            if (source, destination) in self._blocked_pairs:
                continue
            # Packets to the other side go to class 1:2, whose `pfifo limit 0` drops them.
            match = ["u32", "match", "ip", "dst", f"{self.address(destination)}/32", "flowid", "1:2"]
            filter_args = ["dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "10", *match]
            _tc(self.host_namespaces[source], "filter", "add", *filter_args)
            self._blocked_pairs.add((source, destination))

    def heal(self) -> None:
        """Undo every isolate(): all hosts can reach each other again."""
        self._check_open()
        for source in sorted({source for source, _ in self._blocked_pairs}):
            _tc(self.host_namespaces[source], "filter", "del", "dev", "eth0", "parent", "1:")
        self._blocked_pairs.clear()

    def close(self, grace: datetime.timedelta = STOP_GRACE) -> None:
        """Stop every started process group (SIGTERM, then SIGKILL after ``grace``), then delete the
        namespaces (which deletes the veths and the bridge). Idempotent; safe after a failed build."""
        if self._closed:
            return
        self._closed = True
        stop_process_groups(self._processes, grace)
        for namespace in [*self.host_namespaces, self.switch_namespace]:
            if namespace not in _list_namespaces():
                continue  # never created (failed build)
            _kill_namespace_processes(namespace)
            _run(["ip", "netns", "del", namespace])
        with _registry_lock:
            _live_emulators.discard(self)

    def __enter__(self) -> WanEmulator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_hosts:
            raise ValueError(f"host index must be in [0, {self.num_hosts}), got {index}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the WAN emulator is closed")


def stop_process_groups(processes: Sequence[subprocess.Popen], grace: datetime.timedelta) -> None:
    """SIGTERM the process group of each process still running, and SIGKILL those not gone after ``grace``.

    Each process must lead its own group (``start_new_session=True``). The groups share one ``grace``,
    so stopping N of them takes at most ``grace`` plus the SIGKILL reaping, not N times ``grace``.
    """
    running = [process for process in processes if process.poll() is None]
    for process in running:
        _signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace.total_seconds()
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(process.pid, signal.SIGKILL)
            process.wait(timeout=COMMAND_TIMEOUT.total_seconds())
    # Descendants that outlived their group leader are still in the namespace; close() kills those.


def _signal_group(process_group: int, signum: int) -> None:
    try:
        os.killpg(process_group, signum)
    except ProcessLookupError:
        return  # the whole group already exited


def _close_all() -> None:
    with _registry_lock:
        emulators = list(_live_emulators)
    for emulator in emulators:
        emulator.close()


def _raise_system_exit(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds `with` blocks; atexit then closes the rest


_exit_handlers_installed = False


def _install_exit_handlers() -> None:
    """atexit always; SIGTERM only from the main thread and only if nobody else handles it already."""
    global _exit_handlers_installed
    if _exit_handlers_installed:
        return
    _exit_handlers_installed = True
    atexit.register(_close_all)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _raise_system_exit)


# ---- throughput probe -----------------------------------------------------------------------------
_RECEIVER = """
import json, socket, sys, time
server = socket.create_server((sys.argv[1], 0))
server.settimeout(float(sys.argv[2]))
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
connection.settimeout(float(sys.argv[2]))
num_bytes, started = 0, time.perf_counter()
while chunk := connection.recv(1 << 16):
    num_bytes += len(chunk)
print(json.dumps({"bytes": num_bytes, "seconds": time.perf_counter() - started}), flush=True)
"""
_SENDER = """
import socket, sys
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
block, remaining = bytes(1 << 16), int(sys.argv[3])
while remaining > 0:
    connection.sendall(block[:remaining])
    remaining -= len(block)
connection.close()
"""


def measure_tcp_mbit(
    emulator: WanEmulator,
    sender: int,
    receiver: int,
    num_bytes: int,
    timeout: datetime.timedelta = datetime.timedelta(seconds=60),
) -> float:
    """Goodput in Mbit/s of one TCP stream of ``num_bytes`` from host ``sender`` to host ``receiver``,
    timed by the receiver from accept to EOF."""
    seconds = str(timeout.total_seconds())
    receive = emulator.popen(
        receiver,
        [sys.executable, "-c", _RECEIVER, emulator.address(receiver), seconds],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert receive.stdout is not None
    port = receive.stdout.readline().strip()
    if not port:
        raise RuntimeError("throughput receiver did not start")
    send = emulator.popen(
        sender, [sys.executable, "-c", _SENDER, emulator.address(receiver), port, str(num_bytes), seconds]
    )
    send.wait(timeout=timeout.total_seconds())
    result_line, _ = receive.communicate(timeout=timeout.total_seconds())
    if send.returncode != 0 or receive.returncode != 0:
        raise RuntimeError(
            f"throughput probe failed: sender {send.returncode}, receiver {receive.returncode}"
        )
    result = json.loads(result_line)
    if result["bytes"] != num_bytes:
        raise RuntimeError(f"receiver got {result['bytes']} of {num_bytes} bytes")
    return result["bytes"] * 8 / result["seconds"] / 1e6


# ---- CLI ------------------------------------------------------------------------------------------
def run_command_on_all_hosts(
    emulator: WanEmulator, command: Sequence[str], timeout: datetime.timedelta
) -> int:
    """Run ``command`` on every host; fail fast; return the first failing exit status (0 if none)."""
    addresses = ",".join(emulator.addresses())
    processes = []
    for index in range(emulator.num_hosts):
        env = dict(os.environ, WAN_HOST_INDEX=str(index), WAN_NUM_HOSTS=str(emulator.num_hosts))
        env.update(WAN_ADDRESSES=addresses, WAN_HOST_ADDRESS=emulator.address(index))
        processes.append(emulator.popen(index, command, env=env))
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        statuses = [process.poll() for process in processes]
        failed = [status for status in statuses if status not in (None, 0)]
        if failed:
            status = failed[0]
            return 128 - status if status < 0 else status  # killed by signal N -> 128 + N
        if all(status == 0 for status in statuses):
            return 0
        time.sleep(0.05)
    print(f"wan_emulator: command still running after {timeout}, stopping it", file=sys.stderr)
    return 124


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2, help="number of hosts (namespaces)")
    parser.add_argument("--link-mbit", type=float, default=None, help="uplink cap per host; omit for none")
    parser.add_argument("--cap-downlink", action="store_true", help="cap each host's downlink as well")
    parser.add_argument("--prefix", default=DEFAULT_NAME_PREFIX, help="name prefix of namespaces")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before CMD is killed")
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers of dead runs and exit")
    parser.add_argument("--force", action="store_true", help="with --cleanup: also remove live runs")
    parser.add_argument("--measure-mbytes", type=float, default=None, help="measure host0->host1 TCP goodput")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS... to run on every host")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.cleanup:
        for namespace in cleanup_leftovers(args.prefix, force=args.force):
            print(f"removed {namespace}")
        return 0
    if not command and args.measure_mbytes is None:
        parser.error("give -- CMD ARGS..., --measure-mbytes or --cleanup")
    if args.measure_mbytes is not None and args.hosts < 2:
        parser.error("--measure-mbytes needs --hosts >= 2")
    emulator = WanEmulator(
        args.hosts, args.link_mbit, name_prefix=args.prefix, cap_downlink=args.cap_downlink
    )
    try:
        if args.measure_mbytes is not None:
            mbit = measure_tcp_mbit(emulator, 0, 1, int(args.measure_mbytes * 1e6))
            print(json.dumps({"link_mbit": args.link_mbit, "measured_mbit": round(mbit, 2)}))
            return 0
        return run_command_on_all_hosts(emulator, command, datetime.timedelta(seconds=args.timeout))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    finally:
        emulator.close()  # stops every host's command, removes the namespaces


if __name__ == "__main__":
    sys.exit(main())
