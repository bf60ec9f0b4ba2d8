"""Finding the processes a benchmark started, to check it stopped every one of them, and the TCP ports
they listen on."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path


def processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains ``text`` (e.g. a run dir only the benchmark's nodes use)."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # exited while we looked
    return pids


def kill_processes_mentioning(text: str) -> None:
    """SIGKILL every process whose command line contains ``text``: a failed test's leftovers."""
    for pid in processes_mentioning(text):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue  # exited meanwhile


def processes_in_groups(process_groups: list[int]) -> list[int]:
    """Pids of the live (not zombie) processes in one of ``process_groups`` (a node's group holds its DHT
    process and p2pd: what a forked node's command line cannot name)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # Fields after "(comm)": state, ppid, pgrp, ...; comm may itself contain spaces or parens.
            state, _, process_group = stat.read_text().rpartition(")")[2].split()[:3]
        except (OSError, ValueError):
            continue  # exited while we looked
        if state != "Z" and int(process_group) in process_groups:
            pids.append(int(stat.parent.name))
    return pids


def kill_process_groups(process_groups: list[int]) -> None:
    """SIGKILL every process of ``process_groups``: a failed test's leftovers."""
    for group in process_groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            continue  # gone already


_TCP_LISTEN = "0A"  # the kernel's TCP_LISTEN state, as /proc/net/tcp prints it


def _socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets ``pid`` holds open (its fds that link to ``socket:[INODE]``)."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue  # closed while we looked
            if target.startswith("socket:["):
                inodes.add(int(target[len("socket:[") : -1]))
    except OSError:
        return inodes  # exited while we looked: what we saw so far
    return inodes


def _hex_address(text: str) -> str:
    """``HOST:PORT`` from /proc/net/tcp{,6}'s ``0100007F:1F40`` (each 32-bit word in host byte order);
    an IPv4-mapped IPv6 address (a dual-stack socket bound to an IPv4 address) as the IPv4 one."""
    host_hex, port_hex = text.split(":")
    words = [bytes.fromhex(host_hex[i : i + 8])[::-1] for i in range(0, len(host_hex), 8)]
    packed = b"".join(words)
    if len(packed) == 16 and packed[:12] == bytes(10) + b"\xff\xff":
        packed = packed[12:]
    host = socket.inet_ntop(socket.AF_INET if len(packed) == 4 else socket.AF_INET6, packed)
    return f"{host}:{int(port_hex, 16)}" if len(packed) == 4 else f"[{host}]:{int(port_hex, 16)}"


def listening_tcp_sockets(pids: list[int]) -> list[str]:
    """The TCP sockets in LISTEN state that any of ``pids`` holds (``HOST:PORT`` each, sorted): their
    fds' socket inodes matched against /proc/<pid>/net/tcp and tcp6 (the tables of each one's own
    network namespace)."""
    listening = set()
    for pid in pids:
        inodes = _socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue  # exited, or no IPv6
            for line in lines:
                fields = line.split()  # sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
                if fields[3] == _TCP_LISTEN and int(fields[9]) in inodes:
                    listening.add(_hex_address(fields[1]))
    return sorted(listening)
