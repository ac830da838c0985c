"""Client requests checked and turned into one generation job for a site.

Everything a client can get wrong is caught here, before any site is asked, so a bad
request costs no worker anything. Chat messages are rendered in the Harmony format
here too: the site then runs a plain SGLang /generate, the one data path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import date
from typing import Any, Literal

from core import tokens, wire
from core.errors import BadRequest, ModelNotFound

JobKind = Literal["chat", "completion", "generate"]
# OpenAI request fields that become SGLang sampling parameters, and their SGLang names.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "seed": "sampling_seed",
    "min_tokens": "min_new_tokens",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
}
_NUMBER_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
_INT_FIELDS = {"top_k", "seed", "min_tokens"}
# OpenAI fields this endpoint does not honour yet (tools, structured output and logprobs are
# issue #18), with the values that ask for nothing. Any other value is refused, naming the
# field: a client that asked for a tool call or a JSON schema must not get plain text back as
# if it had not asked.
_NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "response_format": ({"type": "text"},),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
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


@dataclass(frozen=True, slots=True)
class Job:
    kind: JobKind
    request: wire.GenerateRequest
    max_tokens: int  # what the client asked for; 0 when it set no limit
    stream: bool
    include_usage: bool
    model: str
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every text chunk


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_token(v: Any) -> bool:
    return _is_int(v) and 0 <= v < tokens.VOCAB_SIZE


def _count(text: str, context_tokens: int, param: str) -> int:
    try:
        return tokens.count(text, limit=context_tokens)
    except tokens.PromptTooLong as exc:
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: {exc}.", param=param
        ) from None


def _check_model(body: dict[str, Any], served: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required: use " + repr(served), param="model")
    if model != served:
        raise ModelNotFound(f"The model {model!r} does not exist; this endpoint serves {served!r}.", param="model")
    return model


def _refuse_not_honoured(body: dict[str, Any]) -> None:
    for name, asks_nothing in _NOT_HONOURED.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(v) and value == v for v in asks_nothing):
            raise BadRequest(f"`{name}` is not supported by this endpoint yet; send the request without it", param=name)


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for name, sglang_name in _SAMPLING_FIELDS.items():
        value = body.get(name)
        if value is None:
            continue
        if name in _NUMBER_FIELDS and (
            isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
        ):
            raise BadRequest(f"`{name}` must be a number", param=name)
        if name in _INT_FIELDS and not _is_int(value):
            raise BadRequest(f"`{name}` must be an integer", param=name)
        if name == "ignore_eos" and not isinstance(value, bool):
            raise BadRequest("`ignore_eos` must be true or false", param=name)
        if name == "stop_token_ids" and not (isinstance(value, list) and all(_is_int(v) for v in value)):
            raise BadRequest("`stop_token_ids` must be a list of integers", param=name)
        params[sglang_name] = value
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
            raise BadRequest("`stop` must be a string or a list of up to 4 strings", param="stop")
        params["stop"] = stop
    if body.get("n", 1) != 1:
        raise BadRequest("Only n = 1 is supported.", param="n")
    temperature = params.get("temperature", 1.0)
    if not 0 <= temperature <= 2:
        raise BadRequest(f"`temperature` must be between 0 and 2, got {temperature}", param="temperature")
    top_p = params.get("top_p", 1.0)
    if not 0 < top_p <= 1:
        raise BadRequest(f"`top_p` must be in (0, 1], got {top_p}", param="top_p")
    return params


def _max_tokens(body: dict[str, Any], prompt_tokens: int, context_tokens: int, *fields: str) -> tuple[int, int]:
    """(what the client asked for or 0, the budget the site gets: the rest of the context)."""
    asked = next((body[f] for f in fields if body.get(f) is not None), None)
    room = context_tokens - prompt_tokens - 1
    if room < 1:
        raise BadRequest(
            f"The prompt is {prompt_tokens} tokens; the model's context is {context_tokens} tokens.",
            param="messages" if "max_completion_tokens" in fields else "prompt",
        )
    if asked is None:
        return 0, room
    name = next(f for f in fields if body.get(f) is not None)
    if not _is_int(asked) or asked < 1:
        raise BadRequest(f"`{name}` must be an integer >= 1, got {asked!r}", param=name)
    if asked > room:
        raise BadRequest(
            f"`{name}` is {asked}, but the prompt is {prompt_tokens} tokens and the model's context is "
            f"{context_tokens} tokens: at most {room} tokens can be generated.",
            param=name,
        )
    return asked, asked


def _every_event(body: dict[str, Any], sampling: dict[str, Any]) -> bool:
    """`stream_interval` (SGLang's sampling parameter; on chat and completions an extension of
    ours, as SGLang extends OpenAI's fields with its own): the client wants the worker's own
    chunks, each event of the worker as its own chunk, at once (1: every token). Without it the
    tokens of a short window travel together (see nodes/agent/relay.py)."""
    interval = body.get("stream_interval")
    if interval is None:
        return False
    if not _is_int(interval) or interval < 1:
        raise BadRequest(f"`stream_interval` must be an integer >= 1, got {interval!r}", param="stream_interval")
    sampling["stream_interval"] = interval
    return True


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """stream, include_usage, continuous_usage_stats (SGLang's and vLLM's option, for chat and
    completions alike: the tokens so far on every chunk, so a client that stops reading knows
    what it received)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be true or false", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object", param="stream_options")
    return stream, bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))


