"""What the gateway answers, and how it reaches the client: OpenAI bodies and chunks, SGLang's
native /generate shape, built from the answer's chunks; written to the client's SSE stream as
they arrive, or collected into one body.

Stream events are built per chunk, at the token rate, so a completion's are not built as
dicts: each request's event is cut once into the bytes before and after the chunk's text
(`_text_template`), and a chunk's event is those bytes around its JSON-escaped text. A chat's
(and a Responses request's) output is Harmony, read by openai-harmony's parser into reasoning,
content and tool calls (`OutputItem`), each piece its own delta. /generate's events are cumulative
(each holds the whole answer so far, as SGLang's default stream does): the escaped text and ids
so far are kept and extended, not re-serialised per event.

Chunks arrive in the upstream reader's turn, many requests' at once. Waking each request's
handler to write its own chunk would cost a task switch per chunk per client, a large share of
the gateway's CPU per token at SGLang's pace; so a chunk's event is built at once and queued,
and one call-soon pass after the reader's turn (`WriteBatch`) writes every client that has
events waiting: one socket write per client per batch of deltas, no task woken.

Once the response has begun (aiohttp has sent its headers, with chunked transfer encoding on
HTTP/1.1), the body is written to the transport directly, framed as HTTP/1.1 chunks: aiohttp's
`write` is a coroutine, and a callback cannot await. The handler writes the end itself, through
aiohttp, after flushing what is queued.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import structlog
from aiohttp import hdrs, web

from core import harmony
from core.errors import UpstreamFailed
from federation.gateway import logprobs
from federation.gateway.pieces import Chunk, Job, OutputItem
from federation.gateway.responses_api import ResponseEvents

log = structlog.get_logger("gateway")

# A client that stops reading: past this much unsent, its answer is cut (its connection closed,
# which cancels the generation) rather than kept in this process's memory.
MAX_CLIENT_BUFFER_BYTES = 16 * 1024**2

_HOLE = "\x00"  # stands where a value goes in a template; orjson writes it as below
_HOLE_JSON = b'"\\u0000"'


def openai_finish_reason(finish: dict[str, Any] | None) -> str:
    """SGLang's finish_reason as OpenAI names it; an aborted generation is a failure."""
    kind = (finish or {}).get("type")
    if kind == "length":
        return "length"
    if kind == "stop":
        return "stop"
    raise UpstreamFailed(f"the site ended the generation: {(finish or {}).get('message', 'no finish reason')}")


