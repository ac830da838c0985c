"""The gateway's side of the sites' agents: one Generate call per agent carries every request
this process sends there, both ways.

A request is a numbered stream on that call: `start` sends it, its deltas come back in batches
shared with every other request on the call (see nodes/agent/relay.py for why), and one task per
call reads them and hands each to its stream's `deliver` as it reads, without waking the
request's own task (which sleeps until its stream's first delta and then its end). One watcher
per agent bounds every stream's waits, instead of a timer around every read. gRPC statuses and
the agent's stream errors become the federation's errors here, so the HTTP layer sees one
error tree.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import time
from collections.abc import Callable

import grpc
import structlog

from core import runtime, wire
from core.errors import BadRequest, FederationError, SiteWorkerFailed, UpstreamFailed
from core.mtls import INSECURE, Tls
from core.pki import Identity, Role
from core.settings import GatewayTimings

log = structlog.get_logger("gateway")

# The agent bounds its own waits on the worker (30 min to the first token, 60 s between
# events); these are a little longer, so the agent's clearer error arrives first.
# The reader lets other work (Route answers, new requests) run after this many deltas: a batch
# from a busy site holds thousands, and handing them out is the loop's biggest single job.
DELTAS_PER_TURN = 64
START_BYTES = 256  # a start's fields besides its prompt, roughly (its message's size estimate)

Deliver = Callable[["SiteStream", wire.TokenDelta], None]
# The middle of an answer: its new text, ids and completion tokens so far (see SiteStream.flowed).
Flow = Callable[[str, tuple[int, ...], int], None]
NO_ERROR = wire.StreamError.NONE


class SiteStream:
    """One generation on a site. Its deltas go to `deliver` as they are read, the middle of its
    answer to `flow` when given; `first` resolves with its first delta and `done` at its end;
    either raises the failure that ended it."""

    __slots__ = ("_call", "_deliver", "_flow", "done", "first", "last_at", "number", "started_at")

    def __init__(self, call: _Call, number: int, deliver: Deliver, flow: Flow | None = None) -> None:
        loop = asyncio.get_running_loop()
        self._call = call
        self.number = number
        self._deliver = deliver
        self._flow = flow
        self.first: asyncio.Future[wire.TokenDelta] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.started_at = self.last_at = time.monotonic()

    def receive(self, delta: wire.TokenDelta, now: float) -> None:
        """A failure before any token fails `first` (the request may go to another site); after
        it, `done` (the answer may be resumed elsewhere)."""
        self.last_at = now
        failed = delta.error is not NO_ERROR
        if failed and not (delta.output_ids or delta.text):
            self.fail(self._call.error(delta))
            return
        first = self.first
        if not first.done():
            first.set_result(delta)
        try:
            self._deliver(self, delta)
        except Exception:  # a bug of ours: this request fails, the others on the call go on
            self._relay_failed()
        if failed:
            if not self.done.done():  # its deliver may have ended it
                self.fail(self._call.error(delta))
        elif delta.finish_reason is not None and not self.done.done():
            self._call.forget(self.number)
            self.done.set_result(None)

    def flowed(self, text: str, ids: tuple[int, ...], completion_tokens: int, now: float) -> None:
        """A delta from the batch's columns: new text and ids, never a stream's first, its last or a
        failure (the agent sends those whole). Handed to `flow` as they are, with no TokenDelta
        built (this is the token rate); without a `flow`, or before the first delta, to `receive`."""
        if self._flow is None or not self.first.done():
            self.receive(wire.TokenDelta(self.number, text, ids, completion_tokens, 0), now)
            return
        self.last_at = now
        try:
            self._flow(text, ids, completion_tokens)
        except Exception:  # a bug of ours, as in `receive`
            self._relay_failed()

    def _relay_failed(self) -> None:
        log.exception("upstream.deliver_failed", agent=self._call.address)
        self.fail(UpstreamFailed("internal error in the gateway while relaying the answer"))

    def fail(self, error: FederationError) -> None:
        """End the stream with `error` (at the agent too, if it still runs there)."""
        if self._call.forget(self.number):
            self._call.cancel(self.number)
        if not self.first.done():
            self.first.set_exception(error)
            self.done.cancel()
        elif not self.done.done():
            self.done.set_exception(error)

    def close(self) -> None:
        """The request is done with this stream: stop it at the agent if it still runs."""
        if self._call.forget(self.number):
            self._call.cancel(self.number)
        for future in (self.first, self.done):
            if not future.done():
                future.cancel()
            elif not future.cancelled():
                future.exception()  # seen: an outcome nobody waits for is not an error to log


class _Call:
    """One Generate call to an agent: its streams, the starts and cancels waiting to be sent,
    the task that sends them and the one that reads the deltas."""

    def __init__(self, stub: wire.SiteAgentStub, address: str) -> None:
        self.address = address
        self._grpc = stub.Generate(metadata=(wire.TOKEN_FLOW_METADATA,))
        self.streams: dict[int, SiteStream] = {}
        self._starts: collections.deque[tuple[int, wire.GenerateRequest]] = collections.deque()
        self._cancels: list[int] = []
        self._wake = asyncio.Event()
        self.broken: FederationError | None = None
        self._tasks = (asyncio.ensure_future(self._write_forever()), asyncio.ensure_future(self._read_forever()))

    def start(self, number: int, request: wire.GenerateRequest, stream: SiteStream) -> None:
        self.streams[number] = stream
        self._starts.append((number, request))
        self._wake.set()

    def forget(self, number: int) -> bool:
        """Drop the stream; True if it was still here."""
        return self.streams.pop(number, None) is not None

    def cancel(self, number: int) -> None:
        if self.broken is None:
            self._cancels.append(number)
            self._wake.set()

    def error(self, delta: wire.TokenDelta) -> FederationError:
        if delta.error is wire.StreamError.REJECTED:
            return BadRequest(delta.error_message or "the site refused the request")
        if delta.error is wire.StreamError.WORKER_FAILED:  # one worker broke; the site serves on
            return SiteWorkerFailed(f"site at {self.address}: {delta.error_message}")
        return UpstreamFailed(f"site at {self.address} failed: {delta.error_message}")

    async def _write_forever(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._starts or self._cancels:
                    starts: list[tuple[int, wire.GenerateRequest]] = []
                    size = 0
                    while self._starts and (not starts or size < runtime.GENERATE_COMMAND_BYTES):
                        number, request = self._starts.popleft()
                        starts.append((number, request))
                        size += START_BYTES + len(request.text) + 4 * len(request.input_ids)
                    cancels, self._cancels = self._cancels, []
                    await self._grpc.write(wire.generate_command_to_pb(starts, cancels))
        except grpc.aio.AioRpcError as exc:
            self._break(exc)
        except asyncio.InvalidStateError:  # written after the call ended: its reader says why
            pass
        except Exception as exc:  # a bug of ours: the call's streams fail over rather than hang
            log.exception("upstream.write_failed", agent=self.address)
            self._break(exc)

    async def _read_forever(self) -> None:
        try:
            while True:
                pb = await self._grpc.read()
                if pb is grpc.aio.EOF:
                    self._break(None)
                    return
                await self._hand_out(pb, time.monotonic())
        except grpc.aio.AioRpcError as exc:
            self._break(exc)
        except Exception as exc:  # a malformed batch, a bug of ours: fail over rather than hang
            log.exception("upstream.read_failed", agent=self.address)
            self._break(exc)

    async def _hand_out(self, batch: wire.pb.TokenBatch, now: float) -> None:
        """Each of the batch's deltas to its stream: its messages, then its columns, each of those
        handed on as its text, ids and count (`SiteStream.flowed`). The loop gets a turn every
        DELTAS_PER_TURN deltas."""
        handed = 0
        for delta in wire.token_deltas_from_pb(batch):
            stream = self.streams.get(delta.stream)
            if stream is not None:
                stream.receive(delta, now)
            handed += 1
            if handed % DELTAS_PER_TURN == 0:
                await asyncio.sleep(0)
        if not batch.HasField("flow"):
            return
        for number, text, ids, completion in zip(*wire.token_flow_from_pb(batch.flow), strict=True):
            stream = self.streams.get(number)
            if stream is not None:
                stream.flowed(text, ids, completion, now)
            handed += 1
            if handed % DELTAS_PER_TURN == 0:
                await asyncio.sleep(0)

    def _break(self, exc: Exception | None) -> None:
        """The call is over: every stream still on it fails (and fails over)."""
        if exc is None:
            why = "ended the call"
        elif isinstance(exc, grpc.aio.AioRpcError):
            why = f"failed: {exc.details() or exc.code().name}"
        else:
            why = f"sent what the gateway could not read: {type(exc).__name__}"
        self.broken = UpstreamFailed(f"site at {self.address} {why}")
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.fail(self.broken)

    async def close(self) -> None:
        self._grpc.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class SiteLink:
    """One agent: its channel, kept for the gateway's life, and its current Generate call
    (opened when first needed, and again after one broke). Under TLS the agent must hold its
    site's certificate: the site the schedulers named, whatever address it is dialled at."""

    def __init__(self, site: str, address: str, timings: GatewayTimings, ping_timeout_s: float, tls: Tls) -> None:
        self.address = address
        self._timings = timings
        options = runtime.keepalive_options(ping_timeout_s) + runtime.GRPC_CHANNEL_OPTIONS  # a blackholed site is found
        self._channel = tls.channel(address, Identity(Role.SITE, site), options)
        self._stub = wire.SiteAgentStub(self._channel)
        self._call: _Call | None = None
        self._retired: set[_Call] = set()  # broken calls, closed by the watcher

    def start(self, number: int, request: wire.GenerateRequest, deliver: Deliver, flow: Flow | None) -> SiteStream:
        if self._call is None or self._call.broken is not None:
            if self._call is not None:
                self._retired.add(self._call)
            self._call = _Call(self._stub, self.address)
        stream = SiteStream(self._call, number, deliver, flow)
        self._call.start(number, request, stream)
        return stream

    async def check(self, now: float) -> None:
        """Fail the streams that waited too long; close the calls that broke."""
        call = self._call
        for stream in list(call.streams.values()) if call is not None else ():
            waited = now - stream.last_at
            timings = self._timings
            limit_s = timings.between_chunks_timeout_s if stream.first.done() else timings.first_chunk_timeout_s
            if waited > limit_s:
                stream.fail(UpstreamFailed(f"site at {self.address} sent nothing for {limit_s:.0f} s"))
        retired, self._retired = self._retired, set()
        for old in retired:
            await old.close()

    async def close(self) -> None:
        for call in (*self._retired, *([self._call] if self._call else [])):
            await call.close()
        await self._channel.close()


