"""Typed models of the request shapes the gateway takes: OpenAI's chat and completions (as
SGLang's own `openai/protocol.py` extends them) and SGLang's native `/generate` (its
`GenerateReqInput` and `SamplingParams`).

Strict (a string is not a number, a number is not a bool) and, for OpenAI's shapes, closed:
a field not listed is refused by name rather than ignored. `/generate` ignores keys it does not
know, as SGLang does (the sglang-router adds its own), but refuses any SGLang field asking for
something the federation does not do. `parse` turns the first failure into a 400 in OpenAI's
shape naming the field (`tools[0].function.name: …`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from core import tokens, wire
from core.errors import BadRequest

FUNCTION_NAME = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5)

_Number = Annotated[float, Field(allow_inf_nan=False)]
_Int = Annotated[int, Field(ge=-(2**63), lt=2**63)]
_Positive = Annotated[int, Field(ge=1, lt=2**63)]
_TokenId = Annotated[int, Field(ge=0, lt=tokens.VOCAB_SIZE)]
_Stop = str | Annotated[list[str], Field(max_length=4)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# -- chat's parts ------------------------------------------------------------------------------


class Function(Strict):
    name: FUNCTION_NAME
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: Function


class _Named(Strict):
    name: str


class NamedChoice(Strict):
    type: Literal["function"]
    function: _Named


class _SchemaSpec(Strict):
    name: FUNCTION_NAME
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _SchemaSpec | None = None


class _TextPart(Strict):
    type: Literal["text"]
    text: str


class _CallFunction(Strict):
    name: FUNCTION_NAME
    arguments: str


class Call(Strict):
    id: str
    type: Literal["function"]
    function: _CallFunction


class Message(Strict):
    """`name` and an earlier answer's `reasoning_content` are accepted and not rendered, as
    gpt-oss's own chat template drops them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[Call] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: None = None
    # What the client's own copy of an earlier answer may carry (openai's model_dump()):
    # annotations are not rendered; audio and a legacy function_call must be empty.
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None


class StreamOptions(Strict):
    include_usage: bool = False
    # SGLang's and vLLM's option: the tokens so far on every chunk, so a client that stops
    # reading knows what it received.
    continuous_usage_stats: bool = False


# -- chat and completions ----------------------------------------------------------------------


