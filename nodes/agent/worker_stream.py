"""A streamed /generate from one SGLang worker, read in the transport's callbacks.

A worker sends one SSE event per decode step per request (`--stream-interval 1`, SGLang's
default): ~14 events/s per stream at MLPerf's TPOT, ~140 k/s from a full MI355X site. aiohttp's
client wakes the reading task for every event. This protocol parses the events as the bytes
arrive instead (HTTP framing by httptools, the llhttp parser uvicorn uses) and hands each one to
the request's `on_event` without waking any task: a fraction of aiohttp's CPU per event, most of
it the kernel's (docs/DATAPATH.md, "Worker → agent"). The request's own task sleeps until the
answer ends (`WorkerCall.done`).

One connection per request, `Connection: close`: a connection costs per request, not per token,
and closing it is how SGLang learns that its client is gone (it aborts the request). Waits are
bounded by whoever owns the calls, from `last_event_at` (one watcher for all of them, not a timer
per read); `close()` ends a call at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Protocol, cast
from urllib.parse import urlsplit

import httptools
import msgspec
import orjson

from nodes.agent.sglang import WorkerFailed, WorkerRejected, WorkerUnreachable, error_message

# SGLang's default stream repeats the whole answer in every event: a 100 k-token answer is ~1 MB
# an event. Anything longer is a broken worker, not an answer.
MAX_EVENT_BYTES = 8 * 1024**2
MAX_ERROR_BODY_BYTES = 64 * 1024  # a refusal's body; SGLang's are a few hundred bytes

# text, new output ids, completion tokens so far, prompt tokens, finish reason (None while running)
# (text, ids, completion tokens, prompt tokens, finish, cached tokens: its prompt's prefix-cache hit)
OnEvent = Callable[[str, list[int], int, int, dict[str, Any] | None, int], None]
# Asked for (SGLang's return_logprob): the new tokens' log probabilities, and at each of their
# positions the most likely (id, log probability) pairs; called just before the event's OnEvent.
OnLogprobs = Callable[[list[float], list[tuple[tuple[int, float], ...]]], None]


# What the wire carries a token id and a count as (proto3 uint32): a number outside it would fail
# the whole batch's serialization, so it fails the event's own call here.
Uint32 = Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]
# SGLang's logprob of a token: [logprob, token id, token text or null].
Logprob = tuple[float, Uint32, Any]


class _Meta(msgspec.Struct):
    """What the agent reads of an event's `meta_info` (SGLang sends a dozen more fields; msgspec
    skips them without building them)."""

    finish_reason: Any  # null while running, else SGLang's {"type": ...} (passed on as it is)
    completion_tokens: Uint32 | None = None  # required, but for an abort (see WorkerCall._event)
    prompt_tokens: Uint32 = 0  # 0 when absent, as the agent has always read it
    cached_tokens: Uint32 = 0  # of the prompt, found in the worker's prefix cache (SGLang's meta_info)
    output_token_logprobs: list[Logprob] | None = None
    output_top_logprobs: list[list[Logprob] | None] | None = None


class _Event(msgspec.Struct):
    """One event of SGLang's /generate stream: an answer so far, or an error in its place. Decoded
    straight into these fields and their types, at the token rate: an event whose fields are not of
    SGLang's types fails its own call here, rather than the batch it would have gone into (a batch
    is many generations' tokens). Also cheaper per event than a dict with every field of
    `meta_info` (orjson), measured alone (docs/BENCHMARKS.md, "typed worker events")."""

    text: str | None = None  # None: not in the event (an error event has none of these three)
    output_ids: list[Uint32] | None = None
    meta_info: _Meta | None = None
    error: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode


class Heard(Protocol):
    """Whatever keeps the time of the last event any of a worker's calls received (the pool's
    `Worker`): a worker that streams is alive, whatever its health checks say."""

    last_event_at: float


class WorkerCall(asyncio.Protocol):
    """One request's connection to a worker: writes the request, parses the answer's events."""

    def __init__(
        self,
        request: bytes,
        *,
        incremental: bool,
        on_event: OnEvent,
        heard: Heard,
        on_logprobs: OnLogprobs | None = None,
    ) -> None:
        self._request = request
        self._incremental = incremental
        self._on_event = on_event
        self._on_logprobs = on_logprobs
        self._sent_logprobs = 0  # cumulative mode: the positions earlier events already held
        self._heard = heard
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._status = 0
        self._rest = b""  # an event not complete yet
        self._error_body = b""
        self._sent_text = 0  # cumulative mode: what earlier events already held
        self._sent_ids = 0
        self._relayed = 0  # the completion tokens passed on so far
        self.answered = False  # response bytes arrived: the worker has the request
        self.started_at = time.monotonic()
        self.last_event_at: float | None = None  # None until the first event
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # ---- the owner's side ------------------------------------------------------------------

    def fail(self, error: WorkerFailed | WorkerRejected) -> None:
        """End the call with `error` (a timeout, a bad event) and close its connection."""
        if not self.done.done():
            self.done.set_exception(error)
        self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        if not self.done.done():  # closed by its owner: nobody awaits the outcome any more
            self.done.cancel()

    def pause(self) -> None:
        """Stop reading the worker until `resume`: whoever the events go to is behind (the events
        wait in the kernel, and then SGLang's sends do)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.pause_reading()

    def resume(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.resume_reading()

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self._transport = stream
        stream.write(self._request)

    def data_received(self, data: bytes) -> None:
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # raised in one of the callbacks below
            cause = exc.__context__
            if isinstance(cause, WorkerFailed | WorkerRejected):
                self.fail(cause)
            elif isinstance(cause, ValueError | KeyError | TypeError):  # an event not in SGLang's shape
                self.fail(WorkerFailed(f"malformed event from the worker: {type(cause).__name__}: {cause}"))
            else:
                raise
        except httptools.HttpParserError as exc:
            self.fail(WorkerFailed(f"malformed HTTP from the worker: {exc}", connection_lost=True))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        why = f"{type(exc).__name__}: {exc}" if exc else "the worker closed the connection"
        if not self.answered:  # nothing of the answer exists: another worker may take it
            self.done.set_exception(WorkerUnreachable(why, connection_lost=True))
        else:
            self.done.set_exception(WorkerFailed(f"{why} before the answer's end", connection_lost=True))

    # ---- httptools callbacks -----------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()
        if self._status >= 500:
            raise WorkerFailed(f"answered {self._status}")

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            if len(self._error_body) < MAX_ERROR_BODY_BYTES:
                self._error_body += body[: MAX_ERROR_BODY_BYTES - len(self._error_body)]
            return
        data = self._rest + body if self._rest else body
        if b"\r" in data:  # SSE allows CRLF line ends; SGLang sends LF
            data = data.replace(b"\r\n", b"\n")
        events = data.split(b"\n\n")
        self._rest = events.pop()
        if len(self._rest) > MAX_EVENT_BYTES:
            raise WorkerFailed(f"sent an event over {MAX_EVENT_BYTES} bytes")
        for event in events:
            if self.done.done():
                return
            self._event(event)

    def on_message_complete(self) -> None:
        if self.done.done():
            return
        if self._status != 200:
            try:
                message = error_message(orjson.loads(self._error_body))
            except orjson.JSONDecodeError:
                message = self._error_body.decode(errors="replace")[:500]
            raise WorkerRejected(message)
        raise WorkerFailed("ended the stream without [DONE]")

    # ---- events ------------------------------------------------------------------------------

    def _event(self, event: bytes) -> None:
        event = event.strip()
        if not event.startswith(b"data:"):
            return  # a comment or another field: nothing of the answer
        data = event[5:].strip()
        if data == b"[DONE]":
            self.done.set_result(None)
            self.close()
            return
        body = _decode_event(data)
        if body.error is not None:
            err, message = body.error, error_message({"error": body.error})
            if isinstance(err, dict) and isinstance(err.get("code"), int) and err["code"] < 500:
                raise WorkerRejected(message)
            raise WorkerFailed(message)
        meta, text, ids = body.meta_info, body.text, body.output_ids
        finish = meta.finish_reason if meta is not None else None
        if isinstance(finish, dict) and finish.get("type") == "abort":
            # An abort relays no tokens, only its finish: SGLang 0.5.23 ends a request aborted in
            # its queue (one retracted there mid-answer too) with its whole text so far and its last
            # id again, even when it streams increments, and in some versions with no ids or counts
            # (TokenizerManager._handle_abort_req). The worker is well; the gateway resumes the
            # answer elsewhere from what its client has, so a token made after the last event and
            # not relayed is made again there, never sent twice.
            status = finish.get("status_code")
            if isinstance(status, int) and 400 <= status < 500:  # SGLang's refusal of the request itself
                raise WorkerRejected(str(finish.get("message") or f"refused the request ({status})"))
            text, ids, completion = "", [], self._relayed
            assert meta is not None  # the finish came from it
        elif meta is None or text is None or ids is None or meta.completion_tokens is None:
            raise ValueError("an event without its text, output_ids, meta_info or count, and not an error")
        else:
            completion = meta.completion_tokens
            if not self._incremental:
                text, ids = text[self._sent_text :], ids[self._sent_ids :]
                self._sent_text += len(text)
                self._sent_ids += len(ids)
            if self._on_logprobs is not None and meta.output_token_logprobs:
                self._logprobs(meta)
        self._relayed = completion
        self.last_event_at = self._heard.last_event_at = time.monotonic()
        self._on_event(text, ids, completion, meta.prompt_tokens, finish, meta.cached_tokens)

    def _logprobs(self, meta: _Meta) -> None:
        """SGLang's [logprob, id, text] triples (cumulative unless the worker streams increments)."""
        chosen, top = meta.output_token_logprobs or [], meta.output_top_logprobs or []
        if not self._incremental:
            chosen, top = chosen[self._sent_logprobs :], top[self._sent_logprobs :]
            self._sent_logprobs += len(chosen)
        pairs = [tuple((int(t[1]), float(t[0])) for t in position or ()) for position in top]
        assert self._on_logprobs is not None
        self._on_logprobs([float(t[0]) for t in chosen], pairs)


async def start(
    url: str,
    payload: dict[str, Any],
    *,
    incremental: bool,
    on_event: OnEvent,
    heard: Heard,
    connect_timeout_s: float,
    on_logprobs: OnLogprobs | None = None,
    headers: Sequence[tuple[str, str]] = (),
) -> WorkerCall:
    """POST `payload` to the worker's /generate as a stream, with `headers` besides ours (a trace
    context); events go to `on_event` as they arrive. Raises WorkerUnreachable if no connection
    can be made."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = orjson.dumps({**payload, "stream": True})
    head = (
        f"POST {parts.path.rstrip('/')}/generate HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        + "".join(f"{name}: {value}\r\n" for name, value in headers)
        + "\r\n"
    )
    call = WorkerCall(
        head.encode() + body, incremental=incremental, on_event=on_event, heard=heard, on_logprobs=on_logprobs
    )
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(connect_timeout_s):
            await loop.create_connection(lambda: call, host, port)
    except (OSError, TimeoutError) as exc:
        raise WorkerUnreachable(f"{url}: cannot connect: {type(exc).__name__}: {exc}", connection_lost=True) from None
    return call
