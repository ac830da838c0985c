"""What the gateway answers: OpenAI bodies and chunks, and SGLang's native /generate shape,
built from the answer's chunks.

Stream events are built per chunk, at the token rate, so they are not built as dicts: each
request's event is cut once into the bytes before and after the chunk's text (`_Template`), and
a chunk's event is those bytes around its JSON-escaped text. /generate's events are cumulative
(each holds the whole answer so far, as SGLang's default stream does): the escaped text and ids
so far are kept and extended, not re-serialised per event.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from core.errors import UpstreamFailed
from federation.gateway.failover import Chunk
from federation.gateway.jobs import Job

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


def usage(job: Job, completion_tokens: int) -> dict[str, int]:
    prompt = job.request.prompt_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


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
        self.finish: dict[str, Any] | None = None
        self.site = ""
        self.error: str | None = None  # why a stream ended early, after its first byte
        self._text_json = bytearray()  # /generate: the text so far, escaped for a JSON string
        self._ids_json = bytearray()  # /generate: the ids so far, comma-separated
        self._template: tuple[bytes, ...] = ()  # a text chunk's event, cut around its text (and usage)

    def add(self, chunk: Chunk) -> None:
        if not self.job.stream:  # a stream's text and ids go out as they come, and are not kept
            self.text_parts.append(chunk.text)
            self.output_ids.extend(chunk.output_ids)
        self.completion_tokens = chunk.completion_tokens
        self.finish = chunk.finish_reason or self.finish
        self.site = chunk.site or self.site

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

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
        finish = openai_finish_reason(self.finish)
        if self.job.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
                "logprobs": None,
                "finish_reason": finish,
            }
            return {
                **self._head("chat.completion"),
                "choices": [choice],
                "usage": usage(self.job, self.completion_tokens),
            }
        choice = {"index": 0, "text": self.text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage(self.job, self.completion_tokens)}

    def meta_info(self, e2e_latency_s: float | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.job.request.request_id,
            "finish_reason": self.finish,
            "prompt_tokens": self.job.request.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": 0,
            "site": self.site,
        }
        if e2e_latency_s is not None:
            meta["e2e_latency"] = e2e_latency_s
        return meta

    # ---- stream events -----------------------------------------------------------------

    def opening_events(self) -> bytes:
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
            return b'data: {"text":"%b","output_ids":[%b],"meta_info":%b}\n\n' % (self._text_json, self._ids_json, meta)
        if not chunk.text:
            return b""
        if not self._template:
            self._template = self._text_template()
        if len(self._template) == 3:  # continuous usage: the tokens so far on every chunk
            before, between, after = self._template
            prompt, completion = self.job.request.prompt_tokens, self.completion_tokens
            counts = _USAGE % (prompt, completion, prompt + completion)
            return b"".join((before, orjson.dumps(chunk.text), between, counts, after))
        before, after = self._template
        return b"".join((before, orjson.dumps(chunk.text), after))

    def _text_template(self) -> tuple[bytes, ...]:
        if self.job.kind == "chat":
            choice = {"index": 0, "delta": {"content": _HOLE}, "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": _HOLE, "logprobs": None, "finish_reason": None}
        event = {**self._head(self._chunk_object), "choices": [choice]}
        if self.job.continuous_usage:
            event["usage"] = _HOLE
        return _cut(event)

    def closing_events(self) -> bytes:
        if self.job.kind == "generate":
            return b""
        finish = openai_finish_reason(self.finish)
        kind = self._chunk_object
        if self.job.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
        events = sse({**self._head(kind), "choices": [choice]})
        if self.job.include_usage:
            events += sse({**self._head(kind), "choices": [], "usage": usage(self.job, self.completion_tokens)})
        return events
