"""The agent's spans: one per generation a gateway starts here, and one per call to a worker for
it (core/tracing.py says why and how tracing is turned on).

A generation's span is the child of the gateway's attempt, whose trace context came in the
generation's start (`GenerateRequest.traceparent`: the Generate call is shared by every request
of a gateway process, so its metadata cannot carry one request's). It spans the wait for a worker
slot and the worker's answer; the worker call's span is its child, and the worker gets its
context as a `traceparent` header (SGLang ignores it; a traced SGLang would follow it). Both
begin and end once per request: the tokens that flow in between are never touched.

While tracing is off, each wrapper hands back the coroutine it was given, unwrapped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from opentelemetry.trace import SpanKind, Tracer, use_span
from opentelemetry.util.types import AttributeValue

from core import tracing, wire
from nodes.agent.relay import Relayed
from nodes.agent.sglang import WorkerFailed, WorkerRejected, WorkerUnreachable

GENERATE = "agent.generate"
WORKER_CALL = "agent.worker_call"

Generate = Callable[[wire.GenerateRequest, Relayed], Coroutine[Any, Any, None]]


def generation(generate: Generate, site: str, req: wire.GenerateRequest, record: Relayed) -> Awaitable[None]:
    """`generate(req, record)`, in the generation's span when tracing is on. The outcome is read
    from the record's last delta: the generation turns its failures into it rather than raise."""
    tracer = tracing.tracer()
    if tracer is None:
        return generate(req, record)
    return _generation_in_span(tracer, generate, site, req, record)


async def _generation_in_span(
    tracer: Tracer, generate: Generate, site: str, req: wire.GenerateRequest, record: Relayed
) -> None:
    parent = tracing.parent_from({"traceparent": req.traceparent}) if req.traceparent else None
    attributes: dict[str, AttributeValue] = {
        tracing.REQUEST_ID: req.request_id,
        tracing.SITE: site,
        "federation.prompt_tokens": req.prompt_tokens,
    }
    span = tracer.start_span(GENERATE, parent, SpanKind.SERVER, attributes)
    with use_span(span, record_exception=False, set_status_on_exception=False):
        try:
            await generate(req, record)
        except BaseException as exc:
            outcome = "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"
            span.set_attribute("federation.output_tokens", record.completion_tokens)
            tracing.end(span, outcome, "" if outcome == "cancelled" else f"{type(exc).__name__}: {exc}")
            raise
    span.set_attribute("federation.output_tokens", record.completion_tokens)
    if record.error is wire.StreamError.NONE:
        tracing.end(span, "ok")
    else:  # rejected (the client's fault), worker_failed, site_failed
        tracing.end(span, record.error.name.lower(), record.error_message)


def worker_call(
    relay: Coroutine[Any, Any, None], req: wire.GenerateRequest, site: str, worker: str, record: Relayed
) -> Awaitable[None]:
    """`relay`, the call to `worker` for `req`, in a span of its own when tracing is on (a worker
    that never answered is one call, and the next worker another)."""
    tracer = tracing.tracer()
    if tracer is None:
        return relay
    return _worker_call_in_span(tracer, relay, req, site, worker, record)


async def _worker_call_in_span(
    tracer: Tracer, relay: Coroutine[Any, Any, None], req: wire.GenerateRequest, site: str, worker: str, record: Relayed
) -> None:
    attributes = {tracing.REQUEST_ID: req.request_id, tracing.SITE: site, "federation.worker": worker}
    span = tracer.start_span(WORKER_CALL, kind=SpanKind.CLIENT, attributes=attributes)
    with use_span(span, record_exception=False, set_status_on_exception=False):
        try:
            await relay
        except BaseException as exc:
            span.set_attribute("federation.output_tokens", record.completion_tokens)
            tracing.end(span, *_worker_failure(exc))
            raise
    span.set_attribute("federation.output_tokens", record.completion_tokens)
    tracing.end(span, "ok")


def _worker_failure(exc: BaseException) -> tuple[str, str]:
    """(outcome, error) of a worker call that raised."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", ""
    if isinstance(exc, WorkerRejected):
        return "rejected", str(exc)
    if isinstance(exc, WorkerUnreachable):
        return "unreachable", str(exc)
    if isinstance(exc, WorkerFailed):
        return "failed", str(exc)
    return "error", f"{type(exc).__name__}: {exc}"
