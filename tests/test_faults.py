"""Drill faults: brownout, failing health checks, hanging and dying workers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import aiohttp
import pytest

from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch
from tests.conftest import FAST

BODY = {"text": "drill", "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}


async def _e2e(http: aiohttp.ClientSession, url: str) -> float:
    async with http.post(url + "/generate", json=BODY) as resp:
        return (await resp.json())["meta_info"]["e2e_latency"]


async def _faults(http: aiohttp.ClientSession, url: str, **faults: object) -> aiohttp.ClientResponse:
    async with http.post(url + "/_emulator/faults", json=faults) as resp:
        await resp.read()
        return resp


async def test_brownout_slows_the_gpu(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """slowdown=4 makes the same request take about four times as long, and 1 restores it."""
    url = fresh_worker.urls[0]
    before = await _e2e(http, url)
    assert (await _faults(http, url, slowdown=4)).status == 200
    slow = await _e2e(http, url)
    assert (await _faults(http, url, slowdown=1)).status == 200
    after = await _e2e(http, url)
    assert 2.5 < slow / before < 6
    assert 0.5 < after / before < 2


async def test_unhealthy_fails_health_but_serves(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """An unhealthy worker answers 503 on /health and /health_generate; generation still works."""
    url = fresh_worker.urls[0]
    await _faults(http, url, unhealthy=True)
    for path in ("/health", "/health_generate"):
        async with http.get(url + path) as resp:
            assert resp.status == 503
    assert await _e2e(http, url) > 0
    await _faults(http, url, unhealthy=False)
    async with http.get(url + "/health") as resp:
        assert resp.status == 200


async def test_hang_accepts_and_never_answers(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """A hung worker accepts connections but never answers; its admin path still works."""
    url = fresh_worker.urls[0]
    await _faults(http, url, hang=True)
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=1.0)):
            pass
    await _faults(http, url, hang=False)
    async with http.get(url + "/health") as resp:
        assert resp.status == 200


async def test_die_resets_streams_and_closes_the_port(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """After /_emulator/die an open stream is cut and new connections are refused."""
    url = fresh_worker.urls[0]
    body = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 50_000, "ignore_eos": True}}
    async with http.post(url + "/generate", json=body) as stream:
        await stream.content.readline()
        async with http.post(url + "/_emulator/die") as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientPayloadError):
            async for _ in stream.content:
                pass
    with pytest.raises(aiohttp.ClientConnectorError):
        async with http.get(url + "/health"):
            pass


@pytest.fixture(scope="module")
def refusing_worker() -> Iterator[Emulator]:
    """A worker with fault endpoints that only refused requests reach: each must leave it as
    it was, so one serves every case (a case that changed it fails at once, and so do the next)."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", FAST, "--enable-faults"])
    yield emu
    emu.stop()


@pytest.mark.parametrize(
    "faults",
    [{"slowdown": 0.5}, {"slowdown": "fast"}, {"hang": "yes"}, {"explode": True}],
    ids=["slowdown-below-1", "slowdown-type", "hang-type", "unknown-fault"],
)
async def test_bad_fault_requests_are_refused(refusing_worker: Emulator, http: aiohttp.ClientSession, faults) -> None:
    """The fault endpoint refuses bad input with a 400 and changes nothing."""
    resp = await _faults(http, refusing_worker.urls[0], **faults)
    assert resp.status == 400
    async with http.get(refusing_worker.urls[0] + "/_emulator/state") as state:
        assert (await state.json())["faults"] == {
            "slowdown": 1.0,
            "unhealthy": False,
            "hang": False,
            "dead": False,
        }


async def test_without_enable_faults_nobody_can_break_a_worker(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """An emulator started without --enable-faults has no fault endpoints: anyone reaching its
    port gets a 404 and the worker serves on, unchanged."""
    url = mi355x.urls[0]
    assert (await _faults(http, url, slowdown=4, unhealthy=True)).status == 404
    async with http.post(url + "/_emulator/die") as resp:
        assert resp.status == 404
    async with http.get(url + "/health") as resp:
        assert resp.status == 200
    async with http.get(url + "/_emulator/state") as state:
        assert (await state.json())["faults"] == {"slowdown": 1.0, "unhealthy": False, "hang": False, "dead": False}


async def test_fault_flags_at_start(http: aiohttp.ClientSession) -> None:
    """Faults can be set by flags: --unhealthy fails health checks, --die-after-s kills the ports."""
    emu = launch(["--profile", "mi355x", "--workers", "2", "--speed", "20", "--unhealthy", "--die-after-s", "1.5"])
    try:
        for url in emu.urls:
            async with http.get(url + "/health") as resp:
                assert resp.status == 503
        await asyncio.sleep(2.0)
        for url in emu.urls:
            with pytest.raises(aiohttp.ClientConnectorError):
                async with http.get(url + "/health"):
                    pass
    finally:
        emu.stop()
