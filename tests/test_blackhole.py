"""Links that drop packets instead of refusing them: a scheduler replica behind a blackhole is
found by the gateway's watch and keepalive pings, routes go to the other replica, and with every
replica blackholed the gateway routes from the last state (degraded) — no request fails."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from core.processes import free_port_block, start_python
from federation.linkproxy import Link, LinkProxy
from tests.test_federation import MODEL

DETECTION_BOUND_S = 5.0  # generous: two keepalive periods (2 s) plus a loaded machine's slack


async def _until(check, bound_s: float) -> float:
    """Seconds until `check()` (a coroutine function) is true; fails past `bound_s`."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < bound_s, "not within the bound"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.timeout(180)
async def test_blackholed_scheduler_replicas_are_routed_around_then_degraded(make_federation) -> None:
    fed, _ = make_federation(scheduler="replicas: 2")
    host = fed.config.host
    proxies = [LinkProxy(Link(host, 0, host, fed.config.scheduler_port + i, 0.0)) for i in range(2)]
    for proxy in proxies:
        await proxy.start()
    port = free_port_block(1)
    args = ["--host", host, "--port", str(port), "--model", MODEL]
    args += [arg for p in proxies for arg in ("--scheduler", f"{host}:{p.port}")]
    gateway = start_python("gateway behind blackholes", "federation.gateway", args)
    url = f"http://{host}:{port}"
    failures: list[str] = []
    try:
        async with aiohttp.ClientSession() as http:

            async def health() -> dict:
                async with http.get(url + "/health") as resp:
                    return await resp.json()

            async def traffic() -> int:
                """Requests one after another, each bounded: a request waiting out a dead replica fails."""
                done = 0
                while True:
                    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
                    try:
                        async with asyncio.timeout(DETECTION_BOUND_S + 5):
                            async with http.post(url + "/v1/completions", json=body) as resp:
                                if resp.status != 200:
                                    failures.append(f"{resp.status} {await resp.text()}")
                    except TimeoutError:
                        failures.append("timed out")
                    done += 1
                    await asyncio.sleep(0.02)

            first = f"{host}:{proxies[0].port}"
            await _until(lambda: _is(health, "ok", first), 30)
            load = asyncio.ensure_future(traffic())
            await asyncio.sleep(1.0)

            proxies[0].blackhole()
            second = f"{host}:{proxies[1].port}"
            await _until(lambda: _is(health, "ok", second), DETECTION_BOUND_S)
            await asyncio.sleep(3.0)  # routes flow through the second replica meanwhile

            proxies[1].blackhole()
            await _until(lambda: _is(health, "degraded", None), 2 * DETECTION_BOUND_S)
            await asyncio.sleep(3.0)  # routes decided here, from the last state

            for proxy in proxies:
                proxy.heal()
            await _until(lambda: _is(health, "ok", None), 15)
            await asyncio.sleep(1.0)
            load.cancel()
            await asyncio.gather(load, return_exceptions=True)
    finally:
        gateway.stop()
        for proxy in proxies:
            await proxy.stop()
    assert failures == []


async def _is(health, status: str, scheduler: str | None) -> bool:
    h = await health()
    return h["status"] == status and (scheduler is None or h["scheduler"] == scheduler)
