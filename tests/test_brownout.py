"""A site whose GPUs slow down mid-load is cut by the schedulers while its first slow step
overruns the site's pace, before any token of that step arrives: a brownout seen as it
happens, not once the slow tokens have dragged the measured rate down."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from core import wire
from federation import admin
from federation.drills.faults import poll_until

SITE = "us-mi355x"
STREAMS = 64  # ~12 a US worker (most go there): busy (the estimator reads steps from 8 a worker)
BUSY_S = 8.0  # past the estimator's 5 s of settling


def _site(fed) -> wire.SiteState:
    state, _ = admin.replicas_state(list(fed.config.scheduler_addresses), fed.operator)
    assert state is not None
    return next(s for s in state.sites if s.name == SITE)


async def _faults(http: aiohttp.ClientSession, urls: list[str], **faults: float) -> None:
    for url in urls:
        async with http.post(url + "/_emulator/faults", json=faults) as resp:
            assert resp.status == 200


@pytest.mark.timeout(120)
async def test_a_step_that_overruns_cuts_the_sites_capacity_at_once(make_federation, http) -> None:
    """The US site runs ~50 streams at a steady, slow pace (its GPUs 10 times slower); then its
    steps slow 100-fold: within 2 s the schedulers say its step overran (`overdue_age_s`) and
    its capacity is cut far below what it was, though not one token of the slow step has come.
    Back to its pace, the cut ends with that step."""
    fed, _ = make_federation(faults=True, speed=1)
    site = next(s for s in fed.config.sites if s.name == SITE)
    urls = [f"http://{fed.config.host}:{site.worker_port + i}" for i in range(site.gpus)]
    await _faults(http, urls, slowdown=10)
    body = {"model": fed.config.model, "prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    endpoint = fed.config.gateway_url + "/v1/completions"

    async def stream() -> None:
        async with http.post(endpoint, json=body) as resp:
            async for _ in resp.content:
                pass

    tasks = [asyncio.ensure_future(stream()) for _ in range(STREAMS)]
    try:
        await asyncio.sleep(BUSY_S)
        before = _site(fed)
        assert before.overdue_age_s < 0 and before.capacity_tok_s > 0, before
        await _faults(http, urls, slowdown=1000)
        slowed_at = time.monotonic()
        seen_s = await asyncio.to_thread(poll_until, lambda: _site(fed).overdue_age_s >= 0, 10.0)
        assert seen_s is not None and seen_s < 2.0, seen_s
        cut = _site(fed)
        assert cut.capacity_tok_s < 0.5 * before.capacity_tok_s, (before.capacity_tok_s, cut.capacity_tok_s)
        assert cut.overdue_age_s <= time.monotonic() - slowed_at
        await _faults(http, urls, slowdown=10)  # the slow step in progress still ends first
        ended_s = await asyncio.to_thread(poll_until, lambda: _site(fed).capacity_evidence != "overdue", 20.0)
        assert ended_s is not None, repr(_site(fed))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
