"""Latency mode's hold queue: held requests wait on the federation state the gateway already
watches, not on the scheduler; each asks it once, when it arrives."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from core.config import load
from core.processes import free_port_block
from federation.drills.sampler import gateway_counters
from federation.embedded import Federation
from tests.test_federation import MODEL

HELD = 40
FAR_RTT_MS = 3000  # a client across this WAN cannot get a first token within BUDGET_MS
BUDGET_MS = 2000


@pytest.mark.timeout(120)
async def test_held_requests_do_not_poll_the_scheduler(tmp_path) -> None:
    first = free_port_block(4 + 4)
    path = tmp_path / "federation.yaml"
    path.write_text(
        f"model: {MODEL}\nspeed: 10\n"
        f"gateway: {{port: {first}, region: us-west-2}}\n"
        f"scheduler: {{port: {first + 1}, region: us-west-2}}\n"
        f"links: [{{between: [sa-east-1, us-west-2], rtt_ms: {FAR_RTT_MS}}}]\n"
        f"sites: [{{name: us, region: us-west-2, gpu: mi355x, gpus: 4, agent_port: {first + 2}, "
        f"worker_port: {first + 3}}}]\n"
    )
    fed = Federation(load(path))
    fed.up()
    base = fed.config.gateway_url
    try:
        async with aiohttp.ClientSession() as http:

            async def ask(region: str) -> int:
                body = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
                headers = {"X-TTFT-Budget-Ms": str(BUDGET_MS), "X-Client-Region": region}
                async with http.post(base + "/v1/completions", json=body, headers=headers) as resp:
                    await resp.read()
                    return resp.status

            before = gateway_counters(base + "/metrics")
            held = asyncio.gather(*(ask("sa-east-1") for _ in range(HELD)))
            await asyncio.sleep(0.5)
            near = await ask("us-west-2")  # the site can start it in time: served, not queued behind
            statuses = await held
            after = gateway_counters(base + "/metrics")
    finally:
        fed.down()
    assert statuses == [429] * HELD and near == 200
    dry_runs = after.get("federation_gateway_route_calls_total{kind=dry_run}", 0) - before.get(
        "federation_gateway_route_calls_total{kind=dry_run}", 0
    )
    # One each on arrival; polling every 50 ms for the 2-s budget would have been ~40 each.
    assert HELD + 1 <= dry_runs <= HELD + 3
    routes = after.get("federation_gateway_route_calls_total{kind=route}", 0) - before.get(
        "federation_gateway_route_calls_total{kind=route}", 0
    )
    assert routes == 1  # the near one's: no held request was sent anywhere