def usage(job: Job, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, as SGLang gives it with --enable-cache-report: the prompt's tokens found in
    the prefix cache in `prompt_tokens_details` (summed over the sites a resumed answer used)."""
    prompt = job.request.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(event: Any) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def _cut(event: dict[str, Any]) -> tuple[bytes, ...]:
    """An SSE event with `_HOLE`s, as the bytes between them."""
    return tuple((b"data: " + orjson.dumps(event) + b"\n\n").split(_HOLE_JSON))


_USAGE = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'


class Answer:
    """Accumulates the chunks into the answer so far, and says it as the client's API does."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.created = int(time.time())
        self.text_parts: list[str] = []
        self.output_ids: list[int] = []
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt, found in prefix caches (summed over a resume's sites)
        self.finish: dict[str, Any] | None = None
        self.site = ""
        self.error: str | None = None  # why a stream ended early, after its first byte
        self._text_json = bytearray()  # /generate: the text so far, escaped for a JSON string
        self._ids_json = bytearray()  # /generate: the ids so far, comma-separated
        self._template: tuple[bytes, ...] = ()  # a text chunk's event, cut around its text (and usage)
        # A chat's output is Harmony: read into reasoning, content and tool calls as it comes.
        self._reader = harmony.OutputReader() if job.kind in ("chat", "responses") else None
        self._pieces: list[tuple[harmony.PieceKind, str]] = []  # the latest chunk's, read
        self._piece_items: list[int] = []  # the item each of those pieces belongs to
        self.items: list[OutputItem] = []  # what the reader found, in order
        self.final_begun = False  # a chat's answer (not its reasoning) has begun
        self._responses = ResponseEvents(self) if job.kind == "responses" else None
        # Asked for: the log probabilities of the answer's tokens so far, and of the latest chunk's.
        self._logprobs_asked = job.request.logprobs
        # A streamed completion without logprobs: a mid-answer chunk is its template around its text.
        self._plain_stream = job.kind == "completion" and job.stream and not self._logprobs_asked
        self._completion_logprobs = logprobs.CompletionLogprobs()
        self.logprob_parts: list[Any] = []  # chat: content entries; completion: parts; generate: (id, lp, top)
        self._chunk_logprobs: Any = None

    def add(self, chunk: Chunk) -> None:
        if self._reader is not None:
            self._read(chunk)
        elif not self.job.stream:  # a stream's text and ids go out as they come, and are not kept
            self.text_parts.append(chunk.text)
            self.output_ids.extend(chunk.output_ids)
        if self._logprobs_asked:
            self._add_logprobs(chunk)
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.finish = chunk.finish_reason or self.finish
        self.site = chunk.site or self.site

    def _add_logprobs(self, chunk: Chunk) -> None:
        """A chat's are its answer tokens' (not its reasoning's or a tool call's)."""
        ids, lps, top = chunk.output_ids, chunk.logprobs, chunk.top or ((),) * len(chunk.logprobs)
        if self._reader is not None:
            kinds = self._reader.token_kinds if chunk.output_ids else []
            entries = [
                logprobs.chat_entry(t, lp, tp)
                for t, lp, tp, kind in zip(ids, lps, top, kinds, strict=False)
                if kind == "content"
            ]
            self.logprob_parts += entries
            self._chunk_logprobs = entries
        elif self.job.kind == "completion":
            self._chunk_logprobs = self._completion_logprobs.add(ids[: len(lps)], lps, chunk.top)
            self.logprob_parts.append(self._chunk_logprobs)
        else:
            self.logprob_parts += zip(ids, lps, top, strict=False)

    def _read(self, chunk: Chunk) -> None:
        assert self._reader is not None
        if chunk.output_ids:
            self._pieces = self._reader.feed(chunk.output_ids)
        else:  # a site that sent text without ids: its text is the answer
            self._pieces = [("content", chunk.text)] if chunk.text else []
        items, self._piece_items = self.items, []
        self.final_begun = self.final_begun or self._reader.final_begun
        for kind, text in self._pieces:
            self.final_begun = self.final_begun or kind == "content"
            if kind == "arguments":
                items[-1].parts.append(text)
            elif kind == "call":
                items.append(OutputItem("call", "call_" + uuid.uuid4().hex[:24], text))
            elif items and items[-1].kind == kind:
                items[-1].parts.append(text)
            else:
                items.append(OutputItem(kind, ("rs_" if kind == "reasoning" else "msg_") + uuid.uuid4().hex[:24]))
                items[-1].parts.append(text)
            self._piece_items.append(len(items) - 1)

    def joined(self, kind: str) -> str:
        return "".join(item.text for item in self.items if item.kind == kind)

    @property
    def calls(self) -> list[OutputItem]:
        return [item for item in self.items if item.kind == "call"]

    def constrained_output_begun(self) -> bool:
        """Whether a grammar on the answer already shapes what was sent: a chat's constrains its
        final answer only (not the reasoning before it); any other's, its whole output."""
        return self.final_begun if self._reader is not None else self.completion_tokens > 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def ended_with_call(self) -> bool:
        """The answer ended by calling a tool (`<|call|>`), and a call was read."""
        if self._reader is None or not self.calls:
            return False
        return self._reader.ended_with_call or (self.finish or {}).get("matched") == harmony.CALL

    @property
    def openai_id(self) -> str:
        prefix = "chatcmpl-" if self.job.kind == "chat" else "cmpl-"
        return prefix + self.job.request.request_id

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.job.kind == "chat" else "text_completion"

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.openai_id, "object": kind, "created": self.created, "model": self.job.model}

    # ---- whole answers ---------------------------------------------------------------

    def body(self, e2e_latency_s: float) -> dict[str, Any]:
        if self.job.kind == "generate":
            return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info(e2e_latency_s)}
        finish = "tool_calls" if self.ended_with_call else openai_finish_reason(self.finish)
        if self._responses is not None:
            return self._responses.response("completed" if finish != "length" else "incomplete")
        if self.job.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": self.joined("content") or None}
            if reasoning := self.joined("reasoning"):
                message["reasoning_content"] = reasoning
            if calls := self.calls:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.text}} for c in calls
                ]
            choice = {
                "index": 0,
                "message": message,
                "logprobs": self._chat_logprobs(self.logprob_parts),
                "finish_reason": finish,
            }
            return {
                **self._head("chat.completion"),
                "choices": [choice],
                "usage": usage(self.job, self.completion_tokens, self.cached_tokens),
            }
        choice = {
            "index": 0,
            "text": self.text,
            "logprobs": logprobs.merge_completion(self.logprob_parts),
            "finish_reason": finish,
        }
        return {
            **self._head("text_completion"),
            "choices": [choice],
            "usage": usage(self.job, self.completion_tokens, self.cached_tokens),
        }

    def meta_info(self, e2e_latency_s: float | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.job.request.request_id,
            "finish_reason": self.finish,
            "prompt_tokens": self.job.request.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "site": self.site,
        }
        if e2e_latency_s is not None:
            meta["e2e_latency"] = e2e_latency_s
        if self._logprobs_asked:
            ids, lps, top = zip(*self.logprob_parts, strict=True) if self.logprob_parts else ((), (), ())
            meta.update(logprobs.sglang_triples(list(ids), list(lps), list(top) if any(top) else []))
        return meta

    def _chat_logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"content": entries} if self._logprobs_asked else None

    # ---- stream events -----------------------------------------------------------------

    def opening_events(self) -> bytes:
        if self._responses is not None:
            return self._responses.opening()
        if self.job.kind != "chat":
            return b""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse({**self._head("chat.completion.chunk"), "choices": [choice]})

    def chunk_events(self, chunk: Chunk, started: float) -> bytes:
        """The events for one chunk (already added to the answer); `started` is when the request
        arrived (time.monotonic()), for /generate's latency."""
        if self.job.kind == "generate":  # SGLang's cumulative form
            self._text_json += orjson.dumps(chunk.text)[1:-1]
            if chunk.output_ids:
                self._ids_json += (b"," if self._ids_json else b"") + orjson.dumps(chunk.output_ids)[1:-1]
            final = chunk.finish_reason is not None
            meta = orjson.dumps(self.meta_info(time.monotonic() - started if final else None))
            parts = (b'data: {"text":"', self._text_json, b'","output_ids":[', self._ids_json, b'],"meta_info":', meta)
            return b"".join((*parts, b"}\n\n"))
        if self._responses is not None:
            return self._responses.pieces(self._pieces, self._piece_items)
        if self._reader is not None:
            return b"".join(self._chat_event(kind, text) for kind, text in self._pieces)
        if self._logprobs_asked and (chunk.text or chunk.logprobs):  # not the template: a chunk's own logprobs
            choice = {"index": 0, "text": chunk.text, "logprobs": self._chunk_logprobs, "finish_reason": None}
            event: dict[str, Any] = {**self._head("text_completion"), "choices": [choice]}
            if self.job.continuous_usage:
                event["usage"] = usage(self.job, self.completion_tokens, self.cached_tokens)
            return sse(event)
        return self._text_event(chunk.text) if chunk.text else b""

    def flowed(
        self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str, started: float
    ) -> bytes:
        """`add` and `chunk_events` for a chunk from the middle of the answer (no finish, no
        logprobs), most chunks by far: a plain streamed completion's straight from its template,
        with no Chunk built; any other answer's as any chunk's."""
        if not self._plain_stream:
            chunk = Chunk(text, output_ids, completion_tokens, None, site)
            self.add(chunk)
            return self.chunk_events(chunk, started)
        self.completion_tokens, self.site = completion_tokens, site
        return self._text_event(text) if text else b""

    def _text_event(self, text: str) -> bytes:
        """A completion's text chunk: its template around `text` (and the usage so far, when asked)."""
        if not self._template:
            self._template = self._text_template()
        if len(self._template) == 3:  # continuous usage: the tokens so far on every chunk
            before, between, after = self._template
            prompt, completion = self.job.request.prompt_tokens, self.completion_tokens
            counts = _USAGE % (prompt, completion, prompt + completion)
            return b"".join((before, orjson.dumps(text), between, counts, after))
        before, after = self._template
        return b"".join((before, orjson.dumps(text), after))

    def _chat_event(self, kind: harmony.PieceKind, text: str) -> bytes:
        """A chat chunk: reasoning, content, a tool call's start or its arguments so far."""
        delta: dict[str, Any]
        if kind == "reasoning":
            delta = {"reasoning_content": text}
        elif kind == "content":
            delta = {"content": text}
        elif kind == "call":
            calls = self.calls
            call = {"index": len(calls) - 1, "id": calls[-1].id, "type": "function"}
            delta = {"tool_calls": [{**call, "function": {"name": calls[-1].name, "arguments": ""}}]}
        else:
            delta = {"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]}
        lps = self._chat_logprobs(self._chunk_logprobs or []) if kind == "content" else None
        event = {
            **self._head("chat.completion.chunk"),
            "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": None}],
        }
        if self.job.continuous_usage:
            event["usage"] = usage(self.job, self.completion_tokens, self.cached_tokens)
        return sse(event)

    def _text_template(self) -> tuple[bytes, ...]:
        """A completion's text chunk (a chat's chunks are read from Harmony: `_chat_event`)."""
        choice = {"index": 0, "text": _HOLE, "logprobs": None, "finish_reason": None}
        event = {**self._head(self._chunk_object), "choices": [choice]}
        if self.job.continuous_usage:
            event["usage"] = _HOLE
        return _cut(event)

    def closing_events(self) -> bytes:
        if self.job.kind == "generate":
            return b""
        finish = "tool_calls" if self.ended_with_call else openai_finish_reason(self.finish)
        if self._responses is not None:
            return self._responses.closing("completed" if finish != "length" else "incomplete")
        kind = self._chunk_object
        if self.job.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        events = sse({**self._head(kind), "choices": [choice]})
        if self.job.include_usage:
            events += sse(
                {
                    **self._head(kind),
                    "choices": [],
                    "usage": usage(self.job, self.completion_tokens, self.cached_tokens),
                }
            )
        return events


