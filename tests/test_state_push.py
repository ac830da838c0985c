"""The state a replica pushes to its watchers (WatchState) is the state it would answer GetState
with: each site's part is rebuilt only when the site's version moved (a report, a status change),
and brought up to date otherwise (its outstanding work, its routes, its ages), so a thousand
sites cost a push milliseconds instead of tens (docs/BENCHMARKS.md, "The control plane at scale")."""

from __future__ import annotations

import dataclasses
import time

from core import wire
from core.wire import RouteRequest, SiteRegistration, SiteReport
from scheduler.service import SchedulerService

MODEL = "openai/gpt-oss-120b"
AGES = {"last_report_age_s": 0.0, "status_age_s": 0.0, "workers_age_s": 0.0}


def _same_but_ages(service: SchedulerService) -> None:
    pushed = wire.federation_state_from_pb(service._state_to_push())
    answered = service._state()
    assert [dataclasses.replace(s, **AGES) for s in pushed.sites] == [
        dataclasses.replace(s, **AGES) for s in answered.sites
    ]
    for p, a in zip(pushed.sites, answered.sites, strict=True):
        assert abs(p.status_age_s - a.status_age_s) < 0.5 and (p.last_report_age_s < 0) == (a.last_report_age_s < 0)
    assert pushed.built_unix_s > 0 and pushed.model == answered.model


def test_a_pushed_state_is_the_state_after_reports_routes_and_downs() -> None:
    service = SchedulerService(MODEL, {})
    for name, gpu in (("kr", "mi300x"), ("us", "mi355x"), ("eu", "mi355x")):
        service.registry.register(SiteRegistration(name, name, gpu, 8, f"{name}:1", MODEL))
    _same_but_ages(service)  # joining, never reported
    now = time.monotonic()
    for name in ("kr", "us", "eu"):
        report = SiteReport(name, healthy_workers=8, total_workers=8, running_requests=10, slots=512)
        service.registry.apply_report(report, now)
    _same_but_ages(service)
    for i in range(20):  # routes move outstanding work, not the sites' versions
        service._decide(RouteRequest(f"r{i}", 1000, 500))
    _same_but_ages(service)
    service.registry.apply_report(SiteReport("us", healthy_workers=6, total_workers=8, running_requests=3), now + 0.2)
    service.registry.expire(now + 5.0)  # every site silent: down
    _same_but_ages(service)
    service.registry.remove("eu")
    _same_but_ages(service)
    assert "eu" not in service._site_pbs
