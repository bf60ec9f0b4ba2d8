"""``dtnode status [ADDR] [--json]``: a running node's view of the swarm, printed for an operator.

The node answers from memory (``protocol/swarm/status.py``): its own params and phase, the group
of its last round, and every peer of its last DHT view with that peer's round, param_hash,
bandwidth and the age of its last heartbeat. ``ADDR`` is the node's gRPC ``host:port``; without it
the address comes from ``RUN_DIR/node.json``, which ``dtnode join`` writes at start (the run dir
is resolved as ``join`` resolves it: ``--run-dir`` > ``DTNODE_RUN_DIR`` > TOML > ``runs/<name>``).

A node started with ``--tls`` accepts only mutual-TLS connections from holders of the swarm key, so
``auth`` (from ``--swarm-key-file`` / ``--tls``) brings the certificate; without it the handshake fails
at once and the error says which flags a TLS node needs.

Exit codes: 0 with the status printed; 1 if the node cannot be reached (or does not answer) within
``--timeout``; 2 for a user mistake (no ``node.json`` where the run dir says, a malformed one).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from node.ops.cli_errors import error_line
from protocol.auth.channels import SwarmAuth
from protocol.discovery.addresses import split_host_port
from protocol.swarm.status import NodeStatus, StatusUnavailable, get_status

DEFAULT_TIMEOUT = timedelta(seconds=5)
EXIT_UNREACHABLE = 1
SHORT_ID_CHARS = 10  # peer ids share a long prefix ("12D3KooW..."); their tails tell them apart
SHORT_HASH_CHARS = 12


def address_from_run_dir(run_dir: Path) -> str:
    """The ``grpc_address`` a node recorded in ``run_dir/node.json``; ValueError if there is none."""
    path = run_dir / "node.json"
    if not path.exists():
        raise ValueError(
            f"no {path}: start a node there with `dtnode join`, or pass its gRPC address (HOST:PORT)"
        )
    try:
        identity = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    address = identity.get("grpc_address") if isinstance(identity, dict) else None
    if isinstance(identity, dict) and identity.get("client_mode"):
        raise ValueError(
            f"{path} is a --client-mode node's: it listens on no port, so it cannot be asked; ask a node "
            "it joined (dtnode status HOST:PORT)"
        )
    if not isinstance(address, str) or not address:
        raise ValueError(f"{path} has no grpc_address")
    return address


def check_address(address: str) -> str:
    """``host:port`` with a port in 1..65535; ValueError otherwise."""
    host_port = split_host_port(address)
    if host_port is None or not host_port[0] or host_port[1] == 0:
        raise ValueError(f"ADDR must be the node's gRPC HOST:PORT, got {address!r}")
    return address


def status_to_json(status: NodeStatus) -> dict[str, Any]:
    """Every field of the status as plain JSON (the phase as its name, e.g. ``"training"``)."""
    return dataclasses.asdict(status)


def _short(text: str, chars: int) -> str:
    return text if len(text) <= chars else "…" + text[-chars:]


def _rows(status: NodeStatus) -> list[list[str]]:
    """One row per peer of the view; the answering node is marked ``*``."""
    rows = []
    for peer in status.peers:
        rows.append(
            [
                ("*" if peer.is_self else " ") + _short(peer.peer_id, SHORT_ID_CHARS),
                peer.grpc_address,
                str(peer.round),
                peer.param_hash[:SHORT_HASH_CHARS],
                str(peer.ready_for_round) if peer.ready_for_round is not None else "-",
                f"{peer.tokens_per_s:.0f}",
                f"{peer.bandwidth_bytes_per_s * 8 / 1e6:.1f}",
                f"{peer.seconds_since_heartbeat:.1f}",
                f"{peer.seconds_until_expiry:.1f}",
                "yes" if peer.in_group else "",
            ]
        )
    return rows


COLUMNS = (
    "PEER", "ADDRESS", "ROUND", "PARAM_HASH", "READY", "TOK/S", "MBIT/S", "LAST_HB_S", "TTL_LEFT_S", "IN_GROUP",
)  # fmt: skip
"""LAST_HB_S: seconds since the peer's last heartbeat; TTL_LEFT_S: seconds until its record expires."""