class Upstream:
    """The sites' agents, one link per address, kept for the gateway's life."""

    def __init__(
        self, timings: GatewayTimings = GatewayTimings(), longest_rtt_s: float = 0.0, tls: Tls = INSECURE
    ) -> None:
        """`longest_rtt_s`: the longest round trip to a site (a ping to it must be given that long
        on top of the second a healthy site takes at most to answer)."""
        self._timings = timings
        self._tls = tls
        self._ping_timeout_s = 1.0 + longest_rtt_s
        self._links: dict[tuple[str, str], SiteLink] = {}
        self._numbers = itertools.count(1)
        self._watch = asyncio.ensure_future(self._watch_forever())

    def start(
        self, site: str, address: str, request: wire.GenerateRequest, deliver: Deliver, flow: Flow | None = None
    ) -> SiteStream:
        """Start `request` at `site`'s agent at `address`; `deliver` gets its deltas as they come,
        and `flow`, when given, the middle of the answer (`SiteStream.flowed`). Close the stream
        when done with it (that cancels it at the agent if it still runs)."""
        link = self._links.get((site, address))
        if link is None:
            link = SiteLink(site, address, self._timings, self._ping_timeout_s, self._tls)
            self._links[site, address] = link
        return link.start(next(self._numbers), request, deliver, flow)

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self._timings.stream_check_s)
            now = time.monotonic()
            for link in list(self._links.values()):
                try:
                    await link.check(now)
                except asyncio.CancelledError:
                    raise
                except Exception:  # one link's bug must not end the watch over the others
                    log.exception("upstream.watch_failed", agent=link.address)

    async def close(self) -> None:
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        for link in self._links.values():
            await link.close()
