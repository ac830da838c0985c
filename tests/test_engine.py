"""The event-driven engine against the step-time model it implements (pure, no HTTP)."""

from __future__ import annotations

import asyncio
import itertools
import random
from collections.abc import AsyncIterator

import pytest

from core.gpus import PROFILES, GpuProfile
from nodes.emulator.engine import Engine
from nodes.emulator.prefix_cache import CacheConfig, PriorityScheduling
from nodes.emulator.sequence import SeqState, Sequence
from nodes.emulator.stretch import KvShape, StepShape, Stretch
from nodes.emulator.wakeups import StepWakeups


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
    seg = Stretch(t0=10.0, s0=0.02, d=0.0003, k_max=500, shape=StepShape(batch=1, context_tokens=100))
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


class _Kept:
    """An engine listener that keeps the stretches it is given."""

    def __init__(self) -> None:
        self.stretches: list[Stretch] = []

    def on_first_token(self, seq: Sequence) -> None:
        pass

    def on_finish(self, seq: Sequence) -> None:
        pass

    def on_stretch(self, stretch: Stretch) -> None:
        self.stretches.append(stretch)

    def on_idle(self, kv: KvShape, at: float) -> None:
        pass


async def test_listener_gets_every_step_with_its_shape(run_engine) -> None:
    """Every step reaches the listener once, in a stretch whose shape says what it did, through
    retractions and mixed steps: the steps add up to the engine's; the prompt chunks to the
    prompts plus the retracted requests' replays, which are counted apart; the batches decoded
    (by decode and mixed steps alike) plus one token per completed prefill to every token made."""
    kept = _Kept()
    engine = run_engine(PROFILES["mi300x"], speed=500.0, kv_capacity_tokens=40_000, listener=kept)
    loop = asyncio.get_running_loop()
    seqs = [_seq(500, 3000, loop.time()) for _ in range(16)]
    for s in seqs:
        engine.submit(s)
    await asyncio.wait_for(asyncio.gather(*(s.done for s in seqs)), 30)
    shapes = [(st.k_max, st.shape) for st in kept.stretches]
    assert engine.retractions > 0 and sum(shape.retracted for _, shape in shapes) == engine.retractions
    assert sum(k for k, _ in shapes) == engine.steps_done()
    assert all(k == 1 for k, shape in shapes if shape.prefill_tokens)
    prefilled = sum(shape.prefill_tokens for _, shape in shapes)
    replayed = sum(shape.reprocessed_tokens for _, shape in shapes)
    assert prefilled - replayed == 16 * 500 and replayed > 0
    decoded = sum(k * shape.batch for k, shape in shapes)
    assert decoded + len(seqs) + engine.retractions == engine.emitted_tokens_total() == 16 * 3000


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


def _tokens_reached(engine: Engine, seq: Sequence, tokens: int) -> asyncio.Future[None]:
    """A future done when the engine makes its call for `tokens` of `seq`."""
    fut = asyncio.get_running_loop().create_future()
    engine.call_at_tokens(seq, tokens, lambda: fut.done() or fut.set_result(None))
    return fut


def test_step_wakeups_release_in_step_order() -> None:
    """Waiters come out by the step they wait for, all of a step together, and only up to the
    step asked; the earliest pending step is always known."""
    wakeups: StepWakeups[str] = StepWakeups()
    for step, name in [(7, "a"), (3, "b"), (7, "c"), (5, "d"), (3, "e")]:
        wakeups.add(step, name)
    assert wakeups.first() == 3
    assert wakeups.pop_due(2) == []
    assert wakeups.pop_due(5) == ["b", "e", "d"]
    assert wakeups.first() == 7
    assert wakeups.pop_due(100) == ["a", "c"]
    assert wakeups.first() is None


