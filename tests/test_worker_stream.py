"""The agent's reader of a worker's streamed /generate: exact deltas in both of SGLang's stream
forms, and every way a worker can fail a request told apart (refused, unreachable, broken,
hostile)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from core import tokens, wire
from nodes.agent import worker_stream
from nodes.agent.pool import Worker
from nodes.agent.relay import RelayCall, Relayed
from nodes.agent.sglang import WorkerFailed, WorkerRejected, WorkerUnreachable
from nodes.emulator.launch import EmulatorProcess as Emulator
from nodes.emulator.launch import launch
from tests.conftest import RETRACTING_WORKER, abort_all_once_one_is_retracted, retracting_requests

PAYLOAD = {"input_ids": list(range(1000, 1016)), "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}}


class Events:
    """What a call handed its owner, event by event."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.ids: list[int] = []
        self.counts: list[int] = []
        self.finish: Any = None

    def __call__(self, text: str, ids: list[int], completion: int, prompt: int, finish: Any, cached: int) -> None:
        self.text.append(text)
        self.ids.extend(ids)
        self.counts.append(completion)
        self.finish = finish


@pytest.fixture(scope="module")
def incremental() -> Iterator[Emulator]:
    emu = launch(["--profile", "mi355x", "--workers", "1", "--speed", "20", "--incremental-streaming-output"])
    yield emu
    emu.stop()


async def _generate(url: str, *, incremental: bool, payload: dict | None = None) -> Events:
    events = Events()
    call = await worker_stream.start(
        url, payload or PAYLOAD, incremental=incremental, on_event=events, heard=Worker(url), connect_timeout_s=5.0
    )
    try:
        async with asyncio.timeout(30):
            await call.done
    finally:
        call.close()
    return events


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_deltas_add_up_to_the_answer_in_either_stream_form(
    mode: str, mi355x: Emulator, incremental: Emulator
) -> None:
    """Cumulative events (SGLang's default) and incremental ones give the same deltas: the ids and
    text of the whole answer once each, counts that only grow, and the finish at the end."""
    url = (incremental if mode == "incremental" else mi355x).urls[0]
    events = await _generate(url, incremental=mode == "incremental")
    assert len(events.ids) == 30
    assert events.counts == sorted(events.counts) and events.counts[-1] == 30
    assert events.finish == {"type": "length", "length": 30}
    whole = await _generate(url, incremental=mode == "incremental")
    assert "".join(whole.text) and len(whole.ids) == 30  # a second call on a fresh connection works too


async def test_a_refusal_is_the_clients_fault(mi355x: Emulator) -> None:
    """A sampling parameter SGLang does not know gets its 400, raised as WorkerRejected with the
    worker's message."""
    payload = {**PAYLOAD, "sampling_params": {"max_new_tokens": 3, "no_such_param": 1}}
    with pytest.raises(WorkerRejected, match="no_such_param"):
        await _generate(mi355x.urls[0], incremental=False, payload=payload)


async def test_a_closed_port_is_unreachable() -> None:
    """Nothing listening: WorkerUnreachable (another worker may take the request as new)."""
    with pytest.raises(WorkerUnreachable):
        await worker_stream.start(
            "http://127.0.0.1:9",
            PAYLOAD,
            incremental=False,
            on_event=Events(),
            heard=Worker("http://127.0.0.1:9"),
            connect_timeout_s=5.0,
        )


async def _serve_bytes(reply: bytes, *, close: bool = True) -> tuple[asyncio.AbstractServer, str]:
    """A hostile or broken peer: answers any request with `reply`, then hangs up (or not)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(reply)
        await writer.drain()
        if close:
            writer.close()
        else:
            await asyncio.sleep(3600)

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


LENGTH = {"type": "length", "length": 6}
DONE = b"data: [DONE]\n\n"


def _event(text: Any = "a", output_ids: Any = (1,), completion_tokens: Any = 1, finish: Any = None) -> bytes:
    """An incremental event of SGLang's /generate, its fields as given (no ids: none sent)."""
    meta = {"id": "r", "completion_tokens": completion_tokens, "finish_reason": finish, "prompt_tokens": 16}
    body = {"text": text, "meta_info": meta}
    if output_ids is not None:
        body["output_ids"] = list(output_ids)
    return b"data: " + orjson.dumps(body) + b"\n\n"


