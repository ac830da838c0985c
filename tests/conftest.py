"""Shared fixtures: real emulator processes on loopback ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch

FAST = "20"  # emulated GPUs 20x faster than real ones: tests finish in seconds


@pytest.fixture(scope="session")
def mi355x() -> Iterator[Emulator]:
    """Two emulated MI355X workers, shared by tests that don't change their state."""
    emu = launch(["--profile", "mi355x", "--workers", "2", "--speed", FAST])
    yield emu
    assert emu.stop() == 0


@pytest.fixture
def fresh_worker() -> Iterator[Emulator]:
    """One emulated MI300X worker of the test's own (faults, aborts, counters)."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", FAST])
    yield emu
    emu.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session
