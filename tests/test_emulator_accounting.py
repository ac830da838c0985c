"""The emulator's /metrics carry SGLang 0.5.23's own accounting of its work, at SGLang's cadence
(nodes/emulator/reporter.py): counters per forward pass, a mixed step counted as one prefill
pass, gauges held between log points, idle seconds published at most once a second.

The first tests replay stretches of steps through the reporter (pure); the rest start a real
emulator and read its /metrics as Prometheus does, against numbers worked out by hand from the
requests sent and the GPU's step model."""

from __future__ import annotations

import asyncio
import itertools
import math
import re
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.gpus import PROFILES
from nodes.emulator.launch import EmulatorProcess, launch
from nodes.emulator.reporter import Reporter, ReportState
from nodes.emulator.stretch import KvShape, StepShape, Stretch
from tests.conftest import RETRACTING_WORKER, retracting_requests

LOG_INTERVAL = 40  # SGLang's --decode-log-interval default: decode passes between log points
POOL = 10**9  # a KV pool no test fills


def _decode(t0: float, passes: int, batch: int, context: int, queued: int = 0) -> Stretch:
    shape = StepShape(batch=batch, context_tokens=context, queued=queued, kv=KvShape(full_used=context))
    return Stretch(t0, 0.01, 0.0001, passes, shape)


def _prefill(t0: float, chunk: int, batch: int = 0, context: int = 0, held: int = 0, **shape: int) -> Stretch:
    """A prefill pass; `held`: KV held besides the running sequences' (prompts partly prefilled)."""
    kv = KvShape(full_used=context + held)
    step = StepShape(batch=batch, context_tokens=context, prefill_tokens=chunk, kv=kv, **shape)
    return Stretch(t0, 0.05, 0.0, 1, step)


def _replay(stretches: list[Stretch], max_running: int = 1024) -> ReportState:
    reporter = Reporter(0.0, max_running, POOL, 0)
    for stretch in stretches:
        reporter.on_stretch(stretch)
    return reporter.state


def test_decode_log_points_and_throughput_match_pass_by_pass() -> None:
    """Decode passes spread over stretches of any length, with prefill passes between, log
    exactly where a pass-by-pass count of SGLang's forward_ct_decode puts its log points: the
    batch, its ΣL and its KV as of that pass, and gen_throughput as the decode tokens since the
    previous log point over the time since it (the mixed passes' decode not counted)."""
    stretches, t, ctx = [], 0.0, 300
    for i, (passes, batch) in enumerate([(7, 3), (45, 3), (1, 4), (90, 4), (33, 2), (200, 5), (40, 5)]):
        decode = _decode(t, passes, batch, ctx, queued=i)
        stretches.append(decode)
        t, ctx = decode.end(), ctx + batch * passes
        mixed = _prefill(t, 123, batch=batch, context=ctx)
        stretches.append(mixed)
        t, ctx = mixed.end(), ctx + batch + 124
    state = _replay(stretches)

    # SGLang's reporter, one pass at a time (the prefill passes' reports are checked elsewhere).
    count, generated, logged_at, gen, gauges = 0, 0, 0.0, 0.0, None
    for stretch in stretches:
        if stretch.shape.prefill_tokens:
            continue
        for j in range(1, stretch.k_max + 1):
            count, generated = count + 1, generated + stretch.shape.batch
            if count % LOG_INTERVAL == 0:
                t = stretch.t0 + stretch.duration(j)
                gen, generated, logged_at = generated / (t - logged_at), 0, t
                seq_lens = stretch.shape.context_tokens + stretch.shape.batch * (j - 1)
                gauges = (stretch.shape.batch, stretch.shape.queued, seq_lens)
    assert gauges is not None
    assert state.decode_tokens == sum(s.k_max * s.shape.batch for s in stretches if not s.shape.prefill_tokens)
    assert state.decode_graph_passes == sum(s.k_max for s in stretches if not s.shape.prefill_tokens)
    assert state.decode_logged_at == logged_at and state.generated_since_log == generated
    assert state.last_gen_throughput == pytest.approx(gen, rel=1e-12)
    assert state.decode_sum_seq_lens == gauges[2], "kept by the mixed pass that logged last"
    assert (state.running, state.pools.full_used) == (5, stretches[-1].shape.context_tokens + 123)
    assert (state.prefill_passes, state.prefill_compute_tokens) == (7, 7 * 123)


