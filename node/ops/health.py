"""``dtnode health ADDR``: ask a node's gRPC port whether it serves (the standard health protocol).

Every node serves ``grpc.health.v1.Health`` on its ``--listen`` port (``protocol/swarm/server.py``):
the whole server (service ``""``) and each dtnode service are SERVING while the node runs, and
NOT_SERVING once it leaves. This is the check a container orchestrator runs (``docker/Dockerfile``'s
HEALTHCHECK): exit 0 when the answer is SERVING, 1 for any other answer, an unreachable node or no
answer within the timeout. Health needs no swarm-key token; a node started with ``--tls`` answers
only over mutual TLS, so ``auth`` brings the swarm's certificate then.

A ``--client-mode`` node listens on no port, so there is nothing to ask: without ADDR, when the run
dir's ``node.json`` says client mode, the answer is its ``liveness.json`` instead (``node/ops/liveness.py``:
healthy while its training loop writes records within the round's stall bound and it rounds with peers).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from node.config import flat_defaults, resolve_run_dir
from node.ops.liveness import LIVENESS_FILE, liveness_verdict, read_liveness
from protocol.auth.channels import SwarmAuth, operator_channel
from protocol.discovery.addresses import local_dial_address, parse_host_port

EXIT_SERVING = 0
EXIT_UNHEALTHY = 1


def check_health(
    address: str, *, service: str = "", timeout: timedelta, auth: SwarmAuth | None = None
) -> tuple[bool, str]:
    """Ask ``address`` (``host:port``) for ``service``'s health (``""``: the whole server).

    Returns (serving, what was heard): the status name (``SERVING``, ``NOT_SERVING``, …) or the gRPC
    error (``UNAVAILABLE: …``, ``DEADLINE_EXCEEDED: …``). Blocks for at most ``timeout``.
    """
    options: list[tuple[str, int | str]] = [("grpc.enable_retries", 0)]
    with operator_channel(address, options=options, auth=auth) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout.total_seconds()
            )
        except grpc.RpcError as error:
            code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
            details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
            return False, f"{code.name}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status


def run_health(address: str, *, service: str, timeout: timedelta, auth: SwarmAuth | None) -> int:
    """Print one line (``ADDR: SERVING``) and return the exit code: 0 serving, 1 otherwise."""
    serving, heard = check_health(address, service=service, timeout=timeout, auth=auth)
    label = f"{address} ({service})" if service else address
    print(f"{label}: {heard}", flush=True)
    return EXIT_SERVING if serving else EXIT_UNHEALTHY


@dataclass(frozen=True)
class HealthSettings:
    """What ``dtnode health`` reads of the node's settings."""

    listen: str
    run_dir: Path
    swarm_key_file: str
    tls: bool


def health_settings(values: dict[str, Any]) -> HealthSettings:
    """The settings from the layers' values (``node.config.layered_values``), defaults filled in.

    A container runs the health check every few seconds: building a whole ``NodeConfig`` validates
    the model preset, which imports torch (seconds of CPU each time), so only these are read."""
    setting = {**flat_defaults(), **values}
    return HealthSettings(
        listen=str(setting["listen"]),
        run_dir=resolve_run_dir(name=str(setting["name"]), run_dir=str(setting["run_dir"])),
        swarm_key_file=str(setting["swarm_key_file"]),
        tls=bool(setting["tls"]),
    )


def run_liveness_health(run_dir: Path, *, now: float | None = None) -> int:
    """A node with no port to ask (``--client-mode``): print one line (``RUN_DIR/liveness.json: why``)
    and return the exit code from its liveness record: 0 healthy, 1 otherwise."""
    healthy, why = liveness_verdict(read_liveness(run_dir), time.time() if now is None else now)
    print(f"{run_dir / LIVENESS_FILE}: {why}", flush=True)
    return EXIT_SERVING if healthy else EXIT_UNHEALTHY


def _recorded_identity(run_dir: Path) -> dict[str, Any]:
    """``run_dir/node.json`` as the node wrote it; empty if there is none (the node is starting) or it
    was caught mid-write."""
    try:
        identity = json.loads((run_dir / "node.json").read_text())
    except (OSError, ValueError):
        return {}
    return identity if isinstance(identity, dict) else {}


def recorded_client_mode(run_dir: Path) -> bool:
    """Whether the node of ``run_dir`` recorded that it runs in client mode (it listens on no port)."""
    return _recorded_identity(run_dir).get("client_mode") is True


def recorded_local_address(run_dir: Path) -> str | None:
    """The ``local_address`` the node recorded in ``run_dir/node.json`` (where a process on its own
    machine reaches its gRPC server: the port it bound), None if there is no such record."""
    address = _recorded_identity(run_dir).get("local_address")
    return address if isinstance(address, str) and address else None


def local_address(listen: str, run_dir: Path) -> str:
    """The address of this machine's node: the one it recorded in ``run_dir/node.json`` (what it
    bound, whatever flag or variable set it: a container started with ``join --listen 0.0.0.0:8000``
    is asked at 8000, not at the image's ``DTNODE_LISTEN``); before it has one, loopback and the
    ``--listen`` port, or (port 0: any free port) the ``grpc_address`` of an older node.json."""
    from node.ops.status import address_from_run_dir

    recorded = recorded_local_address(run_dir)
    if recorded is not None:
        return recorded
    if listen:
        host, port = parse_host_port(listen, flag="--listen", empty_host="")
        if port:
            return local_dial_address(host, port)
    return address_from_run_dir(run_dir)
