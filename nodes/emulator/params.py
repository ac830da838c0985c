"""Request validation with SGLang 0.5.23's checks, messages and error classes.

Three kinds of bad input get three shapes in SGLang, and callers (the sglang-router,
our site agent) see exactly these, so the emulator keeps them apart:
- `BodyError`: the body is not JSON or has the wrong structure (FastAPI validation),
- `ContractError`: `sampling_params` breaks the API contract (unknown key, wrong type),
- `RequestError`: a value SGLang's own checks refuse (range, context length).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import orjson


class BodyError(ValueError):
    """FastAPI-level validation failure: 400 with the flat OpenAI error body."""


class ContractError(ValueError):
    """API-contract failure on /generate: 400 `{"error": "<message>"}`."""


class RequestError(ValueError):
    """SGLang's own check failed: 400 `{"error": {"message": ...}}` on /generate."""


# SamplingParams fields in 0.5.23, with the type the API contract expects.
SAMPLING_FIELDS: dict[str, str] = {
    "max_new_tokens": "i64",
    "stop": "stop",
    "stop_token_ids": "ids",
    "stop_regex": "stop",
    "temperature": "f64",
    "top_p": "f64",
    "top_k": "i64",
    "min_p": "f64",
    "frequency_penalty": "f64",
    "presence_penalty": "f64",
    "repetition_penalty": "f64",
    "min_new_tokens": "i64",
    "n": "i64",
    "json_schema": "a string",
    "regex": "a string",
    "ebnf": "a string",
    "structural_tag": "a string",
    "ignore_eos": "a boolean",
    "skip_special_tokens": "a boolean",
    "spaces_between_special_tokens": "a boolean",
    "no_stop_trim": "a boolean",
    "stream_interval": "i64",
    "logit_bias": "a map",
    "sampling_seed": "i64",
    "custom_params": "a map",
    "beam_width": "i64",
    "watermark": "any",
    "choice": "any",
}
_EXPECTED_LIST = ", ".join(f"`{k}`" for k in SAMPLING_FIELDS)


def decode_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(
            f"[{{'type': 'json_invalid', 'loc': ('body', {exc.pos}), 'msg': 'JSON decode error', "
            f"'input': {{}}, 'ctx': {{'error': {str(exc.msg)!r}}}}}]"
        ) from None


def serde_describe(value: Any) -> str:
    """How serde names an unexpected JSON value in its error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {orjson.dumps(value).decode()}"
    if isinstance(value, list):
        return "sequence"
    return "map"


def _fits(kind: str, value: Any) -> bool:
    if value is None or kind == "any":
        return True
    if kind == "i64":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "f64":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "a string":
        return isinstance(value, str)
    if kind == "a boolean":
        return isinstance(value, bool)
    if kind == "a map":
        return isinstance(value, dict)
    if kind == "stop":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == "ids":
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    raise AssertionError(kind)


def check_sampling_contract(sampling: Any) -> dict[str, Any]:
    if sampling is None:
        return {}
    if not isinstance(sampling, dict):
        raise ContractError(f"invalid type: {serde_describe(sampling)}, expected a map")
    for key, value in sampling.items():
        kind = SAMPLING_FIELDS.get(key)
        if kind is None:
            raise ContractError(f"unknown field `{key}`, expected one of {_EXPECTED_LIST}")
        if not _fits(kind, value):
            expected = {"stop": "a string or a sequence", "ids": "a sequence"}.get(kind, kind)
            raise ContractError(f"invalid type: {serde_describe(value)}, expected {expected}")
    return sampling


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling parameters the emulator acts on, verified as SGLang verifies them."""

    max_new_tokens: int | None
    min_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    no_stop_trim: bool
    seed: int | None
    stream_interval: int | None