async def test_token_call_comes_at_the_step_that_makes_the_token(run_engine) -> None:
    """call_at_tokens(seq, n, ...) calls when the step that produces token n completes: the count is
    then exactly n, and the time is the first token's plus the model's step durations. At speed 0.1
    a step is ~50 ms: this task asks for token n after token n-1's call, and at real speed (5-ms
    steps) a busy machine woke it a step late, when token n had already been made."""
    profile, prompt, speed = PROFILES["mi355x"], 100, 0.1
    engine = run_engine(profile, speed=speed)
    loop = asyncio.get_running_loop()
    seq = _seq(prompt, 12, loop.time())
    engine.submit(seq)
    await seq.first_token
    seen, expected_at, step_start = [], [], seq.first_token_at
    for n in range(2, 12):
        await _tokens_reached(engine, seq, n)
        seen.append((engine.generated_tokens(seq), loop.time()))
        # decode step k of a batch of one attends the prompt and the k + 1 tokens so far
        step_start += profile.step_ms(1, prompt + n - 1, 0) / 1000.0 / speed
        expected_at.append(step_start)
    assert [count for count, _ in seen] == list(range(2, 12))
    lateness = [t - want for (_, t), want in zip(seen, expected_at, strict=True)]
    assert min(lateness) > -0.001, "no token before its step completes"
    assert sum(lateness) / len(lateness) < 0.005, lateness


async def test_token_call_past_the_answer_comes_at_the_finish(run_engine) -> None:
    """Asking for more tokens than the answer has ends when the request finishes, with its count."""
    engine = run_engine(PROFILES["mi355x"], speed=20.0)
    seq = _seq(100, 5, asyncio.get_running_loop().time())
    engine.submit(seq)
    await asyncio.wait_for(_tokens_reached(engine, seq, 50), 5)
    assert seq.done.done() and engine.generated_tokens(seq) == 5


async def test_abort_makes_a_pending_token_call_at_once(run_engine) -> None:
    """An abort ends a client's wait for its next token immediately, not at the next step."""
    engine = run_engine(PROFILES["mi300x"], speed=1.0)
    seq = _seq(100, 10**6, asyncio.get_running_loop().time())
    engine.submit(seq)
    await seq.first_token
    waiter = _tokens_reached(engine, seq, 1000)
    assert not waiter.done()
    engine.abort(seq, "test")
    assert waiter.done()


async def _follow(engine: Engine, seq: Sequence) -> list[int]:
    """A per-token streaming client: every count it observes, one wait per next token; the last
    token is seen with the finish."""
    await seq.first_token
    counts: list[int] = []
    while not seq.done.done():
        n = min(engine.generated_tokens(seq), seq.target_tokens - 1)
        if not counts or n > counts[-1]:
            counts.append(n)
        else:
            await _tokens_reached(engine, seq, n + 1)
    counts.append(engine.generated_tokens(seq))
    return counts


async def test_one_wake_per_token_while_the_batch_changes(run_engine) -> None:
    """A streaming client waiting token by token sees every count once, in order, while other
    requests arrive and finish around it (each one replans the stretch of steps). Emulated 10x
    slower than a GPU (~70 ms a step): at full pace a step is ~7 ms, and a loaded CI machine can
    hold the follower's loop that long and let it see two tokens at once."""
    engine = run_engine(PROFILES["mi355x"], speed=0.1)
    loop = asyncio.get_running_loop()
    followed = _seq(100, 40, loop.time())
    engine.submit(followed)
    follower = asyncio.create_task(_follow(engine, followed))
    rng = random.Random(3)
    while not followed.done.done():
        engine.submit(_seq(rng.randint(10, 500), rng.randint(1, 8), loop.time()))
        await asyncio.sleep(rng.uniform(0.02, 0.15))
    assert await follower == list(range(1, 41))


