"""MLPerf's two scenarios against an endpoint, and what a run delivered.

Offline sends every sample at once (up to the client's connection budget); Server sends
them at Poisson arrival times. A run's numbers are MLPerf's: output tokens/s = tokens ÷
time to the last completion; TPOT per sample = (latency − TTFT) ÷ (tokens − 1).

Sustained Offline keeps the endpoint loaded for a set time instead (every finished sample
replaced at once) and measures the tokens delivered over a window after a warm-up: what
MLPerf's Offline ratio tends to as runs grow, without runs of an hour (see `window_rate`).

Times are reported in GPU time: with the emulator slowed down (`--speed 0.25` runs every GPU 4×
slower, so that more of them fit on the machine's cores) a wall-clock second is `speed` GPU
seconds. Latencies are multiplied by `speed`, rates divided by it, so the numbers read as the
real GPUs would deliver them; ratios (efficiency, shares) are the same either way.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import uvloop
from tqdm import tqdm

from federation.bench.client import Result, send, served_model, session
from federation.bench.workload import Sample

# Each open request holds a socket in the client and in a gateway process; a process has
# 20,000 file descriptors here (a hard limit root cannot raise), so the client runs one
# process per this many open requests (and the bench's federation two gateway processes).
PER_PROCESS_IN_FLIGHT = 15_000
# Enough open requests to keep all 20,480 running slots of the embedded default busy, with a
# queue at every site: Offline means every GPU always has work.
MAX_IN_FLIGHT = 24_000
FIRST_WAVE_S = 1.0  # requests sent this soon after the start (wall s) make up the opening burst
START_DELAY_S = 3.0  # lets every client process start before the first arrival (or the warm-up)
# A run whose open requests fit in one client process runs in this one and starts no other: it
# waits only for its session and one /v1/models before the first arrival.
IN_PROCESS_START_DELAY_S = 1.0
# A sustained run's lane whose request failed waits this long before its next, doubling while
# its requests keep failing, up to the max: a user's client backs off an endpoint that refuses
# or is gone, rather than send thousands of requests a second that fail at once (which would
# also be counted as the drill's failures, and take the cores the federation needs).
LANE_BACKOFF_S = 0.1
LANE_BACKOFF_MAX_S = 2.0
# MLPerf gpt-oss-120b Server limits, GPU time.
TTFT_LIMIT_MS = 3000.0
TPOT_LIMIT_MS = 80.0


@dataclass(frozen=True, slots=True)
class Planned:
    sample: Sample
    due: float | None  # time.monotonic() it arrives (Server); None: at once (Offline)


def offline_plan(samples: Sequence[Sample]) -> list[Planned]:
    """Every sample at once, longest answer first: with every sample known up front (MLPerf
    Offline), a run must not end on one long answer that happened to be sent last and decodes
    alone; MLPerf's Offline SUTs order their queries too."""
    return [Planned(s, None) for s in sorted(samples, key=lambda s: s.output_tokens, reverse=True)]


def client_processes(max_in_flight: int) -> int:
    """How many processes send a run with this many requests open at once (1: this one)."""
    return max(1, math.ceil(max_in_flight / PER_PROCESS_IN_FLIGHT))


def start_delay_s(max_in_flight: int) -> float:
    """From now until a run's first arrival (Server) or its warm-up's start (sustained): time for
    the client processes it needs to start, and no more when it needs none."""
    return START_DELAY_S if client_processes(max_in_flight) > 1 else IN_PROCESS_START_DELAY_S


def server_plan(
    samples: Sequence[Sample], rate_per_s: float, *, speed: float, seed: int, max_in_flight: int
) -> list[Planned]:
    """Poisson arrivals at `rate_per_s` (GPU time) starting once the run's clients can send
    (`start_delay_s`)."""
    rng = random.Random(seed)
    due, plan = time.monotonic() + start_delay_s(max_in_flight), []
    for sample in samples:
        due += rng.expovariate(rate_per_s * speed)
        plan.append(Planned(sample, due))
    return plan


