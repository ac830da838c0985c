"""Small smoke runs of the emulator benchmarks (the real runs are long; see docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nodes.emulator.launch import PROJECT_ROOT


def _run(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "federation.bench.emulator", *args, "--json", str(out)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_fidelity_smoke(tmp_path: Path) -> None:
    """The fidelity benchmark runs both profiles and reports prediction beside measurement."""
    result = _run(tmp_path, "fidelity", "--speed", "20", "--warmup-s", "1", "--window-s", "3")
    for name in ("mi300x", "mi355x"):
        p = result["profiles"][name]
        assert p["requests_completed"] > 0
        assert p["predicted_output_tokens_per_s"] > 0 and p["measured_output_tokens_per_s"] > 0
        ratio = p["measured_output_tokens_per_s"] / p["predicted_output_tokens_per_s"]
        assert p["throughput_ratio"] == pytest.approx(ratio, abs=1e-3)  # both sides are rounded
    assert result["mi355x_to_mi300x_throughput"] > 1


def test_scale_smoke(tmp_path: Path) -> None:
    """The scale benchmark drives several workers without streaming and reports CPU use."""
    result = _run(
        tmp_path,
        "scale",
        "--workers",
        "2",
        "--speed",
        "20",
        "--output-mean",
        "200",
        "--warmup-s",
        "1",
        "--window-s",
        "3",
    )
    assert result["requests_completed"] > 0 and result["requests_per_s"] > 0
    assert 0 < result["emulator_cpu_cores"] <= 2.0
