"""A replica keeps the reports its sites send within a budget (SchedulerTimings.reports_per_s):
each site that registers is told the interval at which all of them stay within it, never shorter
than the timings' own, and is declared down after as many silent intervals as any site. At a
thousand sites every 0.25 s the reports were most of a replica's core (docs/BENCHMARKS.md)."""

from __future__ import annotations

from core.settings import SchedulerTimings
from core.wire import SiteRegistration, SiteReport
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
