"""The workers' streams read in other processes (`--readers N`), so that a site is not capped by
the agent's one core.

At SGLang's per-token pace reading the workers is most of the agent's CPU: a `recv`, its ACK,
the HTTP framing and an event's decoding per token (`worker_stream`, docs/DATAPATH.md), and one
Python process runs on one core. A site of more than a few MI355X makes more events than one
core reads (docs/DATAPATH.md, "How far one process goes"). With reader processes, each holds a
share of the worker calls (`nodes/agent/reader.py`) and hands the events each turn of its loop
gathered to the agent as one message, over a socket pair that only the two processes hold. The
agent keeps everything else (the slots, the ledger, the relay, the deadlines), and pays per
event only a decoded list and the relay's own work.

`ReaderPool.start` stands in for `worker_stream.start`, and its `RemoteCall` for `WorkerCall`:
the service does not know which one it holds. A reader that dies fails its calls with
`ReaderLost` (their connections closed with it, so the workers have already dropped the
requests), which the service does not count against the workers; the pool starts it again.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import structlog

from core.processes import PROJECT_ROOT
from core.settings import AgentTimings
from nodes.agent.sglang import WorkerFailed, WorkerRejected, WorkerUnreachable
from nodes.agent.worker_stream import Heard, OnEvent, OnLogprobs

log = structlog.get_logger("agent.readers")

READER_MODULE = "nodes.agent.reader"  # what a reader process runs (`python -m`)
MAX_READERS = 64  # more than a host has cores to give them
# One message between the agent and a reader: a length, then msgpack.
LENGTH = struct.Struct(">I")
MAX_MESSAGE_BYTES = 64 * 1024**2  # a turn's events from thousands of streams are a few hundred KB
# The agent → a reader.
START, CLOSE = 0, 1
# A reader → the agent, many in one message: ([EVENT, call, text, ids, completion, prompt, finish, cached], ...).
EVENT, LOGPROBS, DONE, ENDED = 0, 1, 2, 3

encode = msgspec.msgpack.Encoder().encode
decode = msgspec.msgpack.Decoder().decode


class ReaderLost(WorkerFailed):
    """The reader holding the call died or failed it itself: the worker did nothing wrong."""


# What an ENDED call raised, as a code (a subclass before its base: the first that matches is sent).
ERRORS: tuple[type[Exception], ...] = (WorkerUnreachable, ReaderLost, WorkerFailed, WorkerRejected)
ENTRIES_PER_MESSAGE = 256  # a turn's entries go as several messages, each far below MAX_MESSAGE_BYTES


def frame(message: Any) -> bytes:
    body = encode(message)
    return LENGTH.pack(len(body)) + body


class Frames:
    """Splits a byte stream into its messages; raises ValueError on one over MAX_MESSAGE_BYTES."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buffer = self._buffer
        buffer += data
        messages, at = [], 0
        while len(buffer) - at >= LENGTH.size:
            (size,) = LENGTH.unpack_from(buffer, at)
            if size > MAX_MESSAGE_BYTES:
                raise ValueError(f"a message of {size} bytes, over {MAX_MESSAGE_BYTES}")
            if len(buffer) - at - LENGTH.size < size:
                break
            at += LENGTH.size
            messages.append(decode(buffer[at : at + size]))
            at += size
        del buffer[:at]
        return messages


class RemoteCall:
    """A worker call that a reader process runs: what the service uses of a `WorkerCall`."""

    __slots__ = ("_heard", "_link", "_on_event", "_on_logprobs", "done", "id", "last_event_at", "started_at")

    def __init__(
        self, link: _ReaderLink, call_id: int, on_event: OnEvent, on_logprobs: OnLogprobs | None, heard: Heard
    ) -> None:
        self._link, self.id = link, call_id
        self._on_event, self._on_logprobs, self._heard = on_event, on_logprobs, heard
        self.started_at = time.monotonic()
        self.last_event_at: float | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def fail(self, error: WorkerFailed | WorkerRejected) -> None:
        if not self.done.done():
            self.done.set_exception(error)
        self.close()

    def close(self) -> None:
        """The reader closes the worker's connection (how SGLang learns its client is gone)."""
        self._link.forget(self)
        if not self.done.done():
            self.done.cancel()