def summary_lines(status: NodeStatus) -> list[str]:
    """What the node says about itself, its last group and its view, as sentences."""
    lines = [f"node {status.peer_id} (run {status.run_name!r}, gRPC {status.grpc_address})"]
    phase = f"phase: {status.phase}"
    if status.phase_round:
        phase += f" toward round {status.phase_round}"
    if status.round_vector:  # the part of the state that round carries (--fragments: its fragment)
        phase += f" ({status.round_vector} in flight)"
    lines.append(f"{phase}, for {status.seconds_in_phase:.1f} s")
    if status.published:
        lines.append(f"params: round {status.round}, param_hash {status.param_hash}")
    else:
        lines.append("params: not published yet")
    if status.group is not None:
        group = status.group
        lines.append(
            f"last group: round {group.round}, {len(group.member_ids)} member(s), led by "
            f"{_short(group.leader_id, SHORT_ID_CHARS)}; {status.rounds_formed} group(s) so far"
        )
    else:
        lines.append("last group: none yet")
    lines.append(f"view: {len(status.peers)} peer(s), read {status.view_age_seconds:.1f} s ago")
    if status.syncing_peers:
        lines.append("syncing to join: " + ", ".join(
            f"{_short(p.peer_id, SHORT_ID_CHARS)} to round {p.round}"
            + ("" if p.seconds_until_ready is None else f", due in {p.seconds_until_ready:.0f} s")
            for p in status.syncing_peers
        ))  # fmt: skip
    if status.lost_peers:
        lost = ", ".join(
            f"{_short(p.peer_id, SHORT_ID_CHARS)} ({p.seconds_since_seen:.0f} s ago)"
            for p in status.lost_peers
        )
        lines.append(f"lost: {lost}")
    return lines


def format_text(status: NodeStatus) -> str:
    """The status as plain text: the summary, then the peers in aligned columns."""
    rows = [list(COLUMNS), *_rows(status)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    table = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join([*summary_lines(status), "", *table]) + "\n"


def print_rich(status: NodeStatus, stream: TextIO) -> None:
    """The status as a rich table (for a terminal)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(file=stream)
    for line in summary_lines(status):
        console.print(line, highlight=False, markup=False, soft_wrap=True)
    table = Table(*COLUMNS, box=box.SIMPLE)
    for row in _rows(status):
        table.add_row(*row)
    console.print(table)


def unreachable_hint(auth: SwarmAuth | None) -> str:
    """What to check when the node did not answer: a plaintext call to a ``--tls`` node fails like a
    dead one (the server just closes the connection), so name the flags that reach such a node."""
    if auth is not None and auth.tls:
        return "is it running, with --tls and this swarm's key?"
    return "is it running? (a node started with --tls answers only to --swarm-key-file KEY --tls)"


def run_status(
    *, address: str | None, run_dir: Path, as_json: bool, timeout: timedelta, auth: SwarmAuth | None = None
) -> int:
    """Ask the node for its status and print it; returns the exit code (messages go to stderr)."""
    try:
        address = check_address(address) if address else address_from_run_dir(run_dir)
    except ValueError as error:
        print(error_line("dtnode status", str(error)), file=sys.stderr)
        return 2
    try:
        status = get_status(address, timeout=timeout, auth=auth)
    except StatusUnavailable as error:
        print(
            f"dtnode status: error: the node at {address} did not answer within {timeout.total_seconds():g} s "
            f"({error.code.name}: {error.details}); {unreachable_hint(auth)}",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    except ValueError as error:  # an answer this version cannot read
        print(
            f"dtnode status: error: the node at {address} sent a status this dtnode cannot read: {error}",
            file=sys.stderr,
        )
        return EXIT_UNREACHABLE
    if as_json:
        print(json.dumps(status_to_json(status), indent=2))
    elif sys.stdout.isatty():
        print_rich(status, sys.stdout)
    else:
        sys.stdout.write(format_text(status))
    return 0
