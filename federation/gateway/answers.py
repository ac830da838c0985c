"""An answer as each API says it: one class per API, chosen once per request (`answer_for`), each
accumulating the chunks into the answer so far and saying it as a whole body or as its stream's
events. The request's kind is looked at once, here, and nowhere on the path of a token.

Stream events are built per chunk, at the token rate, so a completion's are not built as dicts:
each request's event is cut once into the bytes before and after the chunk's text
(`CompletionAnswer._text_template`), and a chunk's event is those bytes around its JSON-escaped
text. A chat's (and a Responses request's) output is Harmony, read by openai-harmony's parser into
reasoning, content and tool calls (`OutputItem`), each piece its own delta. /generate's events
are cumulative (each holds the whole answer so far, as SGLang's default stream does): the escaped
text and ids so far are kept and extended, not re-serialised per event.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson

from core import harmony
from core.errors import UpstreamFailed
from federation.gateway import logprobs
from federation.gateway.pieces import Chunk, Job, JobKind, OutputItem
from federation.gateway.responses_api import ResponseEvents

_HOLE = "\x00"  # stands where a value goes in a template; orjson writes it as below
_HOLE_JSON = b'"\\u0000"'
_USAGE = b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'


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


class Answer:
    """What every API's answer keeps: its tokens, the prompt's cached tokens, how it finished, the
    site that said its last chunk, and why a stream ended early. Each API adds what it keeps of
    the chunks (`_take`) and how it says them."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.created = int(time.time())
        self.completion_tokens = 0
        self.cached_tokens = 0  # of the prompt, found in prefix caches (summed over a resume's sites)
        self.finish: dict[str, Any] | None = None
        self.site = ""
        self.error: str | None = None  # why a stream ended early, after its first byte
        self._logprobs_asked = job.request.logprobs

    def add(self, chunk: Chunk) -> None:
        self._take(chunk)
        self.completion_tokens = chunk.completion_tokens
        self.cached_tokens = max(self.cached_tokens, chunk.cached_tokens)
        self.finish = chunk.finish_reason or self.finish
        self.site = chunk.site or self.site

    def _take(self, chunk: Chunk) -> None:
        """What this API keeps of a chunk (its text, ids, log probabilities)."""

    def flowed(
        self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str, started: float
    ) -> bytes:
        """`add` and `chunk_events` for a chunk from the middle of the answer (no finish, no
        logprobs), most chunks by far."""
        chunk = Chunk(text, output_ids, completion_tokens, None, site)
        self.add(chunk)
        return self.chunk_events(chunk, started)

    def constrained_output_begun(self) -> bool:
        """Whether a grammar on the answer already shapes what was sent: its whole output."""
        return self.completion_tokens > 0

    def body(self, e2e_latency_s: float) -> dict[str, Any]:
        """The whole answer, for a request that did not stream."""
        raise NotImplementedError

    def opening_events(self) -> bytes:
        return b""

    def chunk_events(self, chunk: Chunk, started: float) -> bytes:
        """The events for one chunk (already added to the answer); `started` is when the request
        arrived (time.monotonic()), for /generate's latency."""
        raise NotImplementedError

    def closing_events(self) -> bytes:
        return b""

    def _usage(self) -> dict[str, Any]:
        return usage(self.job, self.completion_tokens, self.cached_tokens)


class _OpenAIAnswer(Answer):
    """An answer of OpenAI's APIs: an id, an object name, a finish reason in OpenAI's words."""

    id_prefix = ""
    chunk_object = ""

    @property
    def openai_id(self) -> str:
        return self.id_prefix + self.job.request.request_id

    def _head(self, kind: str) -> dict[str, Any]:
        return {
            "id": self.openai_id,
            "object": kind,
            "created": self.created,
            "model": self.job.model,
            "service_tier": self.job.request.tier.label,
        }

    def _finish_reason(self) -> str:
        return openai_finish_reason(self.finish)

    def closing_events(self) -> bytes:
        events = sse({**self._head(self.chunk_object), "choices": [self._closing_choice(self._finish_reason())]})
        if self.job.include_usage:
            events += sse({**self._head(self.chunk_object), "choices": [], "usage": self._usage()})
        return events

    def _closing_choice(self, finish: str) -> dict[str, Any]:
        raise NotImplementedError


class _Said:
    """A non-streamed answer's text and ids, kept as its chunks come (a stream's go out as they
    come and are not kept)."""

    __slots__ = ("output_ids", "parts")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.output_ids: list[int] = []

    def add(self, chunk: Chunk) -> None:
        self.parts.append(chunk.text)
        self.output_ids.extend(chunk.output_ids)

    @property
    def text(self) -> str:
        return "".join(self.parts)


