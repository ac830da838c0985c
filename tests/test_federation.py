"""The whole data path: client -> gateway -> scheduler -> site agent -> emulated SGLang workers.

`fedctl up` runs a small version of the embedded default (4 GPUs a site instead of 16,
emulated 10x faster) with the WAN link to Korea emulated at 130 ms.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path

import aiohttp
import openai
import pytest

from core import tokens
from core.config import load
from core.gpus import PROFILES
from core.mtls import INSECURE
from core.processes import PROJECT_ROOT, Child, free_port_block, start_python
from federation import control
from federation.admin import fetch_state
from federation.drills.faults import poll_until
from federation.throwaway_ca import operator_tls
from tests.test_worker_state import metric

MODEL = "openai/gpt-oss-120b"
GPUS = 4


def _config(
    tmp: Path,
    sites: list[tuple[str, str, str]],
    *,
    speed: float = 10,
    scheduler: str = "",
    gateway: str = "",
    rtt_ms: float = 130,
    timings: str = "",
    gpus: int = GPUS,
) -> tuple[Path, dict]:
    """A small federation's YAML (`gpus` GPUs a site); `scheduler` and `gateway` add keys to their
    sections (replicas, policy; processes), `timings` is the timings section. Every port from one block free now: blocks found free one by one are not
    reserved, and two of them overlapped (an emulator could not bind a port its agent had)."""
    replicas = 2 if "replicas: 2" in scheduler else 1
    first = free_port_block(1 + replicas + len(sites) * (1 + gpus))
    ports = {"gateway": first, "scheduler": first + 1}  # replica i listens on scheduler + i
    next_port = first + 1 + replicas
    lines = [
        f"model: {MODEL}",
        f"speed: {speed}",
        f"gateway: {{port: {ports['gateway']}, region: us-west-2{', ' + gateway if gateway else ''}}}",
        f"scheduler: {{port: {ports['scheduler']}, region: us-west-2{', ' + scheduler if scheduler else ''}}}",
        "links:",
        f"  - {{between: [ap-northeast-2, us-west-2], rtt_ms: {rtt_ms}}}",
        "  - {between: [eu-central-1, us-west-2], rtt_ms: 150}",  # for a site that joins (fedctl drill add-site)
        "sites:",
    ]
    for name, region, gpu in sites:  # the agent's port, then its workers'
        ports[name] = next_port + 1
        lines.append(
            f"  - {{name: {name}, region: {region}, gpu: {gpu}, gpus: {gpus}, "
            f"agent_port: {next_port}, worker_port: {ports[name]}}}"
        )
        next_port += 1 + gpus
    if timings:
        lines.append(f"timings: {timings}")
    path = tmp / "federation.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path, ports


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Child, Path, dict]]:
    path, ports = _config(
        tmp_path_factory.mktemp("fed"),
        [("kr-mi300x", "ap-northeast-2", "mi300x"), ("us-mi355x", "us-west-2", "mi355x")],
    )
    fed = start_python("fedctl up", "federation.cli", ["up", "--config", str(path)], timeout_s=90)
    yield fed, path, ports
    assert fed.stop(30) == 0


@pytest.fixture
async def client(federation) -> AsyncIterator[openai.AsyncOpenAI]:
    fed, _, _ = federation
    async with openai.AsyncOpenAI(base_url=fed.ready["endpoint"], api_key="unused", max_retries=0) as c:
        yield c


def _status(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "federation.cli", "status", "--json", "--config", str(path)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return json.loads(out.stdout)


def _routed(path: Path) -> int:
    """Requests the schedulers have routed, asked in-process (a `fedctl status` is a process start,
    ~0.3 s of CPU: the bad-request cases ask twice each)."""
    config = load(path)
    state = fetch_state(config.scheduler_addresses[0], operator_tls(control.tls_dir(config)) or INSECURE)
    return sum(s.routed_requests for s in state.sites)


async def _worker_totals(http: aiohttp.ClientSession, ports: dict, *samples: tuple[str, dict]) -> float:
    """The sum of these metric samples over every worker of every site."""
    total = 0.0
    for site in ("kr-mi300x", "us-mi355x"):
        for port in range(ports[site], ports[site] + GPUS):
            async with http.get(f"http://127.0.0.1:{port}/metrics") as resp:
                text = await resp.text()
            total += sum(metric(text, name, **labels) for name, labels in samples)
    return total


ABORTED = ("sglang:num_aborted_requests_total", {})
# The agent sends every request as a stream; its health checks (1-token generations) are not.
SERVED = ("sglang:num_requests_total", {"is_streaming": "true"})


MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


async def test_chat_and_completion_with_usage(client: openai.AsyncOpenAI) -> None:
    """The official client gets chat and completion answers, whole and streamed, whose usage adds up:
    completion_tokens is what the text holds, prompt_tokens is the Harmony-rendered prompt."""
    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 60 == len(tokens.encode(chat.choices[0].message.content))
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 60
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=80,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 80 == len(tokens.encode(text))
    assert chunks[-1].usage.prompt_tokens == chat.usage.prompt_tokens
    comp = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=40, extra_body={"ignore_eos": True}
    )
    assert comp.usage.completion_tokens == 40 == len(tokens.encode(comp.choices[0].text))
    assert comp.usage.prompt_tokens == tokens.count("Once upon a time")
    stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [c async for c in stream]
    assert len(tokens.encode("".join(c.choices[0].text for c in chunks if c.choices))) == 40
    assert chunks[-1].usage.completion_tokens == 40


async def test_fields_that_ask_for_nothing_are_served(client: openai.AsyncOpenAI) -> None:
    """Fields the endpoint does not honour yet pass when their value asks for nothing (no
    logprobs, no echo), as clients send them by default; so do empty tools and a text format."""
    chat = await client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        tools=[],
        tool_choice="auto",
        response_format={"type": "text"},
        logprobs=False,
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    comp = await client.completions.create(model=MODEL, prompt="Once", max_tokens=5, echo=False, best_of=1)
    assert comp.choices[0].text


async def test_continuous_usage_says_the_tokens_so_far(client: openai.AsyncOpenAI) -> None:
    """With `continuous_usage_stats` every streamed text chunk says the tokens so far, chat and
    completion alike (a client that stops reading knows what it received), ending at the total."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, stream=True, stream_options=options,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    comp = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=80, stream=True, stream_options=options,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunks, text_of in (
        ([c async for c in chat], lambda c: c.choices[0].delta.content),
        ([c async for c in comp], lambda c: c.choices[0].text),
    ):
        texts = [text_of(c) for c in chunks if c.choices and text_of(c)]
        counted = [c.usage.completion_tokens for c in chunks if c.choices and text_of(c)]
        received = [len(tokens.encode(text)) for text in itertools.accumulate(texts)]
        assert len(counted) >= 2 and counted == sorted(counted) and counted[-1] == 80
        assert all(abs(n - m) <= 1 for n, m in zip(counted, received, strict=True))  # a chunk may end mid-word
        assert chunks[-1].usage.completion_tokens == 80