@pytest.mark.parametrize(
    ("reply", "error", "message"),
    [
        (
            HEAD + _chunk(b'data: {"text": "a", "output_ids": [1], "meta_info": {"completion_tokens": 1, '),
            WorkerFailed,
            "before the answer's end",
        ),
        (HEAD + _chunk(b"data: {not json}\n\n"), WorkerFailed, "malformed event"),
        (HEAD + _chunk(b'data: {"text": "a"}\n\n'), WorkerFailed, "malformed event"),
        (HEAD + _chunk(_event(output_ids=["x"])), WorkerFailed, r"malformed event.*\$\.output_ids\[0\]"),
        (HEAD + _chunk(_event(text=7)), WorkerFailed, r"malformed event.*\$\.text"),
        (HEAD + _chunk(_event(completion_tokens="1")), WorkerFailed, r"malformed event.*completion_tokens"),
        (HEAD + _chunk(_event(output_ids=[2**32])), WorkerFailed, r"malformed event.*\$\.output_ids\[0\]"),
        (HEAD + _chunk(_event(completion_tokens=-1)), WorkerFailed, r"malformed event.*completion_tokens"),
        (HEAD + _chunk(_event(output_ids=None)), WorkerFailed, r"malformed event.*without its text, output_ids"),
        (
            HEAD + _chunk(b'data: {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": null}}\n\n'),
            WorkerFailed,
            r"malformed event.*without its text, output_ids, meta_info or count",
        ),
        (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n", WorkerFailed, "503"),
        (b"NOT HTTP AT ALL\r\n\r\n", WorkerFailed, "malformed HTTP"),
        (HEAD + _chunk(b'data: {"error": {"message": "boom", "code": 500}}\n\n'), WorkerFailed, "boom"),
        (HEAD + _chunk(b'data: {"error": {"message": "bad stop", "code": 400}}\n\n'), WorkerRejected, "bad stop"),
        (HEAD + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n", None, None),
    ],
    ids=[
        "cut",
        "not-json",
        "not-sglang",
        "ids-not-ints",
        "text-not-text",
        "count-not-int",
        "id-beyond-uint32",
        "count-negative",
        "no-ids",
        "no-count",
        "503",
        "not-http",
        "error-event",
        "refusal-event",
        "empty-answer",
    ],
)
async def test_a_broken_or_hostile_worker_fails_the_request_clearly(reply: bytes, error, message) -> None:
    """Whatever the worker sends, the call ends with the right kind of failure and a reason,
    never an exception of the parser's and never a hang."""
    server, url = await _serve_bytes(reply)
    try:
        if error is None:
            events = await _generate(url, incremental=False)
            assert events.ids == []
        else:
            with pytest.raises(error, match=message):
                await _generate(url, incremental=False)
    finally:
        server.close()


async def _events_of(reply: bytes, *, incremental: bool) -> Events:
    server, url = await _serve_bytes(HEAD + _chunk(reply + DONE) + b"0\r\n\r\n")
    try:
        return await _generate(url, incremental=incremental)
    finally:
        server.close()


ABORT = {"type": "abort", "message": "Abort in waiting queue"}


def _sse(body: dict) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def test_sglangs_abort_of_a_queued_request_ends_it_as_aborted() -> None:
    """SGLang ends a request aborted in its queue with an abort finish and, by version, empty ids,
    no ids, or no counts either: the call ends normally with that finish and nothing generated,
    not as a malformed event (which would mark a well worker unhealthy). An event of no ids that
    is not an abort is still malformed (above: `no-ids`, `no-count`)."""
    counted = {"id": "r", "finish_reason": ABORT, "prompt_tokens": 0, "completion_tokens": 0}
    bare = {"id": "r", "finish_reason": ABORT}
    for body in (
        {"text": "", "output_ids": [], "meta_info": counted},
        {"text": "", "meta_info": counted},
        {"meta_info": bare},
        {"text": "", "meta_info": bare},
    ):
        events = await _events_of(_sse(body), incremental=False)
        assert (events.text, events.ids, events.counts, events.finish) == ([""], [], [0], ABORT), body


async def test_an_abort_with_a_client_error_status_is_a_refusal() -> None:
    """SGLang 0.5.23 streams its own refusal of a request (a grammar it cannot compile, an input
    too long once tokenized) as an abort finish with a 4xx `status_code`: that is the client's
    fault (WorkerRejected: no other worker or site would do better), not a site's abort. With a
    5xx status it is the worker's trouble: an abort, which the gateway resumes elsewhere."""
    refusal = {"type": "abort", "message": "Invalid grammar request", "status_code": 400, "err_type": "BadRequestError"}
    with pytest.raises(WorkerRejected, match="Invalid grammar request"):
        await _events_of(
            _sse({"text": "", "output_ids": [], "meta_info": {"finish_reason": refusal}}), incremental=True
        )
    overloaded = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    events = await _events_of(_sse({"meta_info": {"finish_reason": overloaded}}), incremental=True)
    assert (events.ids, events.counts, events.finish) == ([], [0], overloaded)


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "cumulative"])
async def test_an_abort_after_tokens_relays_none_of_its_own(incremental: bool) -> None:
    """SGLang 0.5.23 ends a request retracted to its queue and aborted there with its whole text
    so far and its last id again, even when it streams increments (TokenizerManager.
    _handle_abort_req): relayed as it is, the client would get its answer twice over. An abort
    relays only its finish, counted as what was relayed; the gateway resumes from there."""
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 3}
    first = {"text": "Hel", "output_ids": [1], "meta_info": {**meta, "completion_tokens": 1}}
    second = {"text": "lo" if incremental else "Hello", "output_ids": [2] if incremental else [1, 2]}
    second["meta_info"] = {**meta, "completion_tokens": 2}
    abort = {"text": "Hello", "output_ids": [2] if incremental else [1, 2]}
    abort["meta_info"] = {"id": "r", "finish_reason": ABORT, "completion_tokens": 2}
    events = await _events_of(_sse(first) + _sse(second) + _sse(abort), incremental=incremental)
    assert (events.text, events.ids, events.counts, events.finish) == (["Hel", "lo", ""], [1, 2], [1, 2, 2], ABORT)


