"""docker-compose.yml stays in step with our programs' flags (no Docker engine runs here)."""

from __future__ import annotations

import importlib

import yaml

from core.processes import PROJECT_ROOT


def test_every_service_command_parses() -> None:
    """Each service runs one of our modules with arguments that module's parser accepts, all from
    one image, and the gateway publishes port 8080."""
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
        importlib.import_module(modules[module]).parse_args(args)
    assert services["gateway"]["ports"] == ["8080:8080"]