def test_a_prefill_pass_logs_the_batch_it_was_scheduled_with() -> None:
    """A mixed pass's log point shows the running batch as scheduled (the decode rows), the
    queue, the KV after the pass (their ΣL, the partly prefilled prompts and the chunk), and the
    last retraction; a retracted request's tokens are computed but not effective input."""
    decode = _decode(0.0, 10, 4, 1000)
    mixed = _prefill(decode.end(), 500, batch=4, context=1040, held=300, queued=2, reprocessed_tokens=120)
    state = _replay([decode, mixed])
    assert (state.running, state.queued, state.pools.full_used, state.retracted) == (4, 2, 1040 + 300 + 500, 0)
    state = _replay([decode, mixed, _prefill(mixed.end(), 64, batch=5, context=1500, retracted=2)])
    assert (state.running, state.queued, state.pools.full_used, state.retracted) == (5, 0, 1564, 2)
    assert (state.prefill_compute_tokens, state.effective_input_tokens) == (564, 444)
    assert state.decode_sum_seq_lens == 0  # no decode log point yet: a prefill's report leaves it


def test_a_decode_batch_above_the_graph_limit_runs_eagerly() -> None:
    """A decode pass runs in a CUDA graph up to 512 sequences (or --max-running-requests, if
    lower), beyond that without one; either way it adds its batch to the decode tokens."""
    state = _replay([_decode(0.0, 3, 512, 0), _decode(1.0, 2, 513, 0)])
    assert (state.decode_graph_passes, state.decode_eager_passes, state.decode_tokens) == (3, 2, 3 * 512 + 2 * 513)
    assert _replay([_decode(0.0, 2, 200, 0)], max_running=128).decode_eager_passes == 2


def test_going_idle_zeroes_the_load_gauges_once_they_show_a_batch() -> None:
    """Idle, the scheduler republishes its load at once if the running gauge still shows
    requests (zero running, queue, KV and gen_throughput, the batch's ΣL kept); if it showed
    none, only 30 s after its last log point."""
    reporter = Reporter(0.0, 1024, POOL, 0)
    reporter.on_stretch(_decode(0.0, 40, 2, 500))
    busy = reporter.view(0.5, None)
    assert (busy.running, busy.pools.full_used, busy.gen_throughput) == (0, 0, 0.0)
    assert busy.decode_sum_seq_lens == 500 + 2 * 39 and busy.last_gen_throughput > 0

    reporter = Reporter(0.0, 1024, POOL, 0)
    reporter.on_stretch(_prefill(0.0, 64))  # logs running 0, KV 64
    end = 0.05
    assert reporter.view(end + 29.0, None).pools.full_used == 64
    assert reporter.view(end + 31.0, None).pools.full_used == 0


def test_idle_seconds_are_published_a_second_apart_at_events() -> None:
    """Idle time is published at the scheduler's events, at least a second after the previous
    publication: while idle (it spins) exactly on the second; while busy at the first pass
    launched after it; a scrape is no event."""
    reporter = Reporter(10.0, 1024, POOL, 0)
    assert reporter.view(10.9, None).idle_published_s == 0.0
    assert reporter.view(12.5, None).idle_published_s == pytest.approx(2.0)
    busy = Stretch(12.75, 0.3, 0.0, 10, StepShape(batch=1, context_tokens=10))  # passes end 13.05, 13.35, ...
    reporter.on_stretch(busy)
    state = reporter.state
    # Published at 13.05 (2.75 s idle), then 14.25 and 15.45 (no more idle); it ends at 15.75.
    assert (state.idle_published_s, state.idle_recorded_at) == (pytest.approx(2.75), pytest.approx(15.45))
    assert reporter.view(16.3, None).idle_published_s == pytest.approx(2.75)
    assert reporter.view(16.6, None).idle_published_s == pytest.approx(2.75 + 0.7)  # at 16.45
    assert reporter.state is state and state.at == pytest.approx(15.75), "a view commits nothing"


# ---- a real emulator -------------------------------------------------------------


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def emulator(request: pytest.FixtureRequest) -> Iterator[EmulatorProcess]:
    """One worker of the test's own: `--profile mi355x --speed <param>`, counters from zero."""
    emu = launch(["--profile", "mi355x", "--workers", "1", "--speed", str(request.param)])
    yield emu
    emu.stop()


