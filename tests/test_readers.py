"""A site agent whose workers' streams are read by reader processes (`--readers`,
nodes/agent/readers.py) relays exactly what it relays reading them itself, stops a worker's
request when its gateway cancels it, and loses nothing but a reader's own streams when that
reader dies: those fail over as a broken worker's would, the workers stay in service, and the
reader is started again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import aiohttp
import psutil
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from core import wire
from core.errors import SiteWorkerFailed, UpstreamFailed
from core.processes import Child, free_port_block, start_python
from core.settings import AgentTimings
from federation.gateway.upstream import SiteStream, Upstream
from nodes.agent import worker_stream
from nodes.agent.readers import (
    MAX_MESSAGE_BYTES,
    READER_MODULE,
    Frames,
    ReaderLost,
    ReaderPool,
    frame,
)
from nodes.agent.sglang import WorkerFailed
from nodes.emulator.launch import EmulatorProcess, launch
from tests.conftest import until

TIMINGS = AgentTimings()
SILENT_S = TIMINGS.reader_silent_s


@pytest.fixture(scope="module")
def workers() -> Iterator[EmulatorProcess]:
    emulator = launch(["--profile", "mi355x", "--workers", "2", "--speed", "20", "--incremental-streaming-output"])
    yield emulator
    emulator.stop()


def _agent(urls: list[str], readers: int, log: IO[str] | None = None) -> tuple[Child, int, int]:
    """An agent on `urls` with `readers` reader processes (its log lines to `log`, else ours): it, its
    gRPC port and its metrics port."""
    port = free_port_block(2)
    metrics = port + 1
    args = ["--insecure", "--site", "s", "--region", "r", "--gpu", "mi355x", "--gpus", "2", "--port", str(port)]
    args += ["--metrics-port", str(metrics), "--readers", str(readers)]
    args += ["--scheduler", f"127.0.0.1:{free_port_block(1)}"]  # nobody there: the agent keeps retrying
    for url in urls:
        args += ["--worker-url", url]
    return start_python("agent", "nodes.agent", args, log=log), port, metrics


def _readers_of(pid: int) -> list[psutil.Process]:
    """The live reader processes `pid` started: a child that has died (a zombie until its parent
    reaps it, or gone) is none, since its command line can no longer be read."""
    readers = []
    for child in psutil.Process(pid).children():
        try:
            if READER_MODULE in " ".join(child.cmdline()):
                readers.append(child)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return readers


class _Heard:
    """A worker's `heard`, for calls started here rather than by an agent's pool."""

    last_event_at = 0.0


@dataclass
class Answer:
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    completion: int = 0
    finish: str = ""
    failed: type[UpstreamFailed] | None = None  # how the site said it failed the stream


def _request(i: int, tokens: int) -> wire.GenerateRequest:
    params = {"max_new_tokens": tokens, "ignore_eos": True, "sampling_seed": 1000 + i}
    return wire.GenerateRequest(f"q{i}", 8, params, input_ids=tuple(range(1000 + i, 1008 + i)))


async def _generate(upstream: Upstream, port: int, i: int, tokens: int, started: asyncio.Event | None = None) -> Answer:
    answer = Answer()

    def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
        answer.text.append(delta.text)
        answer.ids.extend(delta.output_ids)
        answer.completion = delta.completion_tokens
        if delta.finish_reason:
            answer.finish = delta.finish_reason["type"]
        if started is not None and answer.completion:
            started.set()

    stream = upstream.start("s", f"127.0.0.1:{port}", _request(i, tokens), deliver)
    try:
        async with asyncio.timeout(60):
            await stream.first  # a failure before any token ends this one (the gateway retries it)
            await stream.done
    except UpstreamFailed as exc:
        answer.failed = type(exc)
    finally:
        stream.close()
    return answer


async def _running(http: aiohttp.ClientSession, urls: list[str]) -> int:
    total = 0
    for url in urls:
        async with http.get(url + "/v1/loads") as resp:
            total += sum(load["num_running_reqs"] + load["num_waiting_reqs"] for load in (await resp.json())["loads"])
    return total


async def _healthy_workers(http: aiohttp.ClientSession, metrics: int) -> float:
    async with http.get(f"http://127.0.0.1:{metrics}/metrics") as resp:
        text = await resp.text()
    samples = (s for f in text_string_to_metric_families(text) for s in f.samples)
    return next(s.value for s in samples if s.name == "federation_agent_workers" and s.labels["health"] == "healthy")


@pytest.mark.timeout(120)
async def test_readers_relay_exactly_what_the_agent_relays_itself(workers: EmulatorProcess) -> None:
    """The same 24 seeded requests through an agent that reads its workers and through one with
    two readers: the same text, ids, counts and finishes, token for token."""
    answers = {}
    for readers in (0, 2):
        agent, port, _ = _agent(workers.urls, readers)
        try:
            assert len(_readers_of(agent.pid)) == readers
            upstream = Upstream()
            results = await asyncio.gather(*(_generate(upstream, port, i, 300) for i in range(24)))
            await upstream.close()
        finally:
            agent.stop()
        answers[readers] = [("".join(a.text), a.ids, a.completion, a.finish, a.failed) for a in results]
    assert all(a[2] == 300 and len(a[1]) == 300 and a[3] == "length" for a in answers[2]), answers[2][0][2:]
    assert answers[2] == answers[0]


@pytest.mark.timeout(120)
async def test_a_reader_that_dies_fails_only_its_streams_and_comes_back(
    workers: EmulatorProcess, tmp_path: Path
) -> None:
    """Two readers, 16 long answers; one reader is killed mid-answer. Its streams end with a
    worker failure (the gateway resumes them), the others complete; the workers stay healthy and
    drop the dead reader's requests (its connections closed); a new reader starts and serves."""
    log = (tmp_path / "agent.log").open("w")
    agent, port, metrics = _agent(workers.urls, 2, log)
    upstream = Upstream()
    try:
        async with aiohttp.ClientSession() as http:
            started = asyncio.Event()
            answers = [
                asyncio.ensure_future(_generate(upstream, port, i, 4000, started if i == 15 else None))
                for i in range(16)
            ]
            await asyncio.wait_for(started.wait(), 20)
            victim = _readers_of(agent.pid)[0]
            os.kill(victim.pid, signal.SIGKILL)
            results = await asyncio.gather(*answers)
            failed = [a for a in results if a.failed]
            completed = [a for a in results if not a.failed]
            assert failed and completed, [a.failed for a in results]
            assert {a.failed for a in failed} == {SiteWorkerFailed}  # resumed by the gateway, at this site too
            assert all(a.completion < 4000 and len(a.ids) == a.completion for a in failed)
            assert all(a.completion == len(a.ids) == 4000 for a in completed)
            assert await _healthy_workers(http, metrics) == 2
            assert "worker.unhealthy" not in (tmp_path / "agent.log").read_text()  # the reader died, not they
            assert await _running(http, workers.urls) == 0  # nothing left generating for nobody

            async def two_readers() -> bool:
                return len(_readers_of(agent.pid)) == 2

            await until(two_readers, 10)
            assert victim.pid not in {p.pid for p in _readers_of(agent.pid)}
            again = await asyncio.gather(*(_generate(upstream, port, i, 200) for i in range(8)))
            assert all(a.completion == 200 and not a.failed for a in again)
    finally:
        await upstream.close()
        agent.stop()
        log.close()


