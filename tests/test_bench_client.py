"""The load generator's client (federation/bench/client.py over connections.py) against a real
aiohttp server on loopback: what it reads of a stream, what it makes of every way an endpoint
can fail, and that it keeps connections alive only when an answer ended whole."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp import web

from federation.bench import client, connections, scenarios
from federation.bench.workload import Sample

TOKENS = 5
SAMPLE = Sample(0, "hello", 1, TOKENS)


def _chunk(text: str, completion_tokens: int) -> bytes:
    usage = {"prompt_tokens": 1, "completion_tokens": completion_tokens, "total_tokens": 1 + completion_tokens}
    event = {"object": "text_completion", "choices": [{"index": 0, "text": text}], "usage": usage}
    return b"data: " + orjson.dumps(event) + b"\n\n"


class Endpoint:
    """A streamed /v1/completions whose behaviour each test picks by the prompt: it keeps the
    connection (transport) of every request, so reuse of a connection shows."""

    def __init__(self) -> None:
        self.connections: list[object] = []
        self.disconnected = asyncio.Event()
        self.refusals_left = 3  # "flaky": the first requests are refused, the rest answered

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.connections.append(request.transport)
        mode = (await request.json())["prompt"]
        if mode == "flaky" and self.refusals_left > 0:
            self.refusals_left -= 1
            mode = "refused"
        if mode == "refused":
            return web.json_response({"error": {"message": "slow down", "code": 429}}, status=429)
        response = web.StreamResponse(
            headers={"X-Federation-Site": "kr", "Server-Timing": "hop;dur=2.50, route;dur=1.25"}
        )
        await response.prepare(request)
        try:
            for k in range(1, TOKENS + 1):
                if mode == "error" and k == 3:
                    await response.write(b'data: {"error": {"message": "the site failed", "code": 503}}\n\n')
                    return response
                if mode == "dropped" and k == 3:
                    request.transport.close()  # type: ignore[union-attr]
                    return response
                await response.write(_chunk("x", k))
                if mode == "slow":
                    await asyncio.sleep(0.2)
                if mode == "long-line" and k == 1:
                    await response.write(b"data: " + b"y" * 4096)
                    await asyncio.sleep(0.1)  # the unended line arrives alone
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        await response.write_eof()
        return response


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[str, Endpoint]]:
    served = Endpoint()
    app = web.Application()
    app.router.add_post("/v1/completions", served.completions)
    app.router.add_get("/v1/models", served.models)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/v1", served
    finally:
        await runner.cleanup()


async def _send(url: str, http: connections.Session, mode: str, **kwargs) -> client.Result:
    return await client.send(http, url, "m", Sample(0, mode, 1, TOKENS), **kwargs)


async def test_a_stream_is_read_whole_and_its_connection_kept(endpoint: tuple[str, Endpoint]) -> None:
    """A streamed answer gives its tokens (from the usage), one event per text chunk, its first
    token's time, the site and Server-Timing; the next request goes on the same connection."""
    url, served = endpoint
    firsts: list[float] = []
    async with client.session(url) as http:
        one = await _send(url, http, "ok", on_first_token=lambda: firsts.append(time.monotonic()))
        two = await _send(url, http, "ok")
    assert (one.error, one.output_tokens, one.events, one.site, one.hop_ms, one.route_ms) == (
        None, TOKENS, TOKENS, "kr", 2.5, 1.25,
    )  # fmt: skip
    assert one.first_token is not None and len(firsts) == 1 and one.started <= one.first_token <= firsts[0]
    assert two.ok and served.connections[0] is served.connections[1]


