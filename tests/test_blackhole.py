"""Links that drop packets instead of refusing them: a scheduler replica behind a blackhole is
found by the gateway's watch and keepalive pings, routes go to the other replica, and with every
replica blackholed the gateway routes from the last state (degraded) — no request fails; a site
behind one is found by the pings, and its streams resume elsewhere."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from core.pki import Identity, Role
from core.processes import free_port_block, start_python
from federation.linkproxy import BLACKHOLE_SIGNAL, Link, LinkProxy
from tests.conftest import until
from tests.test_federation import MODEL

DETECTION_BOUND_S = 5.0  # generous: two keepalive periods (2 s) plus a loaded machine's slack


@pytest.mark.timeout(180)
async def test_blackholed_scheduler_replicas_are_routed_around_then_degraded(make_federation) -> None:
    fed, _ = make_federation(scheduler="replicas: 2")
    host = fed.config.host
    proxies = [LinkProxy(Link(host, 0, host, fed.config.scheduler.port + i, 0.0)) for i in range(2)]
    for proxy in proxies:
        await proxy.start()
    port = free_port_block(1)
    args = ["--host", host, "--port", str(port), "--model", MODEL]
    args += [arg for p in proxies for arg in ("--scheduler", f"{host}:{p.port}")]
    args += fed.tls_flags(Identity(Role.GATEWAY))
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
            await until(lambda: _is(health, "ok", first), 30)
            load = asyncio.ensure_future(traffic())
            await asyncio.sleep(1.0)

            proxies[0].blackhole()
            second = f"{host}:{proxies[1].port}"
            await until(lambda: _is(health, "ok", second), DETECTION_BOUND_S)
            await asyncio.sleep(3.0)  # routes flow through the second replica meanwhile

            proxies[1].blackhole()
            await until(lambda: _is(health, "degraded", None), 2 * DETECTION_BOUND_S)
            await asyncio.sleep(3.0)  # routes decided here, from the last state

            for proxy in proxies:
                proxy.heal()
            await until(lambda: _is(health, "ok", None), 15)
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


@pytest.mark.timeout(180)
async def test_streams_at_a_blackholed_site_resume_elsewhere_within_seconds(make_federation) -> None:
    """The gateway's link to Korea drops every byte, its connections left open: HTTP/2 pings
    find it (a second with nothing read, then a ping unanswered for 1 s plus the longest round
    trip), and the streams Korea held resume at the US, whole — none waits for the link to heal
    (measured before the fix: they waited until the heal, 20 s in the drill)."""
    fed, _ = make_federation(scheduler="policy: round_robin", speed=2)  # half the streams on Korea
    url = fed.config.gateway_url
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def stream() -> int:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "stream": True}
            tokens = 0
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        tokens += 1
            return tokens

        async def resumed() -> bool:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            return any(
                line.startswith("federation_gateway_resumed_total ") and float(line.split()[1]) > 0
                for line in text.splitlines()
            )

        streams = [asyncio.ensure_future(stream()) for _ in range(8)]
        await asyncio.sleep(3.0)  # every stream has begun, at both sites
        fed.child("link gateway->kr-mi300x").proc.send_signal(BLACKHOLE_SIGNAL)
        await until(resumed, DETECTION_BOUND_S)  # fails past the bound
        assert all(t > 0 for t in await asyncio.gather(*streams))