async def test_forty_requests_reach_both_sites(client: openai.AsyncOpenAI, federation) -> None:
    """Forty concurrent requests are spread over both sites by capacity, and `fedctl status --json`
    shows both sites ready with the requests routed to each."""
    _, path, _ = federation
    before = {s["name"]: s["routed_requests"] for s in _status(path)["sites"]}

    async def one(i: int) -> str:
        raw = await client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=200,
            extra_body={"ignore_eos": True},
        )
        assert raw.parse().usage.completion_tokens == 200
        return raw.headers["x-federation-site"]

    sites = Counter(await asyncio.gather(*(one(i) for i in range(40))))
    assert set(sites) == {"kr-mi300x", "us-mi355x"}
    assert sites["us-mi355x"] > sites["kr-mi300x"], "the MI355X site has ~4.5x the prior capacity"
    status = _status(path)
    assert {s["name"]: s["state"] for s in status["sites"]} == {"kr-mi300x": "ready", "us-mi355x": "ready"}
    routed = {s["name"]: s["routed_requests"] - before[s["name"]] for s in status["sites"]}
    assert routed == dict(sites)
    # Every route acknowledged by the call it sent, every call finished: nothing left in transit.
    settled = poll_until(lambda: all(s["outstanding_requests"] == 0 for s in _status(path)["sites"]), 10, every_s=0.5)
    assert settled is not None, _status(path)["sites"]
    tiers = _status(path)["tiers"]  # and by service tier: the sites' queues, the gateway's answers
    assert tiers["default"]["ok"] >= 40 and tiers["default"]["ttft_p50_ms"] > 0, tiers
    assert all(t["at_sites"] == 0 and t["held"] == 0 for t in tiers.values()), tiers
    assert set(status["sites"][0]) >= {  # the keys; more may be added
        "name",
        "region",
        "gpu",
        "gpus",
        "state",
        "capacity_tok_s",
        "outstanding_requests",
        "routed_requests",
    }


