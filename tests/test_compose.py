"""docker-compose.yml stays in step with our programs' flags (no Docker engine runs here), and
its `monitoring` profile stays private and pinned."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from core import pki
from core.processes import PROJECT_ROOT
from federation.gateway import keys


def _compose() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())


def _federation(compose: dict) -> dict[str, dict]:
    """The federation's own services: those that run without a profile."""
    return {name: s for name, s in compose["services"].items() if "profiles" not in s}


def _certificates(root: Path) -> None:
    """What the compose file's comment tells the operator to make, made in `root`: certificates
    and the gateway's keys file."""
    ca = pki.init_ca(root / "federation-ca")
    for identity in (
        pki.Identity(pki.Role.SCHEDULER),
        pki.Identity(pki.Role.GATEWAY),
        pki.Identity(pki.Role.SITE, "kr-mi300x"),
        pki.Identity(pki.Role.SITE, "us-mi355x"),
        pki.OPERATOR,  # Prometheus's, in the monitoring profile
    ):
        pki.issue(ca, identity, root / "certs")
    keys.add(root / "keys" / "federation-keys.json", "me", keys.KeyLimits())


def _mounted(args: list[str], volumes: list[str], root: Path) -> list[str]:
    """The command's arguments with each file (or file in a directory) the container mounts at
    its path on the host."""
    mounts = {}
    for volume in volumes:
        host, container, _ = volume.split(":")
        mounts[container] = str(root / host.removeprefix("./"))

    def on_host(arg: str) -> str:
        for container, host in mounts.items():
            if arg == container or arg.startswith(container + "/"):
                return host + arg.removeprefix(container)
        return arg

    return [on_host(arg) for arg in args]


def test_every_service_command_parses_with_its_own_certificate(tmp_path: Path) -> None:
    """Each service runs one of our modules with arguments that module's parser accepts, all from
    one image, the gateway publishes port 8080, and every process that speaks gRPC mounts a
    certificate its parser takes as its own (a site's names that site) and nothing else."""
    _certificates(tmp_path)
    services = _federation(_compose())
    assert {s["image"] for s in services.values()} == {"inference-federation:latest"}
    modules = {
        "scheduler": "scheduler.__main__",
        "federation.gateway": "federation.gateway.__main__",
        "nodes.agent": "nodes.agent.__main__",
        "federation.linkproxy": "federation.linkproxy",
    }
    for name, service in services.items():
        python, dash_m, module, *args = service["command"]
        assert (python, dash_m) == ("python", "-m"), name
        if module != "federation.linkproxy":
            assert "--insecure" not in args and "--ca" in args, name
            assert all(v.endswith(":ro") and "ca.key" not in v for v in service["volumes"]), name
            args = _mounted(args, service["volumes"], tmp_path)
        importlib.import_module(modules[module]).parse_args(args)
    assert services["gateway"]["ports"] == ["8080:8080"]


def test_quotas_profile_gateway_parses_and_its_store_is_private(tmp_path: Path) -> None:
    """The quotas profile's gateway takes its keys from the region's store (its parser accepts
    the command), and the store asks for a password and is published on the host's loopback only."""
    _certificates(tmp_path)
    services = _compose()["services"]
    gateway, store = services["gateway-quotas"], services["quota-store"]
    python, dash_m, module, *args = gateway["command"]
    assert (python, dash_m, module) == ("python", "-m", "federation.gateway")
    parsed = importlib.import_module("federation.gateway.__main__").parse_args(
        _mounted(args, gateway["volumes"], tmp_path)
    )
    assert parsed.quota_stores == {"us-west-2": "redis://:${QUOTA_STORE_PASSWORD:-}@quota-store:6379/0"}
    assert parsed.api_keys is None and "--ca" in args
    assert re.fullmatch(r"redis:\d+\.\d+\.\d+-alpine", store["image"])
    assert "--requirepass" in store["entrypoint"][-1] and "exit 1" in store["entrypoint"][-1]
    assert store["ports"] == ["127.0.0.1:6379:6379"]


