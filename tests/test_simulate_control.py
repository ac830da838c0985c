"""`fedctl simulate --sites N`: the real scheduler replicas (processes, mutual TLS) under the
reports of N simulated sites and the routes of gateways. A smoke run at 64 sites: every key of
the issue is measured, every route asked is decided (also across a replica's death), every
site's reports reach the replica, and a site killed or silenced is seen down by every gateway
within the heartbeat's bound. The figures themselves are benchmarks (docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core.processes import PROJECT_ROOT

KEYS = (
    "sites",
    "routes_per_s",
    "route_ms_p50",
    "route_ms_p99",
    "reports_per_s",
    "scheduler_cpu_cores",
    "scheduler_rss_mb",
    "watch_fanout_ms_p99",
    "detect_down_s",
    "replica_failover_s",
)


def _simulate(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "federation.cli", "simulate", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_smoke_run_at_64_sites_measures_every_key_and_loses_no_route(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    proc = _simulate(
        "--sites", "64", "--warmup-s", "2", "--window-s", "4", "--routes-per-s", "300", "--json", str(out),
        timeout_s=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert all(report[key] is not None for key in KEYS), report
    assert report["sites"] == 64 and report["regions"] == 8
    assert report["routes_per_s"] > 0.8 * 300, report  # the replica kept up with what was asked
    assert report["routes_lost"] == 0 and report["routes_asked"] > 300 * 4
    # Each site reports every 0.25 s to the replica measured (some of a window's may come late).
    assert 0.8 * 64 * 4 < report["reports_per_s"] < 1.2 * 64 * 4, report
    assert report["detect_down_s"] < 1.0 and report["detect_silent_s"] < 2.0, report  # heartbeat 1 s
    assert report["routes_lost_in_failover"] == 0 and report["replica_failover_s"] < 5.0, report


def test_a_flag_of_the_other_mode_is_refused() -> None:
    """The policy simulation's flags mean nothing to the control plane's, and the reverse: each
    is refused with exit 2, naming it, not ignored."""
    control = _simulate("--sites", "64", "--added", "3")
    assert control.returncode == 2 and "--added" in control.stderr
    policy = _simulate("--policy-quality", "--replicas", "3")
    assert policy.returncode == 2 and "--replicas" in policy.stderr
    several = _simulate("--policy-quality", "--sites", "64,128")
    assert several.returncode == 2 and "one --sites" in several.stderr
    nonsense = _simulate("--sites", "64,x")
    assert nonsense.returncode == 2 and "--sites" in nonsense.stderr
