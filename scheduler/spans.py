"""The scheduler's span: one per route, the child of the gateway's route span whose trace
context the route carries: a Route call in its metadata, a route on a RouteStream call in its
own message (core/tracing.py says why and how tracing is turned on).

For Route, an interceptor, so that the service stays as it is: it wraps Route only (the report
and watch streams are long-lived, not a request's), and is installed only when tracing is on.
A RouteStream call carries many requests' routes, so the service has each one's span made here
(`answered`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from opentelemetry.trace import SpanKind, Tracer, use_span

from core import tracing, wire

ROUTE_METHOD = "/federation.v1.Scheduler/Route"  # proto/federation.proto: package, service, method
SPAN = "scheduler.route"


def interceptors() -> list[grpc.aio.ServerInterceptor]:
    """What the gRPC server is made with (after `unreadable.Refuse`, so that a request that does
    not parse is refused before it is traced): nothing while tracing is off."""
    tracer = tracing.tracer()
    return [RouteSpans(tracer)] if tracer is not None else []


class RouteSpans(grpc.aio.ServerInterceptor):
    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != ROUTE_METHOD:
            return handler
        return grpc.unary_unary_rpc_method_handler(
            self._traced(handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _traced(self, route: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]):
        tracer = self._tracer

        async def traced(request: Any, context: grpc.aio.ServicerContext) -> Any:
            req = wire.route_request_from_pb(request)
            parent = tracing.parent_from(dict(context.invocation_metadata() or ()))
            span = tracer.start_span(SPAN, parent, SpanKind.SERVER, _attributes(req, "Route"))
            with use_span(span, record_exception=False, set_status_on_exception=False):
                try:
                    reply = await route(request, context)
                except asyncio.CancelledError:
                    tracing.end(span, "cancelled")
                    raise
                except BaseException as exc:
                    code = context.code()  # what the service aborted with (no site ready, not allowed)
                    outcome = (
                        "no_site" if code is grpc.StatusCode.FAILED_PRECONDITION else "refused" if code else "error"
                    )
                    tracing.end(span, outcome, context.details() or f"{type(exc).__name__}: {exc}")
                    raise
            decision = wire.decision_from_pb(reply)
            span.set_attributes({tracing.SITE: decision.site, "federation.reason": decision.reason})
            tracing.end(span, "ok")
            return reply

        return traced


def answered(answer: Callable[[wire.RouteCall], wire.RouteAnswer], call: wire.RouteCall) -> wire.RouteAnswer:
    """`answer(call)`, in a span of its own while tracing is on (a RouteStream call's route)."""
    tracer = tracing.tracer()
    if tracer is None:
        return answer(call)
    parent = tracing.parent_from(dict(call.trace_context))
    span = tracer.start_span(SPAN, parent, SpanKind.SERVER, _attributes(call.request, "RouteStream"))
    with use_span(span, record_exception=False, set_status_on_exception=False):
        try:
            result = answer(call)
        except BaseException as exc:
            tracing.end(span, "error", f"{type(exc).__name__}: {exc}")
            raise
    if result.decision is None:
        no_site = result.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        tracing.end(span, "no_site" if no_site else "error", result.message)
    else:
        span.set_attributes({tracing.SITE: result.decision.site, "federation.reason": result.decision.reason})
        tracing.end(span, "ok")
    return result


def _attributes(req: wire.RouteRequest, method: str) -> dict[str, Any]:
    return {
        tracing.REQUEST_ID: req.request_id,
        "federation.dry_run": req.dry_run,
        "rpc.system": "grpc",
        "rpc.method": method,
    }
