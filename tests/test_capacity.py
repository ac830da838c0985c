"""The capacity estimator learns what a site delivers; the prior is only where it starts."""

from __future__ import annotations

from federation.wire import SiteReport
from scheduler.capacity import CapacityEstimator, prior_capacity_tok_s

REPORT_S = 0.25


def _run(est: CapacityEstimator, seconds: float, **report: float) -> None:
    for _ in range(round(seconds / REPORT_S)):
        est.observe(SiteReport("s", **report), REPORT_S)


def test_a_saturated_site_that_is_slower_than_declared_loses_share_within_30_s() -> None:
    """Declared 16 x MI355X, delivering like 16 x MI300X with requests waiting: within 30 s the
    estimate is within 5 % of what it delivers."""
    declared, real = prior_capacity_tok_s("mi355x", 16), prior_capacity_tok_s("mi300x", 16)
    est = CapacityEstimator.from_prior(declared)
    _run(est, 30, healthy_workers=16, total_workers=16, queued_requests=40, gen_throughput_tok_s=real)
    assert abs(est.capacity_tok_s(16, 16) / real - 1) < 0.05


def test_idle_sites_keep_their_estimate_and_busy_ones_raise_it() -> None:
    """A site with room to spare delivering little proves nothing (the estimate stays); one that
    delivers more than believed raises it, saturated or not."""
    est = CapacityEstimator.from_prior(100_000)
    _run(est, 60, healthy_workers=16, total_workers=16, queued_requests=0, gen_throughput_tok_s=10_000)
    assert est.capacity_tok_s(16, 16) == 100_000
    _run(est, 30, healthy_workers=16, total_workers=16, queued_requests=0, gen_throughput_tok_s=150_000)
    assert est.capacity_tok_s(16, 16) > 145_000


def test_saturation_must_settle_before_it_lowers_the_estimate() -> None:
    """The first seconds of saturation show a throughput average still full of idle time: they
    must not drag the estimate down."""
    est = CapacityEstimator.from_prior(100_000)
    _run(est, 4, healthy_workers=16, total_workers=16, queued_requests=10, gen_throughput_tok_s=20_000)
    assert est.capacity_tok_s(16, 16) == 100_000


def test_lost_workers_lower_capacity_at_once() -> None:
    """A site with 12 of 16 workers healthy delivers three quarters of its capacity; what the
    12 deliver is read as the whole site's rate scaled up, so losing workers is not slowness."""
    est = CapacityEstimator.from_prior(160_000)
    assert est.capacity_tok_s(12, 16) == 120_000
    _run(est, 30, healthy_workers=12, total_workers=16, queued_requests=5, gen_throughput_tok_s=120_000)
    assert abs(est.capacity_tok_s(16, 16) / 160_000 - 1) < 0.01
