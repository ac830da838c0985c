"""The site agent gives each worker only a few requests beyond its running limit and queues
the rest itself, handing each to whichever worker frees a slot first."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from federation import wire
from federation.gateway.upstream import SiteStream, Upstream
from federation.processes import free_port_block, start_python
from nodes.agent.pool import HEADROOM_MIN
from nodes.emulator.launch import launch

RUNNING_LIMIT = 2
REQUESTS = 24


@pytest.mark.timeout(90)
async def test_requests_beyond_the_workers_limits_wait_at_the_agent_and_all_complete() -> None:
    """Two workers running at most 2 requests each get 24 concurrent requests: every one
    completes with its exact token count, and no worker ever holds more than its limit plus
    the agent's headroom (the rest wait at the agent, not in a worker's queue)."""
    emulator = launch(
        ["--profile", "mi355x", "--workers", "2", "--speed", "20", "--max-running-requests", str(RUNNING_LIMIT)]
    )
    port = free_port_block(1)
    agent_args = ["--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "2", "--port", str(port)]
    agent_args += ["--scheduler", f"127.0.0.1:{free_port_block(1)}"]  # nobody there: the agent keeps retrying
    for url in emulator.urls:
        agent_args += ["--worker-url", url]
    agent = start_python("agent", "nodes.agent", agent_args)
    peak = {url: 0 for url in emulator.urls}
    try:
        upstream = Upstream()
        async with aiohttp.ClientSession() as http:

            async def one(i: int) -> int:
                req = wire.GenerateRequest(
                    f"q{i}", 8, {"max_new_tokens": 40, "ignore_eos": True}, input_ids=tuple(range(1000, 1008))
                )
                tokens = 0

                def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
                    nonlocal tokens
                    tokens = delta.completion_tokens

                stream = upstream.start(f"127.0.0.1:{port}", req, deliver)
                try:
                    async with asyncio.timeout(60):
                        await stream.done
                finally:
                    stream.close()
                return tokens

            async def watch() -> None:
                while True:
                    for url in emulator.urls:
                        async with http.get(url + "/v1/loads") as resp:
                            load = (await resp.json())["loads"][0]
                        peak[url] = max(peak[url], load["num_running_reqs"] + load["num_waiting_reqs"])
                    await asyncio.sleep(0.01)

            watcher = asyncio.ensure_future(watch())
            results = await asyncio.gather(*(one(i) for i in range(REQUESTS)))
            watcher.cancel()
        await upstream.close()
    finally:
        agent.stop()
        emulator.stop()
    assert results == [40] * REQUESTS
    assert all(0 < p <= RUNNING_LIMIT + HEADROOM_MIN for p in peak.values()), peak
