"""One request, one trace (issue #19): the gateway's, the scheduler's and the site agent's spans of
a request share its trace id and hang from one another as the request went, a resumed stream
included. The processes are real ones started as `fedctl up` starts them: each inherits
FEDERATION_TRACE_DIR and writes its finished spans there as JSON lines, which the test reads."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from core import tracing
from tests.conftest import KOREAN, SITES
from tests.test_federation import MODEL

Span = dict[str, Any]
EVERY_HOP = {
    "gateway.request",
    "gateway.route",
    "gateway.attempt",
    "scheduler.route",
    "agent.generate",
    "agent.worker_call",
}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"  # a client's own trace (W3C's example)
SPANS_WAIT_S = 20.0  # each process exports every 100 ms here (OTEL_BSP_SCHEDULE_DELAY)


@pytest.fixture
def span_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where every process started from now on writes its spans, exported every 100 ms."""
    directory = tmp_path / "spans"
    monkeypatch.setenv(tracing.TRACE_DIR_ENV, str(directory))
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    return directory


def _read(directory: Path) -> list[Span]:
    """Every span the processes wrote so far (none before the first export)."""
    return [json.loads(line) for path in sorted(directory.glob("*.jsonl")) for line in path.read_text().splitlines()]


async def _trace_of(directory: Path, request_id: str, wanted: set[str]) -> list[Span]:
    """Every span written in the trace of the request's span at the gateway, once the spans named
    `wanted` are among them."""
    deadline = time.monotonic() + SPANS_WAIT_S
    while True:
        spans = _read(directory)
        requests = [s for s in spans if s["name"] == "gateway.request" and _attr(s, tracing.REQUEST_ID) == request_id]
        if requests:
            trace_id = requests[0]["context"]["trace_id"]
            found = [s for s in spans if s["context"]["trace_id"] == trace_id]
            if wanted <= {s["name"] for s in found}:
                return found
        if time.monotonic() > deadline:
            seen = sorted((s["name"], s["context"]["trace_id"], s["parent_id"]) for s in spans)
            pytest.fail(f"spans {sorted(wanted)} of {request_id} not all written within {SPANS_WAIT_S:.0f} s: {seen}")
        await asyncio.sleep(0.1)


def _attr(span: Span, name: str) -> Any:
    return span["attributes"].get(name)


def _one(spans: list[Span], name: str) -> Span:
    named = [s for s in spans if s["name"] == name]
    assert len(named) == 1, f"{len(named)} spans named {name}"
    return named[0]


def _service(span: Span) -> str:
    return span["resource"]["attributes"]["service.name"]


def test_tracing_is_off_unless_the_environment_turns_it_on() -> None:
    """No exporter configured, or the SDK disabled: no tracer, and no trace context goes out."""
    assert tracing.configure("gateway", environ={}) is None
    disabled = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317", "OTEL_SDK_DISABLED": "true"}
    assert tracing.configure("gateway", environ=disabled) is None
    assert tracing.tracer() is None and tracing.outgoing() == ()


@pytest.mark.timeout(120)
async def test_one_request_is_one_trace_across_gateway_scheduler_and_agent(make_federation, span_dir) -> None:
    """A chat through the official client: its spans at the gateway (the request, its Route call,
    its attempt at the site), the scheduler (Route) and the agent (the generation, its worker
    call) are one trace, each the child of the hop that called it, every one with the request id,
    the site and outcome ok. The client's own trace context is linked, not followed: the edge is
    public, and the federation's trace begins at it."""
    site = "us-mi355x"
    fed, _ = make_federation(sites=[s for s in SITES if s[0] == site])
    request_id = "trace-one-request"
    async with openai.AsyncOpenAI(base_url=fed.config.gateway_url + "/v1", api_key="unused", max_retries=0) as client:
        answer = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me about rivers."}],
            max_tokens=24,
            extra_headers={"X-Request-Id": request_id, "traceparent": f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"},
        )
    spans = await _trace_of(span_dir, request_id, EVERY_HOP)

    assert sorted(s["name"] for s in spans) == sorted(EVERY_HOP)
    assert {_attr(s, tracing.REQUEST_ID) for s in spans} == {request_id}
    assert {_attr(s, tracing.SITE) for s in spans} == {site}
    assert {_attr(s, tracing.OUTCOME) for s in spans} == {"ok"}
    request, route, attempt = (_one(spans, n) for n in ("gateway.request", "gateway.route", "gateway.attempt"))
    scheduled, generated, worker = (_one(spans, n) for n in ("scheduler.route", "agent.generate", "agent.worker_call"))
    assert {_service(s) for s in (request, route, attempt)} == {"federation-gateway"}
    assert _service(scheduled) == "federation-scheduler"
    assert _service(generated) == _service(worker) == "federation-agent"
    assert request["parent_id"] is None
    assert [link["context"]["trace_id"] for link in request["links"]] == ["0x" + CLIENT_TRACE]
    assert request["context"]["trace_id"] != "0x" + CLIENT_TRACE
    assert route["parent_id"] == attempt["parent_id"] == request["context"]["span_id"]
    assert scheduled["parent_id"] == route["context"]["span_id"]
    assert _attr(scheduled, "rpc.method") == "RouteStream"  # the gateway's one call per replica
    assert generated["parent_id"] == attempt["context"]["span_id"]
    assert worker["parent_id"] == generated["context"]["span_id"]
    assert [e["name"] for e in attempt["events"]] == ["first_token"]
    assert _attr(request, "federation.output_tokens") == answer.usage.completion_tokens


@pytest.mark.timeout(120)
async def test_a_stream_resumed_on_another_site_is_a_second_attempt_in_the_same_trace(
    make_federation, span_dir
) -> None:
    """A stream whose site is killed mid-answer (agent and workers) is resumed on the other site:
    the same trace holds both attempts, the first failed at the killed site, the second a resume
    (tokens already sent) at the other, whose agent's generation is that attempt's child. (The
    killed agent's own spans die with it. A Korean client: the slower site is the one killed.)"""
    fed, _ = make_federation(speed=1)
    request_id = "trace-resumed-request"
    async with openai.AsyncOpenAI(base_url=fed.config.gateway_url + "/v1", api_key="unused", max_retries=0) as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL,
            prompt="Tell me about rivers.",
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": request_id, **KOREAN},
        )
        killed = raw.headers["x-federation-site"]
        text = ""
        async for event in raw.parse():
            if event.choices and not text:
                text = event.choices[0].text
                fed.child(f"agent {killed}").proc.send_signal(signal.SIGKILL)
    other = next(name for name, _, _ in SITES if name != killed)
    spans = await _trace_of(span_dir, request_id, {"gateway.request", "agent.generate"})

    assert {_attr(s, tracing.REQUEST_ID) for s in spans} == {request_id}
    request = _one(spans, "gateway.request")
    assert _attr(request, tracing.OUTCOME) == "ok" and _attr(request, "federation.resumed") == 1
    first, resumed = sorted((s for s in spans if s["name"] == "gateway.attempt"), key=lambda s: s["start_time"])
    assert (_attr(first, tracing.SITE), _attr(first, tracing.OUTCOME)) == (killed, "failed")
    assert _attr(first, "federation.sent_tokens") == 0
    assert (_attr(resumed, tracing.SITE), _attr(resumed, tracing.OUTCOME)) == (other, "ok")
    assert _attr(resumed, "federation.sent_tokens") > 0
    generated = _one(spans, "agent.generate")
    assert _attr(generated, tracing.SITE) == other
    assert generated["parent_id"] == resumed["context"]["span_id"]
    assert len([s for s in spans if s["name"] == "scheduler.route"]) == 2
