"""Streaming at SGLang's pace: an event per decode step, or every `stream_interval` steps.

The paced emulators here are MI300X at half speed (~47 ms steps at batch 1), so every step is
long enough for its event to go out on its own even on a busy test machine.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import statistics
import time
from collections.abc import Iterator

import aiohttp
import pytest

from core import tokens
from core.gpus import PROFILES
from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch
from nodes.emulator.output import GenerateSpec, plan_output
from nodes.emulator.streaming import next_output_point, output_point

MI300X = PROFILES["mi300x"]
PACED = ["--profile", "mi300x", "--workers", "1", "--speed", "0.5"]
SPEED = 0.5  # as in PACED: steps twice as long as a GPU's


@pytest.fixture(scope="module")
def per_token() -> Iterator[Emulator]:
    """One paced MI300X with SGLang's defaults: cumulative events, stream_interval 1."""
    emu = launch(PACED)
    yield emu
    assert emu.stop() == 0


@pytest.fixture(scope="module")
def every_fourth() -> Iterator[Emulator]:
    """One paced MI300X with --stream-interval 4 and incremental events."""
    emu = launch([*PACED, "--stream-interval", "4", "--incremental-streaming-output"])
    yield emu
    assert emu.stop() == 0


async def _timed_events(resp: aiohttp.ClientResponse) -> list[tuple[float, dict]]:
    """Each `data:` event with the time it arrived; the stream must end with [DONE]."""
    assert resp.status == 200
    events, done = [], False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        payload = line.removeprefix("data: ")
        if payload == "[DONE]":
            done = True
        else:
            assert not done
            events.append((time.perf_counter(), json.loads(payload)))
    assert done
    return events


async def _generate(http: aiohttp.ClientSession, url: str, sampling: dict, *, stream: bool):
    body = {"text": "Count slowly.", "stream": stream, "sampling_params": {"ignore_eos": True, **sampling}}
    async with http.post(url + "/generate", json=body) as resp:
        return await _timed_events(resp) if stream else await resp.json()


def _counts(events: list[tuple[float, dict]]) -> list[int]:
    return [e["meta_info"]["completion_tokens"] for _, e in events]


def test_output_points_follow_sglang() -> None:
    """Interval 1 outputs every count; interval N outputs counts 1, N+1, 2N+1, ... (SGLang's
    `len(output_ids) % N == 1`), and between two points the latest one is what is due."""
    assert [output_point(n, 1) for n in range(6)] == [0, 1, 2, 3, 4, 5]
    assert [output_point(n, 4) for n in range(11)] == [0, 1, 1, 1, 1, 5, 5, 5, 5, 9, 9]
    assert [next_output_point(s, 1) for s in (0, 1, 7)] == [1, 2, 8]
    assert [next_output_point(s, 4) for s in (0, 1, 5, 9)] == [1, 5, 9, 13]


@pytest.mark.parametrize(
    "spec",
    [
        GenerateSpec(rid="eos", prompt_tokens=5, max_new_tokens=400, seed=1),
        GenerateSpec(rid="len", prompt_tokens=5, max_new_tokens=37, ignore_eos=True, seed=2),
        GenerateSpec(rid="stop", prompt_tokens=5, max_new_tokens=400, ignore_eos=True, stop=("e",), seed=3),
    ],
    ids=["eos", "length", "stop-string"],
)
def test_deltas_add_up_to_the_answer(spec: GenerateSpec) -> None:
    """Incremental pieces cut at any counts join into exactly the whole answer: the final piece
    hides EOS and trims a stop string as the whole answer does."""
    synth = tokens.synthetic_text()
    plan = plan_output(spec, synth, 200.0)
    cuts = [0, *range(1, plan.tokens, 3), plan.tokens]
    pieces = [plan.delta(synth, a, b) for a, b in itertools.pairwise(cuts)]
    text, ids = plan.text_and_ids(synth, plan.tokens)
    assert "".join(t for t, _ in pieces) == text
    assert [i for _, piece in pieces for i in piece] == ids