class GenerateAnswer(Answer):
    """SGLang's native /generate: text, ids and meta_info; a stream's events are cumulative."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.said = _Said()
        self.logprob_parts: list[Any] = []  # (id, logprob, top) per token
        self._text_json = bytearray()  # a stream's text so far, escaped for a JSON string
        self._ids_json = bytearray()  # a stream's ids so far, comma-separated

    def _take(self, chunk: Chunk) -> None:
        if not self.job.stream:
            self.said.add(chunk)
        if self._logprobs_asked:
            top = chunk.top or ((),) * len(chunk.logprobs)
            self.logprob_parts += zip(chunk.output_ids, chunk.logprobs, top, strict=False)

    def body(self, e2e_latency_s: float) -> dict[str, Any]:
        return {"text": self.said.text, "output_ids": self.said.output_ids, "meta_info": self.meta_info(e2e_latency_s)}

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

    def chunk_events(self, chunk: Chunk, started: float) -> bytes:
        self._text_json += orjson.dumps(chunk.text)[1:-1]
        if chunk.output_ids:
            self._ids_json += (b"," if self._ids_json else b"") + orjson.dumps(chunk.output_ids)[1:-1]
        final = chunk.finish_reason is not None
        meta = orjson.dumps(self.meta_info(time.monotonic() - started if final else None))
        parts = (b'data: {"text":"', self._text_json, b'","output_ids":[', self._ids_json, b'],"meta_info":', meta)
        return b"".join((*parts, b"}\n\n"))


class CompletionAnswer(_OpenAIAnswer):
    """/v1/completions: text choices; a mid-answer chunk of a plain stream is its template
    around its text, with no Chunk built."""

    id_prefix = "cmpl-"
    chunk_object = "text_completion"

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.said = _Said()
        self.logprob_parts: list[Any] = []  # OpenAI's logprobs parts, one per chunk
        self._completion_logprobs = logprobs.CompletionLogprobs()
        self._chunk_logprobs: Any = None
        self._plain_stream = job.stream and not self._logprobs_asked
        self._template: tuple[bytes, ...] = ()  # a text chunk's event, cut around its text (and usage)

    def _take(self, chunk: Chunk) -> None:
        if not self.job.stream:
            self.said.add(chunk)
        if self._logprobs_asked:
            ids = chunk.output_ids[: len(chunk.logprobs)]
            self._chunk_logprobs = self._completion_logprobs.add(ids, chunk.logprobs, chunk.top)
            self.logprob_parts.append(self._chunk_logprobs)

    def flowed(
        self, text: str, output_ids: tuple[int, ...], completion_tokens: int, site: str, started: float
    ) -> bytes:
        if not self._plain_stream:
            return super().flowed(text, output_ids, completion_tokens, site, started)
        self.completion_tokens, self.site = completion_tokens, site
        return self._text_event(text) if text else b""

    def body(self, e2e_latency_s: float) -> dict[str, Any]:
        choice = {
            "index": 0,
            "text": self.said.text,
            "logprobs": logprobs.merge_completion(self.logprob_parts),
            "finish_reason": self._finish_reason(),
        }
        return {**self._head("text_completion"), "choices": [choice], "usage": self._usage()}

    def chunk_events(self, chunk: Chunk, started: float) -> bytes:
        if self._logprobs_asked and (chunk.text or chunk.logprobs):  # not the template: a chunk's own logprobs
            choice = {"index": 0, "text": chunk.text, "logprobs": self._chunk_logprobs, "finish_reason": None}
            event: dict[str, Any] = {**self._head("text_completion"), "choices": [choice]}
            if self.job.continuous_usage:
                event["usage"] = self._usage()
            return sse(event)
        return self._text_event(chunk.text) if chunk.text else b""

    def _text_event(self, text: str) -> bytes:
        """A text chunk: its template around `text` (and the usage so far, when asked)."""
        if not self._template:
            self._template = self._text_template()
        if len(self._template) == 3:  # continuous usage: the tokens so far on every chunk
            before, between, after = self._template
            prompt, completion = self.job.request.prompt_tokens, self.completion_tokens
            counts = _USAGE % (prompt, completion, prompt + completion)
            return b"".join((before, orjson.dumps(text), between, counts, after))
        before, after = self._template
        return b"".join((before, orjson.dumps(text), after))

    def _text_template(self) -> tuple[bytes, ...]:
        choice = {"index": 0, "text": _HOLE, "logprobs": None, "finish_reason": None}
        event = {**self._head(self.chunk_object), "choices": [choice]}
        if self.job.continuous_usage:
            event["usage"] = _HOLE
        return _cut(event)

    def _closing_choice(self, finish: str) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}


class _HarmonyAnswer(_OpenAIAnswer):
    """An answer read from Harmony as it comes: reasoning, content and tool calls (`items`); the
    log probabilities kept are the content's (not the reasoning's or a call's)."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._reader = harmony.OutputReader()
        self._pieces: list[tuple[harmony.PieceKind, str]] = []  # the latest chunk's, read
        self._piece_items: list[int] = []  # the item each of those pieces belongs to
        self.items: list[OutputItem] = []  # what the reader found, in order
        self.final_begun = False  # the answer (not its reasoning) has begun
        self.logprob_parts: list[dict[str, Any]] = []  # the content's entries
        self._chunk_logprobs: list[dict[str, Any]] = []

    def _take(self, chunk: Chunk) -> None:
        self._read(chunk)
        if self._logprobs_asked:
            top = chunk.top or ((),) * len(chunk.logprobs)
            kinds = self._reader.token_kinds if chunk.output_ids else []
            entries = [
                logprobs.chat_entry(t, lp, tp)
                for t, lp, tp, kind in zip(chunk.output_ids, chunk.logprobs, top, kinds, strict=False)
                if kind == "content"
            ]
            self.logprob_parts += entries
            self._chunk_logprobs = entries

    def _read(self, chunk: Chunk) -> None:
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

    @property
    def ended_with_call(self) -> bool:
        """The answer ended by calling a tool (`<|call|>`), and a call was read."""
        if not self.calls:
            return False
        return self._reader.ended_with_call or (self.finish or {}).get("matched") == harmony.CALL

    def constrained_output_begun(self) -> bool:
        """A grammar on a chat constrains its final answer only, not the reasoning before it."""
        return self.final_begun

    def _finish_reason(self) -> str:
        return "tool_calls" if self.ended_with_call else openai_finish_reason(self.finish)