async def test_every_failure_is_a_result_and_a_broken_connection_is_not_reused(
    endpoint: tuple[str, Endpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal says its status and body; an error event, a connection dropped mid-answer and an
    over-long line each end their answer with why (never an exception), and each such connection
    is closed: the next request comes from a new one. A refusal's connection, whole, is kept."""
    url, served = endpoint
    monkeypatch.setattr(connections, "MAX_LINE_BYTES", 1024)
    async with client.session(url) as http:
        refused = await _send(url, http, "refused")
        after_refusal = await _send(url, http, "ok")
        error = await _send(url, http, "error")
        dropped = await _send(url, http, "dropped")
        long_line = await _send(url, http, "long-line")
        last = await _send(url, http, "ok")
    assert refused.error is not None and refused.error.startswith("HTTP 429: ") and "slow down" in refused.error
    assert error.error == "stream error: {'message': 'the site failed', 'code': 503}"
    assert dropped.error is not None and "closed the connection" in dropped.error and dropped.output_tokens == 2
    assert long_line.error == "ValueError: the endpoint sent a line over 1024 bytes"
    assert after_refusal.ok and last.ok
    used = served.connections
    assert used[1] is used[0] and used[2] is used[1]  # kept after the refusal and after a whole answer
    assert used[3] is not used[2] and used[4] is not used[3] and used[5] is not used[4]  # each broken one replaced


async def test_an_answer_cut_at_the_window_says_its_tokens_so_far_and_hangs_up(
    endpoint: tuple[str, Endpoint],
) -> None:
    """At `stop_at` the answer is cut: the tokens the last chunk said, as of that chunk; the
    connection is closed, so the endpoint sees its client leave."""
    url, served = endpoint
    async with client.session(url) as http:
        cut = await _send(url, http, "slow", stop_at=time.monotonic() + 0.5)
        await asyncio.wait_for(served.disconnected.wait(), 5)
    assert cut.cut and cut.error is None and 1 <= cut.output_tokens < TOKENS


async def test_an_endpoint_that_does_not_listen_is_a_result(unused_tcp_port: int) -> None:
    """No server at the address: a Result with the connection's error, not an exception."""
    url = f"http://127.0.0.1:{unused_tcp_port}/v1"
    async with client.session(url) as http:
        result = await _send(url, http, "ok")
    assert result.error is not None and "ConnectionRefusedError" in result.error and result.output_tokens == 0


async def _raw_endpoint(reply: bytes) -> tuple[asyncio.Server, str]:
    """A peer that answers each request with `reply` as it is, then closes the connection."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"


@pytest.mark.parametrize(
    ("status", "last_line_ended", "error"),
    [("200 OK", True, None), ("200 OK", False, None), ("503 Service Unavailable", True, "HTTP 503: overloaded")],
)
async def test_a_body_that_runs_until_the_close_is_read_whole(status: str, last_line_ended: bool, error) -> None:
    """An answer with neither chunks nor a length (HTTP/1.0's framing: its end is the close) is
    whole when the server closes, its last line read even without a line end; a refusal framed
    so still says its status."""
    body = b"".join(_chunk("x", k) for k in range(1, TOKENS + 1)) if status.startswith("200") else b"overloaded"
    if not last_line_ended:
        body = body.rstrip(b"\n")
    server, url = await _raw_endpoint(f"HTTP/1.0 {status}\r\nContent-Type: text/event-stream\r\n\r\n".encode() + body)
    try:
        async with client.session(url) as http:
            result = await _send(url, http, "ok")
    finally:
        server.close()
    assert result.error == error
    if error is None:
        assert (result.output_tokens, result.events) == (TOKENS, TOKENS)


async def test_stale_connections_are_closed_not_left_beside_a_newer_one(
    endpoint: tuple[str, Endpoint], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle connections older than IDLE_REUSE_S are closed when the next request looks for one,
    oldest first, even while a newer one is reused."""
    url, served = endpoint
    monkeypatch.setattr(connections, "IDLE_REUSE_S", 0.5)
    async with client.session(url) as http:
        burst = await asyncio.gather(*(_send(url, http, "ok") for _ in range(5)))
        await asyncio.sleep(0.3)
        reused = await _send(url, http, "ok")  # the newest: the others are 0.3 s idle, not stale yet
        await asyncio.sleep(0.35)
        again = await _send(url, http, "ok")  # the same one again; the other four are now stale
        await asyncio.sleep(0.2)  # their connection_lost
        assert all(r.ok for r in (*burst, reused, again)) and len(http._open) == 1
    used = served.connections
    assert len({id(c) for c in used[:5]}) == 5 and used[5] in used[:5] and used[6] is used[5]


async def test_bytes_after_an_answer_close_its_connection() -> None:
    """Bytes after an answer's end that nobody asked for: the answer stands, and the connection
    is closed rather than reused for the next request."""
    answer = b"".join(_chunk("x", k) for k in range(1, TOKENS + 1)) + b"data: [DONE]\n\n"
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(answer), answer) + b"GARBAGE"
    seen = 0

    async def answer_each(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal seen
        seen += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                writer.write(reply)
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(answer_each, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        async with client.session(url) as http:
            results = [await _send(url, http, "ok") for _ in range(2)]
    finally:
        server.close()
    assert [(r.error, r.output_tokens) for r in results] == [(None, TOKENS)] * 2 and seen == 2


def _sustain(url: str, prompt: str, window_s: float) -> list[client.Result]:
    """Two lanes of a sustained run (one client process, this one), as drills and benches run them."""
    sustain = scenarios.Sustain(warmup_s=0.0, window_s=window_s)
    results, _ = scenarios.run_sustained(url, [Sample(0, prompt, 1, TOKENS)], 2, sustain, 1.0, "test")
    return results


async def test_a_lane_backs_off_an_endpoint_that_refuses_instead_of_spinning(endpoint: tuple[str, Endpoint]) -> None:
    """Every request refused at once: each lane waits 0.1 s after a failure, doubling, instead of
    sending again at once (before: ~1,000 refused requests a second per lane, each counted)."""
    url, _ = endpoint
    started = time.monotonic()
    results = await asyncio.to_thread(_sustain, url, "refused", 1.5)
    took = time.monotonic() - started
    assert results and all((r.error or "").startswith("HTTP 429") for r in results)
    # per lane: sent at 0, 0.1, 0.3, 0.7, 1.5, 3.1 s after it started, until the run stops
    assert 2 <= len(results) <= 2 * math.ceil(math.log2(took / scenarios.LANE_BACKOFF_S + 1)), (len(results), took)


async def test_a_lane_that_recovers_sends_at_full_pace_again(endpoint: tuple[str, Endpoint]) -> None:
    """The back-off ends with the first answer: three refusals, then answers as fast as they come."""
    url, _ = endpoint
    results = await asyncio.to_thread(_sustain, url, "flaky", 2.0)
    failed = [r for r in results if not r.ok]
    assert len(failed) == 3 and all((r.error or "").startswith("HTTP 429") for r in failed)
    # ~5,000 answered here; a back-off never reset leaves at most 2 lanes x 3 s / 0.1 s = 60
    assert len(results) - len(failed) > 200
