"""What the gateway answers: OpenAI bodies and chunks, and SGLang's native /generate shape,
built from the site's token chunks."""

from __future__ import annotations

import time
from typing import Any

from federation import wire
from federation.errors import UpstreamFailed
from federation.gateway.jobs import Job


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


class Answer:
    """Accumulates a site's chunks into the answer so far."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.created = int(time.time())
        self.text_parts: list[str] = []
        self.output_ids: list[int] = []
        self.completion_tokens = 0
        self.finish: dict[str, Any] | None = None
        self.site = ""
        self.error: str | None = None  # why a stream ended early, after its first byte

    def add(self, chunk: wire.GenerateChunk) -> None:
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

    def opening_events(self) -> list[dict[str, Any]]:
        if self.job.kind == "chat":
            delta = {"role": "assistant", "content": ""}
            return [
                {
                    **self._head("chat.completion.chunk"),
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
                }
            ]
        return []

    def chunk_events(self, chunk: wire.GenerateChunk, e2e_latency_s: float) -> list[dict[str, Any]]:
        """Events for one site chunk (already added to the answer)."""
        if self.job.kind == "generate":  # SGLang's cumulative form
            final = chunk.finish_reason is not None
            return [
                {
                    "text": self.text,
                    "output_ids": self.output_ids,
                    "meta_info": self.meta_info(e2e_latency_s if final else None),
                }
            ]
        events = []
        if chunk.text:
            if self.job.kind == "chat":
                choice = {"index": 0, "delta": {"content": chunk.text}, "logprobs": None, "finish_reason": None}
                events.append({**self._head("chat.completion.chunk"), "choices": [choice]})
            else:
                choice = {"index": 0, "text": chunk.text, "logprobs": None, "finish_reason": None}
                events.append({**self._head("text_completion"), "choices": [choice]})
            if self.job.continuous_usage:
                events[-1]["usage"] = usage(self.job, self.completion_tokens)
        return events

    def closing_events(self) -> list[dict[str, Any]]:
        if self.job.kind == "generate":
            return []
        finish = openai_finish_reason(self.finish)
        if self.job.kind == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
            events = [{**self._head("chat.completion.chunk"), "choices": [choice]}]
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish}
            events = [{**self._head("text_completion"), "choices": [choice]}]
            kind = "text_completion"
        if self.job.include_usage:
            events.append({**self._head(kind), "choices": [], "usage": usage(self.job, self.completion_tokens)})
        return events
