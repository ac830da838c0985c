"""A worker that streams is alive: health checks that go unanswered while its answers flow (an
overloaded worker, or the agent's own loop stalled past the checks' timeout) do not cut its
streams. Only a worker silent on every front is given up."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from core import wire
from core.processes import free_port_block, start_python
from federation.gateway.upstream import SiteStream, Upstream
from nodes.emulator.launch import launch

# Checks that give a silent worker up within ~2.4 s, so the test sees it if they do.
TIMINGS = {"health_interval_s": 0.2, "health_timeout_s": 1.0, "call_check_s": 0.1}
TOKENS = 400


@pytest.mark.timeout(90)
async def test_a_streaming_worker_whose_checks_time_out_keeps_its_streams() -> None:
    """Mid-answer the worker stops answering new HTTP requests (/health and /metrics among
    them) while its open streams go on: the stream runs to its last token with no failure,
    though the checks went unanswered for several times the two in a row that give up a
    silent worker."""
    emulator = launch(["--profile", "mi355x", "--workers", "1", "--speed", "1", "--slowdown", "4", "--enable-faults"])
    port = free_port_block(1)
    agent_args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "1", "--port", str(port)]
    agent_args += ["--scheduler", f"127.0.0.1:{free_port_block(1)}", "--timings", json.dumps(TIMINGS)]
    agent_args += ["--worker-url", emulator.urls[0]]
    agent = start_python("agent", "nodes.agent", agent_args)
    upstream = Upstream()
    stream: SiteStream | None = None
    try:
        tokens: list[int] = []
        req = wire.GenerateRequest(
            "alive", 8, {"max_new_tokens": TOKENS, "ignore_eos": True}, input_ids=tuple(range(8))
        )

        def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
            tokens.append(delta.completion_tokens)

        stream = upstream.start("s", f"127.0.0.1:{port}", req, deliver)
        async with asyncio.timeout(30):
            await stream.first
        async with aiohttp.ClientSession() as http:
            async with http.post(emulator.urls[0] + "/_emulator/faults", json={"hang": True}) as resp:
                assert resp.status == 200
            hung_at = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError):  # its checks go unanswered from now on
                async with http.get(emulator.urls[0] + "/health", timeout=aiohttp.ClientTimeout(total=1.0)):
                    pass
            async with asyncio.timeout(60):
                await stream.done
            streamed_s = asyncio.get_running_loop().time() - hung_at
        assert tokens[-1] == TOKENS
        two_checks_s = 2 * (TIMINGS["health_interval_s"] + TIMINGS["health_timeout_s"])
        assert streamed_s > 2 * two_checks_s, f"the answer ended {streamed_s:.1f} s after: too soon to show anything"
    finally:
        if stream is not None:
            stream.close()
        await upstream.close()
        agent.stop()
        emulator.stop()