@pytest.mark.timeout(60)
async def test_a_cancelled_stream_stops_at_its_worker(workers: EmulatorProcess) -> None:
    """The gateway cancels a long answer read by a reader: the worker stops generating it."""
    agent, port, _ = _agent(workers.urls, 1)
    upstream = Upstream()
    try:
        async with aiohttp.ClientSession() as http:
            started = asyncio.Event()

            def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
                started.set()

            stream = upstream.start("s", f"127.0.0.1:{port}", _request(0, 20000), deliver)
            await asyncio.wait_for(started.wait(), 20)
            assert await _running(http, workers.urls) == 1
            stream.close()

            async def stopped() -> bool:
                return await _running(http, workers.urls) == 0

            await until(stopped, 5)
    finally:
        await upstream.close()
        agent.stop()


@pytest.mark.timeout(60)
async def test_a_paused_worker_call_reads_nothing_until_resumed(workers: EmulatorProcess) -> None:
    """What a reader does when the agent falls behind: its calls stop reading (the worker's events
    wait in the kernel), and read on when resumed."""
    events: list[int] = []

    call = await worker_stream.start(
        workers.urls[0],
        {
            "rid": "fed-" + "0" * 32,
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True},
        },
        incremental=True,
        on_event=lambda text, ids, completion, prompt, finish, cached: events.append(completion),
        heard=_Heard(),
        connect_timeout_s=5,
    )
    try:

        async def reading() -> bool:
            return len(events) >= 5

        await until(reading, 10)
        call.pause()
        await asyncio.sleep(0.05)  # what was already read is handed over
        paused_at = len(events)
        await asyncio.sleep(0.5)
        assert len(events) == paused_at
        call.resume()
        await asyncio.sleep(0.5)
        assert len(events) > paused_at and events == sorted(events)
    finally:
        call.close()


