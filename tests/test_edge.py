"""The gateway's port as an attacker on the internet meets it: connections that never send a
request, a request head trickled a byte at a time, a body that never finishes, and one address
opening more connections than its cap. Each is closed or refused in bounded time, and a
well-behaved client of the same gateway is served meanwhile."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest

from core.processes import Child, free_port_block, start_python

IDLE_S = 1.0
PER_ADDRESS = 4


@pytest.fixture
def gateway() -> Iterator[int]:
    """A gateway with short edge limits; its schedulers are not there (nothing here is routed)."""
    port, nowhere = free_port_block(2), free_port_block(1)
    args = ["--port", str(port), "--scheduler", f"127.0.0.1:{nowhere}", "--insecure"]
    args += ["--idle-timeout-s", str(IDLE_S), "--body-timeout-s", str(IDLE_S)]
    args += ["--max-connections-per-address", str(PER_ADDRESS)]
    child: Child = start_python("gateway at the edge", "federation.gateway", args)
    yield port
    child.stop()


async def _closed_after(reader: asyncio.StreamReader, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the server closed the connection, and what it sent before."""
    started, got = time.monotonic(), b""
    async with asyncio.timeout(limit_s):
        while chunk := await reader.read(65536):
            got += chunk
    return time.monotonic() - started, got


async def test_idle_and_slow_header_connections_are_closed(gateway: int) -> None:
    idle_r, idle_w = await asyncio.open_connection("127.0.0.1", gateway)
    slow_r, slow_w = await asyncio.open_connection("127.0.0.1", gateway)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 50

    async def trickle() -> None:
        """A byte every 0.1 s: the head never ends, and each byte comes well inside the timeout."""
        for byte in head:
            slow_w.write(bytes([byte]))
            await slow_w.drain()
            await asyncio.sleep(0.1)

    trickling = asyncio.ensure_future(trickle())
    try:
        idle_s, _ = await _closed_after(idle_r, 5 * IDLE_S)
        slow_s, _ = await _closed_after(slow_r, 5 * IDLE_S)
    finally:
        trickling.cancel()
        await asyncio.gather(trickling, return_exceptions=True)
        idle_w.close()
        slow_w.close()
    assert idle_s < 3 * IDLE_S and slow_s < 3 * IDLE_S
    assert not trickling.done() or trickling.cancelled()  # closed while still trickling


async def test_a_body_that_never_finishes_is_a_408(gateway: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    writer.write(b'Content-Length: 1000\r\n\r\n{"model": ')
    await writer.drain()
    try:
        _, got = await _closed_after(reader, 5 * IDLE_S)
    finally:
        writer.close()
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    assert json.loads(body)["error"]["code"] == "request_timeout"


async def test_an_address_over_its_cap_is_refused_and_others_are_served(gateway: int) -> None:
    held = [await asyncio.open_connection("127.0.0.1", gateway) for _ in range(PER_ADDRESS)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway)
        _, got = await _closed_after(reader, 5 * IDLE_S)
        writer.close()
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 429") and b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
    finally:
        for _, w in held[1:]:
            w.close()
    await asyncio.sleep(0.2)  # the server sees them closed
    async with aiohttp.ClientSession() as http:  # one freed: a client is served again
        async with http.get(f"http://127.0.0.1:{gateway}/v1/models") as resp:
            assert resp.status == 200
        async with http.get(f"http://127.0.0.1:{gateway}/metrics") as resp:
            text = await resp.text()
    assert "federation_gateway_refused_connections_total 1.0" in text
    held[0][1].close()


async def test_huge_prompts_are_refused_at_the_context_not_tokenized_whole(gateway: int) -> None:
    """A ~50-MB chat of 60 long messages (each under the tokenizer's per-piece guard) and one
    900 k-character piece the tokenizer cannot take at once: each is a 400 naming the context.
    Tokenizing stops once the context is passed, so the first costs about one message, not 60."""
    message = {"role": "user", "content": "lorem ipsum dolor sit amet " * 30_000}
    chat = {"model": "openai/gpt-oss-120b", "messages": [message] * 60}
    piece = {"model": "openai/gpt-oss-120b", "prompt": "x " * 450_000}
    async with aiohttp.ClientSession() as http:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", piece)):
            async with http.post(f"http://127.0.0.1:{gateway}{path}", json=body) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 400, error
            assert "longer than the model's context of 131072 tokens" in error["message"]
