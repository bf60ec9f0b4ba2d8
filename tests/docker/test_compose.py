"""The docker-compose swarm (``docker/docker-compose.yml``): a bootstrap node and two workers, each in
its own container, train one model, and after every outer round they all recorded they hold the
same global params (identical ``param_hash``, contract in ``node/ops/metrics.py``). Then every
container is healthy by the image's HEALTHCHECK (``dtnode health``: gRPC health SERVING), runs as
the unprivileged user and keeps its identity key (``--identity-path``) at mode 600.

Skipped unless a Docker engine answers and Docker Compose (``docker compose`` or ``docker-compose``)
is installed. The image (``$SWARM_IMAGE``, default ``dtnode:cpu``) must exist: ``bash docker/build.sh``
makes it, or ``BUILD_DTNODE_IMAGE=1`` lets this test run that script (minutes: a wheelhouse and,
when no base image can be pulled, debootstrap). The variable has no ``DTNODE_`` prefix because
dtnode reads every ``DTNODE_*`` variable as a setting and refuses unknown ones.

Each container's records are read from inside that container (``docker exec``), so the test sees
exactly what every node wrote; the project is removed with ``down -v`` whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO_ROOT / "docker" / "docker-compose.yml"
BUILD_SCRIPT = REPO_ROOT / "docker" / "build.sh"
IMAGE = os.environ.get("SWARM_IMAGE", "dtnode:cpu")
BUILD_ALLOWED = os.environ.get("BUILD_DTNODE_IMAGE", "") == "1"
NUM_WORKERS = 2
NUM_CONTAINERS = 1 + NUM_WORKERS
MIN_COMMON_ROUNDS = 2
DOCKER_CALL_TIMEOUT = timedelta(seconds=60)
BUILD_TIMEOUT = timedelta(minutes=30)
ROUNDS_TIMEOUT = timedelta(minutes=10)
UP_TIMEOUT = timedelta(minutes=3)
DOWN_TIMEOUT = timedelta(minutes=3)
POLL_INTERVAL = timedelta(seconds=5)
HEALTHY_TIMEOUT = timedelta(seconds=60)  # a few of the image's 10 s health-check intervals
# The settings the containers train with (interpolated by compose into their DTNODE_* variables).
SWARM_SETTINGS = {
    "DTNODE_NAME": "compose-test",
    "DTNODE_MODEL": "nano",
    "DTNODE_INNER_STEPS": "10",
    "DTNODE_MAX_ROUNDS": "0",
    "DTNODE_THREADS": "1",
    "DTNODE_CODEC": "int8",
    "DTNODE_LOG_EVERY": "10",
}


def _run(
    argv: list[str], *, timeout: timedelta = DOCKER_CALL_TIMEOUT, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout.total_seconds(), **kwargs)


def _succeeds(argv: list[str]) -> bool:
    try:
        return _run(argv, timeout=timedelta(seconds=20)).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _compose_command() -> list[str] | None:
    """``docker compose`` (v2 plugin) or ``docker-compose`` (v1), whichever works; None if neither."""
    if _succeeds(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose") and _succeeds(["docker-compose", "version"]):
        return ["docker-compose"]
    return None


def _skip_reason() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    if not _succeeds(["docker", "info"]):
        return "no Docker engine is running (`docker info` failed)"
    if _compose_command() is None:
        return "neither `docker compose` nor `docker-compose` is installed"
    return None


_reason = _skip_reason()
pytestmark = pytest.mark.skipif(_reason is not None, reason=_reason or "")


def _image_exists(image: str) -> bool:
    return _succeeds(["docker", "image", "inspect", image])


def _ensure_image() -> None:
    if _image_exists(IMAGE):
        return
    if not BUILD_ALLOWED:
        pytest.skip(
            f"image {IMAGE} is absent: run `bash docker/build.sh`, or set BUILD_DTNODE_IMAGE=1 to build it here"
        )
    build = _run(["bash", str(BUILD_SCRIPT), "--tag", IMAGE], timeout=BUILD_TIMEOUT)
    assert build.returncode == 0, f"docker/build.sh failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"


def _container_rounds(container_id: str) -> list[dict[str, Any]] | None:
    """The round records in the container's own ``metrics.jsonl``; None if it cannot be read now."""
    read = 'cat "/runs/$(cat /etc/hostname)/metrics.jsonl" 2>/dev/null || true'
    try:
        result = _run(["docker", "exec", container_id, "sh", "-c", read])
    except subprocess.TimeoutExpired:
        return None
    if result.returncode != 0:  # not running right now (starting, restarting)
        return None
    rounds = []
    for line in result.stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if isinstance(record, dict) and record.get("kind") == "round":
            rounds.append(record)
    return rounds


def _docker_logs(container_id: str) -> str:
    logs = _run(["docker", "logs", "--tail", "60", container_id])
    return logs.stdout + logs.stderr


