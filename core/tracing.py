"""One trace per request across the federation's processes (OpenTelemetry), off unless configured.

A request crosses three processes (gateway, scheduler replica, site agent) and a worker; an
operator following one that was slow, retried or resumed needs its hops under one trace id.
Tracing must cost nothing when off and nothing per token when on: spans begin and end per
request, per route, per attempt at a site and per worker call, never per chunk. So each hop asks
`tracer()` once per request and, when it is None, does nothing more: no span object, no context,
no propagation header. The spans themselves are made by each process kind's own module
(`federation/gateway/spans.py`, `scheduler/spans.py`, `nodes/agent/spans.py`); this one turns
tracing on, names the attributes they share and carries the W3C trace context between them.

Turned on per process by the environment, which `fedctl up` and `fedctl bench` hand on to every
process they start:

- `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`: OTLP over gRPC, the
  one protocol shipped (the exporter reads the other standard `OTEL_EXPORTER_OTLP_*` variables:
  headers, certificate, timeout, insecure);
- `FEDERATION_TRACE_DIR`: finished spans as JSON lines, one file per process (the tests read
  them; also a look at a few traces without a collector).

`OTEL_SDK_DISABLED=true` turns tracing off whatever else is set; `OTEL_TRACES_SAMPLER` and the
`OTEL_BSP_*` batch settings apply as the SDK defines them.

The tracer is kept per process, as OpenTelemetry keeps its own provider: it is set once at start,
and threading it through every constructor on the path would change a dozen signatures for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import structlog
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# Attributes every span of ours carries (where known), and the ones several share.
REQUEST_ID = "federation.request_id"
SITE = "federation.site"
OUTCOME = "federation.outcome"  # "ok", or how it ended: "failed", "cancelled", "no_site", ... (docs/TRACING.md)
ERROR = "federation.error"  # what went wrong, when the outcome is not "ok"

TRACE_DIR_ENV = "FEDERATION_TRACE_DIR"
OTLP_ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
SERVICE_PREFIX = "federation-"  # service.name: federation-gateway, federation-scheduler, federation-agent

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: Tracer | None = None  # None: tracing is off in this process


def configure(service: str, environ: Mapping[str, str] = os.environ, **resource: str) -> Tracer | None:
    """Turn tracing on in this process if the environment asks for it (see the module's doc);
    `service` is the process kind, `resource` more attributes of the process (its site). Returns
    the tracer, None when tracing stays off (the SDK is then not even imported)."""
    global _tracer
    endpoint = next((environ[name] for name in OTLP_ENDPOINT_ENVS if environ.get(name)), "")
    directory = environ.get(TRACE_DIR_ENV, "")
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true" or not (endpoint or directory):
        _tracer = None
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = SERVICE_PREFIX + service
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: name, **resource}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if protocol not in (None, "", "grpc"):
            structlog.get_logger("tracing").warning("tracing.protocol_unsupported", protocol=protocol, using="grpc")
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint)))
    if directory:
        provider.add_span_processor(BatchSpanProcessor(_span_file(Path(directory), name)))
    _tracer = provider.get_tracer("inference-federation")
    return _tracer


def _span_file(directory: Path, service: str):
    """The SDK's console exporter, writing one JSON object a line to this process's own file."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    directory.mkdir(parents=True, exist_ok=True)
    out = open(directory / f"{service}-{os.getpid()}.jsonl", "a", encoding="utf-8")  # open for the process's life
    return ConsoleSpanExporter(service_name=service, out=out, formatter=lambda span: span.to_json(indent=None) + "\n")


def tracer() -> Tracer | None:
    """This process's tracer; None while tracing is off."""
    return _tracer


def parent_from(carrier: Mapping[str, str]) -> Context:
    """The trace context a caller sent (`traceparent` in metadata or headers); an empty context
    (a new trace) when it sent none or one that does not parse."""
    return _PROPAGATOR.extract(carrier)


def outgoing(span: Span | None = None) -> tuple[tuple[str, str], ...]:
    """The W3C trace context of `span` (default: the current span) as (name, value) pairs for a
    call's gRPC metadata or HTTP headers; () when tracing is off."""
    if _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span) if span is not None else None)
    return tuple(carrier.items())


def end(span: Span, outcome: str, error: str = "") -> None:
    """End `span` saying how it ended: anything but "ok" is an error status, with `error` said."""
    span.set_attribute(OUTCOME, outcome)
    if outcome != "ok":
        if error:
            span.set_attribute(ERROR, error)
        span.set_status(Status(StatusCode.ERROR, error or outcome))
    span.end()
