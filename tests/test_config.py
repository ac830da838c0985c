"""fedctl's configuration: the built-in default and clear errors for bad files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from federation.config import DEFAULT_YAML, ConfigError, parse
from federation.processes import PROJECT_ROOT


def test_default_is_the_embedded_federation() -> None:
    """The default: two sites of 16 GPUs in Korea and Oregon, 130 ms apart, gateway on 8080."""
    c = parse(DEFAULT_YAML)
    assert [(s.name, s.region, s.gpu, s.gpus) for s in c.sites] == [
        ("kr-mi300x", "ap-northeast-2", "mi300x", 16),
        ("us-mi355x", "us-west-2", "mi355x", 16),
    ]
    assert c.gateway_port == 8080 and c.rtt_between("us-west-2", "ap-northeast-2") == 130.0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("gateway: 8080", "`gateway` must be a mapping"),
        ("gateway: {port: http}", "ports must be integers"),
        ("sites: [{name: a, region: r, gpu: h100, gpus: 1, agent_port: 1}]", "gpu must be one of"),
        ("sites: [{name: a, region: r, gpu: mi300x, gpus: 0, agent_port: 1}]", "gpus must be >= 1"),
        ("sites: []", "at least one site"),
        ("links: [{between: [a], rtt_ms: 5}]", "must name two regions"),
        ("{{{", "not valid YAML"),
        ("scheduler: {policy: fastest}", "scheduler.policy must be one of"),
    ],
)
def test_bad_configs_are_explained(text: str, fragment: str) -> None:
    """Each malformed config raises ConfigError naming the problem."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse(text)


def test_fedctl_reports_a_bad_config_without_a_traceback(tmp_path: Path) -> None:
    """`fedctl up --config BAD` exits 2 with one line saying what is wrong."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway: 8080\n")
    proc = subprocess.run(
        [sys.executable, "-m", "federation.cli", "up", "--config", str(bad)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "must be a mapping" in proc.stderr and "Traceback" not in proc.stderr
