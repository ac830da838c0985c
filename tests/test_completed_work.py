"""A site counts the work of the requests it completes as their clients asked for it: a resumed
answer's prompt less what it had said, its output with it. The schedulers learn the workload's
shape from these counts, so a wave of resumes after a failure is the same work re-prefilled,
not another workload (scheduler/workload.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core import wire
from federation.gateway.upstream import Deliver, SiteStream, Upstream
from nodes.emulator.launch import launch
from tests.test_readers import _agent


async def _completed(http: aiohttp.ClientSession, metrics_port: int) -> dict[str, float]:
    async with http.get(f"http://127.0.0.1:{metrics_port}/metrics") as resp:
        text = await resp.text()
    return {
        s.labels["kind"]: s.value
        for family in text_string_to_metric_families(text)
        if family.name == "federation_agent_completed_tokens"
        for s in family.samples
        if s.name.endswith("_total")
    }


def _ignore(stream: SiteStream, delta: wire.TokenDelta) -> None:
    pass


async def _answer(upstream: Upstream, port: int, request: wire.GenerateRequest, deliver: Deliver = _ignore) -> None:
    """One generation through the agent at `port`, to its end (60 s at most), each delta to `deliver`."""
    stream = upstream.start("s", f"127.0.0.1:{port}", request, deliver)
    try:
        async with asyncio.timeout(60):
            await stream.done
    finally:
        stream.close()


@pytest.mark.timeout(120)
async def test_a_resumed_answer_counts_as_its_client_asked(http: aiohttp.ClientSession) -> None:
    """A fresh request of 50 prompt tokens and 30 output tokens counts (50, 30); the resume of an
    answer that had said 20 tokens (a 70-token prompt, 10 tokens to go) counts (50, 30) too, not
    (70, 10); a request cancelled before its end counts nothing."""
    workers = launch(["--profile", "mi355x", "--workers", "1", "--speed", "20"])
    agent, port, metrics_port = _agent(workers.urls, readers=0)
    upstream = Upstream()
    try:
        prompt = tuple(range(1000, 1050))
        said = tuple(range(2000, 2020))
        fresh = wire.GenerateRequest("fresh", 50, {"max_new_tokens": 30, "ignore_eos": True}, input_ids=prompt)
        other = tuple(range(3000, 3050))  # shares nothing with the first: no prefix-cache hit
        resumed = wire.GenerateRequest(
            "resumed", 70, {"max_new_tokens": 10, "ignore_eos": True}, input_ids=other + said, resumed_tokens=20
        )
        await _answer(upstream, port, fresh)
        assert await _completed(http, metrics_port) == {"prompt": 50, "output": 30}
        await _answer(upstream, port, resumed)
        assert await _completed(http, metrics_port) == {"prompt": 100, "output": 60}
        long = wire.GenerateRequest("cut", 50, {"max_new_tokens": 100_000, "ignore_eos": True}, input_ids=prompt)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1.0):
                await _answer(upstream, port, long)
        assert await _completed(http, metrics_port) == {"prompt": 100, "output": 60}
    finally:
        await upstream.close()
        agent.stop()
        workers.stop()