@pytest.mark.parametrize("incremental", [True, False], ids=["incremental", "cumulative"])
async def test_an_emulated_worker_that_retracts_then_aborts_is_relayed_once(incremental: bool) -> None:
    """The same, from a worker's real stream: the emulator retracts a request back to its queue
    (its KV pool is small) and aborts every request there. What the reader relayed of the
    retracted answer is each of its tokens once, counted exactly, and no call fails (a failed call
    would mark the worker unhealthy)."""
    emu = launch([*RETRACTING_WORKER, *(["--incremental-streaming-output"] if incremental else [])])
    url, calls = emu.urls[0], []
    try:
        for payload in retracting_requests():
            events = Events()
            call = await worker_stream.start(
                url, payload, incremental=incremental, on_event=events, heard=Worker(url), connect_timeout_s=5.0
            )
            calls.append((call, events))
        async with aiohttp.ClientSession() as http:
            await abort_all_once_one_is_retracted(http, url)
        async with asyncio.timeout(30):
            await asyncio.gather(*(call.done for call, _ in calls))  # none failed: aborts are answers' ends
    finally:
        for call, _ in calls:
            call.close()
        emu.stop()
    retracted = [e for _, e in calls if e.finish["message"] == "Abort in waiting queue" and e.counts[-1] > 0]
    assert retracted, [(e.finish, e.counts[-1]) for _, e in calls]
    for events in retracted:
        relayed = "".join(events.text)
        assert relayed.encode() == b"".join(map(tokens.token_bytes, events.ids))  # each token once
        assert events.counts[-1] == events.counts[-2] == len(events.ids) and events.text[-1] == ""


async def test_an_endless_event_is_cut_at_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """An event that never ends is a broken worker once it passes MAX_EVENT_BYTES: the buffer is
    bounded, the call fails."""
    monkeypatch.setattr(worker_stream, "MAX_EVENT_BYTES", 10_000)
    server, url = await _serve_bytes(HEAD + _chunk(b"data: " + b"x" * 20_000), close=False)
    try:
        with pytest.raises(WorkerFailed, match="over 10000 bytes"):
            await _generate(url, incremental=False)
    finally:
        server.close()


async def test_a_malformed_event_fails_its_own_generation_not_the_batch() -> None:
    """Two workers' answers relayed on one Generate call: one worker sends an id that is not an
    integer. Its call fails as malformed; the other's tokens, all of them, still go out in the
    call's batches (before typed decoding, the bad id reached the batch and ended the writer of
    every generation on the call)."""
    batches: list = []

    async def write(pb) -> None:
        batches.append(pb.SerializeToString())

    relay = RelayCall(write, lambda record, tokens: None, coalesce_s=0.01, flow=True)
    writer = asyncio.ensure_future(relay.write_forever())
    good_events = b"".join(_chunk(_event(f"t{k}", [k], k + 1)) for k in range(5))
    good, good_url = await _serve_bytes(HEAD + good_events + _chunk(_event("!", [5], 6, LENGTH)) + _chunk(DONE))
    bad, bad_url = await _serve_bytes(HEAD + _chunk(_event("a", [1], 1)) + _chunk(_event("b", ["x"], 2)), close=False)
    try:
        records = [Relayed(relay, 1, False), Relayed(relay, 2, False)]
        calls = [
            await worker_stream.start(
                url, PAYLOAD, incremental=True, on_event=record.event, heard=Worker(url), connect_timeout_s=5.0
            )
            for url, record in zip((good_url, bad_url), records, strict=True)
        ]
        async with asyncio.timeout(10):
            await calls[0].done
            with pytest.raises(WorkerFailed, match=r"malformed event.*output_ids"):
                await calls[1].done
            await relay.drained()
        assert not writer.done()
        deltas = [d for b in batches for d in wire.token_batch_from_pb(wire.pb.TokenBatch.FromString(b))]
        assert sorted(i for d in deltas if d.stream == 1 for i in d.output_ids) == list(range(6))
        assert [d.finish_reason for d in deltas if d.stream == 1 and d.finish_reason] == [LENGTH]
    finally:
        writer.cancel()
        for server in (good, bad):
            server.close()
