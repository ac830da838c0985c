"""A site whose GPUs slow down mid-load loses its capacity within seconds, and gets it back when
they recover: its workers' own accounting says their passes take longer, however the agent
reads their tokens (scheduler/capacity.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from core import wire
from federation import admin
from federation.drills.faults import poll_until

SITE = "us-mi355x"
STREAMS = 64  # most go to the US site: every worker busy
BUSY_S = 8.0  # the accounting's first seconds read, and settled
SLOWDOWN = 4.0
SEEN_WITHIN_S = 10.0


def _site(fed) -> wire.SiteState:
    state, _ = admin.replicas_state(list(fed.config.scheduler_addresses), fed.operator)
    assert state is not None
    return next(s for s in state.sites if s.name == SITE)


async def _faults(http: aiohttp.ClientSession, urls: list[str], **faults: float) -> None:
    for url in urls:
        async with http.post(url + "/_emulator/faults", json=faults) as resp:
            assert resp.status == 200


@pytest.mark.timeout(120)
async def test_a_brownout_is_seen_within_seconds_and_so_is_its_end(make_federation, http) -> None:
    """The US site runs ~50 streams at a steady pace (its GPUs 10 times slower than real, so a pass
    outlasts several of the agent's timer ticks); then its GPUs slow 4-fold: within 10 s the
    schedulers' capacity for it is under half what it was, from its workers' accounting. Back
    to their pace, within 10 s it is back too."""
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
        assert before.capacity_evidence == "accounting" and before.capacity_tok_s > 0, before
        await _faults(http, urls, slowdown=10 * SLOWDOWN)
        cut_s = await asyncio.to_thread(
            poll_until, lambda: _site(fed).capacity_tok_s < 0.5 * before.capacity_tok_s, SEEN_WITHIN_S
        )
        assert cut_s is not None, (before.capacity_tok_s, _site(fed).capacity_tok_s)
        await _faults(http, urls, slowdown=10)
        back_s = await asyncio.to_thread(
            poll_until, lambda: _site(fed).capacity_tok_s > 0.8 * before.capacity_tok_s, SEEN_WITHIN_S
        )
        assert back_s is not None, (before.capacity_tok_s, _site(fed).capacity_tok_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
