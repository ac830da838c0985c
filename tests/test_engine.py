"""The event-driven engine against the step-time model it implements (pure, no HTTP)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from nodes.emulator.engine import Engine, Sequence, _Segment
from nodes.emulator.profiles import PROFILES, GpuProfile


@pytest.fixture
async def run_engine() -> AsyncIterator:
    engines: list[asyncio.Task] = []

    def start(profile: GpuProfile, **kwargs: object) -> Engine:
        engine = Engine(profile, **kwargs)
        engines.append(asyncio.create_task(engine.run()))
        return engine

    yield start
    for task in engines:
        task.cancel()
    await asyncio.gather(*engines, return_exceptions=True)


def _seq(prompt: int, out: int, now: float) -> Sequence:
    return Sequence(rid="r", prompt_tokens=prompt, target_tokens=out, max_new_tokens=out, arrived_at=now)


def test_segment_step_counts_match_durations() -> None:
    """completed(t) is the largest k whose k steps fit in t, for growing step times."""
    seg = _Segment(t0=10.0, s0=0.02, d=0.0003, k_max=500, prefill_tokens=0)
    rng = random.Random(1)
    for _ in range(2000):
        t = 10.0 + rng.uniform(-1, 30)
        k = seg.completed(t)
        assert 0 <= k <= 500
        if k < 500:
            assert seg.duration(k) <= max(t - 10.0, 0) < seg.duration(k + 1)


@pytest.mark.parametrize(("profile", "batch"), [("mi300x", 256), ("mi355x", 1024)])
async def test_saturated_throughput_matches_the_model(run_engine, profile: str, batch: int) -> None:
    """Kept full with `batch` requests, the engine delivers the analytic steady-state tokens/s
    within 10 % (emulated 200x faster than a GPU, so this takes seconds)."""
    speed, prompt, out = 200.0, 1000, 1278
    engine = run_engine(PROFILES[profile], speed=speed)
    loop = asyncio.get_running_loop()
    rng = random.Random(5)

    async def client() -> None:
        while True:
            seq = _seq(prompt, rng.randint(out // 2, out * 3 // 2), loop.time())
            engine.submit(seq)
            await seq.done

    clients = [asyncio.create_task(client()) for _ in range(batch)]
    await asyncio.sleep(1.5)  # > 2 output lifetimes: past the synchronised start
    t0, n0 = loop.time(), engine.emitted_tokens_total()
    await asyncio.sleep(2.0)
    measured = (engine.emitted_tokens_total() - n0) / (loop.time() - t0) / speed
    for c in clients:
        c.cancel()
    predicted, _ = PROFILES[profile].predict_steady_state(batch, prompt, out)
    assert abs(measured / predicted - 1) < 0.10, (measured, predicted)


async def test_full_kv_pool_retracts_and_everyone_finishes(run_engine) -> None:
    """When the KV pool runs out, the engine retracts a request (fewest output tokens first), which
    later re-prefills and still finishes with exactly its tokens."""
    engine = run_engine(PROFILES["mi300x"], speed=500.0, kv_capacity_tokens=40_000)
    loop = asyncio.get_running_loop()
    seqs = [_seq(500, 3000, loop.time()) for _ in range(16)]
    for s in seqs:
        engine.submit(s)
    await asyncio.wait_for(asyncio.gather(*(s.done for s in seqs)), 30)
    assert engine.retractions > 0
    assert max(s.retractions for s in seqs) > 0
    assert [engine.generated_tokens(s) for s in seqs] == [3000] * 16
    assert engine.kv_used_tokens() == 0 and not engine.running


async def test_abort_frees_the_slot(run_engine) -> None:
    """An aborted request ends at once with the tokens it had, and its slot admits the next one."""
    engine = run_engine(PROFILES["mi355x"], speed=50.0, max_running_requests=1)
    loop = asyncio.get_running_loop()
    first, second = _seq(100, 10**6, loop.time()), _seq(100, 50, loop.time())
    engine.submit(first)
    engine.submit(second)
    await first.first_token
    await asyncio.sleep(0.05)
    assert second.first_token_at is None, "the limit of one running request holds"
    engine.abort(first, "test")
    assert first.done.done() and 1 <= engine.generated_tokens(first) < 10**6
    await asyncio.wait_for(second.done, 5)
    assert engine.generated_tokens(second) == 50
