"""SGLang's /generate as the emulator serves it, driven over real HTTP."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from core import tokens
from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch
from tests.conftest import RETRACTING_WORKER, abort_all_once_one_is_retracted, retracting_requests


async def _events(resp: aiohttp.ClientResponse) -> list[dict]:
    events, done = [], False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        assert not done, "nothing may follow [DONE]"
        events.append(json.loads(payload))
    assert done, "the stream ends with data: [DONE]"
    return events


async def test_generate_text_returns_exact_meta_info(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """A non-stream /generate answers text, output_ids and SGLang's meta_info; the text holds
    exactly completion_tokens tokens and the prompt is counted with o200k."""
    prompt = "The quick brown fox jumps over the lazy dog."
    body = {"text": prompt, "rid": "req-1", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    async with http.post(mi355x.urls[0] + "/generate", json=body) as resp:
        assert resp.status == 200
        out = await resp.json()
    meta = out["meta_info"]
    assert meta["id"] == "req-1"
    assert meta["finish_reason"] == {"type": "length", "length": 40}
    assert meta["prompt_tokens"] == len(tokens.encode(prompt))
    assert meta["completion_tokens"] == 40 == len(out["output_ids"])
    assert tokens.encode(out["text"]) == out["output_ids"]
    assert meta["e2e_latency"] > 0
    assert {"weight_version", "cached_tokens", "num_retractions"} <= meta.keys()


async def test_generate_input_ids_and_default_length(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """input_ids count as the prompt; without max_new_tokens /generate stops at SGLang's default
    of 128 tokens unless the model ended its answer first."""
    body = {"input_ids": [1, 2, 3, 4, 5], "sampling_params": {"sampling_seed": 3}}
    async with http.post(mi355x.urls[1] + "/generate", json=body) as resp:
        out = await resp.json()
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == 5
    assert meta["completion_tokens"] <= 128
    if meta["finish_reason"]["type"] == "length":
        assert meta["completion_tokens"] == 128


async def test_eos_finish_counts_the_hidden_eos_token(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """Answers end at EOS when the limit allows: finish_reason reports <|return|> (200002), which
    stays in output_ids and in completion_tokens but not in the text."""
    lengths = []
    for seed in range(4):
        body = {"text": "Why?", "sampling_params": {"max_new_tokens": 60000, "sampling_seed": seed}}
        async with http.post(mi355x.urls[1] + "/generate", json=body) as resp:
            out = await resp.json()
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "stop", "matched": 200002}
        assert out["output_ids"][-1] == 200002
        assert len(tokens.encode(out["text"])) == meta["completion_tokens"] - 1
        lengths.append(meta["completion_tokens"])
    assert len(set(lengths)) > 1, "answer lengths vary like a model's"


async def test_stream_is_cumulative_and_ends_with_done(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """Streaming events carry everything so far (text, output_ids, completion_tokens); the last one
    has the finish reason and e2e_latency, and `data: [DONE]` closes the stream."""
    body = {
        "text": "Count to a hundred.",
        "stream": True,
        "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
    }
    async with http.post(mi355x.urls[0] + "/generate", json=body) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = await _events(resp)
    assert len(events) >= 2
    assert events[0]["meta_info"]["completion_tokens"] == 1
    previous = ""
    for event in events:
        assert event["text"].startswith(previous)
        assert len(event["output_ids"]) == event["meta_info"]["completion_tokens"]
        previous = event["text"]
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 300}
    assert last["completion_tokens"] == 300 and "e2e_latency" in last


async def test_stop_string_trims_text_and_reports_match(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """A stop string ends generation where the model produced it: finish_reason names it, the text
    is cut before it, and completion_tokens counts the tokens up to the one that completed it."""
    body = {"text": "x", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "sampling_seed": 7}}
    async with http.post(mi355x.urls[0] + "/generate", json=body) as resp:
        full = await resp.json()
    stop_word = full["text"].split()[25]
    body["sampling_params"]["stop"] = [" " + stop_word]
    async with http.post(mi355x.urls[0] + "/generate", json=body) as resp:
        cut = await resp.json()
    meta = cut["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": " " + stop_word}
    at = full["text"].index(" " + stop_word)
    assert cut["text"] == full["text"][:at]
    assert meta["completion_tokens"] == len(tokens.encode(full["text"][: at + len(stop_word) + 1]))


async def test_abort_request_ends_running_request(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """POST /abort_request ends a running request with finish_reason abort and the tokens it had."""
    url = fresh_worker.urls[0]
    body = {
        "text": "long",
        "rid": "to-abort",
        "stream": True,
        "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True},
    }
    async with http.post(url + "/generate", json=body) as resp:
        first = await resp.content.readline()
        assert json.loads(first.decode()[len("data: ") :])["meta_info"]["completion_tokens"] == 1
        async with http.post(url + "/abort_request", json={"rid": "to-abort"}) as abort:
            assert abort.status == 200
        events = await _events(resp)
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    assert 1 <= final["completion_tokens"] < 20000


async def test_client_leaving_a_whole_answer_aborts_it(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """A client that gives up on a non-stream request gets it aborted at the worker: its slot frees
    at once instead of decoding to the end for nobody."""
    url = fresh_worker.urls[0]
    body = {"text": "long", "sampling_params": {"max_new_tokens": 50_000, "ignore_eos": True}}
    with pytest.raises(TimeoutError):
        async with http.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=0.5)):
            pass
    for _ in range(50):
        async with http.get(url + "/_emulator/state") as resp:
            engine = (await resp.json())["engine"]
        if engine["running"] == 0:
            break
        await asyncio.sleep(0.1)
    assert engine["running"] == engine["waiting"] == 0


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "cumulative"])
async def test_a_request_retracted_then_aborted_in_the_queue_ends_as_sglang_ends_it(
    incremental: bool, http: aiohttp.ClientSession
) -> None:
    """SGLang 0.5.23 ends a request aborted in its waiting queue, one retracted back there
    mid-answer too, with its whole text so far and every id, or streamed in increments its last
    id again, and no prompt_tokens (TokenizerManager._handle_abort_req); a running request's
    abort is an ordinary event of its stream."""
    emu = launch([*RETRACTING_WORKER, *(["--incremental-streaming-output"] if incremental else [])])
    try:
        url = emu.urls[0]

        async def answer(request: dict) -> list[dict]:
            async with http.post(url + "/generate", json={**request, "stream": True}) as resp:
                return await _events(resp)

        answers = [asyncio.create_task(answer(request)) for request in retracting_requests()]
        await abort_all_once_one_is_retracted(http, url)
        ends = await asyncio.gather(*answers)
    finally:
        emu.stop()
    in_queue = [e for e in ends if e[-1]["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"]
    retracted = [e for e in in_queue if e[-1]["meta_info"]["completion_tokens"] > 0]
    assert retracted, [e[-1]["meta_info"] for e in ends]
    for *before, last in retracted:
        meta, whole = last["meta_info"], tokens.encode(last["text"])
        assert "prompt_tokens" not in meta and len(whole) == meta["completion_tokens"]
        assert last["output_ids"] == (whole[-1:] if incremental else whole)
        assert last["text"].startswith("".join(e["text"] for e in before) if incremental else before[-1]["text"])
    running = [e for e in ends if e[-1]["meta_info"]["finish_reason"]["message"] == "Aborted"]
    assert running and all("prompt_tokens" in e[-1]["meta_info"] for e in running)
