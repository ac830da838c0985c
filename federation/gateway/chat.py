"""A chat request's conversation, tools and output format: already validated against typed
models of OpenAI's shapes (federation/gateway/request_models.py), checked as a whole, rendered in Harmony with
OpenAI's library, and turned into the constraints SGLang decodes under.

How SGLang serves gpt-oss, and so how the sites are asked:
- tools are declared in the developer message; when the client lets the model call them
  (`tool_choice` auto, required or a named function), the call's arguments are constrained by
  SGLang's `structural_tag` (each function's begin string and JSON schema, triggered by the
  model opening a call); `none` leaves the tools out of the prompt;
- `response_format` json_schema / json_object constrains the final answer by `json_schema`
  (SGLang allows one grammar per request, so it cannot be combined with callable tools);
- `reasoning_effort` sets the system message's "Reasoning:" line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from core import harmony, tokens
from core.errors import BadRequest
from federation.gateway.request_models import ChatRequest, Message, NamedChoice, ResponseFormat, Tool

CALL_TRIGGER = "<|channel|>commentary to="
MAX_SCHEMA_CHARS = 65_536  # of all tools' parameter schemas, as JSON (their descriptions are not bounded)
MAX_SCHEMA_RUN = 256  # characters without whitespace, anywhere in a schema
MAX_SCHEMA_DEPTH = 64  # levels of nesting in a tool's or an answer's schema
_RUN = re.compile(r"\S+")


@dataclass(frozen=True, slots=True)
class Chat:
    """A chat request as the site is asked: the prompt's ids and the grammar parameters."""

    prompt_ids: list[int]
    constraints: dict[str, str]  # SGLang sampling params: structural_tag or json_schema


def chat(req: ChatRequest, *, today: str, max_chars: int, context_tokens: int) -> Chat:
    turns = _turns(req.messages)
    tools = req.tools or []
    _check_schemas(tools)
    rendered_chars = sum(len(t.content) + sum(len(a) for _, a in t.calls) for t in turns) + sum(
        len(t.function.description) + len(json.dumps(t.function.parameters)) for t in tools
    )
    if rendered_chars > max_chars:  # rendering is synchronous: a huge chat must not stall every stream
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: the chat holds more than "
            f"{max_chars} characters.",
            param="messages",
        )
    choice = req.tool_choice or ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    if not tools and (choice == "required" or isinstance(choice, NamedChoice)):
        raise BadRequest("`tool_choice` asks for a tool call but there are no `tools`", param="tool_choice")
    if isinstance(choice, NamedChoice) and choice.function.name not in names:
        raise BadRequest(
            f"`tool_choice` names {choice.function.name!r}, which is not among `tools`", param="tool_choice"
        )
    offered = [] if choice == "none" else tools
    constraints: dict[str, str] = {}
    callable_ = [t for t in offered if not isinstance(choice, NamedChoice) or t.function.name == choice.function.name]
    if callable_:
        constraints["structural_tag"] = json.dumps(_structural_tag(callable_))
    schema = _response_schema(req.response_format)
    if schema is not None:
        if constraints:
            raise BadRequest(
                "`response_format` with a JSON schema cannot be combined with callable `tools` (one grammar per "
                "request); set tool_choice to none or drop response_format",
                param="response_format",
            )
        constraints["json_schema"] = json.dumps(schema)
    try:
        ids = harmony.render_chat(
            turns,
            [harmony.Tool(t.function.name, t.function.description, t.function.parameters) for t in offered],
            reasoning_effort=req.reasoning_effort or "medium",
            today=today,
        )
    except tokens.PromptTooLong as exc:
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: {exc}.", param="messages"
        ) from None
    return Chat(ids, constraints)


def _check_schemas(tools: list[Tool]) -> None:
    """Tools' parameter schemas are rendered by openai-harmony's own tokenizer, whose time grows
    with the square of a run without spaces (core/harmony.py says why the rest of a chat is not):
    bounded, the worst schemas render in a fraction of a second (docs/SECURITY.md, "The edge"),
    and real ones (words, short names) far faster."""
    strings = [s for t in tools for s in _strings(t.function.parameters, "tools")]  # nesting checked first
    text = "".join(json.dumps(t.function.parameters, ensure_ascii=False) for t in tools)
    if len(text) > MAX_SCHEMA_CHARS:
        raise BadRequest(
            f"The tools' parameter schemas hold {len(text)} characters of JSON; at most {MAX_SCHEMA_CHARS}.",
            param="tools",
        )
    longest = max((len(m[0]) for s in strings for m in _RUN.finditer(s)), default=0)
    if longest > MAX_SCHEMA_RUN:
        raise BadRequest(
            f"A tool's parameter schema holds a run of {longest} characters without whitespace; at most "
            f"{MAX_SCHEMA_RUN}.",
            param="tools",
        )


def _strings(schema: Any, param: str) -> Iterator[str]:
    """Every key and string value in JSON `schema`, walked without recursion. A schema is written
    on to the sites by Python's `json.dumps`, which fails past ~1,000 levels (the body's parser
    reads 1,024): one nested deeper than any real schema is a 400 naming `param`, not an internal
    error."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            yield value
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > MAX_SCHEMA_DEPTH:
            raise BadRequest(f"A schema nests deeper than {MAX_SCHEMA_DEPTH} levels.", param=param)
        if isinstance(value, dict):
            yield from value.keys()
        stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))


def _turns(messages: list[Message]) -> list[harmony.Turn]:
    """Messages as Harmony turns; a tool result is rendered with its function's name, found
    from the call it answers."""
    called: dict[str, str] = {}
    turns = []
    for i, m in enumerate(messages):
        content = "".join(p.text for p in m.content) if isinstance(m.content, list) else (m.content or "")
        calls = tuple((c.function.name, c.function.arguments) for c in m.tool_calls or ())
        if m.tool_calls is not None and m.role != "assistant":
            raise BadRequest(f"`messages[{i}].tool_calls`: only an assistant message calls tools", param="messages")
        if m.content is None and not calls:
            raise BadRequest(f"`messages[{i}].content` is required", param="messages")
        for call in m.tool_calls or ():
            called[call.id] = call.function.name
        function = ""
        if m.role == "tool":
            function = called.get(m.tool_call_id or "", "") or (m.name or "")
            if not function:
                raise BadRequest(
                    f"`messages[{i}].tool_call_id` must name a tool call made earlier in the conversation",
                    param="messages",
                )
        turns.append(harmony.Turn(m.role, content, calls, function))
    return turns


def _structural_tag(tools: list[Tool]) -> dict[str, Any]:
    """SGLang's structural tag for gpt-oss function calls: each call's header, its arguments
    under the function's schema, and the token that ends a call."""
    structures = [
        {
            "begin": f"{CALL_TRIGGER}functions.{t.function.name} <|constrain|>json<|message|>",
            "schema": t.function.parameters,
            "end": "<|call|>",
        }
        for t in tools
    ]
    return {"type": "structural_tag", "structures": structures, "triggers": [CALL_TRIGGER]}


def _response_schema(spec: ResponseFormat | None) -> dict[str, Any] | None:
    if spec is None or spec.type == "text":
        return None
    if spec.type == "json_object":
        return {"type": "object"}
    if spec.json_schema is None:
        raise BadRequest("`response_format.json_schema` is required with type json_schema", param="response_format")
    for _ in _strings(spec.json_schema.schema_, "response_format"):  # walked for its nesting alone
        pass
    return spec.json_schema.schema_