async def _metrics(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """The scheduler's samples, by (name, mode label or "")."""
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, s.labels.get("mode", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if "tp_rank" in s.labels
    }


def _step_s(profile: str, speed: float, context: int) -> float:
    """One decode pass of a batch of one with `context` tokens, in the emulator's wall seconds."""
    return PROFILES[profile].step_ms(1, context, 0) / 1000.0 / speed


async def _generate(http: aiohttp.ClientSession, url: str, prompt: int, tokens: int) -> dict:
    body = {"input_ids": list(range(7, 7 + prompt)), "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        return await resp.json()


@pytest.mark.parametrize("emulator", [20], indirect=True)
async def test_one_request_is_one_prefill_pass_and_decode_passes(
    emulator: EmulatorProcess, http: aiohttp.ClientSession
) -> None:
    """A 37-token prompt answered with 121 tokens: one prefill pass of 37 tokens (its first
    token), then 120 decode passes of one sequence, in a graph; the last log point (pass 120)
    holds its ΣL 37 + 120, and gen_throughput there is 40 tokens over passes 81 to 120 of the
    step model; idle since, the load gauges read zero."""
    url = emulator.urls[0]
    answer = await _generate(http, url, 37, 121)
    assert answer["meta_info"]["completion_tokens"] == 121
    m = await _metrics(http, url)
    for _ in range(100):  # the idle log point comes at the scheduler's round after the answer
        if m[("sglang:num_running_reqs", "")] == 0:
            break
        await asyncio.sleep(0.05)
        m = await _metrics(http, url)
    assert m[("sglang:realtime_tokens_total", "prefill_compute")] == 37
    assert m[("sglang:realtime_tokens_total", "decode")] == 120
    assert ("sglang:realtime_tokens_total", "prefill_cache") not in m
    assert m[("sglang:prefill_effective_tokens_total", "input")] == 37
    assert m[("sglang:prefill_effective_tokens_total", "device_hit")] == 0
    assert m[("sglang:cuda_graph_passes_total", "prefill_none")] == 1
    assert m[("sglang:cuda_graph_passes_total", "decode_cuda_graph")] == 120
    assert ("sglang:cuda_graph_passes_total", "decode_none") not in m
    assert m[("sglang:decode_sum_seq_lens", "")] == 37 + 120
    assert (m[("sglang:num_running_reqs", "")], m[("sglang:gen_throughput", "")]) == (0, 0)
    async with http.get(url + "/server_info") as resp:
        last = (await resp.json())["internal_states"][0]["last_gen_throughput"]
    # decode pass k (0-based) attends the prompt and the k + 1 tokens so far
    window = sum(_step_s("mi355x", 20, 37 + 1 + k) for k in range(80, 120))
    assert last == pytest.approx(40 / window, rel=1e-6)


@pytest.mark.parametrize("emulator", [2], indirect=True)
async def test_a_mixed_step_is_a_prefill_pass_whose_decode_is_not_counted(
    emulator: EmulatorProcess, http: aiohttp.ClientSession
) -> None:
    """A 30-token request arriving while a 600-token answer decodes is prefilled in a step that
    also decodes the running one: that step is a prefill pass, and the token it decodes is in no
    counter. So the decode tokens are 598 + 19 (each answer's first token comes from its prefill,
    one more of the long one from the mixed step) over 598 decode passes."""
    url = emulator.urls[0]
    body = {
        "input_ids": list(range(50)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 600, "ignore_eos": True},
    }
    async with http.post(url + "/generate", json=body) as resp:
        await resp.content.readline()  # its first token: it decodes from now on (~1.5 s)
        short = asyncio.create_task(_generate(http, url, 30, 20))
        async for _ in resp.content:
            pass
    assert (await short)["meta_info"]["completion_tokens"] == 20
    m = await _metrics(http, url)
    assert m[("sglang:realtime_tokens_total", "prefill_compute")] == 80
    assert m[("sglang:cuda_graph_passes_total", "prefill_none")] == 2
    assert m[("sglang:realtime_tokens_total", "decode")] == 598 + 19
    assert m[("sglang:cuda_graph_passes_total", "decode_cuda_graph")] == 598


@pytest.mark.parametrize("emulator", [1], indirect=True)
async def test_gauges_hold_between_log_points(emulator: EmulatorProcess, http: aiohttp.ClientSession) -> None:
    """Scraped every few milliseconds while one 64-token prompt decodes 400 tokens, the load
    gauges change only at SGLang's log points: until the 40th decode pass they are the prefill's
    report (no running request, 64 tokens of KV) although the request is decoding; after, they
    are those of decode pass 40k (ΣL and KV 64 + 40k, one running), with gen_throughput the 40
    passes before it by the step model; many scrapes in a row read the same values."""
    url = emulator.urls[0]
    body = {
        "input_ids": list(range(64)),
        "stream": True,
        "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
    }
    seen: list[tuple[float, ...]] = []

    async def scrape_while(done: asyncio.Event) -> None:
        while not done.is_set():
            m = await _metrics(http, url)
            names = ("num_running_reqs", "num_queue_reqs", "num_used_tokens", "decode_sum_seq_lens", "gen_throughput")
            seen.append(tuple(m[(f"sglang:{name}", "")] for name in names))
            await asyncio.sleep(0.005)

    done = asyncio.Event()
    async with http.post(url + "/generate", json=body) as resp:
        await resp.content.readline()  # prefilled: the prefill pass has reported
        scraper = asyncio.create_task(scrape_while(done))
        async for line in resp.content:
            # Stop well before the end (~100 ms of steps): idle, the worker zeroes its load.
            if (m := re.search(rb'"completion_tokens":(\d+)', line)) and int(m.group(1)) >= 380:
                done.set()
        await scraper
    windows = {}
    for running, queued, used, seq_lens, gen in seen:
        assert queued == 0
        if seq_lens == 0:
            assert (running, used, gen) == (0, 64, 0), "the prefill's report, held"
            continue
        k, rest = divmod(int(seq_lens) - 64, LOG_INTERVAL)
        assert rest == 0 and k >= 1 and (running, used) == (1, seq_lens)
        if k >= 2:
            window = sum(_step_s("mi355x", 1, 64 + 1 + j) for j in range(40 * (k - 1), 40 * k))
            assert gen == pytest.approx(40 / window, rel=1e-6)
        windows[k] = windows.get(k, 0) + 1
    assert len(windows) >= 4, windows  # the gauges moved on ...
    assert len(seen) > 2 * len(windows), (len(seen), windows)  # ... and held in between


async def test_idle_seconds_lag_by_at_most_a_second(http: aiohttp.ClientSession) -> None:
    """Idle from its start, a worker publishes its idle time every second on the second (a
    whole number of seconds, never ahead of the wall time, behind it by less than one); after
    some work, each publication while idle adds exactly the second that passed."""
    before = time.monotonic()
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", "20"])
    ready = time.monotonic()
    try:
        url = emu.urls[0]
        values = []
        while time.monotonic() < ready + 2.5:
            sent = time.monotonic()
            idle = (await _metrics(http, url))[("sglang:scheduler_idle_seconds_total", "")]
            assert idle == pytest.approx(round(idle), abs=1e-6) and idle <= time.monotonic() - before
            assert idle > sent - ready - 1.0
            values.append(idle)
            await asyncio.sleep(0.1)
        assert values == sorted(values) and values[-1] >= 2
        await _generate(http, url, 100, 50)  # ~60 ms of steps
        after: list[float] = []
        while len(set(after)) < 4:
            after.append((await _metrics(http, url))[("sglang:scheduler_idle_seconds_total", "")])
            await asyncio.sleep(0.1)
        published = sorted(set(after))
        gaps = [b - a for a, b in itertools.pairwise(published)]
        assert published[0] >= values[-1]
        assert any(not math.isclose(gap, 1.0) for gap in gaps), "the second the work fell in"
        assert gaps[-1] == pytest.approx(1.0, abs=1e-6), gaps
    finally:
        emu.stop()


async def test_a_retracted_request_prefilled_again_is_computed_not_effective(http: aiohttp.ClientSession) -> None:
    """Four 20-token prompts outgrow a 2,000-token KV pool, so requests are retracted and
    prefilled again with their output so far: prefill_compute counts those tokens too, while
    the effective input is the 80 prompt tokens alone."""
    emu = launch(RETRACTING_WORKER)
    try:
        url = emu.urls[0]

        async def one(body: dict) -> None:
            async with http.post(url + "/generate", json=body) as resp:
                assert resp.status == 200
                await resp.read()

        await asyncio.gather(*(one(body) for body in retracting_requests()))
        m = await _metrics(http, url)
        assert m[("sglang:prefill_effective_tokens_total", "input")] == 80
        assert m[("sglang:realtime_tokens_total", "prefill_compute")] > 80 + 20
    finally:
        emu.stop()
