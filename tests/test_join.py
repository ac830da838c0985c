"""Joining a federation: a site that does not present the federation's join credential, or
whose workers serve another model or tokenizer, is refused with the reason, never becomes a
site (so no request is routed to it), and `fedctl status` tells the operator why."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from federation.config import JOIN_TOKEN_ENV
from federation.drills.faults import poll_until
from federation.embedded import Federation
from federation.processes import Child, free_port_block, start_python
from nodes.emulator.launch import launch
from tests.conftest import fedctl

NEWCOMER = "eu-mi355x"


def _status(path: Path) -> subprocess.CompletedProcess:
    return fedctl("status", "--config", str(path), timeout_s=30)


def _agent(fed: Federation, credential: str, *workers: str) -> Child:
    """A newcomer's agent, started by hand as an operator would, pointed at the schedulers."""
    schedulers = [arg for address in fed.config.scheduler_addresses for arg in ("--scheduler", address)]
    args = ["--site", NEWCOMER, "--region", "eu-central-1", "--gpu", "mi355x", "--gpus", "1"]
    args += ["--port", str(free_port_block(1)), *schedulers, *workers]
    return start_python(f"agent {NEWCOMER}", "nodes.agent", args, env={JOIN_TOKEN_ENV: credential})


def _refused_for(fed: Federation, path: Path, credential: str, *workers: str) -> str:
    """Starts the newcomer, waits until `fedctl status` lists it as refused; the status text."""
    agent = _agent(fed, credential, *workers)
    try:
        assert poll_until(lambda: f"refused {NEWCOMER}" in _status(path).stdout, 15.0) is not None
        status = _status(path).stdout
    finally:
        agent.stop(10)
    site_names = [line.split()[0] for line in status.splitlines()[1:] if not line.startswith(("refused", "schedulers"))]
    assert NEWCOMER not in site_names, status  # never a site: nothing can be routed to it
    return status


@pytest.mark.timeout(120)
def test_a_site_without_the_credential_is_refused(make_federation) -> None:
    """An agent with a wrong credential gets UNAUTHENTICATED and is shown as refused."""
    fed, path = make_federation()
    status = _refused_for(fed, path, "not-the-credential", "--emulate", "--speed", "10")
    assert "did not present this federation's join credential" in status


@pytest.mark.timeout(120)
def test_a_site_serving_another_model_is_refused(make_federation) -> None:
    """Workers that serve another model: the agent registers what they serve, and is refused."""
    fed, path = make_federation()
    status = _refused_for(fed, path, fed.join_token, "--emulate", "--speed", "10", "--model", "someone/other-model")
    assert "serves 'someone/other-model', but this federation serves 'openai/gpt-oss-120b'" in status


@pytest.mark.timeout(120)
def test_a_site_with_another_tokenizer_is_refused(make_federation) -> None:
    """The same model name over workers that tokenize differently is refused too."""
    fed, path = make_federation()
    workers = launch(["--profile", "mi355x", "--workers", "1", "--speed", "10", "--tokenizer-path", "someone/tok"])
    try:
        status = _refused_for(fed, path, fed.join_token, "--worker-url", workers.urls[0])
    finally:
        workers.stop()
    assert "tokenizes with 'someone/tok'" in status
