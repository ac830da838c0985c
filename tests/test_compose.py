"""docker-compose.yml stays in step with our programs' flags (no Docker engine runs here)."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml

from core import pki
from core.processes import PROJECT_ROOT


def _certificates(root: Path) -> None:
    """What the compose file's comment tells the operator to make, made in `root`."""
    ca = pki.init_ca(root / "federation-ca")
    for identity in (
        pki.Identity(pki.Role.SCHEDULER),
        pki.Identity(pki.Role.GATEWAY),
        pki.Identity(pki.Role.SITE, "kr-mi300x"),
        pki.Identity(pki.Role.SITE, "us-mi355x"),
    ):
        pki.issue(ca, identity, root / "certs")


def _mounted(args: list[str], volumes: list[str], root: Path) -> list[str]:
    """The command's arguments with each file the container mounts at its path on the host."""
    mounts = {}
    for volume in volumes:
        host, container, _ = volume.split(":")
        mounts[container] = str(root / host.removeprefix("./"))
    return [mounts.get(arg, arg) for arg in args]


def test_every_service_command_parses_with_its_own_certificate(tmp_path: Path) -> None:
    """Each service runs one of our modules with arguments that module's parser accepts, all from
    one image, the gateway publishes port 8080, and every process that speaks gRPC mounts a
    certificate its parser takes as its own (a site's names that site) and nothing else."""
    _certificates(tmp_path)
    compose = yaml.safe_load((PROJECT_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
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
