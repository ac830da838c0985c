"""Shared fixtures: real emulator processes and federations on loopback ports."""

# ruff: noqa: E402  (grpc-core's fork handlers are turned off before anything imports grpc)
from __future__ import annotations

from core.forks import keep_grpc_out_of_forks

keep_grpc_out_of_forks()  # before anything imports grpc: the tests start processes while they use it

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from core.config import load
from core.processes import DEFAULT_PORT_RANGE, PORT_RANGE_ENV, PROJECT_ROOT
from federation.embedded import Federation
from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch
from tests.test_federation import _config

# These machines' environment (CI's too) sets PYTHONDONTWRITEBYTECODE, so every process the tests
# start would compile every module it imports from source again: ~0.6 s of CPU for a gateway,
# half the CPU of a federation's start. The tests and their processes write and reuse bytecode,
# as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# A shell starts background jobs with SIGINT ignored, and children inherit that: a `fedctl`
# started by these tests would then shrug off the Ctrl-C the tests send it. The tests' own
# processes take Ctrl-C as an operator's terminal delivers it, however the suite was started.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest-xdist's workers pick free ports side by side: each picks from its own slice of the range
# (and so do the processes its tests start), or two could take the same port between one's pick
# and its bind (CI saw an agent's metrics port taken so).
if "PYTEST_XDIST_WORKER" in os.environ:
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _low, _high = DEFAULT_PORT_RANGE
    _slice = (_high - _low) // _workers
    os.environ[PORT_RANGE_ENV] = f"{_low + _worker * _slice}-{_low + (_worker + 1) * _slice}"

SITES = [("kr-mi300x", "ap-northeast-2", "mi300x"), ("us-mi355x", "us-west-2", "mi355x")]
FAST = "20"  # emulated GPUs 20x faster than real ones: tests finish in seconds
KOREAN = {"X-Client-Region": "ap-northeast-2"}  # the WAN term sends these clients to the Korean site


def fedctl(*args: str, timeout_s: float = 150, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`fedctl ARGS` as an operator runs it (with `env` added to ours): its exit code and what it printed."""
    return subprocess.run(
        [sys.executable, "-m", "federation.cli", *args],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def mi355x() -> Iterator[Emulator]:
    """Two emulated MI355X workers, shared by tests that don't change their state."""
    emu = launch(["--profile", "mi355x", "--workers", "2", "--speed", FAST])
    yield emu
    assert emu.stop() == 0


@pytest.fixture
def fresh_worker() -> Iterator[Emulator]:
    """One emulated MI300X worker of the test's own (faults, aborts, counters)."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", FAST, "--enable-faults"])
    yield emu
    emu.stop()


# A worker whose KV pool (SGLang's --max-total-tokens) four answers of RETRACTED_ANSWER_TOKENS
# outgrow: three are admitted, and as they grow one is retracted back to the queue, where it
# waits (~3 s in) until another ends.
RETRACTING_WORKER = ["--profile", "mi300x", "--workers", "1", "--speed", "5", "--max-total-tokens", "2000"]
RETRACTED_ANSWER_TOKENS = 800


def retracting_requests() -> list[dict]:
    """The four /generate requests (without `stream`) that outgrow RETRACTING_WORKER's pool."""
    params = {"max_new_tokens": RETRACTED_ANSWER_TOKENS, "ignore_eos": True}
    return [{"input_ids": list(range(100 + k, 120 + k)), "sampling_params": params} for k in range(4)]


async def abort_all_once_one_is_retracted(http: aiohttp.ClientSession, url: str) -> None:
    """Wait until the worker has retracted a request back to its waiting queue, then abort every
    request it holds (SGLang's /abort_request with abort_all)."""
    async with asyncio.timeout(30):
        while True:
            async with http.get(url + "/_emulator/state") as resp:
                engine = (await resp.json())["engine"]
            if engine["waiting_retracted"]:
                break
            await asyncio.sleep(0.02)
    async with http.post(url + "/abort_request", json={"abort_all": True}) as resp:
        assert resp.status == 200


async def until(check, bound_s: float) -> float:
    """Seconds until `check()` (a coroutine function) is true; fails past `bound_s`."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < bound_s, "not within the bound"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture(scope="module")
def shared_federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Federation, Path]]:
    """`make_federation()`'s federation, started once for the tests of a module that only
    route through it or start processes of their own beside it: none of them kills, drains,
    faults or reconfigures anything of it, so each saves a start (~5 s on two cores)."""
    path, _ = _config(tmp_path_factory.mktemp("federation"), SITES)
    fed = Federation(load(path))
    try:
        fed.up()
        yield fed, path
    finally:
        fed.down()


@pytest.fixture
def make_federation(tmp_path: Path) -> Iterator:
    """Starts small federations (Korea and the US, 4 GPUs each, speed 10) in-process; stops them after."""
    started: list[Federation] = []

    def make(
        sites=SITES, insecure: bool = False, faults: bool = False, launch: bool = False, **options
    ) -> tuple[Federation, Path]:
        path, _ = _config(tmp_path, sites, **options)
        fed = Federation(load(path), insecure=insecure, faults=faults, launch=launch)
        started.append(fed)
        fed.up()
        return fed, path

    yield make
    for fed in started:
        fed.down()
