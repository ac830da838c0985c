"""The calibration probe a site runs when it joins: how fast its workers really decode.

Before the site takes traffic, every healthy worker decodes a small batch of synthetic
requests; their time per output token at that batch is what the scheduler's estimator
starts from (scheduler.capacity: read against the declared GPU's step model), instead of
the declared GPU × count. A site declared MI355X whose GPUs run like MI300X is then
weighted right from its first request, not after it has been overloaded.
"""

from __future__ import annotations

import asyncio
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


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Per worker, averaged over the workers probed: the batch decoded, the KV context it
    held (mid-probe) and the output tokens/s it delivered."""

    batch: float
    context_tokens: float
    tok_s: float


async def _one(worker: Worker, timings: AgentTimings) -> float | None:
    """Seconds per output token of one probe request (first token to last), None if it failed."""
    payload = {
        "rid": "fed-probe-" + uuid.uuid4().hex,
        "input_ids": [PROBE_TOKEN_ID] * PROBE_PROMPT_TOKENS,
        "sampling_params": {"max_new_tokens": PROBE_OUTPUT_TOKENS, "ignore_eos": True, "temperature": 0},
    }
    first = last = None
    tokens = 0

    def on_event(text: str, ids: list[int], completion_tokens: int, prompt_tokens: int, finish: object) -> None:
        nonlocal first, last, tokens
        now = time.monotonic()
        first = first or now
        last, tokens = now, completion_tokens

    call = None
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
    return (last - first) / (tokens - 1)


async def probe(pool: WorkerPool) -> ProbeResult | None:
    """Probe every healthy worker at once; None if no worker finished its probe."""
    workers = [w for w in pool.workers if w.healthy]
    per_worker = []
    for worker, tpots in zip(
        workers,
        await asyncio.gather(*(asyncio.gather(*(_one(w, pool.timings) for _ in range(PROBE_BATCH))) for w in workers)),
        strict=True,
    ):
        done = [t for t in tpots if t is not None]
        if len(done) == PROBE_BATCH:
            per_worker.append(PROBE_BATCH / statistics.median(done))
        else:
            log.warning("calibrate.worker_left_out", worker=worker.url, finished=len(done))
    if not per_worker:
        return None
    result = ProbeResult(
        batch=PROBE_BATCH,
        context_tokens=PROBE_BATCH * (PROBE_PROMPT_TOKENS + PROBE_OUTPUT_TOKENS / 2),
        tok_s=statistics.mean(per_worker),
    )
    log.info("calibrate.done", workers=len(per_worker), tok_s_per_worker=round(result.tok_s, 1))
    return result
