"""`fedctl site drain|undrain|remove` on a live federation: a drained site gets no new request,
finishes the ones it has, and the command says when it is empty; undrain brings it back;
remove takes it out of every scheduler's list."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from core import wire
from core.config import load
from core.processes import PROJECT_ROOT
from core.wire import SiteStatus
from federation import admin
from federation.admin import fetch_state
from federation.drills.faults import poll_until
from federation.embedded import Federation
from tests.conftest import KOREAN
from tests.test_failover import SITES
from tests.test_federation import MODEL, _config


def _fedctl(path: Path, *args: str) -> asyncio.Task:
    return asyncio.create_task(
        asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "federation.cli", *args, "--config", str(path)],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    )


async def _stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> tuple[str, int]:
    """(site, completion tokens) of one streamed completion from a Korean client."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with http.post(url + "/v1/completions", json=body, headers=KOREAN) as resp:
        assert resp.status == 200, await resp.text()
        site, tokens = resp.headers["X-Federation-Site"], 0
        async for line in resp.content:
            if line.startswith(b'data: {"id"') and b'"usage":{' in line:
                tokens = int(line.split(b'"completion_tokens":')[1].split(b",")[0])
    return site, tokens


async def _until_draining_everywhere(fed: Federation, site: str) -> None:
    """Until every scheduler replica has the site draining (the command is a process starting)."""
    while True:
        states = [await asyncio.to_thread(fetch_state, a, fed.operator) for a in fed.config.scheduler_addresses]
        if all(s.status is SiteStatus.DRAINING for state in states for s in state.sites if s.name == site):
            return
        await asyncio.sleep(0.1)


@pytest.mark.timeout(150)
async def test_drain_undrain_remove(tmp_path: Path) -> None:
    """Six answers in flight at Korea; `fedctl site drain kr-mi300x` waits for them, new Korean
    clients go to the US meanwhile, and the command ends with "drained" once all six finished
    whole. After undrain Korea takes Korean clients again; after remove no scheduler lists it."""
    path, _ = _config(tmp_path, SITES, speed=1)
    fed = Federation(load(path))
    try:
        fed.up()
        url = f"http://{fed.config.host}:{fed.config.gateway.port}"
        async with aiohttp.ClientSession() as http:
            in_flight = [asyncio.create_task(_stream(http, url, 150)) for _ in range(6)]
            await asyncio.sleep(1.0)
            drain = _fedctl(path, "site", "drain", "kr-mi300x")
            await _until_draining_everywhere(fed, "kr-mi300x")
            during = await asyncio.gather(*(_stream(http, url, 4) for _ in range(4)))
            assert {site for site, _ in during} == {"us-mi355x"}
            finished = await asyncio.gather(*in_flight)
            assert finished == [("kr-mi300x", 150)] * 6
            done = await drain
            assert done.returncode == 0, done.stderr
            assert "kr-mi300x: drained" in done.stdout
            assert (await _fedctl(path, "site", "undrain", "kr-mi300x")).returncode == 0
            assert (await _stream(http, url, 4))[0] == "kr-mi300x"
            removed = await _fedctl(path, "site", "remove", "kr-mi300x")
            assert removed.returncode == 0, removed.stderr
            assert [s.name for s in fetch_state(fed.config.scheduler_addresses[0], fed.operator).sites] == ["us-mi355x"]
            missing = await _fedctl(path, "site", "drain", "nowhere")
            assert missing.returncode == 2 and "no site named 'nowhere'" in missing.stderr
    finally:
        fed.down()


@pytest.mark.timeout(120)
def test_a_restarted_replica_keeps_a_drained_site_drained_and_a_removed_one_out(make_federation) -> None:
    """Drain and removal go to every replica; one that restarts afterwards is rebuilt from the
    sites, and must hear from them that one is draining and not take a removed one back."""
    fed, _ = make_federation(scheduler="replicas: 2")
    addresses = list(fed.config.scheduler_addresses)
    admin.drain(addresses, fed.operator, "kr-mi300x")
    fed.restart_scheduler(1)
    at_restarted = [addresses[1]]

    def status(site: str) -> wire.SiteStatus | None:
        state, _ = admin.replicas_state(at_restarted, fed.operator)
        return next((s.status for s in state.sites if s.name == site), None) if state else None

    assert poll_until(lambda: status("us-mi355x") is wire.SiteStatus.READY, 20.0) is not None
    assert poll_until(lambda: status("kr-mi300x") not in (None, wire.SiteStatus.JOINING), 10.0) is not None
    assert status("kr-mi300x") is wire.SiteStatus.DRAINING
    admin.remove(addresses, fed.operator, "kr-mi300x")
    fed.restart_scheduler(1)
    assert poll_until(lambda: status("us-mi355x") is wire.SiteStatus.READY, 20.0) is not None
    time.sleep(2.0)  # a removed site that re-registered would be back by now
    assert status("kr-mi300x") is None