def run_plan(endpoint: str, plan: Sequence[Planned], max_in_flight: int, label: str) -> list[Result]:
    """Send the plan, at most `max_in_flight` open at once, from as many processes as the
    file-descriptor limit asks for (each takes every k-th request, so order and arrivals hold)."""
    parts = client_processes(max_in_flight)
    if parts == 1:
        return uvloop.run(_drive(endpoint, plan, max_in_flight, label, 0))
    jobs = [(endpoint, plan[i::parts], math.ceil(max_in_flight / parts), label, i) for i in range(parts)]
    with multiprocessing.get_context("spawn").Pool(parts) as pool:  # leaving the block terminates them
        return [r for part in pool.starmap(_drive_in_process, jobs) for r in part]


def _drive_in_process(endpoint: str, plan: Sequence[Planned], max_in_flight: int, label: str, part: int) -> list:
    return uvloop.run(_drive(endpoint, plan, max_in_flight, label, part))


async def _drive(endpoint: str, plan: Sequence[Planned], max_in_flight: int, label: str, part: int) -> list[Result]:
    gate = asyncio.Semaphore(max_in_flight)
    results: list[Result] = []
    async with session(endpoint, part) as http:
        model = await served_model(http, endpoint)
        with tqdm(total=len(plan), desc=f"{label} [{part}]", unit="req", position=part, mininterval=2.0) as bar:

            async def one(p: Planned) -> None:
                if p.due is not None:
                    await asyncio.sleep(max(0.0, p.due - time.monotonic()))
                async with gate:
                    results.append(await send(http, endpoint, model, p.sample, started=p.due))
                bar.update()

            await asyncio.gather(*(one(p) for p in plan))
    return results


@dataclass(frozen=True, slots=True)
class Sustain:
    """A sustained Offline run (GPU seconds): loaded for `warmup_s + window_s`, measured over
    the window. The warm-up lets the opening burst's prefill pass and the answers' ends spread
    out, so the window sees the mix a long run would. With `ramp_s`, the open requests start
    evenly over that long instead of at once (no opening burst: the ends spread out sooner)."""

    warmup_s: float
    window_s: float
    ramp_s: float = 0.0
    # Stop reading the answers still open when the window ends (a benchmark: what they delivered
    # is known), rather than reading each to its end (a drill: nothing accepted may be lost).
    cut_at_end: bool = False


def run_sustained(
    endpoint: str,
    samples: Sequence[Sample],
    open_requests: int,
    sustain: Sustain,
    speed: float,
    label: str,
    *,
    stream_interval: int | None = None,
    on_window: Callable[[tuple[float, float]], None] | None = None,
) -> tuple[list[Result], tuple[float, float]]:
    """Keep `open_requests` samples open (cycling through `samples`) until the window ends,
    then let the open ones finish, or with `cut_at_end` stop reading: they are `cut` with the
    tokens they had delivered (an endpoint that says its tokens only at the end has its begun
    answers read to the end). Returns every result and the window (time.monotonic(), shared by
    every client process), which `on_window` hears of before the clients start. With
    `stream_interval` every request asks for the worker's own chunks (see client.body)."""
    start = time.monotonic() + start_delay_s(open_requests) + sustain.warmup_s / speed
    window = (start, start + sustain.window_s / speed)
    if on_window is not None:
        on_window(window)
    parts = client_processes(open_requests)
    lanes = math.ceil(open_requests / parts)
    cut_at = window[1] if sustain.cut_at_end else None
    clients = [
        _Client(
            endpoint, samples[i::parts], lanes, window[1], cut_at, sustain.ramp_s / speed, label, i, stream_interval
        )
        for i in range(parts)
    ]
    if parts == 1:
        return _sustain_in_process(clients[0]), window
    with multiprocessing.get_context("spawn").Pool(parts) as pool:
        return [r for part in pool.map(_sustain_in_process, clients) for r in part], window


