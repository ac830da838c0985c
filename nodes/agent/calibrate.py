"""The calibration probe a site runs when it joins: how fast its workers really decode.

Before the site takes traffic, every healthy worker decodes a small batch of synthetic
requests; their time per output token at that batch is what the scheduler's estimator
starts from (scheduler.capacity: read against the declared GPU's step model), instead of
the declared GPU × count. A site declared MI355X whose GPUs run like MI300X is then
weighted right from its first request, not after it has been overloaded.

The probe times tokens as the agent reads them, so it is only as honest as the agent's loop: a
loop held up (a collection, a burst of other work, the process stopped) reads the tokens of that
time late and all at once, at rates no GPU makes. A ticker watches the loop while the probe
runs; a request whose tokens were read across a stall longer than a small part of its span
(STALL_FRACTION) is left out, and a probe whose every request was is run again, up to
PROBE_ATTEMPTS times, before the site joins on its prior. Once traffic flows, the estimate
learns from the workers' own accounting instead (nodes/agent/accounting.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from dataclasses import dataclass

import structlog

from core.settings import AgentTimings
from nodes.agent import sglang, worker_stream
from nodes.agent.pool import Worker, WorkerPool

log = structlog.get_logger("agent.calibrate")

PROBE_BATCH = 16  # requests per worker: a batch big enough that the step is not all fixed cost
PROBE_PROMPT_TOKENS = 256
PROBE_OUTPUT_TOKENS = 64
PROBE_TOKEN_ID = 1000  # an ordinary o200k token: the prompt is that token repeated
PROBE_ATTEMPTS = 3  # a probe spoilt by the agent's own stalls is run again this many times in all
TICK_S = 0.005  # the loop watcher's tick: a tick this much late and more is the loop held up
# A request's time per token is kept when the loop stalled for at most this part of its span
# (first token to last): the stall's tokens were read late and together.
STALL_FRACTION = 0.05


class LoopWatch:
    """The stretches in which this event loop was held up, seen by a ticker: each tick late by
    more than a tick is that much held up."""

    def __init__(self) -> None:
        self.stalls: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopWatch:
        self._task = asyncio.ensure_future(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _tick(self) -> None:
        due = time.monotonic() + TICK_S
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if now - due > TICK_S:
                self.stalls.append((due, now))
            due = now + TICK_S

    def stalled_s(self, start: float, end: float) -> float:
        """Seconds the loop was held up between `start` and `end`."""
        return sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.stalls)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Per worker, averaged over the workers probed: the batch decoded, the KV context it
    held (mid-probe) and the output tokens/s it delivered."""

    batch: float
    context_tokens: float
    tok_s: float


class _Stalled(Exception):
    """The probe request's tokens were read across a stall of the agent's loop."""


async def _one(worker: Worker, timings: AgentTimings, watch: LoopWatch) -> float | None:
    """Seconds per output token of one probe request (first token to last), None if it failed;
    _Stalled if its tokens were read across a stall of this loop."""
    payload = {
        "rid": "fed-probe-" + uuid.uuid4().hex,
        "input_ids": [PROBE_TOKEN_ID] * PROBE_PROMPT_TOKENS,
        "sampling_params": {"max_new_tokens": PROBE_OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0},
    }
    first = last = None
    tokens = 0

    def on_event(
        text: str, ids: list[int], completion_tokens: int, prompt_tokens: int, finish: object, cached: int
    ) -> None:
        nonlocal first, last, tokens
        now = time.monotonic()
        first = first or now
        last, tokens = now, completion_tokens

    call = None
    started = time.monotonic()
    try:
        async with asyncio.timeout(timings.probe_timeout_s):
            call = await worker_stream.start(
                worker.url,
                payload,
                incremental=worker.incremental,
                on_event=on_event,
                heard=worker,
                connect_timeout_s=timings.connect_timeout_s,
            )
            await call.done
    except (sglang.WorkerFailed, sglang.WorkerRejected, TimeoutError) as exc:
        log.warning("calibrate.request_failed", worker=worker.url, error=str(exc) or "timed out")
        return None
    finally:
        if call is not None:
            call.close()
    if first is None or last is None or tokens < 2 or last <= first:
        return None
    if watch.stalled_s(started, last) > STALL_FRACTION * (last - first):
        raise _Stalled()
    return (last - first) / (tokens - 1)


async def probe(pool: WorkerPool) -> ProbeResult | None:
    """Probe every healthy worker at once; None if no worker finished its probe, or the agent's
    loop spoilt every attempt."""
    for attempt in range(1, PROBE_ATTEMPTS + 1):
        async with LoopWatch() as watch:
            result, stalled = await _probe_once(pool, watch)
        if result is not None or not stalled:
            return result
        log.warning("calibrate.loop_stalled", attempt=attempt, stalls=len(watch.stalls))
    return None


async def _probe_once(pool: WorkerPool, watch: LoopWatch) -> tuple[ProbeResult | None, bool]:
    """One probe, and whether a stall of this loop spoilt any of it."""
    workers = [w for w in pool.workers if w.healthy]
    per_worker = []
    stalled = False
    for worker, outcomes in zip(
        workers,
        await asyncio.gather(
            *(
                asyncio.gather(*(_one(w, pool.timings, watch) for _ in range(PROBE_BATCH)), return_exceptions=True)
                for w in workers
            )
        ),
        strict=True,
    ):
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, _Stalled):
                raise outcome
        kept = [t for t in outcomes if isinstance(t, float)]
        spoilt = sum(isinstance(t, _Stalled) for t in outcomes)
        stalled = stalled or spoilt > 0
        if len(kept) + spoilt == PROBE_BATCH and kept:  # the whole batch ran: its kept times are at that batch
            per_worker.append(PROBE_BATCH / statistics.median(kept))
        else:
            log.warning("calibrate.worker_left_out", worker=worker.url, finished=len(kept), stalled=spoilt)
    if not per_worker:
        return None, stalled
    result = ProbeResult(
        batch=PROBE_BATCH,
        context_tokens=PROBE_BATCH * (PROBE_PROMPT_TOKENS + PROBE_OUTPUT_TOKENS / 2),
        tok_s=statistics.mean(per_worker),
    )
    log.info("calibrate.done", workers=len(per_worker), tok_s_per_worker=round(result.tok_s, 1))
    return result, stalled