class _ReaderLink(asyncio.Protocol):
    """The agent's end of one reader's socket pair: commands out, events in, read in callbacks."""

    def __init__(self, on_lost: Callable[[_ReaderLink], None]) -> None:
        self._on_lost = on_lost
        self._frames = Frames()
        self._transport: asyncio.Transport | None = None
        self.calls: dict[int, RemoteCall] = {}
        self.last_heard = time.monotonic()

    def start(self, call: RemoteCall, request: list[Any]) -> None:
        message = frame([START, call.id, *request])  # raises before the call is counted if it cannot go
        self.calls[call.id] = call
        self._write(message)

    def forget(self, call: RemoteCall) -> None:
        if self.calls.pop(call.id, None) is not None:
            self._write(frame([CLOSE, call.id]))

    def _write(self, message: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(message)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            batches = self._frames.feed(data)
        except ValueError as exc:  # msgspec's DecodeError is one
            log.error("reader.garbled", error=str(exc))
            assert self._transport is not None
            self._transport.abort()  # connection_lost fails its calls
            return
        now = self.last_heard = time.monotonic()
        calls = self.calls
        for batch in batches:
            for entry in batch:
                call = calls.get(entry[1])
                if call is None or call.done.done():
                    continue  # closed here meanwhile: what the reader sent before it knew is dropped
                try:
                    self._apply(call, entry, now)
                except Exception as exc:  # an entry not in shape, or a bug of ours: its call alone fails
                    log.error("reader.bad_entry", error=f"{type(exc).__name__}: {exc}")
                    call.fail(ReaderLost(f"the agent could not take its reader's event: {type(exc).__name__}"))

    def _apply(self, call: RemoteCall, entry: list[Any], now: float) -> None:
        kind = entry[0]
        if kind == EVENT:
            call.last_event_at = call._heard.last_event_at = now
            call._on_event(entry[2], entry[3], entry[4], entry[5], entry[6], entry[7])
        elif kind == LOGPROBS and call._on_logprobs is not None:
            call._on_logprobs(entry[2], [tuple(tuple(pair) for pair in at) for at in entry[3]])
        elif kind == DONE:
            del self.calls[call.id]
            call.done.set_result(None)
        elif kind == ENDED:
            del self.calls[call.id]
            error, message, connection_lost = ERRORS[entry[2]], entry[3], entry[4]
            call.done.set_exception(
                error(message) if error is WorkerRejected else error(message, connection_lost=connection_lost)
            )

    def connection_lost(self, exc: Exception | None) -> None:
        calls, self.calls = self.calls, {}
        for call in calls.values():
            if not call.done.done():
                call.done.set_exception(
                    ReaderLost("the agent lost the reader process that held it", connection_lost=True)
                )
        self._on_lost(self)


class ReaderPool:
    """`count` reader processes; each call goes to the one holding the fewest."""

    def __init__(self, count: int, timings: AgentTimings) -> None:
        self._count = count
        self._timings = timings  # its reader_* waits
        self._links: list[_ReaderLink] = []
        self._procs: dict[_ReaderLink, asyncio.subprocess.Process] = {}
        self._tasks: set[asyncio.Future[None]] = set()  # its watcher, and the restarts under way
        self._spawned = asyncio.Event()  # set and cleared at each start: wakes whoever waits for one
        self._next_id = 0
        self._closed = False

    async def open(self) -> None:
        for _ in range(self._count):
            await self._spawn()
        self._keep(asyncio.ensure_future(self._watch()))

    async def _watch(self) -> None:
        """Kill a reader silent for reader_silent_s (each writes every reader_beat_s): a hung one
        would hold its streams until their deadlines blamed their workers, and draw new ones as
        the least busy."""
        beat_s, silent_s = self._timings.reader_beat_s, self._timings.reader_silent_s
        while True:
            due = time.monotonic() + beat_s
            await asyncio.sleep(beat_s)
            now = time.monotonic()
            if now - due > beat_s:  # this loop was stalled itself: the readers' beats may wait unread
                continue
            for link, proc in list(self._procs.items()):
                if now - link.last_heard > silent_s and proc.returncode is None:
                    log.error("reader.hung", pid=proc.pid, silent_s=round(now - link.last_heard, 1))
                    proc.kill()  # its link closes: its streams fail over, and it is started again

    async def _spawn(self) -> None:
        """A reader on a new socket pair. It exits when its end reads EOF: when the agent closes
        the pair or dies (the kernel closes the agent's end then)."""
        mine, theirs = socket.socketpair()
        proc: asyncio.subprocess.Process | None = None
        try:
            proc = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", READER_MODULE, "--fd", str(theirs.fileno())),
                *("--beat-s", str(self._timings.reader_beat_s)),
                cwd=PROJECT_ROOT,
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
            )
            _, link = await asyncio.get_running_loop().create_connection(lambda: _ReaderLink(self._lost), sock=mine)
        except BaseException:
            mine.close()
            if proc is not None and proc.returncode is None:
                proc.kill()
            raise
        finally:
            theirs.close()
        self._links.append(link)
        self._procs[link] = proc
        self._spawned.set()
        self._spawned.clear()
        log.info("reader.started", pid=proc.pid)

    def _lost(self, link: _ReaderLink) -> None:
        if link in self._links:
            self._links.remove(link)
        proc = self._procs.pop(link, None)
        if self._closed or proc is None:
            return
        log.warning("reader.lost", pid=proc.pid, exit_code=proc.returncode)
        self._keep(asyncio.ensure_future(self._respawn(proc)))

    def _keep(self, task: asyncio.Future[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respawn(self, dead: asyncio.subprocess.Process) -> None:
        """Start a reader in the dead one's place, trying again (less and less often) while it
        cannot be started: out of processes or descriptors for a while."""
        await dead.wait()
        delay = self._timings.reader_restart_s
        while not self._closed:
            await asyncio.sleep(delay)
            try:
                await self._spawn()
                return
            except OSError as exc:
                log.error("reader.restart_failed", error=str(exc), retry_in_s=delay * 2)
                delay = min(delay * 2, self._timings.reader_restart_max_s)

    async def start(
        self,
        url: str,
        payload: dict[str, Any],
        *,
        incremental: bool,
        on_event: OnEvent,
        heard: Heard,
        connect_timeout_s: float,
        on_logprobs: OnLogprobs | None = None,
        headers: Sequence[tuple[str, str]] = (),
    ) -> RemoteCall:
        """As `worker_stream.start`, but the call is made by a reader: it is not connected yet when
        this returns, and a worker that cannot be reached ends it with WorkerUnreachable."""
        if not self._links:  # every reader died: wait (bounded) for one started again
            try:
                async with asyncio.timeout(connect_timeout_s):
                    while not self._links:
                        await self._spawned.wait()
            except TimeoutError:
                raise ReaderLost("no reader process is running", connection_lost=True) from None
        link = min(self._links, key=lambda candidate: len(candidate.calls))
        self._next_id += 1
        call = RemoteCall(link, self._next_id, on_event, on_logprobs, heard)
        try:
            link.start(call, [url, payload, incremental, on_logprobs is not None, connect_timeout_s, list(headers)])
        except (TypeError, ValueError, OverflowError) as exc:  # msgpack cannot carry it (an int past 64 bits)
            raise WorkerRejected(f"the request cannot be passed to a reader: {exc}") from None
        return call

    async def close(self) -> None:
        self._closed = True
        tasks = list(self._tasks)  # each leaves the set as it ends
        for task in tasks:
            task.cancel()
        for link in self._links:
            link.close()  # each reader reads EOF and exits
        stops = (_stop(proc, self._timings.reader_stop_s) for proc in self._procs.values())
        await asyncio.gather(*stops, *tasks, return_exceptions=True)


async def _stop(proc: asyncio.subprocess.Process, timeout_s: float) -> None:
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
