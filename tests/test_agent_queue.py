"""The site agent gives each worker only a few requests beyond its running limit and queues
the rest itself, handing each to whichever worker frees a slot first."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Callable

import aiohttp
import pytest

from core import wire
from core.errors import UpstreamFailed
from core.processes import free_port_block, start_python
from core.settings import AgentTimings
from core.tiers import Tier
from federation.gateway.upstream import SiteStream, Upstream
from nodes.agent.pool import HEADROOM_MIN
from nodes.emulator import __main__ as emulator_main
from nodes.emulator.launch import launch

RUNNING_LIMIT = 2
REQUESTS = 24
QUICK_CHECKS = {"health_interval_s": 0.5, "health_timeout_s": 1.0}  # hung workers given up in ~3 s, not ~12


async def _streamed(
    upstream: Upstream, port: int, req: wire.GenerateRequest, deliver: Callable[[SiteStream, wire.TokenDelta], None]
) -> None:
    """`req` streamed from the agent at `port` (site "s") to its end, each delta to `deliver`."""
    stream = upstream.start("s", f"127.0.0.1:{port}", req, deliver)
    try:
        async with asyncio.timeout(60):
            await stream.done
    finally:
        stream.close()


@pytest.mark.timeout(90)
async def test_requests_beyond_the_workers_limits_wait_at_the_agent_and_all_complete() -> None:
    """Two workers running at most 2 requests each get 24 concurrent requests: every one
    completes with its exact token count, and no worker ever holds more than its limit plus
    the agent's headroom (the rest wait at the agent, not in a worker's queue)."""
    emulator = launch(
        ["--profile", "mi355x", "--workers", "2", "--speed", "20", "--max-running-requests", str(RUNNING_LIMIT)]
    )
    port = free_port_block(1)
    agent_args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "2", "--port", str(port)]
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

                await _streamed(upstream, port, req, deliver)
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


@pytest.mark.timeout(90)
async def test_a_site_that_loses_every_worker_fails_its_queue_at_once() -> None:
    """Requests waiting for their first token when every worker hangs (in the agent's queue, or
    queued at a worker) end with a failure (so the gateway sends them elsewhere) once the health
    checks give the workers up, not after the 1,800-s first-token timeout. (Hung, not crashed: a crash also frees the slots the
    waiters then fail on, which would hide whether the queue itself is failed.)"""
    emulator = launch(
        ["--profile", "mi355x", "--workers", "2", "--speed", "1", "--max-running-requests", str(RUNNING_LIMIT)]
    )
    port = free_port_block(1)
    agent_args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "2", "--port", str(port)]
    agent_args += ["--scheduler", f"127.0.0.1:{free_port_block(1)}", "--timings", json.dumps(QUICK_CHECKS)]
    for url in emulator.urls:
        agent_args += ["--worker-url", url]
    agent = start_python("agent", "nodes.agent", agent_args)
    upstream = Upstream()
    try:
        req = [
            wire.GenerateRequest(f"w{i}", 8, {"max_new_tokens": 2000, "ignore_eos": True}, input_ids=tuple(range(8)))
            for i in range(REQUESTS)
        ]
        streams = [upstream.start("s", f"127.0.0.1:{port}", r, lambda s, d: None) for r in req]
        async with asyncio.timeout(30):
            await asyncio.wait([s.first for s in streams], return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(1.0)  # the workers hold their limits plus headroom; the rest wait at the agent
        waiting = [s for s in streams if not s.first.done()]
        assert waiting, "every request reached a worker: nothing waited at the agent"
        os.kill(emulator.pid, signal.SIGSTOP)  # both workers hang: connections open, nothing answers
        killed_at = asyncio.get_running_loop().time()
        async with asyncio.timeout(60):
            results = await asyncio.gather(*(s.first for s in waiting), return_exceptions=True)
        waited_s = asyncio.get_running_loop().time() - killed_at
        assert all(isinstance(r, UpstreamFailed) for r in results), results
        reasons = {"lost every worker", "stopped answering its health checks"}  # at the agent; at a worker
        assert all(any(why in str(r) for why in reasons) for r in results), results
        # Hung workers are given up by their health checks (each waits `health_timeout_s`); a bound
        # far under the first-token timeout the queue used to wait for.
        timings = AgentTimings(**QUICK_CHECKS)
        assert waited_s < 4 * timings.failures_to_unhealthy * (timings.health_interval_s + timings.health_timeout_s)
    finally:
        for s in streams:
            s.close()
        await upstream.close()
        agent.stop()
        emulator.proc.kill()
        emulator.stop()


async def _first_tokens_by_tier(priority_scheduling: bool, blockers: int) -> list[str]:
    """One worker running one request at a time (with SGLang's priority scheduling, or not)
    behind an agent: `blockers` long default requests, then a flex, a default and a priority
    one asked in that order; the order in which their first tokens came."""
    scheduling = ["--enable-priority-scheduling"] if priority_scheduling else []  # 20 over 10: no preemption
    emulator = launch(
        ["--profile", "mi355x", "--workers", "1", "--speed", "2", "--max-running-requests", "1", *scheduling]
    )
    port = free_port_block(1)
    agent_args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "1", "--port", str(port)]
    agent_args += ["--scheduler", f"127.0.0.1:{free_port_block(1)}", "--worker-url", emulator.urls[0]]
    agent = start_python("agent", "nodes.agent", agent_args)
    order: list[str] = []
    try:
        async with aiohttp.ClientSession() as http, http.get(emulator.urls[0] + "/server_info") as resp:
            assert (await resp.json())["enable_priority_scheduling"] is priority_scheduling
        upstream = Upstream()

        async def one(name: str, tokens: int, tier: Tier) -> None:
            req = wire.GenerateRequest(
                name, 8, {"max_new_tokens": tokens, "ignore_eos": True}, input_ids=tuple(range(1000, 1008)), tier=tier
            )

            def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
                if delta.completion_tokens and name not in order:
                    order.append(name)

            await _streamed(upstream, port, req, deliver)

        # each ~2.6 s long (1,000 steps of ~5 ms at twice real speed): the first still runs when
        # the three are asked, 1.0 to 1.4 s in
        long_ones = [asyncio.ensure_future(one(f"block{i}", 1000, Tier.DEFAULT)) for i in range(blockers)]
        await asyncio.sleep(1.0)
        waiting = []
        for name, tier in (("flex", Tier.FLEX), ("default", Tier.DEFAULT), ("priority", Tier.PRIORITY)):
            waiting.append(asyncio.ensure_future(one(name, 5, tier)))
            await asyncio.sleep(0.2)
        await asyncio.gather(*long_ones, *waiting)
        await upstream.close()
    finally:
        agent.stop()
        emulator.stop()
    return [name for name in order if not name.startswith("block")]


@pytest.mark.timeout(90)
async def test_requests_waiting_at_the_agent_are_served_by_service_tier() -> None:
    """The worker's headroom filled with long default requests: the flex, default and priority
    ones wait at the agent, and the priority one is handed the first slot that frees, then the
    default, then the flex."""
    assert await _first_tokens_by_tier(False, 1 + HEADROOM_MIN) == ["priority", "default", "flex"]


@pytest.mark.timeout(90)
async def test_a_worker_with_priority_scheduling_serves_its_queue_by_the_tier_the_agent_sends() -> None:
    """A worker started with SGLang's --enable-priority-scheduling says so in its server_info, and
    the agent gives each request SGLang's priority for its tier: with one long request running,
    the three fit in the worker's headroom and wait in the worker's own queue, which starts the
    priority one first."""
    assert await _first_tokens_by_tier(True, 1) == ["priority", "default", "flex"]


def test_the_emulator_takes_priority_scheduling_as_sglang_does_and_refuses_what_it_does_not_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse = emulator_main.parse_args
    args = parse(
        ["--profile", "mi300x", "--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "5"]
    )
    assert args.enable_priority_scheduling and args.schedule_policy == "fcfs"
    (config,) = emulator_main.worker_configs(args)
    assert config.cache.priority.preempts and config.cache.priority.threshold == 5
    args = parse(["--profile", "mi300x", "--enable-priority-scheduling", "--disable-priority-preemption"])
    assert not emulator_main.worker_configs(args)[0].cache.priority.preempts
    for extra, said in (
        (["--schedule-policy", "lpm"], "schedule_policy must be 'fcfs' or 'lof'"),
        (["--abort-on-priority-when-disabled"], "not emulated"),
    ):
        with pytest.raises(SystemExit):
            parse(["--profile", "mi300x", "--enable-priority-scheduling", *extra])
        assert said in capsys.readouterr().err
