"""A real deployment from one config file: each process started with `--config` alone, and
`fedctl check` passing the files we ship and refusing broken ones with one line per fault."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import openai
import pytest

from core import pki
from core.processes import PROJECT_ROOT, Child, free_port_block, start_python
from federation import cli
from federation.drills.faults import poll_until
from federation.gateway import keys
from tests.test_config import BAD_CONFIGS

SITES = {"kr-mi300x": ("ap-northeast-2", "mi300x"), "us-mi355x": ("us-west-2", "mi355x")}


def _operator_files(root: Path) -> None:
    """What the operator makes (docs/REAL_GPUS.md §2): the CA, a certificate per process, a key."""
    ca = pki.init_ca(root / "federation-ca")
    for identity in (pki.SCHEDULER, pki.GATEWAY, pki.OPERATOR, *(pki.Identity(pki.Role.SITE, s) for s in SITES)):
        pki.issue(ca, identity, root / "certs")
    (root / "keys").mkdir()
    keys.add(root / "keys" / "federation-keys.json", "me", keys.KeyLimits())


def _check(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    code = cli.main(["check", "--config", str(config)])
    return code, capsys.readouterr().err.splitlines()


def test_fedctl_check_passes_the_shipped_configs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/configs/* as they are, and deploy/federation.yaml beside the files the guide makes."""
    for config in sorted((PROJECT_ROOT / "docs" / "configs").glob("*.yaml")):
        assert _check(config, capsys) == (0, []), config
    (tmp_path / "deploy").mkdir()
    shutil.copy(PROJECT_ROOT / "deploy" / "federation.yaml", tmp_path / "deploy")
    _operator_files(tmp_path)
    assert _check(tmp_path / "deploy" / "federation.yaml", capsys) == (0, [])


@pytest.mark.parametrize(("text", "fragment"), BAD_CONFIGS)
def test_fedctl_check_refuses_a_broken_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, fragment: str
) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text(text + "\n")
    code, lines = _check(config, capsys)
    assert code == 2 and len(lines) == 1 and fragment in lines[0], lines


def test_fedctl_check_names_every_certificate_and_key_fault(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A scheduler certificate that is the gateway's, a site's from another CA, a missing key
    and a missing keys file: four lines, exit 2, and nothing else said wrong."""
    (tmp_path / "deploy").mkdir()
    shutil.copy(PROJECT_ROOT / "deploy" / "federation.yaml", tmp_path / "deploy")
    _operator_files(tmp_path)
    certs = tmp_path / "certs"
    shutil.copy(certs / "gateway.crt", certs / "scheduler.crt")
    shutil.copy(certs / "gateway.key", certs / "scheduler.key")
    other = pki.init_ca(tmp_path / "other-ca")
    pki.issue(other, pki.Identity(pki.Role.SITE, "kr-mi300x"), certs)
    (certs / "site-us-mi355x.key").unlink()
    (tmp_path / "keys" / "federation-keys.json").unlink()
    code, lines = _check(tmp_path / "deploy" / "federation.yaml", capsys)
    assert code == 2 and len(lines) == 4, lines
    said = "\n".join(lines)
    assert "scheduler.crt is gateway's certificate; this needs scheduler's" in said
    assert "site-kr-mi300x.crt is not signed by the CA" in said
    assert "site-us-mi355x.key: no such file" in said
    assert "gateway.api_keys" in said and "federation-keys.json: no such file" in said


def _deployment(root: Path) -> Path:
    """deploy/federation.yaml made runnable on this machine: its processes on 127.0.0.1's free
    ports, the sites emulated (one emulator process each, 2 GPUs) instead of launching SGLang."""
    text = (PROJECT_ROOT / "deploy" / "federation.yaml").read_text()
    gateway, schedulers, agents = free_port_block(1), free_port_block(2), free_port_block(2)
    replaced = {
        "control.federation.example": "127.0.0.1",
        "bind: 0.0.0.0": "bind: 127.0.0.1",
        "port: 8080": f"port: {gateway}",
        "metrics_port: 9400": f"metrics_port: {free_port_block(2)}",
        "scheduler-0.federation.example:50051": f"127.0.0.1:{schedulers}",
        "scheduler-1.federation.example:50051": f"127.0.0.1:{schedulers + 1}",
        "kr-mi300x.sites.example:50062": f"127.0.0.1:{agents}",
        "us-mi355x.sites.example:50062": f"127.0.0.1:{agents + 1}",
        "workers: sglang": "workers: emulate",
        "gpus: 8": "gpus: 2",
        "rtt_ms: 118": "rtt_ms: 10",
    }
    for old, new in replaced.items():
        assert old in text, old
        text = text.replace(old, new)
    lines = text.splitlines()
    # Each site's agent on a port of its own (one machine here), its metrics not served.
    lines = [line for line in lines if "metrics_port: 9462" not in line]
    first = next(i for i, line in enumerate(lines) if "agent_port: 50062" in line)
    lines[first] = lines[first].replace("50062", str(agents))
    lines = [line.replace("agent_port: 50062", f"agent_port: {agents + 1}") for line in lines]
    (root / "deploy").mkdir()
    path = root / "deploy" / "federation.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.timeout(180)
def test_the_three_processes_start_from_config_alone(tmp_path: Path) -> None:
    """Two scheduler replicas, two sites' agents and the gateway, each given only `--config`
    (and which replica or site it is), make one federation: mutual TLS from the file's
    certificates, the gateway's keys from its keys file, a chat answered with a key."""
    _operator_files(tmp_path)
    key = keys.add(tmp_path / "keys" / "federation-keys.json", "chat", keys.KeyLimits())
    config = _deployment(tmp_path)
    started: list[Child] = []
    try:
        for replica in range(2):
            started.append(
                start_python(f"scheduler {replica}", "scheduler", ["--config", str(config), "--replica", str(replica)])
            )
        for site in SITES:
            started.append(
                start_python(f"agent {site}", "nodes.agent", ["--config", str(config), "--site", site], timeout_s=90)
            )
        gateway = start_python("gateway", "federation.gateway", ["--config", str(config)])
        started.append(gateway)
        base = f"http://{gateway.ready['listen']}" if "listen" in gateway.ready else None
        port = int(config.read_text().split("port: ", 1)[1].split()[0])
        base = base or f"http://127.0.0.1:{port}"

        def ready_sites() -> int:
            request = urllib.request.Request(base + "/health", headers={"Authorization": f"Bearer {key}"})
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    return len(json.load(resp).get("ready_sites", []))
            except OSError:
                return 0

        poll_until(lambda: ready_sites() == 2, 60, "both sites ready at the gateway")
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0)
        reply = client.chat.completions.create(
            model="openai/gpt-oss-120b", messages=[{"role": "user", "content": "Hello"}], max_tokens=20
        )
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key="not-a-key", max_retries=0).models.list()
    finally:
        for child in reversed(started):
            child.stop(30)
