"""The real sglang-router (PyPI) admits emulated workers, health-checks them and routes to them.

The router runs in a network namespace whose only link leads to this host, so its
attempt to fetch a tokenizer from the model hub fails at once instead of leaving
the machine.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator

import aiohttp
import openai
import pytest

from core import tokens
from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import free_port_block, launch
from tests import netns
from tests.test_worker_state import metric

pytestmark = pytest.mark.netns
ROUTER_READY_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def test_host() -> Iterator[netns.TestHost]:
    try:
        host = netns.create("rt")
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"needs root and `ip netns`: {exc}")
    yield host
    netns.destroy(host)


@pytest.fixture(scope="module")
def workers(test_host: netns.TestHost) -> Iterator[Emulator]:
    emu = launch(["--profile", "mi355x", "--workers", "2", "--speed", "20"], host=test_host.host_ip)
    yield emu
    emu.stop()


@pytest.fixture(scope="module", params=["round_robin", "power_of_two", "cache_aware"])
async def router(request, test_host: netns.TestHost, workers: Emulator) -> AsyncIterator[tuple[str, str]]:
    """The router's URL and policy, once it lists both workers healthy."""
    port = free_port_block(1)
    cmd = test_host.exec_args(
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *workers.urls,
        "--policy",
        request.param,
        "--host",
        test_host.ns_ip,
        "--port",
        str(port),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warn",
    )
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{test_host.ns_ip}:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(int(ROUTER_READY_TIMEOUT_S * 4)):
                try:
                    async with http.get(url + "/workers") as resp:
                        body = await resp.json()
                        if resp.status == 200 and sum(w["is_healthy"] for w in body["workers"]) == 2:
                            break
                except (aiohttp.ClientError, ValueError):
                    pass
                assert proc.returncode is None, "router exited"
                await asyncio.sleep(0.25)
            else:
                pytest.fail("router never admitted both workers")
        yield url, request.param
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def test_router_admits_both_workers(
    router: tuple[str, str], workers: Emulator, http: aiohttp.ClientSession
) -> None:
    """The router health-checks our workers, reads their server/model info and lists them healthy."""
    async with http.get(router[0] + "/workers") as resp:
        listed = (await resp.json())["workers"]
    assert sorted(w["url"] for w in listed) == sorted(workers.urls)
    assert all(w["is_healthy"] and w["model_id"] == "openai/gpt-oss-120b" for w in listed)


async def test_router_routes_generate(router: tuple[str, str], workers: Emulator, http: aiohttp.ClientSession) -> None:
    """/generate through the router, whole and streamed, comes back with the worker's exact bodies;
    round robin spreads the requests over both workers."""
    router_url, policy = router
    before = [await _requests_total(http, url) for url in workers.urls]
    for i in range(8):
        body = {"text": f"hello {i}", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}}
        async with http.post(router_url + "/generate", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
        assert out["meta_info"]["completion_tokens"] == 20 == len(out["output_ids"])
        assert tokens.encode(out["text"]) == out["output_ids"]
    body = {"text": "stream", "stream": True, "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}
    async with http.post(router_url + "/generate", json=body) as resp:
        lines = [line.decode().strip() async for line in resp.content if line.strip()]
    assert lines[-1] == "data: [DONE]"
    assert '"completion_tokens":30' in lines[-2] and '"type":"length"' in lines[-2]
    after = [await _requests_total(http, url) for url in workers.urls]
    assert sum(a - b for a, b in zip(after, before, strict=True)) == 9
    if policy == "round_robin":
        assert [a - b for a, b in zip(after, before, strict=True)] in ([4, 5], [5, 4])


async def test_router_routes_chat_for_the_openai_client(router: tuple[str, str]) -> None:
    """The openai client through the router gets whole and streamed chat answers whose usage adds up."""
    async with openai.AsyncOpenAI(base_url=router[0] + "/v1", api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": "hi"}]
        resp = await client.chat.completions.create(
            model="openai/gpt-oss-120b", messages=messages, max_tokens=25, extra_body={"ignore_eos": True}
        )
        assert resp.usage is not None and resp.usage.completion_tokens == 25
        assert len(tokens.encode(resp.choices[0].message.content or "")) == 25
        stream = await client.chat.completions.create(
            model="openai/gpt-oss-120b",
            messages=messages,
            max_tokens=25,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(tokens.encode(text)) == 25
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 25


async def _requests_total(http: aiohttp.ClientSession, url: str) -> float:
    async with http.get(url + "/metrics") as resp:
        return metric(await resp.text(), "sglang:num_requests_total")