class _OpenAIRequest(Strict):
    """The fields chat and completions share: each honoured, refused when its value asks for
    something not done (`not_honoured`), or informational (user, metadata, prompt_cache_key,
    safety_identifier: nothing in the answer depends on them). `service_tier` orders the
    request's waits (core/tiers.py), within its key's ceiling."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: _Positive | None = None
    temperature: Annotated[_Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[_Number, Field(gt=0, le=1)] | None = None
    top_k: _Int | None = None
    min_p: _Number | None = None
    presence_penalty: _Number | None = None
    frequency_penalty: _Number | None = None
    repetition_penalty: _Number | None = None
    seed: _Int | None = None
    min_tokens: _Int | None = None
    stop: _Stop | None = None
    stop_token_ids: list[_Int] | None = None
    ignore_eos: bool | None = None
    n: Literal[1] | None = None
    # SGLang's sampling parameter, an extension here (as SGLang extends OpenAI's fields): the
    # client wants each of the worker's events as its own chunk, at once (1: every token).
    stream_interval: _Positive | None = None
    logit_bias: dict[str, _Number] | None = None
    store: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def sampling(self) -> dict[str, Any]:
        """The SGLang sampling parameters these fields are."""
        fields = self.model_dump(include=set(_SGLANG_NAMES), exclude_none=True)
        params = {_SGLANG_NAMES[name]: value for name, value in fields.items()}
        if isinstance(self.stop, str):
            params["stop"] = [self.stop]
        return params


# OpenAI request fields that are SGLang sampling parameters, and their SGLang names.
_SGLANG_NAMES = {
    **{
        name: name
        for name in (
            "temperature top_p top_k min_p presence_penalty frequency_penalty repetition_penalty stop "
            "stop_token_ids ignore_eos stream_interval"
        ).split()
    },
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
}


class ChatRequest(_OpenAIRequest):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: _Positive | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # OpenAI's fields this endpoint does not do (`functions` and `function_call` are the
    # deprecated forms of `tools` and `tool_choice`): only their empty values are taken.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] | list[_TokenId] | list[list[_TokenId]]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: _Positive | None = None


# Each field's values that ask for nothing; any other value is refused, naming the field: a
# client that asked for something must not get an answer back as if it had not asked.
_NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none", "auto"),
    "logit_bias": ({},),
    "echo": (False,),
    "suffix": ("",),
    "best_of": (1,),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "store": (False,),
}


# -- SGLang's /generate ------------------------------------------------------------------------


class SamplingParams(Strict):
    """SGLang's SamplingParams, the fields and types its API takes; the ranges are checked by
    the worker, with SGLang's own messages, as before."""

    max_new_tokens: _Int | None = None
    min_new_tokens: _Int | None = None
    stop: _Stop | None = None
    stop_token_ids: list[_Int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: _Number | None = None
    top_p: _Number | None = None
    top_k: _Int | None = None
    min_p: _Number | None = None
    frequency_penalty: _Number | None = None
    presence_penalty: _Number | None = None
    repetition_penalty: _Number | None = None
    n: Literal[1] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: _Int | None = None
    sampling_seed: _Int | None = None
    logit_bias: dict[str, _Number] | None = None
    custom_params: dict[str, Any] | None = None


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput for one prompt (a batch is sent as separate requests)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    text: str | None = None
    input_ids: list[_TokenId] | None = None
    sampling_params: SamplingParams | None = None
    stream: bool = False
    rid: Annotated[str, StringConstraints(pattern=wire.REQUEST_ID.pattern)] | None = None  # as X-Request-Id
    return_logprob: bool | None = None
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    logprob_start_len: Literal[-1] | None = None
    return_text_in_logprobs: Literal[False] | None = None
    # SGLang's fields for what the federation does not serve (images, LoRA, sessions, …):
    # only their empty values are taken.
    input_embeds: None = None
    image_data: None = None
    video_data: None = None
    audio_data: None = None
    lora_path: None = None
    lora_id: None = None
    session_params: None = None
    custom_logit_processor: None = None
    token_ids_logprob: None = None
    return_hidden_states: Literal[False] | None = None
    return_routed_experts: Literal[False] | None = None  # bench_serving sends false
    log_metrics: bool | None = None  # the sglang-router sets it; nothing depends on it
    priority: int | None = None  # SGLang's request priority: it names the service tier (core/tiers.py)


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], body: dict[str, Any]) -> M:
    """`body` as `model`, or a 400 naming the first field that is not."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        path, message = invalid(exc)
        raise BadRequest(message, param=str(path[0]) if path else None) from None


def refuse_not_honoured(request: BaseModel) -> None:
    for name, asks_nothing in _NOT_HONOURED.items():
        value = getattr(request, name, None)
        if value is not None and not any(type(value) is type(v) and value == v for v in asks_nothing):
            raise BadRequest(f"`{name}` is not supported by this endpoint yet; send the request without it", param=name)


_UNION_BRANCHES = {"str", "int", "float", "bool", "dict", "list", "none"}


def invalid(exc: ValidationError, within: tuple[str, ...] = ()) -> tuple[list[int | str], str]:
    """A pydantic failure as a client can act on it: the field's path as the client wrote it
    (without pydantic's union-branch names), and "`a.b[0]`: why". Of a union's failures, the
    one that got furthest into the value and says what is wrong with it rather than its type."""
    error = max(exc.errors(), key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    path = [
        *within,
        *(p for p in error["loc"] if isinstance(p, int) or (str(p).isidentifier() and p not in _UNION_BRANCHES)),
    ]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")
    if error["type"] == "extra_forbidden":
        return path, f"`{where}` is not a field this endpoint takes"
    return path, f"`{where}`: {error['msg']}"
