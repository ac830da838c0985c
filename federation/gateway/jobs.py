"""Client requests checked and turned into one generation job for a site.

Everything a client can get wrong is caught here, before any site is asked, so a bad
request costs no worker anything. Chats are rendered in the Harmony format here too
(federation/gateway/chat.py): the site then runs a plain SGLang /generate on their token
ids, the one data path.
"""

from __future__ import annotations

import dataclasses
from datetime import date
from typing import Any

from core import prefixes, tiers, tokens, wire
from core.errors import BadRequest, ModelNotFound
from federation.gateway import chat, request_models, responses_api
from federation.gateway.pieces import Job, JobKind


def _encode(text: str, context_tokens: int, param: str) -> list[int]:
    try:
        return tokens.encode(text, limit=context_tokens)
    except tokens.PromptTooLong as exc:
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: {exc}.", param=param
        ) from None


def _check_model(body: dict[str, Any], served: str) -> None:
    """The model first: a request for another model is a 404 whatever else it holds."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("`model` is required: use " + repr(served), param="model")
    if model != served:
        raise ModelNotFound(f"The model {model!r} does not exist; this endpoint serves {served!r}.", param="model")


def _budget(asked: int | None, name: str, prompt_tokens: int, context_tokens: int, prompt_param: str) -> int:
    """The budget the site gets: what the client asked for, else the rest of the context."""
    room = context_tokens - prompt_tokens - 1
    if room < 1:
        raise BadRequest(
            f"The prompt is {prompt_tokens} tokens; the model's context is {context_tokens} tokens.",
            param=prompt_param,
        )
    if asked is None:
        return room
    if asked > room:
        raise BadRequest(
            f"`{name}` is {asked}, but the prompt is {prompt_tokens} tokens and the model's context is "
            f"{context_tokens} tokens: at most {room} tokens can be generated.",
            param=name,
        )
    return asked


def _job(
    kind: JobKind,
    req: request_models.ChatRequest | request_models.CompletionRequest,
    request: wire.GenerateRequest,
    asked: int,
) -> Job:
    options = req.stream_options or request_models.StreamOptions()
    return Job(
        kind,
        request,
        asked,
        req.stream,
        options.include_usage,
        req.model,
        options.continuous_usage_stats,
        service_tier=req.service_tier,
    )


def chat_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    _check_model(body, served_model)
    req = request_models.parse(request_models.ChatRequest, body)
    request_models.refuse_not_honoured(req)
    if req.top_logprobs and not req.logprobs:
        raise BadRequest("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    rendered = chat.chat(
        req, today=date.today().isoformat(), max_chars=tokens.MAX_ENCODE_CHARS, context_tokens=context_tokens
    )
    prompt_tokens = len(rendered.prompt_ids)
    if prompt_tokens >= context_tokens:
        raise BadRequest(
            f"The input is longer than the model's context of {context_tokens} tokens: it has {prompt_tokens}.",
            param="messages",
        )
    asked, name = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else (req.max_tokens, "max_tokens")
    )
    budget = _budget(asked, name, prompt_tokens, context_tokens, "messages")
    params = {**req.sampling(), **rendered.constraints, "max_new_tokens": budget}
    request = wire.GenerateRequest(
        request_id,
        prompt_tokens,
        params,
        input_ids=tuple(rendered.prompt_ids),
        every_event=req.stream_interval is not None,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        prefix_hashes=prefixes.prefix_hashes(rendered.prompt_ids),
    )
    return _job("chat", req, request, asked or 0)


def responses_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    """/v1/responses: the chat it is (federation/gateway/responses_api.py)."""
    converted, echo = responses_api.chat_body(body)
    job = chat_job(converted, request_id=request_id, served_model=served_model, context_tokens=context_tokens)
    return dataclasses.replace(job, kind="responses", echo=echo)


# Chat's fields, which a completion (a raw prompt, no Harmony) has no meaning for.
_CHAT_ONLY = ("messages", "tools", "tool_choice", "response_format", "top_logprobs", "reasoning_effort")


def completion_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    _check_model(body, served_model)
    for name in _CHAT_ONLY:
        if body.get(name) not in (None, []):
            raise BadRequest(f"`{name}` is a chat field; /v1/completions takes a raw `prompt`", param=name)
    req = request_models.parse(request_models.CompletionRequest, {k: v for k, v in body.items() if k not in _CHAT_ONLY})
    request_models.refuse_not_honoured(req)
    prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 else req.prompt
    ids: tuple[int, ...] = ()
    if isinstance(prompt, str) and prompt:
        text, encoded = prompt, _encode(prompt, context_tokens, "prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = tuple(t for t in prompt if isinstance(t, int))
        text, encoded = "", list(ids)
    else:
        raise BadRequest("`prompt` must be one non-empty string or one list of token ids", param="prompt")
    prompt_tokens = len(encoded)
    asked = 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default for completions
    params = {**req.sampling(), "max_new_tokens": _budget(asked, "max_tokens", prompt_tokens, context_tokens, "prompt")}
    top = req.logprobs
    request = wire.GenerateRequest(
        request_id,
        prompt_tokens,
        params,
        text,
        ids,
        req.stream_interval is not None,
        top is not None,
        top or 0,
        prefix_hashes=prefixes.prefix_hashes(encoded),
    )
    return _job("completion", req, request, asked)


def generate_job(body: dict[str, Any], *, request_id: str, served_model: str, context_tokens: int) -> Job:
    """SGLang's native /generate: its shape checked here, its sampling ranges by the worker
    (with SGLang's own messages). A `rid` is the request's id, as X-Request-Id is."""
    req = request_models.parse(request_models.GenerateRequest, body)
    ids: tuple[int, ...] = ()
    if req.text:
        encoded, text = _encode(req.text, context_tokens, "text"), req.text
    elif req.input_ids:
        encoded, ids, text = req.input_ids, tuple(req.input_ids), ""
    else:
        raise BadRequest(
            f"Either text (a string) or input_ids (a list of token ids in [0, {tokens.VOCAB_SIZE})) should be provided."
        )
    prompt_tokens = len(encoded)
    if prompt_tokens >= context_tokens:
        raise BadRequest(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_tokens} tokens)."
        )
    sampling = req.sampling_params.model_dump(exclude_none=True) if req.sampling_params else {}
    max_new = sampling.get("max_new_tokens")
    if max_new is not None and not 0 <= max_new < context_tokens:
        raise BadRequest(
            f"max_new_tokens must be an integer in [0, {context_tokens}), got {max_new!r}", param="sampling_params"
        )
    # The worker validates the interval itself; whoever sets it wants the worker's own chunks.
    every_event = sampling.get("stream_interval") is not None
    top = req.top_logprobs_num if req.return_logprob else None
    request = wire.GenerateRequest(
        req.rid or request_id,
        prompt_tokens,
        sampling,
        text,
        ids,
        every_event,
        top is not None,
        top or 0,
        prefix_hashes=prefixes.prefix_hashes(encoded),
    )
    tier = None if req.priority is None else tiers.from_sglang_priority(req.priority).label
    return Job("generate", request, max_new or 0, req.stream, False, served_model, service_tier=tier)
