"""The official `openai` client against the emulator's OpenAI-compatible routes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import date

import openai
import pytest

from core import harmony, tokens
from nodes.emulator.launch import EmulatorProcess as Emulator

MODEL = "openai/gpt-oss-120b"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers."},
]


@pytest.fixture
async def client(mi355x: Emulator) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=mi355x.urls[0] + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_models_lists_the_served_model(client: openai.AsyncOpenAI) -> None:
    """/v1/models names the served model, as SGLang does."""
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]


async def test_chat_usage_adds_up(client: openai.AsyncOpenAI) -> None:
    """A chat answer's usage adds up: completion_tokens is what the content holds, prompt_tokens is
    the Harmony-rendered conversation counted with o200k."""
    resp = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=50, extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 50 == len(tokens.encode(choice.message.content or ""))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    turns = [harmony.Turn(m["role"], m["content"]) for m in MESSAGES]
    assert resp.usage.prompt_tokens == len(
        harmony.render_chat(turns, [], reasoning_effort="medium", today=date.today().isoformat())
    )


async def test_chat_stream_with_usage(client: openai.AsyncOpenAI) -> None:
    """A streamed chat answer opens with the assistant role, carries deltas that add up to the answer,
    ends with a finish reason, then one usage chunk with no choices."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_completion_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 120 == len(tokens.encode(text))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


async def test_completion_and_stream(client: openai.AsyncOpenAI) -> None:
    """Completions answer whole and streamed with the same accounting."""
    resp = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, extra_body={"ignore_eos": True}
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 30
    assert len(tokens.encode(resp.choices[0].text)) == 30
    assert resp.usage.prompt_tokens == tokens.count("Once upon a time")
    stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert len(tokens.encode(text)) == 30
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 30


async def test_completion_stream_with_continuous_usage(client: openai.AsyncOpenAI) -> None:
    """`continuous_usage_stats`: as SGLang does, every completion chunk says the tokens so far."""
    stream = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=30, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    counted = [c.usage.completion_tokens for c in [c async for c in stream] if c.choices]
    assert len(counted) >= 2 and counted == sorted(counted) and counted[-1] == 30


async def test_stop_sequence_in_chat(client: openai.AsyncOpenAI) -> None:
    """`stop` ends a chat answer with finish_reason stop and the stop text removed."""
    first = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=200, seed=11, extra_body={"ignore_eos": True}
    )
    word = (first.choices[0].message.content or "").split()[10]
    again = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=200,
        seed=11,
        stop=[" " + word],
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].finish_reason == "stop"
    content = again.choices[0].message.content or ""
    assert (first.choices[0].message.content or "").startswith(content)
    assert (" " + word) not in content


async def test_errors_are_openai_shaped(client: openai.AsyncOpenAI) -> None:
    """Bad chat requests raise the client's BadRequestError with SGLang's messages."""
    with pytest.raises(openai.BadRequestError, match="Messages cannot be empty"):
        await client.chat.completions.create(model=MODEL, messages=[], max_tokens=5)
    with pytest.raises(openai.BadRequestError, match="max_new_tokens must be at least 0"):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-3)
    with pytest.raises(openai.BadRequestError, match="exceeds the model's maximum context length"):
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=200_000)
