"""One benchmark request through an OpenAI-compatible endpoint, timed as MLPerf times it.

The request is a streamed `/v1/completions` with the sample's text prompt, its
length as `max_tokens` and `ignore_eos`, and `include_usage`: the API our users call,
which the federation's gateway, SGLang itself and the sglang-router all serve. TTFT is
the first event carrying text; the token count is the usage the endpoint reports. It also
asks for `continuous_usage_stats`: an endpoint that reports the tokens so far on every chunk
(our gateway does) lets a sustained run stop reading when its window ends, knowing what each
open answer delivered, instead of waiting minutes for the longest ones to finish.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import orjson

from federation.bench.workload import Sample

SITE_HEADER = "X-Federation-Site"  # set by our gateway; peers leave it out
# Our gateway's `Server-Timing: hop;dur=MS, route;dur=MS`: from the request's arrival to its
# agent taking it, and to its route decided.
HOP = re.compile(r"(?:^|,)\s*hop;dur=([0-9.]+)")
ROUTE = re.compile(r"(?:^|,)\s*route;dur=([0-9.]+)")


@dataclass(frozen=True, slots=True)
class Result:
    index: int
    started: float  # time.monotonic()
    first_token: float | None
    finished: float
    output_tokens: int
    site: str
    error: str | None = None
    cut: bool = False  # the client stopped reading at `stop_at`: `output_tokens` were received by `finished`
    events: int = 0  # stream events that carried text
    hop_ms: float | None = None  # the endpoint's `Server-Timing` hop (ours only)
    route_ms: float | None = None  # and its route

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """MLPerf's per-sample TPOT: (latency - TTFT) / (tokens - 1)."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def session(endpoint: str = "", part: int = 0) -> aiohttp.ClientSession:
    """One connection per open request, no total timeout (an Offline answer may wait minutes).
    To a gateway on this machine, client process `part` connects from a loopback address of its
    own: one source address has ~28 k ephemeral ports for a destination, and a drill keeps
    32,000 requests open."""
    local = urlsplit(endpoint).hostname == "127.0.0.1"
    connector = aiohttp.TCPConnector(
        limit=0, limit_per_host=0, local_addr=(f"127.0.0.{2 + part}", 0) if local else None
    )
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=60))


async def served_model(http: aiohttp.ClientSession, endpoint: str) -> str:
    """The first model the endpoint lists (`endpoint` ends in /v1)."""
    async with http.get(endpoint + "/models") as resp:
        resp.raise_for_status()
        return (await resp.json(content_type=None))["data"][0]["id"]  # the sglang-router says text/plain


def body(model: str, sample: Sample, stream_interval: int | None = None) -> bytes:
    """With `stream_interval`, the client asks for the worker's own chunks (an extension of SGLang's
    and ours; see federation/gateway/jobs.py) instead of the endpoint's."""
    request = {
        "model": model,
        "prompt": sample.prompt,
        "max_tokens": sample.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if stream_interval is not None:
        request["stream_interval"] = stream_interval
    return orjson.dumps(request)


async def send(
    http: aiohttp.ClientSession,
    endpoint: str,
    model: str,
    sample: Sample,
    on_first_token: Callable[[], None] | None = None,
    started: float | None = None,
    stop_at: float | None = None,
    stream_interval: int | None = None,
) -> Result:
    """Never raises for the endpoint's failures: they come back as a Result with `error`.
    `on_first_token` is called the moment the first text arrives (LoadGen's FirstTokenComplete).
    `started` is when the request was due (a Poisson arrival): latencies count from there even
    if the client could only send it later. At `stop_at` (time.monotonic()) the answer is `cut`:
    its tokens so far, as of the last chunk that said them; an answer that has begun on an
    endpoint that says its tokens only at the end is read to the end."""
    started, first, tokens, site = started or time.monotonic(), None, 0, ""
    counted_at: float | None = None  # when a chunk last said how many tokens had come
    events, hop_ms, route_ms = 0, None, None

    def result(error: str | None = None, cut: bool = False, finished: float | None = None) -> Result:
        end = finished or time.monotonic()
        return Result(sample.index, started, first, end, tokens, site, error, cut, events, hop_ms, route_ms)

    try:
        async with asyncio.timeout_at(stop_at) as window:
            async with http.post(
                endpoint + "/completions",
                data=body(model, sample, stream_interval),
                headers={"Content-Type": "application/json"},
            ) as resp:
                site = resp.headers.get(SITE_HEADER, "")
                timing = resp.headers.get("Server-Timing", "")
                hop, route = HOP.search(timing), ROUTE.search(timing)
                hop_ms, route_ms = (float(hop.group(1)) if hop else None), (float(route.group(1)) if route else None)
                if resp.status != 200:
                    return result(f"HTTP {resp.status}: {(await resp.text())[:300]}")
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    event = orjson.loads(line[len(b"data: ") :])
                    if "error" in event:
                        return result(f"stream error: {event['error']}")
                    has_text = any(c.get("text") for c in event.get("choices", ()))
                    events += has_text
                    if first is None and has_text:
                        first = time.monotonic()
                        if on_first_token is not None:
                            on_first_token()
                        if not event.get("usage"):
                            window.reschedule(None)  # its tokens come only at the end: read to it
                    if event.get("usage"):
                        tokens, counted_at = event["usage"]["completion_tokens"], time.monotonic()
    except (aiohttp.ClientError, TimeoutError) as exc:
        if isinstance(exc, TimeoutError) and window.expired():
            return result(cut=True, finished=counted_at)
        return result(f"{type(exc).__name__}: {exc}")
    if tokens != sample.output_tokens:
        return result(f"usage says {tokens} tokens, asked for {sample.output_tokens}")
    return result()