class WriteBatch:
    """Clients with events waiting, written in one pass as soon as the loop is free."""

    def __init__(self) -> None:
        self._clients: list[SseClient] = []
        self._scheduled = False

    def add(self, client: SseClient) -> None:
        self._clients.append(client)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._write)

    def _write(self) -> None:
        clients, self._clients, self._scheduled = self._clients, [], False
        for client in clients:
            client.flush()


class Collected:
    """A whole answer in one body: the chunks only accumulate."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.first_chunk_at: float | None = None

    def chunk(self, chunk: Chunk) -> None:
        self.answer.add(chunk)

    def flow(self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str) -> None:
        self.answer.add(Chunk(text, output_ids, completion_tokens, None, site))

    def constrained_output_begun(self) -> bool:
        return self.answer.constrained_output_begun()

    async def opened(self, site: str) -> None:
        self.first_chunk_at = time.monotonic()


class SseClient:
    """One client's SSE stream. `opened` sends the headers (`headers()` says them then) and what
    came so far; later chunks are written as they arrive (see the module's docstring)."""

    def __init__(
        self, request: web.Request, answer: Answer, writes: WriteBatch, headers: Callable[[], dict[str, str]]
    ) -> None:
        self._request = request
        self.answer = answer
        self._writes = writes
        self._headers = headers
        self._started = time.monotonic()
        self.first_chunk_at: float | None = None
        self.response: web.StreamResponse | None = None
        self._transport: asyncio.Transport | None = None  # set once the headers went
        self._chunked = False
        self._pending: list[bytes] = []
        self._queued = False

    def chunk(self, chunk: Chunk) -> None:
        answer = self.answer
        answer.add(chunk)
        self._queue(answer.chunk_events(chunk, self._started))

    def flow(self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str) -> None:
        self._queue(self.answer.flowed(text, output_ids, completion_tokens, site, self._started))

    def _queue(self, data: bytes) -> None:
        """`data` to be written in the next pass (nothing is written before the headers went)."""
        if data:
            self._pending.append(data)
            if not self._queued and self._transport is not None:
                self._queued = True
                self._writes.add(self)

    def constrained_output_begun(self) -> bool:
        return self.answer.constrained_output_begun()

    async def opened(self, site: str) -> None:
        self.first_chunk_at = time.monotonic()
        response = web.StreamResponse(
            headers={**self._headers(), "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(self._request)  # sends the headers
        self.response = response
        self._chunked = response.headers.get(hdrs.TRANSFER_ENCODING) == "chunked"
        self._transport = self._request.transport
        self._pending.insert(0, self.answer.opening_events())
        self.flush()

    def flush(self) -> None:
        """Write what is queued; a client gone or too slow to read gets nothing more."""
        self._queued = False
        transport = self._transport
        if not self._pending or transport is None or transport.is_closing():
            return
        data = b"".join(self._pending) if len(self._pending) > 1 else self._pending[0]
        self._pending.clear()
        if not data:
            return
        if transport.get_write_buffer_size() > MAX_CLIENT_BUFFER_BYTES:
            log.warning("client.too_slow", unsent_bytes=transport.get_write_buffer_size())
            transport.close()  # the handler is cancelled, and with it the generation
            return
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    async def end(self, events: bytes) -> web.StreamResponse:
        """The last events and [DONE], after everything queued; the response is complete."""
        assert self.response is not None
        self.flush()
        if self._transport is None or self._transport.is_closing():
            return self.response  # the client left after its last chunk: nobody to tell
        await self.response.write(events + b"data: [DONE]\n\n")
        return self.response
