"""The Responses API (`/v1/responses`), the API gpt-oss documents first, served by the chat
machinery: a request becomes a chat (its input items as messages, its function tools as
tools, `reasoning.effort`, `text.format`), and the chat's answer, read from Harmony, is said
as a Response: a reasoning item, then a message or function calls, streamed as the Responses
API's typed events.

Nothing is stored: each request carries its whole conversation (as with `store: false`), so
`previous_response_id` and `store: true` are refused, as is any field not listed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import orjson
from pydantic import Field, ValidationError

from core.errors import BadRequest
from federation.gateway.pieces import Job, OutputItem
from federation.gateway.request_models import Strict, invalid


class SaidAnswer(Protocol):
    """What a Response says of an answer (`answers.ResponsesAnswer` holds it as it is read)."""

    job: Job
    created: int
    completion_tokens: int
    cached_tokens: int
    items: list[OutputItem]


class _FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedTool(Strict):
    type: Literal["function"]
    name: str


class _Reasoning(Strict):
    effort: Literal["low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class _Format(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class _Text(Strict):
    format: _Format | None = None


class _Request(Strict):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[_FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | _NamedTool | None = None
    reasoning: _Reasoning | None = None
    text: _Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: Literal[False] | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None


def chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chat request a Responses request is, and what its Response echoes back."""
    try:
        req = _Request.model_validate(body)
    except ValidationError as exc:
        path, message = invalid(exc)
        unstored = path[:1] in (["store"], ["previous_response_id"])
        hint = " (responses are not stored: send the whole conversation, with store false)" if unstored else ""
        raise BadRequest(message + hint, param=str(path[0]) if path else None) from None
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + _messages(req.input)
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.tools:
        chat["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in req.tools
        ]
    if isinstance(req.tool_choice, _NamedTool):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    if req.reasoning and req.reasoning.summary:
        raise BadRequest(
            "`reasoning.summary` is not supported: gpt-oss's reasoning comes whole, as a reasoning item",
            param="reasoning",
        )
    if req.reasoning and req.reasoning.effort:
        chat["reasoning_effort"] = req.reasoning.effort
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or not fmt.name:
            raise BadRequest("`text.format` json_schema needs a `name` and a `schema`", param="text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_}}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("service_tier", req.service_tier),
    ):
        if value is not None:
            chat[name] = value
    echo = {
        "instructions": req.instructions,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": [t.model_dump(by_alias=True) for t in req.tools],
        "reasoning": req.reasoning.model_dump() if req.reasoning else None,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        "max_output_tokens": req.max_output_tokens,
        "store": False,
    }
    return chat, echo


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: a function call joins the assistant turn before it, a
    function's output is a tool message; earlier reasoning items are dropped (as gpt-oss's
    template drops earlier reasoning)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
                    raise BadRequest(f"`input[{i}].content`: every part needs a string `text`", param="input")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str) or item.get("role") not in ("system", "developer", "user", "assistant"):
                raise BadRequest(f"`input[{i}]` needs a role and a string or text parts as content", param="input")
            messages.append({"role": item["role"], "content": content})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise BadRequest(f"`input[{i}]`: a function_call needs call_id, name and arguments", param="input")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str) or not isinstance(item.get("output"), str):
                raise BadRequest(f"`input[{i}]`: a function_call_output needs call_id and output", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind != "reasoning":
            raise BadRequest(f"`input[{i}].type` {kind!r} is not supported by this endpoint", param="input")
    return messages


# The event that carries a piece of each kind, and its fields besides the item and the text.
_DELTA_EVENTS: dict[str, tuple[str, dict[str, Any]]] = {
    "reasoning": ("response.reasoning_text.delta", {"content_index": 0}),
    "content": ("response.output_text.delta", {"content_index": 0, "logprobs": []}),
    "arguments": ("response.function_call_arguments.delta", {}),
}


class ResponseEvents:
    """An answer said as a Response: the whole object, or the stream of events that builds it
    (each item added, its deltas, done; `sequence_number` counting every event)."""

    def __init__(self, answer: SaidAnswer) -> None:
        self._answer = answer
        self._sequence = 0
        self._open: int | None = None  # index of the output item being streamed

    def response(self, status: str) -> dict[str, Any]:
        answer, job = self._answer, self._answer.job
        output_tokens = answer.completion_tokens
        return {
            "id": "resp_" + job.request.request_id,
            "object": "response",
            "created_at": answer.created,
            "model": job.model,
            "status": status,
            "service_tier": job.request.tier.label,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": [_item(item, "completed") for item in answer.items] if status != "in_progress" else [],
            "usage": {
                "input_tokens": job.request.prompt_tokens,
                "input_tokens_details": {"cached_tokens": answer.cached_tokens},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": job.request.prompt_tokens + output_tokens,
            }
            if status != "in_progress"
            else None,
            **(job.echo or {}),
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        event = {"type": kind, "sequence_number": self._sequence - 1, **fields}
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"

    def opening(self) -> bytes:
        begun = self.response("in_progress")
        return self._event("response.created", response=begun) + self._event("response.in_progress", response=begun)

    def pieces(self, pieces: Sequence[tuple[str, str]], items: list[int]) -> bytes:
        """Events for the pieces the latest chunk added, each for the item it belongs to (the
        answer's items already hold them)."""
        out = []
        for (kind, text), index in zip(pieces, items, strict=True):
            if index != self._open:
                if self._open is not None:
                    out.append(self._close(self._open))
                self._open = index
                out.append(self._added(index))
            if kind in _DELTA_EVENTS:  # a call's start is its item being added
                name, fields = _DELTA_EVENTS[kind]
                item_id = _item_id(self._answer.items[index])
                out.append(self._event(name, item_id=item_id, output_index=index, **fields, delta=text))
        return b"".join(out)

    def _added(self, index: int) -> bytes:
        item = self._answer.items[index]
        out = self._event("response.output_item.added", output_index=index, item=_item(item, "in_progress", empty=True))
        if item.kind != "call":
            out += self._event(
                "response.content_part.added",
                item_id=_item_id(item),
                output_index=index,
                content_index=0,
                part=_part(item.kind, ""),
            )
        return out

    def _close(self, index: int) -> bytes:
        item = self._answer.items[index]
        if item.kind == "reasoning":
            out = self._event(
                "response.reasoning_text.done",
                item_id=_item_id(item),
                output_index=index,
                content_index=0,
                text=item.text,
            )
            out += self._event(
                "response.content_part.done",
                item_id=_item_id(item),
                output_index=index,
                content_index=0,
                part=_part("reasoning", item.text),
            )
        elif item.kind == "content":
            part = _part("content", item.text)
            out = self._event(
                "response.output_text.done",
                item_id=_item_id(item),
                output_index=index,
                content_index=0,
                text=item.text,
                logprobs=[],
            )
            out += self._event(
                "response.content_part.done", item_id=_item_id(item), output_index=index, content_index=0, part=part
            )
        else:
            out = self._event(
                "response.function_call_arguments.done", item_id=_item_id(item), output_index=index, arguments=item.text
            )
        return out + self._event("response.output_item.done", output_index=index, item=_item(item, "completed"))

    def closing(self, status: str) -> bytes:
        out = self._close(self._open) if self._open is not None else b""
        self._open = None
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + self._event(kind, response=self.response(status))


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _item_id(item: Any) -> str:
    """An output item's id; a function call's item has its own, beside the call's `call_id`."""
    return "fc_" + item.id.removeprefix("call_") if item.kind == "call" else item.id


def _item(item: Any, status: str, empty: bool = False) -> dict[str, Any]:
    text = "" if empty else item.text
    if item.kind == "reasoning":
        return {
            "id": item.id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "status": status,
        }
    if item.kind == "content":
        content: list[dict[str, Any]] = (
            [] if empty else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        )
        return {"id": item.id, "type": "message", "role": "assistant", "status": status, "content": content}
    return {
        "id": _item_id(item),
        "type": "function_call",
        "call_id": item.id,
        "name": item.name,
        "arguments": text,
        "status": status,
    }