@dataclass(frozen=True, slots=True)
class _Client:
    """One client process of a sustained run: `lanes` requests open, each replaced as it ends
    until `stop_at`; read until `cut_at` (None: to their ends)."""

    endpoint: str
    samples: Sequence[Sample]
    lanes: int
    stop_at: float
    cut_at: float | None
    ramp_s: float
    label: str
    part: int
    stream_interval: int | None = None


def _sustain_in_process(client: _Client) -> list[Result]:
    return uvloop.run(_sustain(client))


async def _sustain(c: _Client) -> list[Result]:
    feed = itertools.cycle(c.samples)
    results: list[Result] = []
    async with session(c.endpoint, c.part) as http:
        model = await served_model(http, c.endpoint)
        with tqdm(desc=f"{c.label} [{c.part}]", unit="req", position=c.part, mininterval=2.0) as bar:

            async def lane(k: int) -> None:
                await asyncio.sleep(c.ramp_s * k / c.lanes)
                failed_in_a_row = 0
                while time.monotonic() < c.stop_at:
                    sample = next(feed)
                    result = await send(
                        http, c.endpoint, model, sample, stop_at=c.cut_at, stream_interval=c.stream_interval
                    )
                    results.append(result)
                    bar.update()
                    if result.cut:  # the window is over, whatever this clock says: the cut's timer runs
                        break  # on the loop's (uvloop's, in ms), which can be a hair ahead of it
                    failed_in_a_row = 0 if result.ok else failed_in_a_row + 1
                    if failed_in_a_row:
                        backoff_s = min(LANE_BACKOFF_MAX_S, LANE_BACKOFF_S * 2 ** (failed_in_a_row - 1))
                        if time.monotonic() + backoff_s >= c.stop_at:
                            break  # the back-off outlasts the run; a sleep cut to stop_at can wake a
                            # hair early (the loop's clock) and send once more after the window
                        await asyncio.sleep(backoff_s)

            await asyncio.gather(*(lane(k) for k in range(c.lanes)))
    return results


def percentile_ms(values: list[float], q: float, speed: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0] * 1000 * speed, 2)
    return round(statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1] * 1000 * speed, 2)


def steady_rate(results: Sequence[Result]) -> tuple[float, float]:
    """(output tokens/s, window seconds) while the client kept the endpoint fully loaded: from
    when the first wave of requests had its first tokens (the burst absorbed) to when the last
    sample was sent (after which load only falls). A run too small to have such a window
    (every sample sent before the first answers began) is measured whole.

    Why beside MLPerf's tokens ÷ time to the last completion: that one needs runs much longer
    than the longest answer (10,240 tokens ≈ 12 GPU-minutes), or it measures that one answer;
    MLPerf runs 600 s and more. This window is biased too: it holds the burst's decode but
    little of its prefill. A sustained run (`run_sustained`) measures neither way."""
    window = steady_window(results)
    if window is None:
        return 0.0, 0.0
    return window_rate(results, window), window[1] - window[0]


def steady_window(results: Sequence[Result]) -> tuple[float, float] | None:
    """`steady_rate`'s window (time.monotonic()); None when no request was answered."""
    ok = [r for r in results if r.ok and r.first_token is not None]
    if not ok:
        return None
    t0 = min(r.started for r in results)
    first_wave = sorted(r.first_token for r in ok if r.started - t0 < FIRST_WAVE_S)
    start = first_wave[int(0.9 * (len(first_wave) - 1))] if first_wave else t0
    end = max(r.started for r in results)
    if end <= start:  # every sample went out before the burst was absorbed: the whole run is the window
        start, end = t0, max(r.finished for r in ok)
    return start, end