async def test_every_token_is_an_event_at_its_step(per_token: Emulator, http: aiohttp.ClientSession) -> None:
    """With stream_interval 1 each of 20 tokens arrives as its own event, one decode step after the
    one before (the MI300X step model at batch 1), and the last carries the finish."""
    events = await _generate(http, per_token.urls[0], {"max_new_tokens": 20}, stream=True)
    assert _counts(events) == list(range(1, 21))
    assert events[-1][1]["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert all(e["meta_info"]["finish_reason"] is None for _, e in events[:-1])
    prompt = events[0][1]["meta_info"]["prompt_tokens"]
    steps_s = [MI300X.step_ms(1, prompt + n, 0) / 1000.0 / SPEED for n in range(1, 20)]
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(events)]
    assert abs(statistics.median(gaps) / statistics.median(steps_s) - 1) < 0.2, gaps
    assert abs((events[-1][0] - events[0][0]) / sum(steps_s) - 1) < 0.1, gaps


async def test_request_interval_sends_tokens_1_5_9(per_token: Emulator, http: aiohttp.ClientSession) -> None:
    """sampling_params.stream_interval 4 sends tokens 1, 5, 9, ... four steps apart and the
    finish; cumulative events grow to exactly the answer a non-stream request gets."""
    sampling = {"max_new_tokens": 22, "stream_interval": 4, "sampling_seed": 11}
    events = await _generate(http, per_token.urls[0], sampling, stream=True)
    whole = await _generate(http, per_token.urls[0], sampling, stream=False)
    assert _counts(events) == [1, 5, 9, 13, 17, 21, 22]
    for _, event in events:
        k = event["meta_info"]["completion_tokens"]
        assert event["output_ids"] == whole["output_ids"][:k]
        assert whole["text"].startswith(event["text"])
    assert events[-1][1]["text"] == whole["text"]
    four_steps_s = 4 * MI300X.step_ms(1, 10, 0) / 1000.0 / SPEED
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(events[:-1])]
    assert abs(statistics.median(gaps) / four_steps_s - 1) < 0.2, gaps


async def test_finish_on_an_output_point_is_one_event(per_token: Emulator, http: aiohttp.ClientSession) -> None:
    """When the last token falls on an output point, it goes out once, with the finish."""
    events = await _generate(http, per_token.urls[0], {"max_new_tokens": 9, "stream_interval": 4}, stream=True)
    assert _counts(events) == [1, 5, 9]
    assert events[-1][1]["meta_info"]["finish_reason"] == {"type": "length", "length": 9}


async def test_server_interval_with_incremental_events(every_fourth: Emulator, http: aiohttp.ClientSession) -> None:
    """--stream-interval 4 sends tokens 1, 5, 9, ... and the finish; incremental events carry only
    what is new and join into exactly the non-stream answer."""
    sampling = {"max_new_tokens": 22, "sampling_seed": 5}
    events = await _generate(http, every_fourth.urls[0], sampling, stream=True)
    whole = await _generate(http, every_fourth.urls[0], sampling, stream=False)
    assert _counts(events) == [1, 5, 9, 13, 17, 21, 22]
    assert [len(e["output_ids"]) for _, e in events] == [1, 4, 4, 4, 4, 4, 1]
    assert "".join(e["text"] for _, e in events) == whole["text"]
    assert [i for _, e in events for i in e["output_ids"]] == whole["output_ids"]


async def test_request_interval_overrides_the_server(every_fourth: Emulator, http: aiohttp.ClientSession) -> None:
    """A request's stream_interval 1 gets an event per token from a server set to 4."""
    events = await _generate(http, every_fourth.urls[0], {"max_new_tokens": 10, "stream_interval": 1}, stream=True)
    assert _counts(events) == list(range(1, 11))


async def test_openai_stream_follows_the_server_interval(every_fourth: Emulator, http: aiohttp.ClientSession) -> None:
    """The OpenAI routes have no per-request interval: a completions stream gets chunks at the
    server's points (1, 5, 9) and the finish, and its pieces join into the whole completion."""
    body = {"model": "m", "prompt": "Go.", "max_tokens": 10, "ignore_eos": True, "seed": 9}
    async with http.post(every_fourth.urls[0] + "/v1/completions", json=body) as resp:
        whole = (await resp.json())["choices"][0]["text"]
    body |= {"stream": True, "stream_options": {"continuous_usage_stats": True}}
    async with http.post(every_fourth.urls[0] + "/v1/completions", json=body) as resp:
        chunks = [e for _, e in await _timed_events(resp)]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 5, 9, 10]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole


