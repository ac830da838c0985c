"""The gateway's per-site circuit breakers: open after failures in a row, then half-open with
exactly one trial request, closed by its first token or opened again by its failure; alone,
and in a real federation whose gateway loses its link to one site."""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from federation.gateway import metrics
from federation.gateway.failover import SiteBreakers
from tests.test_federation import MODEL

KR = "kr-mi300x"


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


def _metric(text: str, name: str, site: str | None = None) -> float:
    """A sample's value in a /metrics page (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (site is None or sample.labels.get("site") == site):
                return sample.value
    return 0.0


@pytest.mark.timeout(240)
async def test_a_cut_off_site_gets_one_trial_per_open_window_then_serves_again(make_federation) -> None:
    """Real processes, round-robin routing so that every other request would go to Korea: with
    the gateway's link to Korea cut, its circuit opens; each time it half-opens exactly one
    request tries Korea (and is retried elsewhere, so no client sees a failure); once the link
    is healed the next trial closes the circuit and Korea serves again."""
    open_s = 2.0
    fed, _ = make_federation(scheduler="policy: round_robin", timings=f"{{gateway: {{circuit_open_s: {open_s}}}}}")
    link = fed.child("link gateway->kr-mi300x").proc
    url = fed.config.gateway_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:

        async def ask(n: int) -> None:
            for _ in range(n):
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
                async with http.post(url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

        async def metrics() -> str:
            async with http.get(url + "/metrics") as resp:
                return await resp.text()

        await ask(4)
        assert _metric(await metrics(), "federation_gateway_output_tokens_total", KR) > 0
        link.send_signal(signal.SIGUSR1)  # cut: every connection through it reset, new ones too
        await ask(12)  # round robin sends Korea every other one: three failures in a row open it
        page = await metrics()
        assert _metric(page, "federation_gateway_circuit_open", KR) == 1
        opened, retries = (
            _metric(page, "federation_gateway_circuit_opened_total", KR),
            _metric(page, "federation_gateway_retries_total"),
        )
        assert opened == 1
        for window in range(2):  # still cut: each half-open window lets exactly one trial fail
            await asyncio.sleep(open_s + 0.2)
            await ask(10)
            page = await metrics()
            assert _metric(page, "federation_gateway_circuit_opened_total", KR) == opened + window + 1
            assert _metric(page, "federation_gateway_retries_total") == retries + window + 1
        link.send_signal(signal.SIGUSR2)  # healed
        tokens_before = _metric(page, "federation_gateway_output_tokens_total", KR)
        await asyncio.sleep(open_s + 0.2)
        await ask(10)
        page = await metrics()
        assert _metric(page, "federation_gateway_circuit_open", KR) == 0
        assert _metric(page, "federation_gateway_output_tokens_total", KR) > tokens_before  # Korea serves again
