"""Several gateway processes share one port, and a scrape of /metrics reaches one of them at
random: each must answer with the counts of all (what operators and drills read)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

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
