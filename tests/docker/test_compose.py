"""The docker-compose swarm (``docker/docker-compose.yml``): a bootstrap node and two workers, each in
its own container, train one model in a closed swarm (the swarm key given as a Docker secret), and
after every outer round they all recorded they hold the same global params (identical
``param_hash``, contract in ``node/ops/metrics.py``). Compose's Prometheus scrapes all three (its
targets API says ``up`` for each). Every container is healthy by the image's HEALTHCHECK
(``dtnode health``: gRPC health SERVING), runs as the unprivileged user and keeps its identity key
(``--identity-path``) at mode 600. Then a worker's node is killed (SIGKILL): the container restarts,
takes its run dir back and resumes from its checkpoint, on the same peer id.

Skipped unless a Docker engine answers and Docker Compose (``docker compose`` or ``docker-compose``)
is installed. The images (``$SWARM_IMAGE``, default ``dtnode:cpu``, and ``dtnode-prometheus:bookworm``)
must exist: ``bash docker/build.sh --prometheus`` makes them, or ``BUILD_DTNODE_IMAGE=1`` lets this test
run that script (minutes: a wheelhouse and, when no base image can be pulled, debootstrap). The
variable has no ``DTNODE_`` prefix because dtnode reads every ``DTNODE_*`` variable as a setting
and refuses unknown ones. The compose file publishes the bootstrap's gRPC port 7000 and
Prometheus' 9090 on the host's loopback: both must be free.

Each container's records are read from inside that container (``docker exec``), so the test sees
exactly what every node wrote; the project is removed with ``down -v`` whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
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
PROMETHEUS_IMAGE = "dtnode-prometheus:bookworm"
PROMETHEUS_URL = "http://127.0.0.1:9090"
NODE_UID = 10001  # the image's user, who must be able to read the key secret
BUILD_ALLOWED = os.environ.get("BUILD_DTNODE_IMAGE", "") == "1"
NUM_WORKERS = 2
NUM_CONTAINERS = 1 + NUM_WORKERS  # the nodes (Prometheus runs beside them)
NODE_SERVICES = ("bootstrap", "worker")
MIN_COMMON_ROUNDS = 2
DOCKER_CALL_TIMEOUT = timedelta(seconds=60)
BUILD_TIMEOUT = timedelta(minutes=30)
ROUNDS_TIMEOUT = timedelta(minutes=10)
UP_TIMEOUT = timedelta(minutes=3)
DOWN_TIMEOUT = timedelta(minutes=3)
POLL_INTERVAL = timedelta(seconds=5)
HEALTHY_TIMEOUT = timedelta(seconds=60)  # a few of the image's 10 s health-check intervals
SCRAPED_TIMEOUT = timedelta(seconds=90)  # Prometheus' DNS refresh (15 s) and scrape interval (10 s)
RESUME_TIMEOUT = timedelta(minutes=4)  # the node's start-up, a fetch of the swarm's state, a round
# The settings the containers train with (interpolated by compose into their DTNODE_* variables).
SWARM_SETTINGS = {
    "DTNODE_NAME": "compose-test",
    "DTNODE_MODEL": "nano",
    "DTNODE_INNER_STEPS": "10",
    "DTNODE_MAX_ROUNDS": "0",
    "DTNODE_THREADS": "1",
    "DTNODE_CODEC": "int8",
    "DTNODE_LOG_EVERY": "10",
    "DTNODE_CHECKPOINT_EVERY": "1",
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


def _ensure_images() -> None:
    if _image_exists(IMAGE) and _image_exists(PROMETHEUS_IMAGE):
        return
    if not BUILD_ALLOWED:
        pytest.skip(
            f"image {IMAGE} or {PROMETHEUS_IMAGE} is absent: run `bash docker/build.sh --prometheus`, or "
            "set BUILD_DTNODE_IMAGE=1 to build them here"
        )
    build = _run(["bash", str(BUILD_SCRIPT), "--tag", IMAGE, "--prometheus"], timeout=BUILD_TIMEOUT)
    assert build.returncode == 0, f"docker/build.sh failed:\n{build.stdout[-4000:]}\n{build.stderr[-4000:]}"


# The run dir the container's node has (its entry script records it: a worker's is a slot it took).
RUN_DIR = "$(cat /tmp/dtnode-run-dir)"


def _exec(container_id: str, script: str) -> subprocess.CompletedProcess[str]:
    return _run(["docker", "exec", container_id, "sh", "-c", script])


def _container_rounds(container_id: str) -> list[dict[str, Any]] | None:
    """The round records in the container's own ``metrics.jsonl``; None if it cannot be read now."""
    read = f'cat "{RUN_DIR}/metrics.jsonl" 2>/dev/null || true'
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
def compose_project(tmp_path: Path) -> Iterator[ComposeProject]:
    """A project of its own (images ready; a swarm key made for it, owned by the containers' user),
    removed with its volumes whatever the test did."""
    _ensure_images()
    compose_command = _compose_command()
    assert compose_command is not None
    name = f"dtnode-test-{os.getpid()}"
    # Only the settings above reach the containers, not the caller's own DTNODE_* variables.
    env = {key: value for key, value in os.environ.items() if not key.startswith("DTNODE_")}
    key_file = tmp_path / "swarm.key"
    keygen = _run([sys.executable, "-m", "node.ops.cli", "keygen", str(key_file)], cwd=REPO_ROOT)
    assert keygen.returncode == 0, keygen.stderr
    os.chown(key_file, NODE_UID, NODE_UID)  # mode 600 as keygen wrote it: the containers' user only
    env.update(SWARM_SETTINGS, SWARM_IMAGE=IMAGE, SWARM_KEY_FILE=str(key_file))
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
            + SCRAPED_TIMEOUT
            + RESUME_TIMEOUT
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
        listed = compose_project.run("ps", "--all", "--quiet", *NODE_SERVICES)  # not Prometheus
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
    run_dirs = {}
    for container_id in per_container:
        assert _health_status(container_id) == "healthy", _docker_logs(container_id)
        checked = _run(["docker", "exec", container_id, "dtnode", "health"])
        assert checked.returncode == 0 and checked.stdout.strip().endswith("SERVING"), checked
        uid = _run(["docker", "exec", container_id, "id", "-u"]).stdout.strip()
        assert uid == str(NODE_UID), f"container {container_id[:12]} runs as uid {uid}"
        assert _exec(container_id, f'stat -c %a "{RUN_DIR}/identity.key"').stdout.strip() == "600"
        run_dirs[container_id] = _exec(container_id, "cat /tmp/dtnode-run-dir").stdout.strip()
    # Stable run dirs: the bootstrap's and one slot per worker, whatever the containers are called.
    assert sorted(run_dirs.values()) == ["/runs/bootstrap", "/runs/worker-1", "/runs/worker-2"], run_dirs

    # Prometheus scrapes every node: three targets, all up, each serving the round gauge.
    targets = _prometheus_targets(NUM_CONTAINERS)
    assert len(targets) == NUM_CONTAINERS and all(t["health"] == "up" for t in targets), targets
    rounds_scraped = _prometheus_query("dtnode_round")
    assert len(rounds_scraped) == NUM_CONTAINERS and all(float(r["value"][1]) >= 1 for r in rounds_scraped)

    # A worker's node dies (SIGKILL, as the kernel's OOM killer would): docker restarts the container,
    # whose node takes the same run dir back and resumes from its checkpoint, on the same peer id.
    worker = next(cid for cid, run_dir in run_dirs.items() if run_dir == "/runs/worker-1")
    peer_id = json.loads(_exec(worker, f'cat "{RUN_DIR}/node.json"').stdout)["peer_id"]
    last_round = max(_last_record_per_round(_container_rounds(worker) or []))
    restarts = int(_run(["docker", "inspect", "--format", "{{.RestartCount}}", worker]).stdout)
    _exec(worker, "kill -KILL -1")  # every process of the node's user but the shell itself
    deadline = time.monotonic() + RESUME_TIMEOUT.total_seconds()
    resumed: list[dict[str, Any]] = []
    while time.monotonic() < deadline and not resumed:
        time.sleep(POLL_INTERVAL.total_seconds())
        inspected = _run(["docker", "inspect", "--format", "{{.RestartCount}} {{.State.Status}}", worker])
        count, status = inspected.stdout.split()
        if int(count) > restarts and status == "running":
            rounds = _container_rounds(worker) or []
            resumed = [r for r in rounds if int(r["round"]) > last_round]
    full_logs = _run(["docker", "logs", worker])
    logs = full_logs.stdout + full_logs.stderr
    assert resumed, f"worker-1 recorded no round after {last_round} since its restart:\n{logs}"
    assert _exec(worker, "cat /tmp/dtnode-run-dir").stdout.strip() == "/runs/worker-1"
    assert json.loads(_exec(worker, f'cat "{RUN_DIR}/node.json"').stdout)["peer_id"] == peer_id
    assert "resumed from" in logs, logs  # from its own checkpoint, not from scratch
    seconds = time.monotonic() - (deadline - RESUME_TIMEOUT.total_seconds())
    print(
        f"worker-1 killed after round {last_round}; restarted, recorded round {resumed[0]['round']} {seconds:.0f}s later"
    )
    listed = _exec(worker, "ls /runs").stdout.split()
    assert [name for name in listed if not name.endswith(".lock")] == [
        "bootstrap",
        "node",
        "worker-1",
        "worker-2",
    ]