def chat_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    model = _check_model(body, served_model)
    _refuse_not_honoured(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("`messages` must be a non-empty list of messages", param="messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise BadRequest(
                f"messages[{i}] needs a role: system, developer, user, assistant or tool", param="messages"
            )
        content = m.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest(f"messages[{i}].content: every text part needs a string `text`", param="messages")
            content = "".join(texts)
        if content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts", param="messages")
        if m.get("tool_calls") or m.get("function_call") or m["role"] == "tool":
            raise BadRequest(
                f"messages[{i}]: tool calls and tool results are not supported by this endpoint yet", param="messages"
            )
        rendered.append({"role": m["role"], "content": content or ""})
    effort = body.get("reasoning_effort", "medium")
    if effort not in ("low", "medium", "high"):
        raise BadRequest("`reasoning_effort` must be low, medium or high", param="reasoning_effort")
    text = tokens.render_harmony(rendered, reasoning_effort=effort, today=date.today().isoformat())
    prompt_tokens = _count(text, context_tokens, "messages")
    sampling = _sampling(body)
    every_event = _every_event(body, sampling)
    asked, budget = _max_tokens(body, prompt_tokens, context_tokens, "max_completion_tokens", "max_tokens")
    stream, include_usage, continuous = _stream_flags(body)
    params = {**sampling, "max_new_tokens": budget}
    request = wire.GenerateRequest(request_id, prompt_tokens, params, text=text, every_event=every_event)
    return Job("chat", request, asked, stream, include_usage, model, continuous)


def completion_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    model = _check_model(body, served_model)
    _refuse_not_honoured(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        text, ids, prompt_tokens = prompt, (), _count(prompt, context_tokens, "prompt")
    elif isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
        text, ids, prompt_tokens = "", tuple(prompt), len(prompt)
    else:
        raise BadRequest("`prompt` must be one non-empty string or one list of token ids", param="prompt")
    sampling = _sampling(body)
    every_event = _every_event(body, sampling)
    fields = ("max_tokens",)
    asked, budget = _max_tokens({"max_tokens": 16, **body}, prompt_tokens, context_tokens, *fields)
    stream, include_usage, continuous = _stream_flags(body)
    params = {**sampling, "max_new_tokens": budget}
    request = wire.GenerateRequest(request_id, prompt_tokens, params, text, ids, every_event)
    return Job("completion", request, asked, stream, include_usage, model, continuous)


def generate_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    """SGLang's native /generate, passed through: the worker validates sampling_params itself."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str) and text:
        prompt_tokens, ids = _count(text, context_tokens, "text"), ()
    elif isinstance(input_ids, list) and input_ids and all(_is_token(t) for t in input_ids):
        prompt_tokens, ids, text = len(input_ids), tuple(input_ids), ""
    else:
        raise BadRequest(
            f"Either text (a string) or input_ids (a list of token ids in [0, {tokens.VOCAB_SIZE})) should be provided."
        )
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        raise BadRequest("`sampling_params` must be an object", param="sampling_params")
    if prompt_tokens >= context_tokens:
        raise BadRequest(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_tokens} tokens)."
        )
    max_new = sampling.get("max_new_tokens")
    if max_new is not None and not (_is_int(max_new) and 0 <= max_new < context_tokens):
        raise BadRequest(f"max_new_tokens must be an integer in [0, {context_tokens}), got {max_new!r}")
    stream = body.get("stream") is True
    # The worker validates the interval itself; whoever sets it wants the worker's own chunks.
    every_event = sampling.get("stream_interval") is not None
    request = wire.GenerateRequest(request_id, prompt_tokens, sampling, text, ids, every_event)
    return Job("generate", request, max_new if _is_int(max_new) and max_new > 0 else 0, stream, False, served_model)
