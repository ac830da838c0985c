"""SGLang's OpenAI-compatible routes: /v1/chat/completions and /v1/completions.

Bodies, chunk framing and error messages follow SGLang 0.5.23's serving_chat and
serving_completions; chat prompts are rendered in the Harmony format before they are
counted, as the gpt-oss chat template would render them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import date
from typing import Any, get_args

from aiohttp import web

from core import harmony
from nodes.emulator.native_api import cache_key_field, encode_prompt
from nodes.emulator.output import GenerateSpec
from nodes.emulator.params import (
    BodyError,
    ContractError,
    RequestError,
    request_priority,
)
from nodes.emulator.streaming import EventStream
from nodes.emulator.web_common import (
    SSE_DONE,
    WORKER_KEY,
    json_response,
    openai_error,
    read_json_object,
    sse,
    start_sse,
)
from nodes.emulator.worker import DuplicateRequestId, EmulatedWorker, Generation

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and SGLang's) /v1/completions default
_PYDANTIC_TYPES = {
    int: ("int_type", "a valid integer"),
    float: ("float_type", "a valid number"),
    bool: ("bool_type", "a valid boolean"),
    str: ("string_type", "a valid string"),
    list: ("list_type", "a valid list"),
    dict: ("dict_type", "a valid dictionary"),
}
# Request fields that map onto sampling parameters, with their JSON types.
_SAMPLING_FIELDS: dict[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "frequency_penalty": float,
    "presence_penalty": float,
    "repetition_penalty": float,
    "stop_token_ids": list,
    "ignore_eos": bool,
    "no_stop_trim": bool,
    "n": int,
    "seed": int,
    "min_tokens": int,
    "max_tokens": int,
    "max_completion_tokens": int,
}


def _type_error(field: str, expected: type, value: Any) -> BodyError:
    kind, text = _PYDANTIC_TYPES[expected]
    return BodyError(
        f"[{{'type': '{kind}', 'loc': ('body', '{field}'), 'msg': 'Input should be {text}', 'input': {value!r}}}]"
    )


def _check_type(body: dict[str, Any], field: str, expected: type) -> Any:
    value = body.get(field)
    if value is None:
        return None
    ok = isinstance(value, expected) and not (expected is not bool and isinstance(value, bool))
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise _type_error(field, expected, value)
    return value


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    for field, expected in _SAMPLING_FIELDS.items():
        _check_type(body, field, expected)
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise _type_error("stop", str, stop)
    sp = {k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None}
    if "seed" in sp:
        sp["sampling_seed"] = sp.pop("seed")
    if "min_tokens" in sp:
        sp["min_new_tokens"] = sp.pop("min_tokens")
    max_new = sp.pop("max_completion_tokens", None) or sp.pop("max_tokens", None)
    sp.pop("max_tokens", None)
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    if stop is not None:
        sp["stop"] = stop
    return sp


def _spec(worker: EmulatedWorker, body: dict[str, Any], prompt_ids: list[int], default_max: int | None) -> GenerateSpec:
    rid = body.get("rid")
    return worker.spec_for(
        _sampling(body),
        len(prompt_ids),
        rid=rid if isinstance(rid, str) else None,
        streaming=body.get("stream") is True,
        default_max_new_tokens=default_max,
        cache_ids=prompt_ids,
        extra_key=cache_key_field(body, "extra_key"),
        cache_salt=cache_key_field(body, "cache_salt"),
        priority=request_priority(body),
    )


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _chat_prompt_ids(body: dict[str, Any]) -> list[int]:
    messages = body.get("messages")
    if messages is None:
        raise BodyError(
            f"[{{'type': 'missing', 'loc': ('body', 'messages'), 'msg': 'Field required', 'input': {body!r}}}]"
        )
    if not isinstance(messages, list):
        raise _type_error("messages", list, messages)
    if not messages:
        raise RequestError("Messages cannot be empty.")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BodyError(
                f"[{{'type': 'union_tag_invalid', 'loc': ('body', 'messages', {i}), 'msg': 'Input tag not found: every message needs a string role', 'input': {m!r}}}]"
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise _type_error(f"messages.{i}.content", str, content)
        role: harmony.Role = m["role"] if m["role"] in get_args(harmony.Role) else "user"
        rendered.append(harmony.Turn(role, _message_text(content), function=m.get("name") or "tool"))
    effort = body.get("reasoning_effort") or "medium"
    if effort not in harmony.EFFORTS:
        raise RequestError(f"Harmony does not support reasoning effort {effort}")
    return harmony.render_chat(rendered, [], reasoning_effort=effort, today=date.today().isoformat())


def _completion_prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise BodyError(
            f"[{{'type': 'missing', 'loc': ('body', 'prompt'), 'msg': 'Field required', 'input': {body!r}}}]"
        )
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("Prompt cannot be empty")
        return encode_prompt(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise RequestError("Prompt cannot be empty")
        return prompt
    raise RequestError("The emulator serves one prompt per request; send `prompt` as a string or token ids.")


def _finish(gen: Generation) -> tuple[str | None, Any]:
    """OpenAI's finish_reason and SGLang's matched_stop for a request."""
    reason = gen.finish_reason()
    if reason is None:
        return None, None
    kind = reason["type"]
    if kind == "stop":
        return "stop", reason.get("matched")
    return ("length" if kind == "length" else "abort"), None


def _usage(gen: Generation, completion_tokens: int, *, cached: bool) -> dict[str, Any]:
    """SGLang's UsageInfo; with `cached` (--enable-cache-report, where SGLang reports it) the
    prompt tokens the cache held, even 0."""
    prompt = gen.spec.prompt_tokens
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": gen.seq.cached_tokens} if cached else None,
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }


def _cache_report(gen: Generation) -> bool:
    return gen.worker.config.enable_cache_report


async def _serve(
    request: web.Request,
    prompt_ids: Callable[[dict[str, Any]], list[int]],
    default_max: int | None,
    whole: Callable[[dict[str, Any], Generation], dict[str, Any]],
    stream: Callable[[web.Request, web.StreamResponse, dict[str, Any], Generation], Awaitable[None]],
) -> web.StreamResponse:
    """Validate, submit, then answer whole or as SSE chunks; abort if the client leaves."""
    worker = request.app[WORKER_KEY]
    try:
        body = await read_json_object(request)
        stream_options = _check_type(body, "stream_options", dict) or {}
        if body.get("stream") not in (None, True, False):
            raise _type_error("stream", bool, body["stream"])
        spec = _spec(worker, body, prompt_ids(body), default_max)
        gen = await worker.submit(spec)
    except (RequestError, ContractError, DuplicateRequestId) as exc:
        return openai_error(str(exc))
    try:
        if spec.streaming:
            response = await start_sse(request)
            await stream(request, response, {**body, "stream_options": stream_options}, gen)
            await response.write(SSE_DONE)
            return response
        await gen.ended()
        return json_response(whole(body, gen))
    finally:
        worker.release(gen)


def _head(body: dict[str, Any], gen: Generation, kind: str) -> dict[str, Any]:
    """The fields every response and chunk starts with; the model is echoed, never checked."""
    return {
        "id": gen.spec.rid,
        "object": kind,
        "created": int(time.time()),
        "model": body.get("model") or "default",
    }


def _chat_body(body: dict[str, Any], gen: Generation) -> dict[str, Any]:
    k = gen.tokens_now()
    finish, matched = _finish(gen)
    return {
        **_head(body, gen, "chat.completion"),
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": gen.output(0, k)[0],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
        ],
        "usage": _usage(gen, k, cached=_cache_report(gen)),
        "metadata": {"weight_version": "default"},
    }


async def _chat_stream(
    request: web.Request, response: web.StreamResponse, body: dict[str, Any], gen: Generation
) -> None:
    head = _head(body, gen, "chat.completion.chunk")
    options = body["stream_options"]
    continuous = bool(options.get("continuous_usage_stats"))

    def choice(delta: dict[str, Any], finish: str | None = None, matched: Any = None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            "matched_stop": matched,
        }

    def content(since: int, k: int) -> bytes | None:
        delta = gen.output(since, k)[0]
        if not delta:
            return None
        chunk = {**head, "choices": [choice({"reasoning_content": None, "content": delta})]}
        if continuous:
            chunk["usage"] = _usage(gen, k, cached=_cache_report(gen))
        return sse(chunk)

    await response.write(
        sse({**head, "choices": [choice({"reasoning_content": None, "role": "assistant", "content": ""})]})
    )
    sent = await EventStream(gen, request, response, content).run()
    k = gen.tokens_now()
    finish, matched = _finish(gen)
    tail = [content(sent, k), sse({**head, "choices": [choice({"reasoning_content": None}, finish, matched)]})]
    if options.get("include_usage"):
        tail.append(sse({**head, "choices": [], "usage": _usage(gen, k, cached=_cache_report(gen))}))
    await response.write(b"".join(chunk for chunk in tail if chunk))


def _completion_body(body: dict[str, Any], gen: Generation) -> dict[str, Any]:
    k = gen.tokens_now()
    finish, matched = _finish(gen)
    return {
        **_head(body, gen, "text_completion"),
        "choices": [
            {
                "index": 0,
                "text": gen.output(0, k)[0],
                "logprobs": None,
                "finish_reason": finish,
                "matched_stop": matched,
            }
        ],
        "usage": _usage(gen, k, cached=_cache_report(gen)),
        "metadata": {"weight_version": "default"},
    }


async def _completion_stream(
    request: web.Request, response: web.StreamResponse, body: dict[str, Any], gen: Generation
) -> None:
    head = _head(body, gen, "text_completion")
    continuous = bool(body["stream_options"].get("continuous_usage_stats"))

    def piece(since: int, k: int) -> bytes | None:
        delta = gen.output(since, k)[0]
        finish, matched = _finish(gen)
        if not delta and finish is None:
            return None
        choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": finish, "matched_stop": matched}
        return sse({**head, "choices": [choice], "usage": _usage(gen, k, cached=False) if continuous else None})

    sent = await EventStream(gen, request, response, piece).run()
    k = gen.tokens_now()
    tail = [piece(sent, k)]
    if body["stream_options"].get("include_usage"):
        usage = {k_: v for k_, v in _usage(gen, k, cached=_cache_report(gen)).items() if v is not None}
        tail.append(sse({**head, "choices": [], "usage": usage}))
    await response.write(b"".join(chunk for chunk in tail if chunk))


async def handle_chat(request: web.Request) -> web.StreamResponse:
    return await _serve(request, _chat_prompt_ids, None, _chat_body, _chat_stream)


async def handle_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(
        request,
        _completion_prompt_ids,
        COMPLETIONS_DEFAULT_MAX_TOKENS,
        _completion_body,
        _completion_stream,
    )


ROUTES: list[tuple[str, str, Callable[[web.Request], Any]]] = [
    ("POST", "/v1/chat/completions", handle_chat),
    ("POST", "/v1/completions", handle_completions),
]
