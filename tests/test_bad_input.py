"""Bad input gets SGLang's 400 shapes, and the worker keeps serving everyone else."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from nodes.emulator.launch import EmulatorProcess as Emulator

TOO_LONG = " hello" * 140_000  # ~140 k tokens: past the 131,072-token context

# (body, expected status, a predicate on the JSON body)
GENERATE_CASES = [
    pytest.param(
        b'{"text": "hi", "sampling_params": ',
        400,
        lambda b: b["object"] == "error" and "JSON decode error" in b["message"],
        id="malformed-json",
    ),
    pytest.param(
        b'["not", "an", "object"]',
        400,
        lambda b: b["object"] == "error" and b["code"] == 400,
        id="not-an-object",
    ),
    pytest.param(
        {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}},
        400,
        lambda b: b == {"error": 'invalid type: string "ten", expected i64'},
        id="wrong-type",
    ),
    pytest.param(
        {"text": "hi", "sampling_params": {"temprature": 0.5}},
        400,
        lambda b: b["error"].startswith("unknown field `temprature`, expected one of `max_new_tokens`"),
        id="unknown-sampling-param",
    ),
    pytest.param(
        {"text": "hi", "sampling_params": {"max_new_tokens": -5}},
        400,
        lambda b: b == {"error": {"message": "max_new_tokens must be at least 0, got -5."}},
        id="negative-max-new-tokens",
    ),
    pytest.param(
        {"text": "hi", "sampling_params": {"top_p": 1.5}},
        400,
        lambda b: b == {"error": {"message": "top_p must be in (0, 1], got 1.5."}},
        id="top-p-range",
    ),
    pytest.param(
        {"sampling_params": {}},
        400,
        lambda b: b == {"error": {"message": "Either text, input_ids or input_embeds should be provided."}},
        id="no-prompt",
    ),
    pytest.param(
        {"text": ""},
        400,
        lambda b: b == {"error": {"message": "input_ids cannot be empty."}},
        id="empty-text",  # nothing to prefill: a step never takes it (it wedged a worker's engine once)
    ),
    pytest.param(
        {"text": TOO_LONG},
        400,
        lambda b: (
            b["error"]["message"].startswith("The input (")
            and "is longer than the model's context length (131072 tokens)." in b["error"]["message"]
        ),
        id="prompt-too-long",
    ),
]


@pytest.mark.parametrize(("body", "status", "check"), GENERATE_CASES)
async def test_generate_rejects_bad_input(mi355x: Emulator, http: aiohttp.ClientSession, body, status, check) -> None:
    """Each kind of bad /generate body gets SGLang's status and error shape."""
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(mi355x.urls[0] + "/generate", **kwargs) as resp:
        assert resp.status == status
        assert check(await resp.json())


async def test_stream_errors_arrive_as_an_error_event(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """In stream mode SGLang answers a refused value with HTTP 200, one error event, then [DONE]."""
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": -1}}
    async with http.post(mi355x.urls[0] + "/generate", json=body) as resp:
        assert resp.status == 200
        lines = [line.decode().strip() async for line in resp.content if line.strip()]
    assert json.loads(lines[0][len("data: ") :]) == {
        "error": {
            "message": "max_new_tokens must be at least 0, got -1.",
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"model": "m"}, "Field required"),
        ({"model": "m", "messages": "hi"}, "Input should be a valid list"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"},
            "Input should be a valid integer",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": TOO_LONG}]},
            "is longer than the model's context length",
        ),
    ],
    ids=["missing-messages", "messages-not-list", "max-tokens-type", "prompt-too-long"],
)
async def test_chat_rejects_bad_input(mi355x: Emulator, http: aiohttp.ClientSession, body, fragment) -> None:
    """Bad chat bodies get the flat OpenAI error object with code 400."""
    async with http.post(mi355x.urls[0] + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        err = await resp.json()
    assert err["object"] == "error" and err["code"] == 400 and fragment in err["message"]


async def test_bad_input_does_not_disturb_running_work(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """A burst of bad requests while streams run leaves every stream complete and the worker serving."""
    url = mi355x.urls[1]

    async def good(i: int) -> int:
        body = {"text": f"story {i}", "sampling_params": {"max_new_tokens": 333, "ignore_eos": True}}
        async with http.post(url + "/generate", json=body) as resp:
            return (await resp.json())["meta_info"]["completion_tokens"]

    async def bad(i: int) -> int:
        raw = [b"{", b'{"text": 5}', b'{"text": "x", "sampling_params": {"nope": 1}}'][i % 3]
        async with http.post(url + "/generate", data=raw) as resp:
            await resp.read()
            return resp.status

    results = await asyncio.gather(*(good(i) for i in range(10)), *(bad(i) for i in range(30)))
    completion_tokens, statuses = results[:10], results[10:]
    assert completion_tokens == [333] * 10
    assert statuses == [400] * 30
    assert await good(99) == 333
