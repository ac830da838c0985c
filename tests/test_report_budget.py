"""A replica keeps the reports its sites send within a budget (SchedulerTimings.reports_per_s):
each site that registers is told the interval at which all of them stay within it, never shorter
than the timings' own, and is declared down after as many silent intervals as any site. At a
thousand sites every 0.25 s the reports were most of a replica's core (docs/BENCHMARKS.md)."""

from __future__ import annotations

import time
import urllib.request

import pytest

from core.mtls import INSECURE
from core.processes import free_port_block, start_python
from core.settings import SchedulerTimings
from core.wire import SiteRegistration, SiteReport, SiteStatus
from federation.admin import fetch_state
from nodes.emulator.launch import launch
from scheduler.registry import Registry

MODEL = "openai/gpt-oss-120b"


def _join(registry: Registry, name: str):
    return registry.register(SiteRegistration(name, "r", "mi300x", 8, "127.0.0.1:1", MODEL))


def test_sites_beyond_the_budget_report_less_often_and_are_given_as_many_intervals() -> None:
    timings = SchedulerTimings(report_interval_s=0.25, heartbeat_timeout_s=1.0, reports_per_s=8.0)
    registry = Registry(MODEL, timings)
    intervals = [_join(registry, f"s{i}").report_interval_s for i in range(4)]
    assert intervals == [0.25, 0.25, 0.375, 0.5]  # 2 sites fit in 8 reports/s at 0.25 s; 4 need 0.5 s
    assert registry.sites["s3"].heartbeat_timeout_s == 2.0  # four silent intervals, as at 0.25 s and 1 s
    for name in ("s1", "s3"):
        registry.apply_report(SiteReport(name, healthy_workers=8, total_workers=8), 100.0)
    assert registry.expire(101.5) == ["s1"]  # silent 1.5 s: down at 0.25 s, not yet at 0.5 s
    assert registry.expire(102.1) == ["s3"]


def test_sites_that_joined_early_are_paced_as_the_federation_grows() -> None:
    """The first sites were told 0.25 s; once four share a budget of 8 reports/s, those more
    than a tenth too fast are told 0.5 s (the scheduler sends them REPORT_EVERY), and their
    heartbeat timeout grows with it; a site that registers again is counted once."""
    registry = Registry(MODEL, SchedulerTimings(report_interval_s=0.25, heartbeat_timeout_s=1.0, reports_per_s=8.0))
    for i in range(4):
        _join(registry, f"s{i}")
    assert sorted(s.registration.name for s in registry.pace()) == ["s0", "s1", "s2"]
    assert {s.report_interval_s for s in registry.sites.values()} == {0.5}
    assert {s.heartbeat_timeout_s for s in registry.sites.values()} == {2.0}
    assert registry.pace() == []  # paced once
    assert _join(registry, "s0").report_interval_s == 0.5 and registry.pace() == []


def _reports_total(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return next(
        float(line.split()[1]) for line in text.splitlines() if line.startswith("federation_scheduler_reports_total ")
    )


@pytest.mark.timeout(120)
def test_real_agents_follow_the_pace_their_replica_sets() -> None:
    """A scheduler whose budget is 4 reports/s in all, and two real agents: the second to join
    makes both report every 0.5 s (the first told so by REPORT_EVERY), so the replica hears ~4
    reports a second, not 8, and neither site is ever down between its slower reports."""
    port = free_port_block(2)
    scheduler = start_python(
        "scheduler",
        "scheduler",
        ["--insecure", "--port", str(port), "--metrics-port", str(port + 1), "--timings", '{"reports_per_s": 4.0}'],
    )
    emulator = launch(["--profile", "mi355x", "--workers", "1", "--speed", "50"])
    agents = []
    try:
        for name in ("first", "second"):
            args = ["--insecure", "--site", name, "--region", "r", "--gpu", "mi355x", "--gpus", "1"]
            args += ["--port", str(free_port_block(1)), "--scheduler", f"127.0.0.1:{port}"]
            agents.append(start_python(f"agent {name}", "nodes.agent", [*args, "--worker-url", emulator.urls[0]]))
        url = scheduler.ready["metrics"]
        time.sleep(3.0)  # both registered, the first paced
        before, started = _reports_total(url), time.monotonic()
        time.sleep(6.0)
        rate = (_reports_total(url) - before) / (time.monotonic() - started)
        assert 2.5 < rate < 5.5, rate  # 8/s unpaced
        state = fetch_state(f"127.0.0.1:{port}", INSECURE)
        assert {s.name: s.status for s in state.sites} == {"first": SiteStatus.READY, "second": SiteStatus.READY}
    finally:
        for agent in agents:
            agent.stop()
        emulator.stop()
        scheduler.stop()