def test_monitoring_profile_is_pinned_read_only_and_private() -> None:
    """Prometheus and Grafana run only with `--profile monitoring`, from official images at a
    pinned version, with every file mounted read-only (and the operator's certificate, not the
    CA's key); Grafana listens on 127.0.0.1 only, lets no one in anonymously, and takes its
    admin password from the environment, with none written in the file."""
    services = _compose()["services"]
    monitoring = {name: s for name, s in services.items() if s.get("profiles") == ["monitoring"]}
    assert set(monitoring) == {"prometheus", "grafana"}
    others = {name for name, s in services.items() if s.get("profiles") in (["rocm"], ["quotas"])}  # tested apart
    assert set(services) - set(monitoring) - others == set(_federation(_compose()))
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", monitoring["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", monitoring["grafana"]["image"])
    for name, service in monitoring.items():
        assert all(v.endswith(":ro") and "ca.key" not in v for v in service["volumes"]), name
        assert all(p.startswith("127.0.0.1:") for p in service["ports"]), name
        for volume in service["volumes"]:
            host = volume.split(":")[0]
            assert host.startswith(("./monitoring/", "./federation-ca/ca.crt", "./certs/operator.")), volume
            if host.startswith("./monitoring/"):
                assert (PROJECT_ROOT / host).exists(), volume
    grafana = monitoring["grafana"]
    assert grafana["ports"] == ["127.0.0.1:3000:3000"]
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ENABLED"] == "false"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"


def test_grafana_refuses_to_start_without_a_password(tmp_path: Path) -> None:
    """Grafana would fall back to admin/admin on an empty password: its entrypoint stops first,
    saying why, and hands over to Grafana's own (/run.sh) once a password is given."""
    entrypoint = _compose()["services"]["grafana"]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"]
    script = entrypoint[2].replace("$$", "$")  # compose's escape for a literal $
    empty = subprocess.run(
        ["/bin/sh", "-c", script], env={"GF_SECURITY_ADMIN_PASSWORD": ""}, capture_output=True, text=True
    )
    assert empty.returncode == 1 and "set GRAFANA_ADMIN_PASSWORD" in empty.stderr
    given = subprocess.run(
        ["/bin/sh", "-c", script.replace("/run.sh", str(tmp_path / "run.sh"))],
        env={"GF_SECURITY_ADMIN_PASSWORD": "s3cret"},
        capture_output=True,
        text=True,
    )
    assert given.returncode == 127 and "run.sh" in given.stderr  # got as far as Grafana's entrypoint (absent here)


@pytest.mark.skipif(
    shutil.which("docker-compose") is None, reason="needs Debian's docker-compose (apt-get install docker-compose)"
)
def test_docker_compose_reads_the_file_with_and_without_monitoring() -> None:
    """Compose itself accepts the file: without the profile it needs no Grafana password, and
    with it the password comes from GRAFANA_ADMIN_PASSWORD."""
    env = {k: v for k, v in os.environ.items() if k != "GRAFANA_ADMIN_PASSWORD"}

    def config(*flags: str, **extra: str) -> dict:
        done = subprocess.run(
            ["docker-compose", "-f", "docker-compose.yml", *flags, "config"],
            cwd=PROJECT_ROOT,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return yaml.safe_load(done.stdout)

    assert "gateway" in config()["services"]
    monitored = config("--profile", "monitoring", GRAFANA_ADMIN_PASSWORD="s3cret")["services"]
    assert monitored["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "s3cret"
    assert monitored["grafana"]["ports"] == ["127.0.0.1:3000:3000/tcp"]
    quotas = config("--profile", "quotas", QUOTA_STORE_PASSWORD="s3cret")["services"]
    assert "redis://:s3cret@quota-store:6379/0" in " ".join(quotas["gateway-quotas"]["command"])
