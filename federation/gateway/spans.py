"""The gateway's spans: a request, its routes, and its attempts at sites (core/tracing.py says why
and how tracing is turned on).

A request's span is made current in its handler's task, so the spans of its Route calls and of
its attempts are its children. A Route call carries its span's trace context to the scheduler in
the call's metadata (`Schedulers`); an attempt carries its span's to the agent in its
GenerateRequest, since one Generate call carries every request of this process and its metadata
cannot be any one request's. A retry before the first token and a resume after it are each a new
attempt under the same request. All of it per request: nothing here runs per token.

The edge is public, so a request's trace begins here: a client's own `traceparent` is linked, not
followed (its sampled flag must not decide what the federation records).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple

from opentelemetry import context, trace
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.util.types import AttributeValue

from core import tracing, wire
from core.errors import NoCapacity, TooBusy
from federation.gateway.upstream import Deliver, Flow, SiteStream, Upstream

REQUEST = "gateway.request"
ROUTE = "gateway.route"
ATTEMPT = "gateway.attempt"


class RequestSpan(NamedTuple):
    span: Span
    token: contextvars.Token[context.Context]  # the context it was made current with, detached when it ends


def request_started(
    headers: Mapping[str, str], path: str, request_id: str, kind: str, received_unix_s: float
) -> RequestSpan | None:
    """The request's span, from its arrival, made current in this task; None when tracing is off."""
    tracer = tracing.tracer()
    if tracer is None:
        return None
    client = trace.get_current_span(tracing.parent_from(headers)).get_span_context()
    span = tracer.start_span(
        REQUEST,
        context.Context(),  # a new trace, whatever this task's context holds
        SpanKind.SERVER,
        {tracing.REQUEST_ID: request_id, "federation.kind": kind, "http.route": path},
        links=[Link(client)] if client.is_valid else None,
        start_time=int(received_unix_s * 1e9),
    )
    return RequestSpan(span, context.attach(trace.set_span_in_context(span)))


def request_done(
    traced: RequestSpan | None,
    outcome: str,
    *,
    site: str,
    error: str | None,
    retries: int,
    resumed: int,
    output_tokens: int,
) -> None:
    if traced is None:
        return
    span = traced.span
    span.set_attributes(
        {
            tracing.SITE: site,
            "federation.retries": retries,
            "federation.resumed": resumed,
            "federation.output_tokens": output_tokens,
        }
    )
    context.detach(traced.token)
    tracing.end(span, outcome, error or "")


Route = Callable[[wire.RouteRequest], Awaitable[wire.RouteDecision]]


def routed(route: Route, req: wire.RouteRequest) -> Awaitable[wire.RouteDecision]:
    """`route(req)`, in a span of its own when tracing is on (a held request's dry runs, asked
    while it waits in latency mode, are in it too)."""
    tracer = tracing.tracer()
    if tracer is None:
        return route(req)
    return _routed_in_span(tracer, route, req)


async def _routed_in_span(tracer: trace.Tracer, route: Route, req: wire.RouteRequest) -> wire.RouteDecision:
    attributes = {tracing.REQUEST_ID: req.request_id, "federation.excluded_sites": list(req.exclude_sites)}
    span = tracer.start_span(ROUTE, kind=SpanKind.CLIENT, attributes=attributes)
    with trace.use_span(span, record_exception=False, set_status_on_exception=False):
        try:
            decision = await route(req)
        except BaseException as exc:
            tracing.end(span, *_route_failure(exc))
            raise
    span.set_attributes({tracing.SITE: decision.site, "federation.reason": decision.reason})
    tracing.end(span, "ok")
    return decision


def _route_failure(exc: BaseException) -> tuple[str, str]:
    """(outcome, error) of a route that raised: no site ready or reachable, none within the
    request's TTFT budget (latency mode), the client gone."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", ""
    if isinstance(exc, NoCapacity):
        return "no_site", exc.message
    if isinstance(exc, TooBusy):
        return "too_busy", exc.message
    return "error", getattr(exc, "message", f"{type(exc).__name__}: {exc}")


def start_at_site(
    upstream: Upstream,
    decision: wire.RouteDecision,
    request: wire.GenerateRequest,
    deliver: Deliver,
    flow: Flow,
    sent_tokens: int,
) -> SiteStream:
    """`upstream.start` at the decided site, as an attempt with a span of its own when tracing is
    on: it ends with the site's stream (its answer's end, its failure, or its cancelling) and
    says which; `sent_tokens` (the client has them already) > 0 makes it a resume."""
    tracer = tracing.tracer()
    if tracer is None:
        return upstream.start(decision.site, decision.agent_address, request, deliver, flow)
    attributes: dict[str, AttributeValue] = {
        tracing.REQUEST_ID: request.request_id,
        tracing.SITE: decision.site,
        "federation.agent": decision.agent_address,
        "federation.sent_tokens": sent_tokens,
    }
    span = tracer.start_span(ATTEMPT, kind=SpanKind.CLIENT, attributes=attributes)
    traceparent = dict(tracing.outgoing(span)).get("traceparent", "")
    request = dataclasses.replace(request, traceparent=traceparent)
    stream = upstream.start(decision.site, decision.agent_address, request, deliver, flow)
    stream.first.add_done_callback(lambda first: _first_token(span, first))
    stream.done.add_done_callback(lambda _: _attempt_over(span, stream))
    return stream


def _first_token(span: Span, first: asyncio.Future) -> None:
    if not first.cancelled() and first.exception() is None:
        span.add_event("first_token")


def _attempt_over(span: Span, stream: SiteStream) -> None:
    """The stream is over: answered whole, failed (before its first token or after), or given up."""
    done, first = stream.done, stream.first
    if done.cancelled():  # failed before its first token, or given up (the client left)
        failure = first.exception() if first.done() and not first.cancelled() else None
        if failure is None:
            tracing.end(span, "cancelled")
            return
    else:
        failure = done.exception()
    if failure is None:
        tracing.end(span, "ok")
    else:
        tracing.end(span, "failed", getattr(failure, "message", str(failure)))
