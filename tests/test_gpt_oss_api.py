"""GPT-OSS's API through the federation, with the official openai client: reasoning apart from
the answer, tool calls (streamed and not) and their results, answers under a JSON schema, and
each still whole when its site is killed mid-answer: in the reasoning, inside a tool call,
under a schema."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from core.config import load
from federation.drills.sampler import gateway_counters
from federation.embedded import Federation
from tests.conftest import SITES
from tests.test_federation import MODEL, _config

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather in Seoul?"}]
# Long enough that a site killed at its first piece has most of it still to write.
FORECAST = {
    "type": "object",
    "properties": {
        "days": {
            "type": "array",
            "minItems": 20,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {"day": {"type": "integer", "minimum": 1, "maximum": 20}, "sky": {"type": "string"}},
                "required": ["day", "sky"],
            },
        }
    },
    "required": ["days"],
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Iterator[Federation]:
    """One federation for the tests that break nothing (speed 10)."""
    path, _ = _config(tmp_path_factory.mktemp("gpt-oss"), SITES)
    federation = Federation(load(path))
    federation.up()
    yield federation
    federation.down()


def _client(fed) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fed.config.gateway_url + "/v1", api_key="unused", max_retries=0)


def _resumed(fed) -> float:
    return gateway_counters(fed.config.gateway_url + "/metrics").get("federation_gateway_resumed_total", 0.0)


class Streamed:
    """A streamed chat put back together as the client sees it."""

    def __init__(self) -> None:
        self.reasoning, self.content, self.finish, self.usage = "", "", None, None
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, chunk) -> None:
        if chunk.usage:
            self.usage = chunk.usage
        if not chunk.choices:
            return
        choice = chunk.choices[0]
        delta = choice.delta
        self.reasoning += getattr(delta, "reasoning_content", None) or ""
        self.content += delta.content or ""
        for call in delta.tool_calls or ():
            entry = self.calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = call.id or entry["id"]
            if call.function and call.function.name:
                entry["name"] = call.function.name
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        self.finish = choice.finish_reason or self.finish


@pytest.mark.timeout(120)
async def test_a_tool_call_round_trip(shared) -> None:
    """Offered a tool, the model reasons, then calls it (finish_reason tool_calls, arguments
    valid against the tool's schema); given the result, it answers. Both turns streamed and not;
    the reasoning is `reasoning_content`, never in `content`."""
    fed = shared
    async with _client(fed) as client:
        first = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls"
        assert message.model_extra["reasoning_content"] and not message.content
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)

        streamed = Streamed()
        async for chunk in await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=True):
            streamed.add(chunk)
        assert streamed.finish == "tool_calls" and streamed.reasoning and not streamed.content
        (only,) = streamed.calls.values()
        assert only["name"] == "get_weather" and only["id"].startswith("call_")
        jsonschema.validate(json.loads(only["arguments"]), WEATHER)

        followed = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 3}'},
        ]
        answer = await client.chat.completions.create(model=MODEL, messages=followed, tools=TOOLS)
        assert answer.choices[0].finish_reason == "stop"
        assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
        streamed = Streamed()
        stream = await client.chat.completions.create(
            model=MODEL, messages=followed, tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
        async for chunk in stream:
            streamed.add(chunk)
        assert streamed.finish == "stop" and streamed.content and streamed.reasoning and not streamed.calls
        assert streamed.usage.completion_tokens > 0


@pytest.mark.timeout(120)
async def test_reasoning_effort_and_json_answers(shared) -> None:
    """`reasoning_effort` moves the share of an answer spent reasoning (low < high); an answer
    asked for as a JSON schema validates against it; json_object gives a JSON object; a named
    tool_choice calls that tool."""
    fed = shared
    async with _client(fed) as client:
        shares = {}
        for effort in ("low", "high"):
            reply = await client.chat.completions.create(
                model=MODEL, messages=ASK, extra_body={"reasoning_effort": effort}
            )
            message = reply.choices[0].message
            reasoning = message.model_extra["reasoning_content"]
            shares[effort] = len(reasoning) / (len(reasoning) + len(message.content))
        assert shares["low"] < 0.4 < 0.5 < shares["high"], shares

        schema_format = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
        reply = await client.chat.completions.create(model=MODEL, messages=ASK, response_format=schema_format)
        jsonschema.validate(json.loads(reply.choices[0].message.content), FORECAST)
        reply = await client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"})
        assert isinstance(json.loads(reply.choices[0].message.content), dict)

        two = [*TOOLS, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
        named = {"type": "function", "function": {"name": "get_time"}}
        reply = await client.chat.completions.create(model=MODEL, messages=ASK, tools=two, tool_choice=named)
        assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_time"]
        reply = await client.chat.completions.create(model=MODEL, messages=ASK, tools=two, tool_choice="none")
        assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls


BAD_CHATS = [
    ({"tools": "not a list"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tool_choice": 7, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"logit_bias": "x"}, "logit_bias"),
    ({"messages": [{"role": "user"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "tool", "content": "20", "tool_call_id": "call_unknown"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages"),
    ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),  # not a field we take: refused, not ignored
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
]


@pytest.mark.timeout(120)
async def test_invalid_chat_fields_are_refused_naming_them(shared) -> None:
    """Each invalid value is a 400 in OpenAI's shape naming the field, before any site is asked."""
    fed = shared
    async with _client(fed) as client:
        for fields, param in BAD_CHATS:
            extra = {k: v for k, v in fields.items() if k != "messages"}  # as written, past the client's checks
            with pytest.raises(openai.BadRequestError) as raised:
                await client.chat.completions.create(
                    model=MODEL, messages=fields.get("messages", ASK), extra_body=extra
                )
            assert raised.value.body["param"] == param, (fields, raised.value.body)


@pytest.mark.timeout(120)
async def test_no_prompt_is_too_long_for_a_clear_400(shared) -> None:
    """900 k characters (more tokens than the context) are a 400 saying so on chat and
    completions: never a 5xx from the tokenizer."""
    fed = shared
    huge = "x " * 450_000
    async with _client(fed) as client:
        for call in (
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": huge}]),
            client.completions.create(model=MODEL, prompt=huge),
        ):
            with pytest.raises(openai.BadRequestError) as raised:
                await call
            assert "context" in raised.value.body["message"]


@pytest.mark.timeout(120)
async def test_text_slow_to_tokenize_stalls_no_stream(shared) -> None:
    """The attack that stalled a gateway for minutes: a run without spaces (60,000 emoji, ~120 k
    tokens, inside the context), which openai-harmony's tokenizer takes over a minute for while
    holding the process. It is answered, with its exact prompt count, while another client's
    stream keeps flowing; a tool schema built the same way is refused naming `tools`."""
    fed = shared
    emoji = "💥" * 60_000
    async with _client(fed) as client:
        gaps: list[float] = []
        flowing = asyncio.Event()

        async def watch() -> None:  # a long answer, read until the attack is answered
            stream = await client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=60_000, stream=True, extra_body={"ignore_eos": True}
            )
            last = asyncio.get_running_loop().time()
            async for _ in stream:
                now = asyncio.get_running_loop().time()
                gaps.append(now - last)
                last = now
                flowing.set()

        watching = asyncio.create_task(watch())
        await asyncio.wait_for(flowing.wait(), 30)
        answer = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": emoji}], max_tokens=1
        )
        await asyncio.sleep(1)
        watching.cancel()
        assert answer.usage.prompt_tokens > 100_000
        assert max(gaps) < 10, max(gaps)  # a minute or more when the gateway's loop was held
        long_run = {"type": "object", "properties": {"a": {"type": "string", "description": emoji[:300]}}}
        tools = [{"type": "function", "function": {"name": "f", "parameters": long_run}}]
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(model=MODEL, messages=ASK, tools=tools)
        assert raised.value.body["param"] == "tools" and "without whitespace" in raised.value.body["message"]


