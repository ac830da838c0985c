"""The site agent gives each worker only a few requests beyond its running limit and queues
the rest itself, handing each to whichever worker frees a slot first."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import pytest

from federation import wire
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
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel, aiohttp.ClientSession() as http:
            stub = wire.SiteAgentStub(channel)

            async def one(i: int) -> int:
                req = wire.GenerateRequest(
                    f"q{i}", 8, {"max_new_tokens": 40, "ignore_eos": True}, input_ids=tuple(range(1000, 1008))
                )
                tokens = 0
                async for pb in stub.Generate(wire.generate_request_to_pb(req), timeout=60):
                    tokens = wire.chunk_from_pb(pb).completion_tokens
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
    finally:
        agent.stop()
        emulator.stop()
    assert results == [40] * REQUESTS
    assert all(0 < p <= RUNNING_LIMIT + HEADROOM_MIN for p in peak.values()), peak