class ChatAnswer(_HarmonyAnswer):
    """/v1/chat/completions: a message with reasoning_content, content and tool_calls."""

    id_prefix = "chatcmpl-"
    chunk_object = "chat.completion.chunk"

    def body(self, e2e_latency_s: float) -> dict[str, Any]:
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
            "logprobs": self._logprobs(self.logprob_parts),
            "finish_reason": self._finish_reason(),
        }
        return {**self._head("chat.completion"), "choices": [choice], "usage": self._usage()}

    def _logprobs(self, entries: list[dict[str, Any]]) -> dict[str, Any] | None:
        return {"content": entries} if self._logprobs_asked else None

    def opening_events(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return sse({**self._head(self.chunk_object), "choices": [choice]})

    def chunk_events(self, chunk: Chunk, started: float) -> bytes:
        return b"".join(self._event(kind, text) for kind, text in self._pieces)

    def _event(self, kind: harmony.PieceKind, text: str) -> bytes:
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
        lps = self._logprobs(self._chunk_logprobs) if kind == "content" else None
        event = {
            **self._head(self.chunk_object),
            "choices": [{"index": 0, "delta": delta, "logprobs": lps, "finish_reason": None}],
        }
        if self.job.continuous_usage:
            event["usage"] = self._usage()
        return sse(event)

    def _closing_choice(self, finish: str) -> dict[str, Any]:
        return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}


class ResponsesAnswer(_HarmonyAnswer):
    """/v1/responses: the chat's answer said as a Response and its typed events."""

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self._events = ResponseEvents(self)

    def _status(self) -> str:
        return "completed" if self._finish_reason() != "length" else "incomplete"

    def body(self, e2e_latency_s: float) -> dict[str, Any]:
        return self._events.response(self._status())

    def opening_events(self) -> bytes:
        return self._events.opening()

    def chunk_events(self, chunk: Chunk, started: float) -> bytes:
        return self._events.pieces(self._pieces, self._piece_items)

    def closing_events(self) -> bytes:
        return self._events.closing(self._status())


_ANSWERS: dict[JobKind, type[Answer]] = {
    "generate": GenerateAnswer,
    "completion": CompletionAnswer,
    "chat": ChatAnswer,
    "responses": ResponsesAnswer,
}


def answer_for(job: Job) -> Answer:
    """The answer of the job's API."""
    return _ANSWERS[job.kind](job)