@pytest.mark.timeout(120)
async def test_schemas_nested_past_what_json_dumps_writes_are_a_400(shared) -> None:
    """~960 levels, written by hand (Python's json.dumps, the openai client's too, fails past
    ~1,000): the body's parser reads up to 1,024, and the gateway wrote such a schema on with
    json.dumps, an internal error. Now a 400 naming the field, for a tool's and an answer's."""
    deep = '{"type": "object", "properties": {"a": ' * 480 + '{"type": "object"}' + "}}" * 480
    fields = {
        "tools": '[{"type": "function", "function": {"name": "f", "parameters": ' + deep + "}}]",
        "response_format": '{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + deep + "}}",
    }
    async with aiohttp.ClientSession() as http:
        for field, value in fields.items():
            body = '{"model": "' + MODEL + '", "messages": ' + json.dumps(ASK) + ', "' + field + '": ' + value + "}"
            async with http.post(f"{shared.config.gateway_url}/v1/chat/completions", data=body) as response:
                refused = await response.json()
            assert response.status == 400 and refused["error"]["param"] == field, refused
            assert "deeper" in refused["error"]["message"]


async def _kill_when(fed, client, trigger, **request) -> tuple[Streamed, str]:
    """Stream a chat and SIGKILL its site's agent when `trigger(streamed)` first holds."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **request
    )
    site, streamed, killed = raw.headers["x-federation-site"], Streamed(), False
    async for chunk in raw.parse():
        streamed.add(chunk)
        if not killed and trigger(streamed):
            fed.child(f"agent {site}").proc.send_signal(signal.SIGKILL)
            killed = True
    assert killed
    return streamed, site


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": FORECAST}}
LONG_TOOL = [{"type": "function", "function": {"name": "plan_days", "parameters": FORECAST}}]
CUTS = {
    "reasoning": (lambda s: s.reasoning, {"extra_body": {"reasoning_effort": "medium"}}),
    "tool call": (lambda s: s.calls and s.calls[0]["arguments"], {"tools": LONG_TOOL}),
    # Medium effort: at low, the reasoning before the document is short enough that the agent's
    # next chunk (100 ms on) may carry the document's start, and a loaded CI machine then killed
    # the site after that chunk had gone out: a cut inside the document, the next test's case.
    "json schema": (
        lambda s: s.reasoning,
        {"response_format": SCHEMA_FORMAT, "extra_body": {"reasoning_effort": "medium"}},
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cut", list(CUTS))
async def test_an_answer_cut_by_a_site_crash_resumes_with_its_meaning(make_federation, cut) -> None:
    """A site killed while the model reasons, while it writes a tool call's arguments, or while
    it reasons before an answer under a JSON schema: the other site continues in the same
    channel, under the same constraint, and the client gets one whole, valid answer."""
    fed, _ = make_federation(speed=2)
    trigger, request = CUTS[cut]
    async with _client(fed) as client:
        streamed, _ = await _kill_when(fed, client, trigger, messages=ASK, **request)
    assert _resumed(fed) == 1
    assert streamed.reasoning and streamed.usage.completion_tokens > 0
    if cut == "tool call":
        assert streamed.finish == "tool_calls" and not streamed.content
        jsonschema.validate(json.loads(streamed.calls[0]["arguments"]), FORECAST)
    else:
        assert streamed.finish == "stop" and streamed.content and not streamed.calls
    if cut == "json schema":
        jsonschema.validate(json.loads(streamed.content), FORECAST)


@pytest.mark.timeout(120)
async def test_a_cut_inside_a_constrained_document_fails_clearly(make_federation) -> None:
    """Cut inside the JSON document itself, the answer cannot go on under SGLang's grammar (a
    grammar starts at a generation's start, and the document's beginning was already sent):
    the stream ends with an error saying so, not with invalid JSON."""
    fed, _ = make_federation(speed=2)
    async with _client(fed) as client:
        with pytest.raises(openai.APIError, match="cannot continue mid-document"):
            await _kill_when(
                fed,
                client,
                lambda s: s.content,
                messages=ASK,
                response_format=SCHEMA_FORMAT,
                extra_body={"reasoning_effort": "low"},
            )


@pytest.mark.timeout(120)
async def test_the_responses_api_round_trip(shared) -> None:
    """/v1/responses with the official client: reasoning and a function call, then the call's
    output sent back and a message answering; the same streamed, its events building the same
    Response; unsupported fields refused naming them."""
    fed = shared
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    async with _client(fed) as client:
        first = await client.responses.create(
            model=MODEL, input="Weather in Seoul?", tools=tools, reasoning={"effort": "low"}
        )
        kinds = [item.type for item in first.output]
        assert kinds == ["reasoning", "function_call"] and first.status == "completed", kinds
        call = first.output[1]
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert first.usage.output_tokens > 0

        back = [
            {"role": "user", "content": "Weather in Seoul?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"celsius": 3}'},
        ]
        answer = await client.responses.create(model=MODEL, input=back, tools=tools, instructions="Be brief.")
        assert [item.type for item in answer.output] == ["reasoning", "message"] and answer.output_text

        events, text, arguments = [], "", ""
        async with client.responses.stream(model=MODEL, input="Weather in Seoul?", tools=tools) as stream:
            async for event in stream:
                events.append(event.type)
                if event.type == "response.function_call_arguments.delta":
                    arguments += event.delta
            final = await stream.get_final_response()
        assert events[0] == "response.created" and events[-1] == "response.completed"
        assert "response.reasoning_text.delta" in events and "response.output_item.done" in events
        assert [item.type for item in final.output] == ["reasoning", "function_call"]
        assert arguments == final.output[1].arguments
        async with client.responses.stream(model=MODEL, input=back, tools=tools) as stream:
            async for event in stream:
                if event.type == "response.output_text.delta":
                    text += event.delta
            final = await stream.get_final_response()
        assert text and text == final.output_text

        for fields, param in (
            (dict(store=True), "store"),
            (dict(previous_response_id="resp_1"), "previous_response_id"),
            (dict(reasoning={"summary": "auto"}), "reasoning"),
        ):
            with pytest.raises(openai.BadRequestError) as raised:
                await client.responses.create(model=MODEL, input="hi", **fields)
            assert raised.value.body["param"] == param


@pytest.mark.timeout(120)
async def test_logprobs_when_asked(shared) -> None:
    """Chat `logprobs` / `top_logprobs` give one entry per answer token (not per reasoning token),
    whole and streamed, each with its alternatives; completions' `logprobs` N, one per token."""
    fed = shared
    async with _client(fed) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=ASK, logprobs=True, top_logprobs=3)
        content = reply.choices[0].logprobs.content
        assert "".join(e.token for e in content) == reply.choices[0].message.content
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
        assert all(e.logprob <= 0 and bytes(e.bytes).decode() == e.token for e in content)

        streamed, entries = "", []
        stream = await client.chat.completions.create(model=MODEL, messages=ASK, logprobs=True, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                streamed += chunk.choices[0].delta.content
                entries += chunk.choices[0].logprobs.content
        assert streamed and "".join(e.token for e in entries) == streamed

        completion = await client.completions.create(
            model=MODEL, prompt="Once", max_tokens=12, logprobs=2, extra_body={"ignore_eos": True}
        )
        lp = completion.choices[0].logprobs
        assert "".join(lp.tokens) == completion.choices[0].text and len(lp.token_logprobs) == 12
        assert len(lp.top_logprobs) == 12 and all(len(t) == 2 for t in lp.top_logprobs)
        plain = await client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
        assert plain.choices[0].logprobs is None
        for field, value in (("top_logprobs", 2), ("response_format", {"type": "json_object"}), ("tools", TOOLS)):
            with pytest.raises(openai.BadRequestError) as raised:  # chat's fields mean nothing to a raw prompt
                await client.completions.create(model=MODEL, prompt="Once", extra_body={field: value})
            assert raised.value.body["param"] == field
