"""A chat request's conversation, tools and output format: validated against typed models of
OpenAI's shapes (a 400 naming the field for anything invalid), rendered in Harmony with
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
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError

from core import harmony
from core.errors import BadRequest

_FUNCTION_NAME = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
CALL_TRIGGER = "<|channel|>commentary to="


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Function(_Strict):
    name: _FUNCTION_NAME
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class _Tool(_Strict):
    type: Literal["function"]
    function: _Function


class _Named(_Strict):
    name: str


class _NamedChoice(_Strict):
    type: Literal["function"]
    function: _Named


class _SchemaSpec(_Strict):
    name: _FUNCTION_NAME
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class _ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _SchemaSpec | None = None


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _CallFunction(_Strict):
    name: _FUNCTION_NAME
    arguments: str


class _Call(_Strict):
    id: str
    type: Literal["function"]
    function: _CallFunction


class _Message(_Strict):
    """`name` and an earlier answer's `reasoning_content` are accepted and not rendered, as
    gpt-oss's own chat template drops them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[_Call] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None
    # What the client's own copy of an earlier answer may carry (openai's model_dump()):
    # annotations are not rendered; audio and a legacy function_call must be empty.
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


_TOOLS = TypeAdapter(list[_Tool])
_TOOL_CHOICE = TypeAdapter(Literal["none", "auto", "required"] | _NamedChoice)
_RESPONSE_FORMAT = TypeAdapter(_ResponseFormat)
_MESSAGES = TypeAdapter(list[_Message])


_UNION_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}


def invalid(exc: ValidationError, within: tuple[str, ...] = ()) -> tuple[list[int | str], str]:
    """A pydantic error's first failure: the field's path as a client wrote it (without
    pydantic's union-branch names), and "`a.b[0]`: why"."""
    error = exc.errors()[0]
    path = [
        *within,
        *(p for p in error["loc"] if isinstance(p, int) or (str(p).isidentifier() and p not in _UNION_BRANCHES)),
    ]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    return path, f"`{where}`: {error['msg']}"


def _checked(adapter: TypeAdapter, value: Any, field: str) -> Any:
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise BadRequest(invalid(exc, (field,))[1], param=field) from None


@dataclass(frozen=True, slots=True)
class Chat:
    """A chat request as the site is asked: the prompt's ids and the grammar parameters."""

    prompt_ids: list[int]
    constraints: dict[str, str]  # SGLang sampling params: structural_tag or json_schema


def chat(body: dict[str, Any], *, today: str, max_chars: int, context_tokens: int) -> Chat:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of messages", param="messages")
    checked: list[_Message] = _checked(_MESSAGES, messages, "messages")
    turns = _turns(checked)
    tools: list[_Tool] = _checked(_TOOLS, body.get("tools") or [], "tools")
    rendered_chars = sum(len(t.content) + sum(len(a) for _, a in t.calls) for t in turns) + sum(
        len(t.function.description) + len(json.dumps(t.function.parameters)) for t in tools
    )
    if rendered_chars > max_chars:  # rendering is synchronous: a huge chat must not stall every stream
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: the chat holds more than "
            f"{max_chars} characters.",
            param="messages",
        )
    choice = _checked(_TOOL_CHOICE, body.get("tool_choice") or ("auto" if tools else "none"), "tool_choice")
    names = [t.function.name for t in tools]
    if not tools and (choice == "required" or isinstance(choice, _NamedChoice)):
        raise BadRequest("`tool_choice` asks for a tool call but there are no `tools`", param="tool_choice")
    if isinstance(choice, _NamedChoice) and choice.function.name not in names:
        raise BadRequest(
            f"`tool_choice` names {choice.function.name!r}, which is not among `tools`", param="tool_choice"
        )
    effort = body.get("reasoning_effort", "medium")
    if effort not in harmony.EFFORTS:
        raise BadRequest("`reasoning_effort` must be low, medium or high", param="reasoning_effort")
    offered = [] if choice == "none" else tools
    constraints: dict[str, str] = {}
    callable_ = [t for t in offered if not isinstance(choice, _NamedChoice) or t.function.name == choice.function.name]
    if callable_:
        constraints["structural_tag"] = json.dumps(_structural_tag(callable_))
    schema = _response_schema(body.get("response_format"))
    if schema is not None:
        if constraints:
            raise BadRequest(
                "`response_format` with a JSON schema cannot be combined with callable `tools` (one grammar per "
                "request); set tool_choice to none or drop response_format",
                param="response_format",
            )
        constraints["json_schema"] = json.dumps(schema)
    ids = harmony.render_chat(
        turns,
        [harmony.Tool(t.function.name, t.function.description, t.function.parameters) for t in offered],
        reasoning_effort=effort,
        today=today,
    )
    return Chat(ids, constraints)


def _turns(messages: list[_Message]) -> list[harmony.Turn]:
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


def _structural_tag(tools: list[_Tool]) -> dict[str, Any]:
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


def _response_schema(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    spec: _ResponseFormat = _checked(_RESPONSE_FORMAT, value, "response_format")
    if spec.type == "text":
        return None
    if spec.type == "json_object":
        return {"type": "object"}
    if spec.json_schema is None:
        raise BadRequest("`response_format.json_schema` is required with type json_schema", param="response_format")
    return spec.json_schema.schema_
