"""The image and compose files agree with the CLI, checked without a Docker engine: the HEALTHCHECK
is a ``dtnode`` command the parser accepts, the node runs as a non-root user, the ports the image
sets are the ones it exposes, and compose workers wait for a healthy bootstrap."""

from __future__ import annotations

import json
import re
from pathlib import Path

from node.ops.cli import build_parser

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile's final stage, continuation lines joined."""
    text = (DOCKER / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    parsed = [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]
    last_from = max(index for index, (keyword, _) in enumerate(parsed) if keyword == "FROM")
    return [(keyword, rest) for keyword, rest in parsed[last_from:] if keyword == name]


def test_the_healthcheck_is_dtnode_health() -> None:
    ((_, healthcheck),) = instructions("HEALTHCHECK")
    command = json.loads(healthcheck.split("CMD", 1)[1].strip())
    assert command[0] == "dtnode" and command[1] == "health"
    args = build_parser().parse_args(command[1:])  # a command the CLI accepts
    assert args.command == "health" and args.address is None  # the address from DTNODE_LISTEN


def test_the_node_runs_as_a_user_and_exposes_its_ports() -> None:
    ((_, user),) = instructions("USER")
    assert user.split(":")[0] not in ("root", "0")
    env = dict(re.findall(r"(DTNODE_\w+)=(\S+)", " ".join(rest for _, rest in instructions("ENV"))))
    ports = {int(env[key].rpartition(":")[2]) for key in ("DTNODE_LISTEN", "DTNODE_DHT_LISTEN")}
    ports.add(int(env["DTNODE_METRICS_PORT"]))
    ((_, exposed),) = instructions("EXPOSE")
    assert {int(port) for port in exposed.split()} == ports == {7000, 7001, 9400}


def test_compose_workers_wait_for_a_healthy_bootstrap() -> None:
    compose = (DOCKER / "docker-compose.yml").read_text()
    worker = compose[compose.index("\n  worker:") :]
    assert re.search(r"\n    depends_on:\n      bootstrap:\n        condition: service_healthy\n", worker)
    entry = (DOCKER / "swarm-entry.sh").read_text()
    # The bootstrap and every worker keep their peer id in their run dir.
    assert len(re.findall(r'--identity-path "\$runs/[^"]+/identity\.key"', entry)) == 2