async def _read_slowly(url: str, body: dict, pause_s: float) -> list[dict]:
    """POST `body` to /generate from a socket with a tiny receive buffer, read nothing for
    `pause_s` (the worker's writes back up), then read the whole de-chunked SSE stream."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    payload = json.dumps(body).encode()
    writer.write(
        b"POST /generate HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (host.encode(), len(payload), payload)
    )
    await asyncio.sleep(pause_s)
    head, _, rest = (await reader.read()).partition(b"\r\n\r\n")
    writer.close()
    assert b"Transfer-Encoding: chunked" in head
    data = b""
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        data, rest = data + rest[:size], rest[size + 2 :]
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_a_slow_reader_gets_merged_events_and_every_token(http: aiohttp.ClientSession) -> None:
    """While a client does not read, the worker holds its events back and the next one carries
    every token since (as SGLang merges outputs behind a blocked writer): nothing is lost or
    sent twice, and the stream still ends with the exact answer."""
    emu = launch(["--profile", "mi355x", "--workers", "1", "--speed", "4"])
    try:
        # 2,000 cumulative events would be ~26 MB, far beyond any socket buffer; the answer
        # takes ~2.6 s at this speed, all of it while the client reads nothing.
        sampling = {"max_new_tokens": 2000, "ignore_eos": True, "sampling_seed": 4}
        body = {"text": "Read me slowly.", "stream": True, "sampling_params": sampling}
        events = await _read_slowly(emu.urls[0], body, pause_s=3.0)
        whole = await _generate(http, emu.urls[0], sampling, stream=False)
    finally:
        emu.stop()
    counts = [e["meta_info"]["completion_tokens"] for e in events]
    assert counts[0] == 1 and counts[-1] == 2000
    assert all(a < b for a, b in itertools.pairwise(counts))
    assert max(b - a for a, b in itertools.pairwise(counts)) > 300, "events were held back, then merged"
    for event in events:
        assert event["output_ids"] == whole["output_ids"][: event["meta_info"]["completion_tokens"]]
    assert events[-1]["text"] == whole["text"]


@pytest.mark.parametrize("value", [0, -3])
async def test_out_of_range_interval_is_refused(per_token: Emulator, http: aiohttp.ClientSession, value: int) -> None:
    """A stream_interval below 1 is refused with a 400 naming it (as an error event when streaming,
    as SGLang reports its checks on a stream)."""
    body = {"text": "x", "sampling_params": {"stream_interval": value}}
    async with http.post(per_token.urls[0] + "/generate", json=body) as resp:
        assert resp.status == 400
        assert "stream_interval" in (await resp.json())["error"]["message"]
    async with http.post(per_token.urls[0] + "/generate", json={**body, "stream": True}) as resp:
        events = [e for _, e in await _timed_events(resp)]
    assert len(events) == 1 and events[0]["error"]["code"] == 400
    assert "stream_interval" in events[0]["error"]["message"]


@pytest.mark.parametrize("value", ["4", 2.5, True, [1]])
async def test_wrongly_typed_interval_breaks_the_contract(
    per_token: Emulator, http: aiohttp.ClientSession, value: object
) -> None:
    """A stream_interval that is not an integer breaks the API contract: 400 `{"error": "..."}`."""
    for stream in (False, True):
        body = {"text": "x", "stream": stream, "sampling_params": {"stream_interval": value}}
        async with http.post(per_token.urls[0] + "/generate", json=body) as resp:
            assert resp.status == 400
            assert "expected i64" in (await resp.json())["error"]


async def test_server_info_reports_the_interval(
    per_token: Emulator, every_fourth: Emulator, http: aiohttp.ClientSession
) -> None:
    """/server_info shows the server's stream_interval and streaming mode, as SGLang's does."""
    for emu, interval, incremental in ((per_token, 1, False), (every_fourth, 4, True)):
        async with http.get(emu.urls[0] + "/server_info") as resp:
            info = await resp.json()
        assert (info["stream_interval"], info["incremental_streaming_output"]) == (interval, incremental)
