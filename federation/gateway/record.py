"""A request's bookkeeping, in one object: its span, its key's limits, its metrics and its log
line. The handler says when the request began (`RequestRecord`) and how it ended (`done`); what
is recorded of it is decided here, beside the path rather than through it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from core.errors import RateLimited
from federation.gateway import metrics, spans
from federation.gateway.answers import Answer
from federation.gateway.failover import Generation
from federation.gateway.keys import KeyLimits
from federation.gateway.limits import KeyLimiter, Release
from federation.gateway.pieces import Job

log = structlog.get_logger("gateway")


@dataclass(frozen=True, slots=True)
class Arrival:
    """When and how a request came: its id, path and headers, its arrival on both clocks."""

    request_id: str
    path: str
    headers: Mapping[str, str]
    received_unix_s: float  # for the span's start
    started: float  # time.monotonic(), for every duration


class RequestRecord:
    """Opens the request's span once its key's share of the limits is held (`opened`); `done`
    ends the span, counts the request, gives the key's share back and logs one line."""

    def __init__(self, arrival: Arrival, job: Job, holder: tuple[str, KeyLimits] | None, release: Release | None):
        self.arrival, self.job = arrival, job
        self._holder, self._release = holder, release
        self._log = log.bind(request_id=arrival.request_id, kind=job.kind, stream=job.stream, key=self.key_name)
        self._traced = spans.request_started(
            arrival.headers, arrival.path, arrival.request_id, job.kind, arrival.received_unix_s
        )

    @classmethod
    async def opened(
        cls, arrival: Arrival, job: Job, limiter: KeyLimiter | None, holder: tuple[str, KeyLimits] | None
    ) -> RequestRecord:
        """`limiter` and `holder`: the gateway's key limits and the request's key (None: no keys).
        Raises RateLimited for a key over its limits."""
        release = None
        if limiter is not None and holder is not None:
            admitting = asyncio.ensure_future(limiter.admit(*holder, job.request.prompt_tokens))
            try:
                release = await asyncio.shield(admitting)
            except RateLimited:
                metrics.REFUSED_KEYS.labels("over_limit", holder[0]).inc()
                raise
            except asyncio.CancelledError:  # the client left while its key's share was being taken
                admitting.add_done_callback(_given_back)
                raise
        return cls(arrival, job, holder, release)

    @property
    def key_name(self) -> str | None:
        return self._holder[0] if self._holder else None

    def done(
        self,
        outcome: str,
        error: str | None,
        answer: Answer,
        generation: Generation,
        first_chunk_at: float | None,
        refused: bool = False,
    ) -> None:
        """`refused`: the error was a 429 with Retry-After (no site could take it in time)."""
        started, now = self.arrival.started, time.monotonic()
        tier = self.job.request.tier.label
        spans.request_done(
            self._traced,
            outcome,
            site=answer.site,
            error=error,
            retries=generation.retries,
            resumed=generation.resumed,
            output_tokens=answer.completion_tokens,
        )
        metrics.request_done(outcome, generation.retries, generation.resumed, tier, refused)
        metrics.observe(
            metrics.RequestTimes(
                started,
                generation.routed_at,
                first_chunk_at,
                now,
                generation.sites[0] if generation.sites else "",
                answer.site,
                answer.completion_tokens if outcome == "ok" else 0,
                tier,
            )
        )
        if self._release is not None and self._holder is not None:
            self._release(answer.completion_tokens)
            metrics.key_usage(self._holder[0], outcome, self.job.request.prompt_tokens, answer.completion_tokens)
        self._log.info(
            "request.done",
            site=answer.site,
            sites=generation.sites,
            outcome=outcome,
            error=error,
            tier=tier,
            ttft_ms=(first_chunk_at - started) * 1000 if first_chunk_at else None,
            route_ms=(generation.routed_at - started) * 1000 if generation.routed_at else None,  # arrival to route
            output_tokens=answer.completion_tokens,
            prompt_tokens=self.job.request.prompt_tokens,
            retries=generation.retries,
            resumed=generation.resumed,
            latency_ms=round((now - started) * 1000, 1),
        )


def _given_back(admitting: asyncio.Future[Release]) -> None:
    """A share taken for a client that had left: given back at once, as a request that ended
    with no output."""
    if not admitting.cancelled() and admitting.exception() is None:
        admitting.result()(0)
