"""Tokens from a worker that streams an event per token, through the agent and the gateway: the
first token at once, then chunks on the agent's window, each carrying that window's tokens; or,
asked for, every worker event as its own chunk; and the hop from gateway to agent said in
`Server-Timing`."""

from __future__ import annotations

import asyncio
import itertools
import re
import statistics
import time
import urllib.request
from collections.abc import Iterator

import aiohttp
import grpc
import openai
import orjson
import pytest

from core import wire
from core.processes import Child, free_port_block, start_python
from nodes.emulator.launch import launch

WINDOW_MS = 500.0  # the agent's: long beside the emulated steps (~5 ms), so chunks must gather
ANSWER_TOKENS = 400  # ~2 s of decode at speed 1, batch 1


@pytest.fixture(scope="module")
def federation() -> Iterator[tuple[str, str]]:
    """A one-site federation at real GPU speed whose worker streams an event per decode step:
    its gateway's URL and its agent's address."""
    emulator = launch(["--profile", "mi355x", "--workers", "1", "--speed", "1", "--incremental-streaming-output"])
    scheduler_port = free_port_block(3)
    agent_port, gateway_port = scheduler_port + 1, scheduler_port + 2
    children: list[Child] = []
    try:
        children.append(start_python("scheduler", "scheduler", ["--insecure", "--port", str(scheduler_port)]))
        agent = ["--insecure", "--site", "us", "--region", "us-west-2", "--gpu", "mi355x", "--gpus", "1"]
        agent += ["--port", str(agent_port), "--scheduler", f"127.0.0.1:{scheduler_port}"]
        agent += ["--worker-url", emulator.urls[0], "--coalesce-ms", str(WINDOW_MS)]
        children.append(start_python("agent", "nodes.agent", agent))
        gateway = ["--insecure", "--port", str(gateway_port), "--scheduler", f"127.0.0.1:{scheduler_port}"]
        children.append(start_python("gateway", "federation.gateway", gateway))
        _wait_ready(f"http://127.0.0.1:{gateway_port}")
        yield f"http://127.0.0.1:{gateway_port}", f"127.0.0.1:{agent_port}"
    finally:
        for child in reversed(children):
            child.stop()
        emulator.stop()


@pytest.fixture(scope="module")
def endpoint(federation: tuple[str, str]) -> str:
    return federation[0]


def _wait_ready(base: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the gateway never had a ready site")


def _chunks(base: str, **extra) -> tuple[list[float], list[str], int]:
    """Arrival times and texts of a streamed completion's text chunks, and its usage."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    started = time.monotonic()
    times, texts, tokens = [], [], 0
    stream = client.completions.create(
        model="openai/gpt-oss-120b",
        prompt="hello",
        max_tokens=ANSWER_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, **extra},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic() - started)
            texts.append(chunk.choices[0].text)
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return times, texts, tokens


def test_the_first_token_goes_at_once_then_chunks_gather_a_window(endpoint: str) -> None:
    """The first chunk is not held for the agent's window; the tokens after it arrive as chunks
    about a window apart, each carrying many tokens, and all of them arrive."""
    times, texts, tokens = _chunks(endpoint)
    assert tokens == ANSWER_TOKENS
    assert times[0] < WINDOW_MS / 1000 / 2, times[:3]
    gaps = [b - a for a, b in itertools.pairwise(times[1:-1])]  # between the first and the last
    assert gaps and all(g >= WINDOW_MS / 1000 * 0.5 for g in gaps), gaps
    assert len(texts) < ANSWER_TOKENS / 10  # ~2 s of tokens in a few windows, not one chunk each


def test_a_client_can_ask_for_every_worker_event(endpoint: str) -> None:
    """`stream_interval: 1` asks for the worker's own chunking: a chunk per token, none held."""
    _, texts, tokens = _chunks(endpoint, stream_interval=1)
    assert tokens == ANSWER_TOKENS
    assert len(texts) >= 0.9 * ANSWER_TOKENS  # the worker may merge a step or two when it falls behind


@pytest.mark.parametrize("interval", [None, 1])
async def test_native_generate_streams_cumulatively_either_way(endpoint: str, interval: int | None) -> None:
    """SGLang's /generate through the gateway: cumulative events, the last one the whole answer;
    with `sampling_params.stream_interval` one event per worker event (a token each, not a
    window's worth), without it fewer."""
    params = {"max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}
    if interval is not None:
        params["stream_interval"] = interval
    async with aiohttp.ClientSession() as http:
        body = {"text": "hello", "sampling_params": params, "stream": True}
        async with http.post(endpoint + "/generate", json=body) as resp:
            assert resp.status == 200
            hop = re.search(r"hop;dur=([0-9.]+)", resp.headers["Server-Timing"])
            route = re.search(r"route;dur=([0-9.]+)", resp.headers["Server-Timing"])
            events = [
                orjson.loads(line[6:]) for line in (await resp.read()).split(b"\n\n") if line.startswith(b"data: {")
            ]
    assert hop is not None and route is not None and 0 < float(route.group(1)) < float(hop.group(1)) < 1000
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == ANSWER_TOKENS
    assert events[-1]["meta_info"]["completion_tokens"] == ANSWER_TOKENS
    assert "".join(events[-1]["text"]) and events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    if interval is None:
        assert len(events) < ANSWER_TOKENS / 10
    else:  # an event per worker event: one token each, but where the worker itself merged steps
        # (the emulator does when the cores fall behind it, as SGLang's HTTP server does)
        per_event = [b - a for a, b in itertools.pairwise([0, *lengths])]
        assert statistics.median(per_event) == 1, per_event


@pytest.mark.parametrize("flow", [True, False])
async def test_the_agent_sends_columns_only_to_a_gateway_that_reads_them(
    federation: tuple[str, str], flow: bool
) -> None:
    """A gateway that says it reads TokenBatch.flow gets the middle of an answer in its columns;
    one that does not (an older gateway) gets every delta as a TokenDelta. Either way the deltas
    add up to the whole answer, the count exact."""
    metadata = (wire.TOKEN_FLOW_METADATA,) if flow else ()
    request = wire.GenerateRequest("flow-test", 1, {"max_new_tokens": ANSWER_TOKENS, "ignore_eos": True}, "hello")
    async with grpc.aio.insecure_channel(federation[1]) as channel:
        call = wire.SiteAgentStub(channel).Generate(metadata=metadata)
        await call.write(wire.generate_command_to_pb([(7, request)], []))
        ids: list[int] = []
        flow_deltas, finished, completion = 0, None, 0
        while finished is None:
            batch = await asyncio.wait_for(call.read(), 30)
            flow_deltas += len(batch.flow.streams)
            for delta in wire.token_batch_from_pb(batch):
                assert delta.stream == 7 and delta.error is wire.StreamError.NONE
                ids += delta.output_ids
                completion, finished = delta.completion_tokens, delta.finish_reason
        call.cancel()
    assert len(ids) == completion == ANSWER_TOKENS and finished["type"] == "length"
    assert (flow_deltas > 0) is flow