def request_priority(body: dict[str, Any]) -> int | None:
    """A request's `priority` (GenerateReqInput's, and the OpenAI requests'): SGLang checks the
    signed 64-bit range (TokenizerManager._set_default_priority), whether or not the server
    schedules by it."""
    priority = body.get("priority")
    if priority is None:
        return None
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise RequestError(f"priority must be an integer, got {priority!r}")
    if not -(1 << 63) <= priority < (1 << 63):
        raise RequestError(
            "priority must be a signed 64-bit integer between -9223372036854775808 and 9223372036854775807"
        )
    return priority


def verify_sampling(sp: dict[str, Any], *, default_max_new_tokens: int | None) -> Sampling:
    """SamplingParams.verify(): range checks with SGLang's messages."""
    temperature = sp.get("temperature", 1.0)
    if temperature is not None and (temperature < 0 or not math.isfinite(temperature)):
        raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    top_p = sp.get("top_p", 1.0)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}.")
    min_p = sp.get("min_p", 0.0)
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise RequestError(f"min_p must be in [0, 1], got {min_p}.")
    top_k = sp.get("top_k", -1)
    if top_k is not None and top_k < 1 and top_k != -1:
        raise RequestError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    for name in ("frequency_penalty", "presence_penalty"):
        value = sp.get(name, 0.0)
        if value is not None and not -2.0 <= value <= 2.0:
            raise RequestError(f"{name} must be in [-2, 2], got {value}.")
    rep = sp.get("repetition_penalty", 1.0)
    if rep is not None and not 0.0 < rep <= 2.0:
        raise RequestError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {rep}.")
    max_new = sp.get("max_new_tokens", default_max_new_tokens)
    if max_new is not None and max_new < 0:
        raise RequestError(f"max_new_tokens must be at least 0, got {max_new}.")
    min_new = sp.get("min_new_tokens") or 0
    if min_new < 0 or (max_new is not None and min_new > max_new):
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {min_new}.")
    grammars = [k for k in ("json_schema", "regex", "ebnf", "structural_tag") if sp.get(k) is not None]
    if len(grammars) > 1:
        raise RequestError("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
    if (sp.get("n") or 1) != 1:
        raise RequestError("The emulator serves n = 1 only; send one request per sample.")
    stream_interval = sp.get("stream_interval")
    if stream_interval is not None and stream_interval < 1:
        raise RequestError(f"stream_interval must be a positive integer, got {stream_interval}.")
    stop = sp.get("stop") or ()
    return Sampling(
        max_new_tokens=max_new,
        min_new_tokens=min_new,
        stop=(stop,) if isinstance(stop, str) else tuple(s for s in stop if s),
        stop_token_ids=tuple(sp.get("stop_token_ids") or ()),
        ignore_eos=bool(sp.get("ignore_eos")),
        no_stop_trim=bool(sp.get("no_stop_trim")),
        seed=sp.get("sampling_seed"),
        stream_interval=stream_interval,
    )


def resolve_max_new_tokens(
    prompt_tokens: int,
    max_new_tokens: int | None,
    *,
    explicit: bool,
    context_length: int,
    kv_capacity_tokens: int,
) -> int:
    """The tokenizer manager's and scheduler's length checks, then the cap SGLang applies."""
    if prompt_tokens >= context_length:
        raise RequestError(
            f"The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if explicit and max_new_tokens is not None and prompt_tokens + max_new_tokens >= context_length:
        raise RequestError(
            "Requested token count exceeds the model's maximum context length of "
            f"{context_length} tokens. You requested a total of {prompt_tokens + max_new_tokens} "
            f"tokens: {prompt_tokens} tokens from the input messages and {max_new_tokens} tokens "
            "for the completion. Please reduce the number of tokens in the input messages or "
            "the completion to fit within the limit."
        )
    max_req_len = min(context_length - 1, kv_capacity_tokens - 1)
    max_req_input_len = max_req_len - 5
    if prompt_tokens >= max_req_input_len:
        raise RequestError(
            f"Input length ({prompt_tokens} tokens) exceeds the maximum allowed length "
            f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
        )
    room = max_req_len - prompt_tokens - 1
    return room if max_new_tokens is None else min(max_new_tokens, room)
