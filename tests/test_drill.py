"""`fedctl drill`, small: a fault under closed-loop load through the whole federation, with the
issue's JSON keys and a PNG timeline (the real drills are longer; see docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from federation.processes import PROJECT_ROOT
from tests.test_failover import SITES
from tests.test_federation import _config

KEYS = {
    "scenario",
    "requests_sent",
    "requests_ok",
    "requests_failed",
    "lost",
    "retries",
    "resumed",
    "detection_s",
    "recovery_s",
    "output_tokens_per_s_before",
    "output_tokens_per_s_during",
    "output_tokens_per_s_after",
}


def _drill(tmp_path: Path, scenario: str, *args: str) -> dict:
    path, _ = _config(tmp_path, SITES, scheduler="replicas: 2")
    out, png = tmp_path / "drill.json", tmp_path / "drill.png"
    common = ["--config", str(path), "--speed", "10", "--open-requests", "60", "--output-mean", "40"]
    common += ["--warmup-s", "3", "--before-s", "3", "--after-s", "8", "--heal-after-s", "3"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "federation.cli",
            "drill",
            scenario,
            *common,
            *args,
            "--json",
            str(out),
            "--png",
            str(png),
        ],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png.stat().st_size > 10_000
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
def test_site_crash_drill_loses_nothing(tmp_path: Path) -> None:
    """Korea's agent and workers are killed under load: the crash is seen within a second, the
    requests it held are resumed or retried on the US site, and none is lost or failed."""
    report = _drill(tmp_path, "site-crash")
    assert KEYS <= set(report)
    assert report["scenario"] == "site-crash" and report["site"] == "kr-mi300x"
    assert report["requests_sent"] > 60 and report["requests_failed"] == 0 and report["lost"] == 0, report["errors"]
    assert report["detection_s"] is not None and report["detection_s"] <= 1.0
    assert report["resumed"] + report["retries"] >= 1
    assert report["output_tokens_per_s_before"] > 0 and report["output_tokens_per_s_after"] > 0
    assert report["per_site_tokens_per_s_before"]["kr-mi300x"] > 0  # counted by the site that wrote them
    assert report["per_site_tokens_per_s_after"]["kr-mi300x"] == 0