async def test_generate_passthrough(federation, http: aiohttp.ClientSession) -> None:
    """SGLang's native /generate works through the gateway, whole and streamed (cumulative)."""
    fed, _, _ = federation
    base = fed.ready["endpoint"].removesuffix("/v1")
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    async with http.post(base + "/generate", json=body) as resp:
        out = await resp.json()
    assert out["meta_info"]["completion_tokens"] == 30 == len(out["output_ids"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    async with http.post(base + "/generate", json={**body, "stream": True}) as resp:
        lines = [line.decode().strip() async for line in resp.content if line.strip()]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["meta_info"]["completion_tokens"] == 30 and tokens.encode(last["text"]) == last["output_ids"]


async def test_client_disconnect_aborts_at_the_worker(federation, http: aiohttp.ClientSession) -> None:
    """A client that leaves mid-stream gets its request aborted at the worker (emulator metrics)."""
    fed, _, ports = federation
    aborted_before = await _worker_totals(http, ports, ABORTED)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 50_000, "stream": True, "ignore_eos": True}
    resp = await http.post(fed.ready["endpoint"] + "/chat/completions", json=body)
    await resp.content.readline()
    resp.close()
    for _ in range(100):
        if await _worker_totals(http, ports, ABORTED) > aborted_before:
            break
        await asyncio.sleep(0.1)
    assert await _worker_totals(http, ports, ABORTED) == aborted_before + 1


BAD_REQUESTS = [
    pytest.param(b'{"model": "openai/gpt-oss-120b", "messages": [', 400, id="malformed-json"),
    pytest.param({"model": MODEL}, 400, id="no-messages"),
    pytest.param({"model": MODEL, "messages": []}, 400, id="empty-messages"),
    pytest.param({"model": "gpt-4o", "messages": MESSAGES}, 404, id="unknown-model"),
    pytest.param({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}, 400, id="max-tokens-zero"),
    pytest.param({"model": MODEL, "messages": MESSAGES, "max_tokens": 200_000}, 400, id="max-tokens-past-context"),
    pytest.param({"model": MODEL, "messages": MESSAGES, "temperature": "hot"}, 400, id="wrong-type"),
    pytest.param(
        {"model": MODEL, "messages": [{"role": "user", "content": " hello" * 140_000}]}, 400, id="prompt-past-context"
    ),
    pytest.param(
        {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_200_000}]}, 400, id="too-long-to-tokenize"
    ),
    pytest.param(
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, 400, id="part-type"
    ),
    *(
        pytest.param({"model": MODEL, "messages": MESSAGES, field: value}, 400, id=f"refused-{field}-{i}")
        for i, (field, value) in enumerate(
            [
                ("tools", "not a list"),
                ("tool_choice", "required"),
                ("tool_choice", 7),
                ("response_format", {"type": "bogus"}),
                ("logprobs", "yes"),
                ("top_logprobs", 5),
                ("logit_bias", {"1000": 5}),
                ("logit_bias", "x"),
                ("best_of", -3),
            ]
        )
    ),
    pytest.param(
        {"model": MODEL, "messages": [*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
        400,
        id="history-with-tool-calls",
    ),
    pytest.param(
        {"model": MODEL, "messages": [*MESSAGES, {"role": "tool", "tool_call_id": "c", "content": "4"}]},
        400,
        id="tool-result",
    ),
]


@pytest.mark.parametrize(("body", "status"), BAD_REQUESTS)
async def test_bad_requests_never_reach_a_worker(federation, http: aiohttp.ClientSession, body, status) -> None:
    """Bad chat requests get an OpenAI error object with a 4xx status; no site is asked and no
    worker sees a request."""
    fed, path, ports = federation
    routed = _routed(path)
    seen = await _worker_totals(http, ports, SERVED, ABORTED)
    kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
    async with http.post(fed.ready["endpoint"] + "/chat/completions", **kwargs) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    extra = set(body) - {"model", "messages"} if isinstance(body, dict) else set()
    if len(extra) == 1:
        assert error["param"] == extra.pop(), error  # the field refused is named, not ignored
    assert _routed(path) == routed
    assert await _worker_totals(http, ports, SERVED, ABORTED) == seen


@pytest.mark.parametrize(
    "body",
    [
        {"input_ids": [-1, 5]},
        {"input_ids": [2**32]},
        {"text": "hi", "sampling_params": {"max_new_tokens": 2**32}},
        {"text": "hi", "sampling_params": "fast"},
        {"sampling_params": {}},
        {"text": "hi", "sampling_params": {"temprature": 0.5}},
        {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}},
        {"text": "hi", "image_data": "https://example.com/cat.png"},
        {"text": "hi", "lora_path": "adapter"},
        {"text": "hi", "return_logprob": "yes"},
        {"text": "hi", "rid": "has space"},
    ],
    ids=[
        "negative-id",
        "huge-id",
        "huge-max-new-tokens",
        "params-not-object",
        "no-prompt",
        "unknown-sampling-param",
        "sampling-param-type",
        "images",
        "lora",
        "return-logprob-type",
        "bad-rid",
    ],
)
async def test_bad_generate_requests_get_400(federation, http: aiohttp.ClientSession, body) -> None:
    """SGLang-native /generate through the gateway refuses bad input with a 400 JSON error naming
    the field, before any site is asked: SGLang's fields for what is not served here (images,
    LoRA adapters) are refused, not ignored."""
    fed, path, _ = federation
    routed = _routed(path)
    async with http.post(fed.ready["endpoint"].removesuffix("/v1") + "/generate", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    named = set(body) - {"text", "input_ids"} or {None}
    if len(named) == 1 and "text" in body:
        assert error["param"] == named.pop(), error
    assert _routed(path) == routed


async def test_generate_takes_what_sglang_and_its_router_send(federation, http: aiohttp.ClientSession) -> None:
    """Keys SGLang ignores (the sglang-router adds `model`, `log_metrics`, …) are ignored here too;
    SGLang's fields at their empty values are taken; `rid` is the answer's id, as in SGLang."""
    fed, _, _ = federation
    body = {
        "text": "hi",
        "rid": "my-run.42",
        "model": MODEL,
        "log_metrics": True,
        "return_hidden_states": False,
        "lora_path": None,
        "logprob_start_len": -1,
        "some_future_key": 1,
        "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
    }
    async with http.post(fed.ready["endpoint"].removesuffix("/v1") + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    assert answer["meta_info"]["id"] == "my-run.42" and answer["meta_info"]["completion_tokens"] == 5


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": [1, 2, -3]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"logprobs": 9}, "logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"n": 2}, "n"),
        ({"stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"messages": MESSAGES}, "messages"),
        ({"guided_json": {}}, "guided_json"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_bad_completions_are_refused_naming_the_field(federation, http: aiohttp.ClientSession, fields, param):
    fed, path, _ = federation
    routed = _routed(path)
    body = {"model": MODEL, "prompt": "Once upon a time", **fields}
    async with http.post(fed.ready["endpoint"] + "/completions", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert _routed(path) == routed


async def test_a_client_request_id_cannot_abort_anyone_else(federation, http: aiohttp.ClientSession) -> None:
    """Client-chosen request ids are for logs only: a client whose id is a prefix of everyone's
    ("req-") leaves, and another client's stream still completes; a repeated id is served too."""
    fed, _, _ = federation
    url = fed.ready["endpoint"] + "/chat/completions"
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 300, "stream": True, "ignore_eos": True}
    victim = await http.post(url, json=body)
    leaver = await http.post(url, json={**body, "max_tokens": 50_000}, headers={"X-Request-Id": "req-"})
    twin = await http.post(url, json={**body, "max_tokens": 20}, headers={"X-Request-Id": "req-"})
    await leaver.content.readline()
    leaver.close()
    text = (await victim.read()).decode()
    assert '"finish_reason":"length"' in text and text.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in (await twin.read()).decode()


def test_the_readme_tour_chat_gives_reasoning_and_a_tool_call(federation) -> None:
    """The README's first tour step, run as written (its endpoint made this federation's): the
    official client gets the reasoning apart from the answer and a call of the offered tool."""
    fed, _, _ = federation
    readme = (PROJECT_ROOT / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://127.0.0.1:8080/v1" in code
    code = code.replace("http://127.0.0.1:8080/v1", fed.ready["endpoint"])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    reasoning, call = out.splitlines()[:2]
    assert reasoning.startswith("reasoning: ") and len(reasoning) > len("reasoning: ") + 10, out
    name, arguments = call.removeprefix("tool call: ").split(" ", 1)
    assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str), out


def test_ctrl_c_stops_every_process(tmp_path: Path) -> None:
    """Ctrl-C on `fedctl up --launch` (its sites' agents launching a worker process per GPU, as a
    real site launches SGLang) stops the gateway, scheduler, agents and workers, and exits 0."""
    path, ports = _config(tmp_path, [("us-mi355x", "us-west-2", "mi355x")])
    fed = start_python("fedctl up", "federation.cli", ["up", "--launch", "--config", str(path)], timeout_s=90)
    fed.proc.send_signal(signal.SIGINT)
    assert fed.proc.wait(30) == 0
    for port in [ports["gateway"], ports["scheduler"], *range(ports["us-mi355x"], ports["us-mi355x"] + GPUS)]:
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still open"


async def test_latency_mode_refuses_what_no_site_can_start_within_its_budget(
    federation, http: aiohttp.ClientSession
) -> None:
    """With a TTFT budget no site can meet (1 µs: less than any prefill), the gateway holds the
    request until the budget is spent, then answers 429 with Retry-After and an OpenAI error,
    and no site is asked to run it; a budget a site can meet is served; a malformed one is 400."""
    fed, path, _ = federation
    base = fed.ready["endpoint"].removesuffix("/v1")
    before = _routed(path)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
    async with http.post(base + "/v1/completions", json=body, headers={"X-TTFT-Budget-Ms": "0.001"}) as resp:
        refused = await resp.json()
        assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
    assert refused["error"]["code"] == "ttft_budget_unmet"
    assert _routed(path) == before
    async with http.post(base + "/v1/completions", json=body, headers={"X-TTFT-Budget-Ms": "5000"}) as resp:
        assert resp.status == 200 and (await resp.json())["usage"]["completion_tokens"] >= 1
    async with http.post(base + "/v1/completions", json=body, headers={"X-TTFT-Budget-Ms": "soon"}) as resp:
        assert resp.status == 400 and "X-TTFT-Budget-Ms" in (await resp.json())["error"]["message"]


async def _get_json(http: aiohttp.ClientSession, url: str) -> dict:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_sglang_info_endpoints_answer_for_the_federation(federation, http: aiohttp.ClientSession) -> None:
    """SGLang's /model_info, /server_info (and their /get_ aliases) and /v1/loads answer in
    SGLang 0.5.23's keys and types with the federation's values: the served model, one DP rank
    per site in name order (each naming its site), the ready sites' slots and KV pools (by GPU
    profile) summed; `dp_rank` picks one site (none past the last), the Prometheus form says the
    same numbers."""
    fed, path, ports = federation
    base = fed.ready["endpoint"].removesuffix("/v1")
    config = load(path)
    state = fetch_state(config.scheduler_addresses[0], operator_tls(control.tls_dir(config)) or INSECURE)
    sites = sorted(state.sites, key=lambda s: s.name)
    ready = [s for s in sites if s.status.label == "ready" and s.healthy_workers > 0]
    assert [s.name for s in ready] == ["kr-mi300x", "us-mi355x"]

    for info in [await _get_json(http, base + p) for p in ("/model_info", "/get_model_info")]:
        assert info["model_path"] == info["served_model_name"] == info["tokenizer_path"] == MODEL
        assert info["is_generation"] is True and info["model_type"] == "gpt_oss"
        assert info["architectures"] == ["GptOssForCausalLM"] and info["reasoning_parser"] == "gpt-oss"

    server, alias = [await _get_json(http, base + p) for p in ("/server_info", "/get_server_info")]
    assert server.keys() == alias.keys()
    assert server["model_path"] == server["served_model_name"] == server["tokenizer_path"] == MODEL
    assert server["port"] == ports["gateway"] and isinstance(server["host"], str)
    assert server["tp_size"] == 1 and server["dp_size"] == len(sites) == len(server["internal_states"])
    assert server["incremental_streaming_output"] is False and server["stream_interval"] == 1
    assert server["status"] == "ready" and server["version"] == "0.5.23"
    assert server["max_running_requests"] == sum(s.slots for s in ready) > 0
    kv = {s.name: PROFILES[s.gpu].kv_capacity_tokens * s.healthy_workers for s in sites}
    assert server["max_total_num_tokens"] == sum(kv[s.name] for s in ready)
    assert server["max_req_input_len"] == 131_072 - 1 - 5  # SGLang's: the context less 1, less 5
    assert server["federation"]["ready_sites"] == [s.name for s in ready]
    for rank, (site, internal) in enumerate(zip(sites, server["internal_states"], strict=True)):
        assert internal["dp_rank"] == rank and internal["federation"]["site"] == site.name
        assert internal["max_running_requests"] == site.slots and internal["max_total_num_tokens"] == kv[site.name]
        assert internal["model_path"] == MODEL and internal["federation"]["gpus"] == site.gpus

    loads = await _get_json(http, base + "/v1/loads")
    assert loads["version"] == "0.5.23" and loads["num_accelerators"] == sum(s.gpus for s in sites) == 2 * GPUS
    assert datetime.fromisoformat(loads["timestamp"]).tzinfo is not None
    assert "MI300X" in loads["accelerator"] and "MI355X" in loads["accelerator"]
    assert [entry["dp_rank"] for entry in loads["loads"]] == list(range(len(sites)))
    for site, entry in zip(sites, loads["loads"], strict=True):
        assert entry["federation"]["site"] == site.name and entry["max_running_requests"] == site.slots
        assert entry["max_total_num_tokens"] == kv[site.name]
        assert abs(entry["timestamp"] - time.time()) < 30
        for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens"):
            assert isinstance(entry[key], int) and entry[key] >= 0
        for key in ("token_usage", "gen_throughput", "cache_hit_rate", "utilization"):
            assert isinstance(entry[key], float)
    one = await _get_json(http, base + "/v1/loads?dp_rank=1&include=core,queues")
    assert [entry["federation"]["site"] for entry in one["loads"]] == [sites[1].name]
    assert (await _get_json(http, base + "/v1/loads?dp_rank=9"))["loads"] == []
    async with http.get(base + "/v1/loads?format=prometheus") as resp:
        text = await resp.text()
    assert resp.status == 200 and resp.content_type == "text/plain"
    assert f'sglang_max_running_requests{{dp_rank="1"}} {sites[1].slots}' in text


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ("/v1/loads?include=core,bogus", "include"),
        ("/v1/loads?dp_rank=first", "dp_rank"),
        ("/v1/loads?format=xml", "format"),
        ("/v1/loads?verbose=1", "verbose"),
        ("/v1/loads?dp_rank=0&dp_rank=1", "dp_rank"),
        ("/server_info?detail=all", "detail"),
        ("/model_info?x=1", "x"),
    ],
)
async def test_sglang_info_refuses_a_query_it_does_not_take(federation, http: aiohttp.ClientSession, query, param):
    """A query parameter the info endpoints do not take, or a value SGLang would refuse, is a 400
    in OpenAI's shape naming the parameter (SGLang would ignore an unknown one: here it is said)."""
    fed, _, _ = federation
    async with http.get(fed.ready["endpoint"].removesuffix("/v1") + query) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 400 and error["param"] == param and error["type"] == "invalid_request_error"