def _last_record_per_round(rounds: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    # A node that adopted the swarm's state may record a round twice: its last record holds.
    return {int(record["round"]): record for record in rounds}


@dataclass(frozen=True)
class ComposeProject:
    """A compose project of docker/docker-compose.yml: the command prefix and its environment."""

    command: list[str]
    env: dict[str, str]

    def run(self, *args: str, timeout: timedelta = DOCKER_CALL_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return _run([*self.command, *args], env=self.env, timeout=timeout)


@pytest.fixture
def compose_project() -> Iterator[ComposeProject]:
    """A project of its own (image ready), removed with its volume whatever the test did."""
    _ensure_image()
    compose_command = _compose_command()
    assert compose_command is not None
    name = f"dtnode-test-{os.getpid()}"
    # Only the settings above reach the containers, not the caller's own DTNODE_* variables.
    env = {key: value for key, value in os.environ.items() if not key.startswith("DTNODE_")}
    env.update(SWARM_SETTINGS, SWARM_IMAGE=IMAGE)
    project = ComposeProject(
        command=[*compose_command, "--file", str(COMPOSE_FILE), "--project-name", name], env=env
    )
    yield project
    down = project.run("down", "--volumes", "--timeout", "20", timeout=DOWN_TIMEOUT)
    assert down.returncode == 0, f"compose down failed:\n{down.stdout}\n{down.stderr}"


@pytest.mark.timeout(
    int(
        (
            ROUNDS_TIMEOUT
            + DOWN_TIMEOUT
            + NUM_CONTAINERS * HEALTHY_TIMEOUT
            + (BUILD_TIMEOUT if BUILD_ALLOWED else timedelta(0))
        ).total_seconds()
    )
    + 60
)
def test_compose_swarm_trains_one_lineage(compose_project: ComposeProject) -> None:
    started = time.monotonic()
    up = compose_project.run("up", "--detach", "--scale", f"worker={NUM_WORKERS}", timeout=UP_TIMEOUT)
    assert up.returncode == 0, f"compose up failed:\n{up.stdout}\n{up.stderr}"
    deadline = started + ROUNDS_TIMEOUT.total_seconds()
    per_container: dict[str, dict[int, dict[str, Any]]] = {}
    common: list[int] = []
    while time.monotonic() < deadline:
        listed = compose_project.run("ps", "--all", "--quiet")
        assert listed.returncode == 0, listed.stderr
        container_ids = listed.stdout.split()
        for container_id in container_ids:
            state = _run(["docker", "inspect", "--format", "{{.State.Status}}", container_id])
            assert state.stdout.strip() != "exited", (
                f"container {container_id[:12]} exited:\n" + _docker_logs(container_id)
            )
            rounds = _container_rounds(container_id)
            if rounds is not None:
                per_container[container_id] = _last_record_per_round(rounds)
        if len(container_ids) == NUM_CONTAINERS and len(per_container) == NUM_CONTAINERS:
            common = sorted(set.intersection(*(set(rounds) for rounds in per_container.values())))
            if len(common) >= MIN_COMMON_ROUNDS:
                break
        time.sleep(POLL_INTERVAL.total_seconds())
    seconds = time.monotonic() - started
    logs = compose_project.run("logs", "--no-color", "--tail", "40").stdout
    progress = {cid[:12]: sorted(rounds) for cid, rounds in per_container.items()}
    assert len(common) >= MIN_COMMON_ROUNDS, (
        f"after {seconds:.0f}s, rounds recorded per container: {progress}; common: {common}\n{logs}"
    )
    print(f"\n{len(common)} common round(s) {common} in {seconds:.0f}s after `compose up`")

    # Every container holds the same global params after every round all of them recorded.
    for round_index in common:
        hashes = {cid[:12]: rounds[round_index]["param_hash"] for cid, rounds in per_container.items()}
        assert len(set(hashes.values())) == 1, f"round {round_index}: param_hash differs: {hashes}\n{logs}"
    # The params move from round to round: the swarm trains.
    first_container = next(iter(per_container.values()))
    common_hashes = [first_container[round_index]["param_hash"] for round_index in common]
    assert len(set(common_hashes)) == len(common_hashes), f"param_hash repeats across rounds {common}"
    # The three trained together: some round averaged all three contributions, in every container.
    joint = [
        r for r in common if all(rounds[r]["peers"] == NUM_CONTAINERS for rounds in per_container.values())
    ]
    peers = {cid[:12]: {r: rounds[r]["peers"] for r in common} for cid, rounds in per_container.items()}
    assert joint, f"no common round averaged {NUM_CONTAINERS} peers: {peers}"

    # The image's HEALTHCHECK (`dtnode health`, gRPC health SERVING) passes on every running node,
    # the nodes run as the image's unprivileged user, and each keeps its identity key private.
    for container_id in per_container:
        assert _health_status(container_id) == "healthy", _docker_logs(container_id)
        checked = _run(["docker", "exec", container_id, "dtnode", "health"])
        assert checked.returncode == 0 and checked.stdout.strip().endswith("SERVING"), checked
        uid = _run(["docker", "exec", container_id, "id", "-u"]).stdout.strip()
        assert uid == "10001", f"container {container_id[:12]} runs as uid {uid}"
        key_mode = 'stat -c %a "/runs/$(cat /etc/hostname)/identity.key"'
        assert _run(["docker", "exec", container_id, "sh", "-c", key_mode]).stdout.strip() == "600"


def _health_status(container_id: str, within: timedelta = HEALTHY_TIMEOUT) -> str:
    """The container's health once it is no longer ``starting`` (or when ``within`` passes)."""
    deadline = time.monotonic() + within.total_seconds()
    while True:
        inspected = _run(["docker", "inspect", "--format", "{{.State.Health.Status}}", container_id])
        status = inspected.stdout.strip()
        if status != "starting" or time.monotonic() >= deadline:
            return status
        time.sleep(POLL_INTERVAL.total_seconds())