async def test_token_calls_survive_retraction(run_engine) -> None:
    """Clients of retracted requests keep waiting through the re-prefill and see their counts
    only grow, up to the exact answer length."""
    engine = run_engine(PROFILES["mi300x"], speed=500.0, kv_capacity_tokens=40_000)
    loop = asyncio.get_running_loop()
    seqs = [_seq(500, 3000, loop.time()) for _ in range(16)]
    for s in seqs:
        engine.submit(s)
    observed = await asyncio.wait_for(asyncio.gather(*(_follow(engine, s) for s in seqs)), 60)
    assert engine.retractions > 0
    for counts in observed:
        assert all(a < b for a, b in itertools.pairwise(counts))
        assert counts[-1] == 3000


def _priority_seq(rid: str, priority: int, out: int, now: float) -> Sequence:
    return Sequence(rid, 100, out, out, now, queue_entry_at=now, priority=priority)


@pytest.mark.parametrize("preemption", [True, False])
async def test_a_higher_priority_preempts_a_full_batch_past_the_threshold(run_engine, preemption: bool) -> None:
    """SGLang's priority preemption (priority scheduling, threshold 10, strictly exceeded): with
    both slots taken by flex work (priority 0), a priority request (20) takes the newest one's
    slot at once; a default one (10) is not far enough above flex to, and waits for a slot to
    free (the priority one's, when it ends: the preempted flex request waits behind it). With
    --disable-priority-preemption the priority request waits too."""
    priority = PriorityScheduling(enabled=True, preemption=preemption)
    engine = run_engine(PROFILES["mi355x"], speed=50.0, max_running_requests=2, cache=CacheConfig(priority=priority))
    loop = asyncio.get_running_loop()
    flex = [_priority_seq(f"flex{i}", 0, 10**6, loop.time() + i * 0.001) for i in range(2)]
    for s in flex:
        engine.submit(s)
    await asyncio.wait_for(asyncio.gather(*(s.first_token for s in flex)), 5)
    urgent, default = _priority_seq("urgent", 20, 20, loop.time()), _priority_seq("default", 10, 20, loop.time())
    engine.submit(default)
    engine.submit(urgent)
    if preemption:
        await asyncio.wait_for(asyncio.gather(urgent.done, default.first_token), 5)
        assert engine.preemptions == 1 and default.first_token_at >= urgent.finished_at
        assert [s.retractions for s in flex] == [0, 1]  # the newest of the least favoured
        assert flex[1].state is SeqState.WAITING
        assert engine.retractions == 0  # a preemption is not a retraction for lack of KV
    else:
        await asyncio.sleep(0.5)
        assert urgent.first_token_at is None and default.first_token_at is None and engine.preemptions == 0
    for s in flex:
        engine.abort(s, "test")  # a million tokens take a while: free the slots
    await asyncio.wait_for(asyncio.gather(urgent.done, default.done), 5)
    assert [engine.generated_tokens(s) for s in (urgent, default)] == [20, 20]


async def test_a_preempted_request_ends_with_exactly_its_tokens(run_engine) -> None:
    """Preempted mid-answer, a request waits, prefills its prompt and output again and goes on to
    its exact length; its clients' counts only grow."""
    priority = PriorityScheduling(enabled=True)
    engine = run_engine(PROFILES["mi355x"], speed=200.0, max_running_requests=1, cache=CacheConfig(priority=priority))
    loop = asyncio.get_running_loop()
    flex = _priority_seq("flex", 0, 300, loop.time())
    engine.submit(flex)
    await asyncio.wait_for(flex.first_token, 5)
    await asyncio.wait_for(_tokens_reached(engine, flex, 50), 5)
    follow = asyncio.ensure_future(_follow(engine, flex))  # from 50 tokens on, through the preemption
    urgent = _priority_seq("urgent", 20, 30, loop.time())
    engine.submit(urgent)
    counts = await asyncio.wait_for(follow, 10)
    assert flex.retractions == 1 and engine.preemptions == 1
    assert all(a < b for a, b in itertools.pairwise(counts)) and counts[-1] == 300
    assert urgent.finished_at is not None and flex.finished_at is not None and urgent.finished_at < flex.finished_at