def _get_json(path: str) -> Any:
    with urllib.request.urlopen(PROMETHEUS_URL + path, timeout=10) as response:
        return json.loads(response.read())


def _prometheus_targets(expected: int) -> list[dict[str, Any]]:
    """Prometheus' active targets once ``expected`` of them are up (or when the wait runs out)."""
    deadline = time.monotonic() + SCRAPED_TIMEOUT.total_seconds()
    while True:
        try:
            targets = _get_json("/api/v1/targets")["data"]["activeTargets"]
        except OSError:  # not listening yet
            targets = []
        if sum(t["health"] == "up" for t in targets) >= expected or time.monotonic() >= deadline:
            return targets
        time.sleep(POLL_INTERVAL.total_seconds())


def _prometheus_query(query: str) -> list[dict[str, Any]]:
    return _get_json("/api/v1/query?query=" + urllib.parse.quote(query))["data"]["result"]


def _health_status(container_id: str, within: timedelta = HEALTHY_TIMEOUT) -> str:
    """The container's health once it is no longer ``starting`` (or when ``within`` passes)."""
    deadline = time.monotonic() + within.total_seconds()
    while True:
        inspected = _run(["docker", "inspect", "--format", "{{.State.Health.Status}}", container_id])
        status = inspected.stdout.strip()
        if status != "starting" or time.monotonic() >= deadline:
            return status
        time.sleep(POLL_INTERVAL.total_seconds())
