"""The agent's loop never waits on its reporter process: a reporter that stops reading (hung,
stopped, swapped out) while thousands of calls arrive must not block the agent's serving."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import psutil
import pytest

from core import wire
from core.processes import free_port_block, start_python
from federation.gateway.upstream import Upstream
from nodes.agent.reporter import _urgent
from nodes.emulator.launch import launch

CALLS = 3_000  # their request ids alone are ~100 KB: more than a pipe holds


@pytest.mark.timeout(120)
async def test_a_hung_reporter_does_not_block_the_agent() -> None:
    emulator = launch(["--profile", "mi355x", "--workers", "1", "--speed", "50"])
    port = free_port_block(1)
    args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "1", "--port", str(port)]
    args += ["--scheduler", f"127.0.0.1:{free_port_block(1)}", "--worker-url", emulator.urls[0]]
    agent = start_python("agent", "nodes.agent", args)
    reporter = next(p for p in psutil.Process(agent.pid).children() if "spawn_main" in " ".join(p.cmdline()))
    os.kill(reporter.pid, signal.SIGSTOP)
    upstream = Upstream()
    try:

        async def one(i: int) -> None:
            req = wire.GenerateRequest(
                f"a-request-id-long-enough-to-fill-a-pipe-{i:06d}", 4, {"max_new_tokens": 1}, input_ids=(1, 2, 3, 4)
            )
            stream = upstream.start("s", f"127.0.0.1:{port}", req, lambda s, d: None)
            try:
                await stream.done
            finally:
                stream.close()

        async with asyncio.timeout(60):
            for start in range(0, CALLS, 500):  # waves: the ids reach the feed tick after tick
                await asyncio.gather(*(one(i) for i in range(start, start + 500)))
                await asyncio.sleep(0.2)
            await one(CALLS)  # still served after the pipe would have filled
    finally:
        os.kill(reporter.pid, signal.SIGCONT)
        await upstream.close()
        agent.stop()
        emulator.stop()


def test_a_change_of_healthy_workers_is_reported_at_once() -> None:
    """The reporter sends at once (not at the next interval) when the snapshot's healthy workers
    differ from the one before; any other change waits for the interval."""
    normal = wire.SiteReport("s", healthy_workers=4, running_requests=1000, delivered_tok_s=4000.0)
    assert _urgent(normal, dataclasses.replace(normal, healthy_workers=3))
    assert not _urgent(normal, dataclasses.replace(normal, running_requests=10, delivered_tok_s=10.0))
