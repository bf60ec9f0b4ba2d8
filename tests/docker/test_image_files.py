"""The image and compose files agree with the CLI, checked without a Docker engine: the HEALTHCHECK
is a ``dtnode`` command the parser accepts, the node runs as a non-root user with its run dir in a
volume, the ports the image sets are the ones it exposes, compose workers wait for a healthy
bootstrap and take stable run dirs, every node holds the swarm-key secret, compose's Prometheus
scrapes every node service at the metrics port, and README's multi-host Prometheus every host's node."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from node.config import NodeConfig
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
    env = image_env()
    ports = {int(env[key].rpartition(":")[2]) for key in ("DTNODE_LISTEN", "DTNODE_DHT_LISTEN")}
    ports.add(int(env["DTNODE_METRICS_PORT"]))
    ((_, exposed),) = instructions("EXPOSE")
    assert {int(port) for port in exposed.split()} == ports == {7000, 7001, 9400}


def image_env() -> dict[str, str]:
    return dict(re.findall(r"(DTNODE_\w+)=(\S+)", " ".join(rest for _, rest in instructions("ENV"))))


def test_the_run_dir_is_in_a_volume_and_metrics_serve_the_container() -> None:
    ((_, volume),) = instructions("VOLUME")
    env = image_env()
    assert env["DTNODE_RUN_DIR"].startswith(volume.strip() + "/")  # checkpoints outlive the container
    # Every setting the image sets is one the node accepts (the metrics endpoint on every interface
    # of the container's own network namespace: loopback would be unreachable from Prometheus).
    flat = {key.removeprefix("DTNODE_").lower(): value for key, value in env.items()}
    config = NodeConfig.from_flat(**{k: int(v) if v.isdigit() else v for k, v in flat.items()})
    assert config.metrics.listen == "0.0.0.0" and config.metrics.port == 9400


def compose() -> dict:
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def test_compose_workers_wait_for_a_healthy_bootstrap_and_take_stable_run_dirs() -> None:
    services = compose()["services"]
    assert services["worker"]["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    entry = (DOCKER / "swarm-entry.sh").read_text()
    # The bootstrap and every worker keep their peer id in their run dir.
    assert len(re.findall(r'--identity-path "\$(runs/bootstrap|run_dir)/identity\.key"', entry)) == 2
    # A worker's run dir is a slot it holds a lock on, never its (random) container host name.
    assert 'run_dir="$runs/worker-$slot"' in entry and "flock --nonblock 9" in entry
    assert "$host_name/" not in entry


def test_compose_gives_every_node_the_swarm_key_and_publishes_on_loopback() -> None:
    spec = compose()
    services = spec["services"]
    assert spec["secrets"]["swarm_key"]["file"]
    for name in ("bootstrap", "worker"):
        service = services[name]
        assert service["secrets"] == ["swarm_key"]
        assert service["environment"]["DTNODE_SWARM_KEY_FILE"] == "/run/secrets/swarm_key"
        assert "runs:/runs" in service["volumes"]
    published = [port for service in services.values() for port in service.get("ports", [])]
    assert published and all(port.startswith("${SWARM_PUBLISH_HOST:-127.0.0.1}:") for port in published)


def test_compose_prometheus_scrapes_every_node_service() -> None:
    services = compose()["services"]
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (discovery,) = job["dns_sd_configs"]
    node_services = {
        name for name, service in services.items() if service.get("entrypoint") == ["dtnode-swarm-entry"]
    }
    assert set(discovery["names"]) == node_services == {"bootstrap", "worker"}
    assert discovery["port"] == int(image_env()["DTNODE_METRICS_PORT"])
    mounted = {volume.split(":")[1]: volume.split(":")[0] for volume in services["prometheus"]["volumes"]}
    assert mounted["/etc/prometheus/dtnode.yml"] == "./prometheus.yml"
    (rules,) = config["rule_files"]
    assert (DOCKER / mounted[rules]).is_file()
    assert "--config.file=/etc/prometheus/dtnode.yml" in services["prometheus"]["command"]


def test_the_multi_host_recipe_scrapes_each_host_its_node_serves_metrics_on() -> None:
    """README's "Several hosts": Prometheus' targets (docker/prometheus-hosts.yml) are the addresses
    the `docker run` of each node that can be dialled gives DTNODE_METRICS_LISTEN, at the image's
    metrics port; the client-mode node keeps its metrics on loopback; the rule file is mounted."""
    readme = (DOCKER.parent / "README.md").read_text()
    recipe = readme[readme.index("**Several hosts:") : readme.index("`pytest tests/docker` starts")]
    runs = [block for block in re.findall(r"```bash\n(.*?)```", recipe, re.S) if "dtnode:cpu" in block]
    listens = {
        re.search(r"--announce (\S+)", run).group(1) if "--client-mode" not in run else "client": (
            re.search(r"DTNODE_METRICS_LISTEN=(\S+)", run).group(1)
        )
        for run in runs
    }  # fmt: skip
    assert listens["client"] == "127.0.0.1" and len(listens) == 3, listens
    port = image_env()["DTNODE_METRICS_PORT"]
    config = yaml.safe_load((DOCKER / "prometheus-hosts.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = [target for group in job["static_configs"] for target in group["targets"]]
    assert targets == [f"{listens[host]}:{port}" for host in listens if host != "client"]
    (prometheus_run,) = [
        block for block in re.findall(r"```bash\n(.*?)```", recipe, re.S) if "dtnode-prometheus" in block
    ]
    mounts = dict(re.findall(r"-v \$PWD/docker/(\S+):(\S+):ro", prometheus_run))
    assert mounts["prometheus-hosts.yml"] == "/etc/prometheus/dtnode.yml"
    (rules,) = config["rule_files"]
    assert mounts["prometheus-alerts.yml"] == rules and (DOCKER / "prometheus-alerts.yml").is_file()
