"""Several gateway processes share one port, and a scrape of /metrics reaches one of them at
random: each must answer with the counts of all (what operators and drills read)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from federation.drills.sampler import gateway_counters
from tests.conftest import SITES

MODEL = "openai/gpt-oss-120b"
REQUESTS, TOKENS = 24, 16


@pytest.mark.timeout(120)
async def test_every_gateway_process_answers_for_all(make_federation) -> None:
    fed, _ = make_federation(SITES, gateway="processes: 2")
    base = fed.config.gateway_url
    body = {"model": MODEL, "prompt": "count", "max_tokens": TOKENS, "ignore_eos": True}
    # A connection per request, so the kernel spreads them over both processes.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one() -> None:
            async with http.post(base + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()

        await asyncio.gather(*(one() for _ in range(REQUESTS)))
    scrapes = [await asyncio.to_thread(gateway_counters, base + "/metrics") for _ in range(10)]
    for counts in scrapes:
        assert counts["federation_gateway_requests_total{outcome=ok}"] == REQUESTS
        site_tokens = {k: v for k, v in counts.items() if k.startswith("federation_gateway_output_tokens_total")}
        assert sum(site_tokens.values()) == REQUESTS * TOKENS


def _cpu_by_process(text: str) -> dict[str, dict[str, float]]:
    """federation_gateway_cpu_seconds, {pid: {part: seconds}}."""
    cpu: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "federation_gateway_cpu_seconds":
                cpu.setdefault(sample.labels["pid"], {})[sample.labels["part"]] = sample.value
    return cpu


@pytest.mark.timeout(120)
async def test_each_gateway_process_says_its_own_cpu_and_leaves_with_it(make_federation) -> None:
    """Whichever process answers the scrape, each live process is its own series (a per-process
    figure summed would hide a process at its core's ceiling behind an idle one); a process that
    stops takes its series with it."""
    fed, _ = make_federation(SITES, gateway="processes: 2")
    url = fed.config.gateway_url + "/metrics"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:

        async def scrape() -> dict[str, dict[str, float]]:
            async with http.get(url) as resp:
                return _cpu_by_process(await resp.text())

        await asyncio.sleep(1.2)  # each process writes its figures twice a second
        first = await scrape()
        pids = {str(fed.child(f"gateway {i}").pid) for i in range(2)}
        assert set(first) == pids, first
        for parts in first.values():
            assert 0 < parts["loop"] <= parts["process"], parts
        await asyncio.sleep(1.2)
        later = await scrape()
        assert all(later[pid]["process"] >= first[pid]["process"] for pid in pids)
        gone = fed.child("gateway 1")
        assert await asyncio.to_thread(gone.stop) == 0
        for _ in range(5):
            assert set(await scrape()) == {str(fed.child("gateway 0").pid)}
