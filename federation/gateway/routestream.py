"""One scheduler replica's RouteStream call, shared by every route this gateway process asks it.

Every request waits for its route before anything else happens to it, and a unary call is the
dearest way to ask: with grpc.aio a unary round trip costs more time and more CPU across both
ends than a message each way on a call already open (docs/DATAPATH.md, "Before the first
token"). So each replica gets one long-lived call: routes go out numbered, and their answers
come back by number. Messages go at most one per ROUTE_GATHER_S: a route asked sooner after the
last waits out the rest of that time, and goes with those asked meanwhile (up to
ROUTE_CALLS_PER_MESSAGE), since a replica pays more for a message than for a route in it; a
route asked after a quiet spell goes at once.

A route the scheduler cannot decide is answered with the status code Route would have ended
with; the call goes on. A call that breaks fails every route waiting on it with the call's
status, which the asker treats as it would a unary call's (another replica, or degraded mode);
the next route opens a new call.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Sequence

import grpc
import structlog

from core import runtime, wire

log = structlog.get_logger("gateway")

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class RouteFailed(Exception):
    """No decision: the scheduler's status for this route, or the call's."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class RouteStream:
    """The routes this process asks one replica, on one call (see the module's docstring)."""

    def __init__(self, stub: wire.SchedulerStub) -> None:
        self._stub = stub
        self._numbers = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[wire.RouteDecision]] = {}
        self._unsent: list[wire.RouteCall] = []
        self._wake = asyncio.Event()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._tasks: tuple[asyncio.Task, ...] = ()
        self.messages_sent = 0  # RouteStream messages written, over every call

    async def route(
        self, request: wire.RouteRequest, timeout_s: float, trace_context: Sequence[tuple[str, str]] = ()
    ) -> wire.RouteDecision:
        """The replica's decision; RouteFailed with its status, or DEADLINE_EXCEEDED after `timeout_s`."""
        if self._call is None:
            self._open()
        number = next(self._numbers)
        answer: asyncio.Future[wire.RouteDecision] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        self._unsent.append(wire.RouteCall(number, request, tuple(trace_context)))
        self._wake.set()
        try:
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            raise RouteFailed(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g} s") from None
        finally:
            if self._waiting.pop(number, None) is not None and not answer.done():  # timed out, or cancelled
                self._unsent = [c for c in self._unsent if c.number != number]  # a request gone is not routed

    def _open(self) -> None:
        call = self._stub.RouteStream()
        self._call = call
        self._tasks = (
            asyncio.ensure_future(self._write_forever(call)),
            asyncio.ensure_future(self._read_forever(call)),
        )

    async def _write_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        loop, sent_at = asyncio.get_running_loop(), -math.inf
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                gather_s = sent_at + runtime.ROUTE_GATHER_S - loop.time()
                if gather_s > 0 and self._unsent:
                    await asyncio.sleep(gather_s)
                while self._unsent:
                    calls = self._unsent[: runtime.ROUTE_CALLS_PER_MESSAGE]
                    del self._unsent[: runtime.ROUTE_CALLS_PER_MESSAGE]
                    await call.write(wire.route_calls_to_pb(calls))
                    self.messages_sent += 1
                    sent_at = loop.time()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the call ended: its reader says why
        except Exception:  # a bug of ours: the routes waiting go to another replica rather than time out
            log.exception("route_stream.write_failed")
            self._broken(call, RouteFailed(grpc.StatusCode.UNAVAILABLE, "the gateway could not send the routes"))
            call.cancel()

    async def _read_forever(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for message in call:
                for answer in wire.route_answers_from_pb(message):
                    waiting = self._waiting.get(answer.number)
                    if waiting is None or waiting.done():
                        continue  # its asker stopped waiting
                    if answer.decision is not None:
                        waiting.set_result(answer.decision)
                    else:
                        waiting.set_exception(
                            RouteFailed(_CODES.get(answer.code, grpc.StatusCode.UNKNOWN), answer.message)
                        )
            failure = RouteFailed(grpc.StatusCode.UNAVAILABLE, "the scheduler ended the call")
        except grpc.aio.AioRpcError as exc:
            failure = RouteFailed(exc.code(), exc.details() or exc.code().name)
        self._broken(call, failure)

    def _broken(self, call: grpc.aio.StreamStreamCall, failure: RouteFailed) -> None:
        """Every route waiting on `call` fails with `failure`; the next route opens a new call."""
        if self._call is not call:
            return
        self._call = None
        self._tasks[0].cancel()
        self._unsent.clear()
        waiting, self._waiting = self._waiting, {}
        for answer in waiting.values():
            if not answer.done():
                answer.set_exception(failure)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