def window_rate(
    results: Sequence[Result], window: tuple[float, float], count: Callable[[Result], int] = lambda r: r.output_tokens
) -> float:
    """Output tokens/s delivered within `window` (or another `count` of each answer's, e.g. its
    events), each answer's counted as spread evenly between its first token and its end (streams
    arrive in chunks, so their own times would say less)."""
    start, end = window
    total = 0.0
    for r in results:
        if not r.ok or r.first_token is None:
            continue
        span = r.finished - r.first_token
        overlap = min(end, r.finished) - max(start, r.first_token)
        if overlap > 0:
            total += count(r) * (overlap / span if span > 0 else 1.0)
    return total / (end - start)


def summarize(
    results: Sequence[Result],
    *,
    scenario: str,
    policy: str,
    speed: float,
    window: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The issue's JSON keys for one run (GPU time; see the module docstring). With `window`
    (a sustained run) the tokens, duration and rates are the window's."""
    ended = [r for r in results if not r.cut]  # answered or failed; a cut one counts only its tokens
    ok = [r for r in ended if r.ok]
    if window is None:
        start = min((r.started for r in ended), default=0.0)
        end = max((r.finished for r in ok), default=start)
        tokens: float = sum(r.output_tokens for r in ok)
        steady_tok_s, steady_window_s = steady_rate(ended)
    else:
        start, end = window
        steady_tok_s, steady_window_s = window_rate(results, window), end - start
        tokens = steady_tok_s * steady_window_s
    duration_s = (end - start) * speed
    ttfts = [r.first_token - r.started for r in ok if r.first_token is not None]
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    per_site: dict[str, dict[str, int]] = defaultdict(lambda: {"requests": 0, "output_tokens": 0})
    for r in ok:
        per_site[r.site or "unknown"]["requests"] += 1
        per_site[r.site or "unknown"]["output_tokens"] += r.output_tokens
    errors: dict[str, int] = defaultdict(int)
    for r in ended:
        if r.error:
            errors[r.error[:120]] += 1
    return {
        "scenario": scenario,
        "policy": policy,
        "requests": len(ended),
        "requests_ok": len(ok),
        "requests_failed": len(ended) - len(ok),
        "requests_cut": len(results) - len(ended),
        "output_tokens": round(tokens),
        "duration_s": round(duration_s, 2),
        "output_tokens_per_s": round(tokens / duration_s, 1) if duration_s > 0 else 0.0,
        "steady_output_tokens_per_s": round(steady_tok_s / speed, 1),
        "steady_window_s": round(steady_window_s * speed, 2),
        # Of the answered requests' prompt tokens, those found in prefix caches, as their usage says.
        "cache_hit_rate": round(sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)), 4),
        "ttft_p50_ms": percentile_ms(ttfts, 0.5, speed),
        "ttft_p99_ms": percentile_ms(ttfts, 0.99, speed),
        "tpot_p50_ms": percentile_ms(tpots, 0.5, speed),
        "tpot_p99_ms": percentile_ms(tpots, 0.99, speed),
        "per_site": dict(per_site),
        "speed": speed,
        "errors": dict(errors),
    }


def served_rate(results: Sequence[Result], speed: float) -> float:
    """A Server run's output tokens/s as a long run would report it: the tokens of the
    answered samples over the span their arrivals took (GPU time). Holds only when the
    endpoint kept up, which the latency limits check; MLPerf's to-the-last-completion
    rate would instead charge a short run the drain after its last arrival."""
    arrivals = [r.started for r in results]
    span_s = (max(arrivals) - min(arrivals)) * speed if len(arrivals) > 1 else 0.0
    return sum(r.output_tokens for r in results if r.ok) / span_s if span_s > 0 else 0.0


def meets_server_limits(summary: dict[str, Any]) -> bool:
    """MLPerf's gpt-oss-120b Server constraint, and no failed request."""
    ttft, tpot = summary["ttft_p99_ms"], summary["tpot_p99_ms"]
    return (
        summary["requests_failed"] == 0
        and ttft is not None
        and tpot is not None
        and ttft <= TTFT_LIMIT_MS
        and tpot <= TPOT_LIMIT_MS
    )
