"""The gateway's per-site circuit breakers: open after failures in a row, then half-open with
exactly one trial request, closed by its first token or opened again by its failure."""

from __future__ import annotations

import time

from federation.gateway import metrics
from federation.gateway.failover import SiteBreakers


def _open_gauge(site: str) -> float:
    return metrics.REGISTRY.get_sample_value("federation_gateway_circuit_open", {"site": site}) or 0.0


def test_half_open_lets_exactly_one_trial_through() -> None:
    breakers = SiteBreakers(failures_to_open=2, open_s=0.05)
    breakers.failed("kr")
    assert breakers.open_sites() == set() and breakers.admit("kr")  # one failure is not a pattern
    breakers.failed("kr")
    assert breakers.open_sites() == {"kr"} and not breakers.admit("kr") and _open_gauge("kr") == 1
    time.sleep(0.06)
    assert breakers.open_sites() == set()  # half-open: a route may choose it ...
    assert breakers.admit("kr")  # ... and the first request it gets is the trial
    assert not breakers.admit("kr") and breakers.open_sites() == {"kr"}  # the rest go elsewhere
    breakers.failed("kr")  # the trial failed: open again, for open_s
    assert breakers.open_sites() == {"kr"} and not breakers.admit("kr")
    time.sleep(0.06)
    assert breakers.admit("kr")
    breakers.succeeded("kr")  # the trial's first token: closed
    assert breakers.open_sites() == set() and breakers.admit("kr") and breakers.admit("kr")
    assert _open_gauge("kr") == 0


def test_a_trial_without_a_verdict_frees_the_next_request_to_be_the_trial() -> None:
    breakers = SiteBreakers(failures_to_open=1, open_s=0.01)
    breakers.failed("us")
    time.sleep(0.02)
    assert breakers.admit("us") and not breakers.admit("us")
    breakers.no_verdict("us")  # its client left, or one of the site's workers broke
    assert breakers.admit("us")