def test_messages_between_the_agent_and_a_reader_are_framed_and_bounded() -> None:
    """Split anywhere, messages come out whole and in order; a length past the bound is refused
    before anything of it is kept."""
    messages = [[0, i, "tok" * i, list(range(i)), i, 7, None] for i in range(50)]
    stream = b"".join(frame(m) for m in messages)
    frames, out = Frames(), []
    for at in range(0, len(stream), 7):
        out += frames.feed(stream[at : at + 7])
    assert out == messages
    with pytest.raises(ValueError, match="over"):
        Frames().feed((MAX_MESSAGE_BYTES + 1).to_bytes(4, "big") + b"x")


async def _fake_worker() -> tuple[web.AppRunner, str]:
    """A /generate that streams SGLang's events: three tokens and [DONE]; for rid "huge", a
    finish reason msgpack cannot carry (an int past 64 bits), which JSON can; for rid "slow",
    a minute of tokens."""

    async def generate(request: web.Request) -> web.StreamResponse:
        rid = (await request.json())["rid"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for n in range(1, 1200 if rid == "slow" else 4):
            finish = {"type": "stop", "matched": 2**70} if rid == "huge" and n == 3 else None
            meta = {"id": rid, "finish_reason": finish, "completion_tokens": n, "prompt_tokens": 4}
            event = {"text": f" t{n}", "output_ids": [100 + n], "meta_info": meta}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await asyncio.sleep(0.05)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port_block(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.timeout(60)
async def test_an_event_that_cannot_be_carried_or_taken_fails_its_own_call_alone() -> None:
    """One reader holds three calls: one whose worker sends an event msgpack cannot carry, one whose
    events the agent's side cannot take (its sink raises), one plain. The first two fail, each
    alone; the plain one gets all its tokens; the reader lives on."""
    runner, url = await _fake_worker()
    pool = ReaderPool(1, TIMINGS)
    await pool.open()
    try:
        got: dict[str, list[int]] = {"huge": [], "sink": [], "plain": []}

        def sink(rid: str):
            def on_event(text: str, ids: list[int], completion: int, prompt: int, finish: object, cached: int) -> None:
                if rid == "sink":
                    raise ValueError("a sink that breaks")
                got[rid].append(completion)

            return on_event

        calls = {
            rid: await pool.start(
                url,
                {"rid": rid, "input_ids": [1]},
                incremental=True,
                on_event=sink(rid),
                heard=_Heard(),
                connect_timeout_s=5,
            )
            for rid in got
        }
        outcomes = await asyncio.gather(*(c.done for c in calls.values()), return_exceptions=True)
        huge, broken, plain = outcomes
        assert isinstance(huge, WorkerFailed) and "cannot carry" in str(huge), huge
        assert isinstance(broken, ReaderLost), broken
        assert plain is None and got["plain"] == [1, 2, 3]
        assert got["huge"] == [1, 2]  # its tokens before the event that could not go
        again = await pool.start(
            url,
            {"rid": "after", "input_ids": [1]},
            incremental=True,
            on_event=lambda *_: None,
            heard=_Heard(),
            connect_timeout_s=5,
        )
        await asyncio.wait_for(again.done, 10)  # the same reader serves on
    finally:
        await pool.close()
        await runner.cleanup()


@pytest.mark.timeout(60)
async def test_a_hung_reader_is_killed_and_replaced() -> None:
    """A reader stopped (SIGSTOP) while it holds a stream says nothing more: within reader_silent_s and a
    beat the agent's side kills it, the stream fails as the reader's loss (not its worker's), and a
    new reader is started."""
    runner, url = await _fake_worker()
    pool = ReaderPool(1, TIMINGS)
    await pool.open()
    try:
        events: list[int] = []

        call = await pool.start(
            url,
            {"rid": "slow", "input_ids": [1]},
            incremental=True,
            on_event=lambda text, ids, completion, prompt, finish, cached: events.append(completion),
            heard=_Heard(),
            connect_timeout_s=5,
        )

        async def streaming() -> bool:
            return len(events) >= 3

        await until(streaming, 10)
        (hung,) = _readers_of(os.getpid())
        os.kill(hung.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        with pytest.raises(ReaderLost):
            await asyncio.wait_for(call.done, SILENT_S + 10)
        # Silence counts from the reader's last word, which came up to a beat before it was stopped.
        assert SILENT_S - TIMINGS.reader_beat_s <= time.monotonic() - stopped_at < SILENT_S + 5

        async def replaced() -> bool:
            return [p.pid for p in _readers_of(os.getpid())] not in ([], [hung.pid])

        await until(replaced, 10)

        async def reaped() -> bool:  # the pool waits for the killed reader: no zombie is left behind
            return hung.pid not in {child.pid for child in psutil.Process().children()}

        await until(reaped, 10)
    finally:
        await pool.close()
        await runner.cleanup()
