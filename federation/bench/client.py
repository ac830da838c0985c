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

import orjson

from federation.bench.connections import AnswerFailed, Connection, Session
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
    prompt_tokens: int = 0  # as the usage says (the sample's, when it says none)
    cached_tokens: int = 0  # of the prompt, found in prefix caches (the usage's prompt_tokens_details)
    text: str = ""  # the answer, when kept (a conversation's next turn sends it back)
    refused: bool = False  # answered 429 with a Retry-After: come back later, not a failure of the answer
    # The longest wait between two of its text events, and when it ended (time.monotonic()): a
    # stream resumed on another site after its first one crashed waits this long for its next token.
    longest_gap_s: float = 0.0
    longest_gap_end: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """MLPerf's per-sample TPOT: (latency - TTFT) / (tokens - 1)."""
        if self.first_token is None or self.output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.output_tokens - 1)


def session(endpoint: str = "", part: int = 0) -> Session:
    """A client process's connections: kept alive, no total timeout (an Offline answer may wait
    minutes); see federation/bench/connections.py."""
    return Session(endpoint, part)


async def served_model(http: Session, endpoint: str) -> str:
    """The first model the endpoint lists (`endpoint` ends in /v1)."""
    async with http.http.get(endpoint + "/models") as resp:
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
    if sample.service_tier is not None:
        request["service_tier"] = sample.service_tier
    return orjson.dumps(request)


class _Reading:
    """One answer as it arrives (a connections.Reader): its first text, its chunks, and the tokens
    the last chunk said had come."""

    def __init__(
        self, sample: Sample, started: float, on_first_token: Callable[[], None] | None, keep_text: bool = False
    ) -> None:
        self.sample, self.started, self._on_first_token = sample, started, on_first_token
        self.texts: list[str] | None = [] if keep_text else None
        self.prompt_tokens = sample.prompt_tokens
        self.window: asyncio.Timeout | None = None
        self.first: float | None = None
        self.tokens, self.events, self.cached = 0, 0, 0
        self.counted_at: float | None = None  # when a chunk last said how many tokens had come
        self.last_text_at: float | None = None
        self.longest_gap_s, self.longest_gap_end = 0.0, None
        self.site, self.status, self.retry_after = "", 0, False
        self.hop_ms: float | None = None
        self.route_ms: float | None = None
        self.refusal: str | None = None
        self.ended = False  # the connection said the answer is over (`done` may be cancelled before)
        self.done: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()  # its error

    def result(self, error: str | None = None, cut: bool = False, finished: float | None = None) -> Result:
        end = finished or time.monotonic()
        return Result(
            self.sample.index, self.started, self.first, end, self.tokens, self.site, error, cut, self.events,
            self.hop_ms, self.route_ms, self.prompt_tokens, self.cached, "".join(self.texts or ()),
            self.status == 429 and self.retry_after, self.longest_gap_s, self.longest_gap_end,
        )  # fmt: skip

    def head(self, status: int, headers: dict[str, str]) -> None:
        self.status, self.site = status, headers.get(SITE_HEADER.lower(), "")
        self.retry_after = "retry-after" in headers
        timing = headers.get("server-timing", "")
        hop, route = HOP.search(timing), ROUTE.search(timing)
        self.hop_ms, self.route_ms = (float(hop.group(1)) if hop else None), (float(route.group(1)) if route else None)

    def line(self, line: bytes) -> None:
        if not line.startswith(b"data: {"):
            return
        event = orjson.loads(line[len(b"data: ") :])
        if "error" in event:
            raise AnswerFailed(f"stream error: {event['error']}")
        has_text = any(c.get("text") for c in event.get("choices", ()))
        if has_text:
            now = time.monotonic()
            if self.last_text_at is not None and now - self.last_text_at > self.longest_gap_s:
                self.longest_gap_s, self.longest_gap_end = now - self.last_text_at, now
            self.last_text_at = now
            if self.texts is not None:
                self.texts.extend(c.get("text") or "" for c in event["choices"])
        self.events += has_text
        usage = event.get("usage")
        if self.first is None and has_text:
            self.first = time.monotonic()
            if self._on_first_token is not None:
                self._on_first_token()
            if not usage and self.window is not None and not self.window.expired():
                self.window.reschedule(None)  # its tokens come only at the end: read to it
        if usage:
            self.tokens, self.counted_at = usage["completion_tokens"], time.monotonic()
            self.prompt_tokens = usage.get("prompt_tokens") or self.prompt_tokens
            details = usage.get("prompt_tokens_details")  # on the final usage (SGLang: with --enable-cache-report)
            if details:
                self.cached = details.get("cached_tokens") or self.cached

    def refused(self, body: bytes) -> None:
        self.refusal = f"HTTP {self.status}: {body.decode(errors='replace')[:300]}"

    def end(self, error: str | None) -> None:
        self.ended = True
        if not self.done.done():
            self.done.set_result(self.refusal or error)


async def send(
    http: Session,
    endpoint: str,
    model: str,
    sample: Sample,
    on_first_token: Callable[[], None] | None = None,
    started: float | None = None,
    stop_at: float | None = None,
    stream_interval: int | None = None,
    keep_text: bool = False,
) -> Result:
    """Never raises for the endpoint's failures: they come back as a Result with `error`.
    `on_first_token` is called the moment the first text arrives (LoadGen's FirstTokenComplete).
    `started` is when the request was due (a Poisson arrival): latencies count from there even
    if the client could only send it later. At `stop_at` (time.monotonic()) the answer is `cut`:
    its tokens so far, as of the last chunk that said them; an answer that has begun on an
    endpoint that says its tokens only at the end is read to the end."""
    reading = _Reading(sample, started or time.monotonic(), on_first_token, keep_text)
    connection: Connection | None = None
    try:
        async with asyncio.timeout_at(stop_at) as window:
            reading.window = window
            connection = await http.post(endpoint + "/completions", body(model, sample, stream_interval), reading)
            error = await reading.done
    except (OSError, TimeoutError) as exc:
        if isinstance(exc, TimeoutError) and window.expired():
            return reading.result(cut=True, finished=reading.counted_at)
        return reading.result(f"{type(exc).__name__}: {exc}")
    finally:
        if connection is not None and not reading.ended:
            connection.abandon()  # cut, failed or cancelled mid-answer: nobody reads the rest
    if error is not None:
        return reading.result(error)
    if reading.tokens != sample.output_tokens:
        return reading.result(f"usage says {reading.tokens} tokens, asked for {sample.output_tokens}")
    return reading.result()
