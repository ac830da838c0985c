"""Client requests checked and turned into one generation job for a site.

Everything a client can get wrong is caught here, before any site is asked, so a bad
request costs no worker anything. Chats are rendered in the Harmony format here too
(federation/gateway/chat.py): the site then runs a plain SGLang /generate on their token
ids, the one data path.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import date
from typing import Any, Literal

from core import tokens, wire
from core.errors import BadRequest, ModelNotFound
from federation.gateway import chat, responses_api

JobKind = Literal["chat", "completion", "generate", "responses"]
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
# OpenAI fields this endpoint does not honour, with the values that ask for
# nothing. Any other value is refused, naming the field: a client that asked for something
# must not get an answer back as if it had not asked. (`functions` and `function_call` are
# OpenAI's deprecated forms of `tools` and `tool_choice`.)
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


# Every field a chat or a completion may carry: each is honoured, refused when its value asks
# for something not done (_NOT_HONOURED, _CHAT_ONLY), or informational (user, metadata,
# service_tier, prompt_cache_key, safety_identifier: nothing in the answer depends on them).
# Any other field is refused, naming it, rather than ignored.
_COMMON_FIELDS = frozenset(
    "model stream stream_options max_tokens temperature top_p top_k min_p presence_penalty frequency_penalty "
    "repetition_penalty seed min_tokens stop stop_token_ids ignore_eos n stream_interval logprobs logit_bias "
    "user metadata service_tier store prompt_cache_key safety_identifier".split()
)
_CHAT_FIELDS = _COMMON_FIELDS | frozenset(
    "messages max_completion_tokens tools tool_choice parallel_tool_calls response_format reasoning_effort "
    "top_logprobs functions function_call audio modalities prediction web_search_options".split()
)
_COMPLETION_FIELDS = _COMMON_FIELDS | frozenset("prompt echo suffix best_of".split())


def _refuse_unknown(body: dict[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise BadRequest(f"`{name}` is not a field this endpoint takes", param=name)
    for name, kind, what in (
        ("user", str, "a string"),
        ("metadata", dict, "an object"),
        ("parallel_tool_calls", bool, "true or false"),
    ):
        if body.get(name) is not None and not isinstance(body[name], kind):
            raise BadRequest(f"`{name}` must be {what}", param=name)


@dataclass(frozen=True, slots=True)
class Job:
    kind: JobKind
    request: wire.GenerateRequest
    max_tokens: int  # what the client asked for; 0 when it set no limit
    stream: bool
    include_usage: bool
    model: str
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage on every text chunk
    echo: dict[str, Any] | None = None  # /v1/responses: the request's fields its Response says back


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


MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (completions: 5)


def _chat_logprobs(body: dict[str, Any]) -> tuple[bool, int]:
    """Chat: `logprobs` (true: each answer token's) and `top_logprobs` (that many alternatives)."""
    asked, top = body.get("logprobs"), body.get("top_logprobs")
    if asked is not None and not isinstance(asked, bool):
        raise BadRequest("`logprobs` must be true or false", param="logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs")
        if not asked and top:
            raise BadRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    return bool(asked), top or 0


def _completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions: `logprobs` N (0..5): each token's, with the N most likely; None: not asked."""
    asked = body.get("logprobs")
    if asked is None:
        return None
    if not _is_int(asked) or not 0 <= asked <= 5:
        raise BadRequest("`logprobs` must be an integer in [0, 5]", param="logprobs")
    return asked


def _generate_logprobs(body: dict[str, Any]) -> int | None:
    """/generate: SGLang's `return_logprob` and `top_logprobs_num`."""
    asked, top = body.get("return_logprob"), body.get("top_logprobs_num", 0)
    if asked is not None and not isinstance(asked, bool):
        raise BadRequest("`return_logprob` must be true or false", param="return_logprob")
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"`top_logprobs_num` must be an integer in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
    return top if asked else None


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
    _refuse_unknown(body, _CHAT_FIELDS)
    _refuse_not_honoured(body)
    rendered = chat.chat(
        body, today=date.today().isoformat(), max_chars=tokens.MAX_ENCODE_CHARS, context_tokens=context_tokens
    )
    prompt_tokens = len(rendered.prompt_ids)
    if prompt_tokens >= context_tokens:
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: it has {prompt_tokens}.",
            param="messages",
        )
    sampling = _sampling(body)
    every_event = _every_event(body, sampling)
    asked, budget = _max_tokens(body, prompt_tokens, context_tokens, "max_completion_tokens", "max_tokens")
    stream, include_usage, continuous = _stream_flags(body)
    params = {**sampling, **rendered.constraints, "max_new_tokens": budget}
    logprobs, top = _chat_logprobs(body)
    request = wire.GenerateRequest(
        request_id,
        prompt_tokens,
        params,
        input_ids=tuple(rendered.prompt_ids),
        every_event=every_event,
        logprobs=logprobs,
        top_logprobs=top,
    )
    return Job("chat", request, asked, stream, include_usage, model, continuous)


def responses_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    """/v1/responses: the chat it is (federation/gateway/responses_api.py)."""
    converted, echo = responses_api.chat_body(body)
    job = chat_job(converted, request_id=request_id, served_model=served_model, context_tokens=context_tokens)
    return dataclasses.replace(job, kind="responses", echo=echo)


# Chat's fields, which a completion (a raw prompt, no Harmony) has no meaning for.
_CHAT_ONLY = ("messages", "tools", "tool_choice", "response_format", "top_logprobs", "reasoning_effort")


def completion_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    model = _check_model(body, served_model)
    for name in _CHAT_ONLY:
        if body.get(name) not in (None, []):
            raise BadRequest(f"`{name}` is a chat field; /v1/completions takes a raw `prompt`", param=name)
    _refuse_unknown(body, _COMPLETION_FIELDS | frozenset(_CHAT_ONLY))
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
    top = _completion_logprobs(body)
    request = wire.GenerateRequest(request_id, prompt_tokens, params, text, ids, every_event, top is not None, top or 0)
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
    top = _generate_logprobs(body)
    request = wire.GenerateRequest(
        request_id, prompt_tokens, sampling, text, ids, every_event, top is not None, top or 0
    )
    return Job("generate", request, max_new if _is_int(max_new) and max_new > 0 else 0, stream, False, served_model)
