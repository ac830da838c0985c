"""Info, load and metrics endpoints tell the truth about the emulated GPU."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (summed over label sets that match `labels`)."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
            found = True
    assert found, f"{name} {labels} not exported"
    return total


async def idle_metrics(http: aiohttp.ClientSession, url: str, within_s: float = 5.0) -> str:
    """The worker's /metrics once its gauges show it idle. The last token reaches the client
    before the scheduler's next round logs the idle point (as in SGLang), so a scrape right after
    a stream ends may still show the batch it finished in; wait a bounded time for the idle one."""
    deadline = asyncio.get_running_loop().time() + within_s
    while True:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        if metric(text, "sglang:num_running_reqs") == 0:
            return text
        assert asyncio.get_running_loop().time() < deadline, "the worker never logged its idle point"
        await asyncio.sleep(0.05)


async def test_info_endpoints(mi355x: Emulator, http: aiohttp.ClientSession) -> None:
    """model_info, server_info (and their get_ aliases), health and flush_cache answer as SGLang's do."""
    url = mi355x.urls[0]
    for path in ("/model_info", "/get_model_info"):
        async with http.get(url + path) as resp:
            info = await resp.json()
        assert info["model_path"] == "openai/gpt-oss-120b" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):
        async with http.get(url + path) as resp:
            info = await resp.json()
        assert info["max_total_num_tokens"] == 3_060_000
        assert info["incremental_streaming_output"] is False
        assert len(info["internal_states"]) == 1 and info["version"]
    for path in ("/health", "/health_generate"):
        async with http.get(url + path) as resp:
            assert resp.status == 200 and await resp.read() == b""
    async with http.post(url + "/flush_cache") as resp:
        assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")


async def test_load_and_metrics_follow_the_batch(http: aiohttp.ClientSession) -> None:
    """With a limit of 4 running requests and 7 sent, loads and metrics show 4 running and 3
    queued; the queued ones wait for a slot, so their time to first token is longer; when all
    finish, the counters hold exactly the tokens the clients received."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", "20", "--max-running-requests", "4"])
    try:
        url = emu.urls[0]

        async def one(i: int) -> tuple[float, int]:
            body = {
                "text": f"q{i}",
                "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
            }
            loop = asyncio.get_running_loop()
            start, first, tokens_ = loop.time(), None, 0
            async with http.post(url + "/generate", json=body) as resp:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        first = first or loop.time()
                        tokens_ = int(re.search(rb'"completion_tokens":(\d+)', line).group(1))
            return first - start, tokens_

        tasks = [asyncio.create_task(one(i)) for i in range(7)]
        await asyncio.sleep(0.6)
        async with http.get(url + "/v1/loads") as resp:
            load = (await resp.json())["loads"][0]
        async with http.get(url + "/get_load") as resp:
            old = (await resp.json())[0]
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        assert (load["num_running_reqs"], load["num_waiting_reqs"]) == (4, 3)
        assert old["num_reqs"] == 7 and old["num_waiting_reqs"] == 3
        assert metric(text, "sglang:num_running_reqs") == 4
        assert metric(text, "sglang:num_queue_reqs") == 3
        assert 4 * 1 < metric(text, "sglang:num_used_tokens") < 4 * 1600
        assert metric(text, "sglang:gen_throughput") > 0
        results = await asyncio.gather(*tasks)
        ttfts = sorted(t for t, _ in results)
        assert ttfts[4] > 3 * ttfts[3], "queued requests wait for a running one to finish"
        text = await idle_metrics(http, url)
        assert (
            metric(text, "sglang:generation_tokens_total", is_streaming="true")
            == sum(n for _, n in results)
            == 7 * 1500
        )
        assert metric(text, "sglang:num_requests_total", is_streaming="true") == 7
        assert metric(text, "sglang:time_to_first_token_seconds_count", is_streaming="true") == 7
        assert metric(text, "sglang:inter_token_latency_seconds_count") == 7 * 1499
    finally:
        emu.stop()


async def test_client_disconnect_aborts_the_request(fresh_worker: Emulator, http: aiohttp.ClientSession) -> None:
    """A client that goes away mid-stream gets its request aborted at the worker: the slot frees and
    the abort shows in the metrics."""
    url = fresh_worker.urls[0]
    body = {"text": "go", "stream": True, "sampling_params": {"max_new_tokens": 50_000, "ignore_eos": True}}
    resp = await http.post(url + "/generate", json=body)
    await resp.content.readline()
    resp.close()
    for _ in range(50):
        async with http.get(url + "/metrics") as m:
            text = await m.text()
        if metric(text, "sglang:num_aborted_requests_total") == 1 and metric(text, "sglang:num_running_reqs") == 0:
            break
        await asyncio.sleep(0.1)
    assert metric(text, "sglang:num_aborted_requests_total") == 1
    assert metric(text, "sglang:num_running_reqs") == 0
