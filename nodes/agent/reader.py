"""`python -m nodes.agent.reader --fd N`: one of a site agent's reader processes (`--readers`).

It runs the worker calls the agent hands it on its socket pair (fd N) with `worker_stream`, as
the agent would itself, and sends back every event, logprob and outcome that a turn of its loop
gathered as one message (nodes/agent/readers.py). It has no port and serves nobody else; it
exits when its end reads EOF: the agent closed it, or died (the kernel closes the agent's end).

If the agent falls behind, the reader's writes to it back up; past `HIGH_WATER_BYTES` it stops
reading the workers until the agent catches up, so a slow agent slows the workers' sends (TCP's
own back-pressure) rather than filling this process's memory.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys
from functools import partial
from typing import Any, cast

import structlog

from core import runtime
from nodes.agent import worker_stream
from nodes.agent.readers import (
    CLOSE,
    DONE,
    ENDED,
    ENTRIES_PER_MESSAGE,
    ERRORS,
    EVENT,
    LOGPROBS,
    START,
    Frames,
    ReaderLost,
    encode,
    frame,
)
from nodes.agent.sglang import WorkerFailed, WorkerRejected

log = structlog.get_logger("agent.reader")

HIGH_WATER_BYTES = 16 * 1024**2


class _Unheard:
    """The worker's `heard` lives in the agent, which stamps it as the events arrive there."""

    __slots__ = ("last_event_at",)

    def __init__(self) -> None:
        self.last_event_at = 0.0


class AgentLink(asyncio.Protocol):
    """The reader's end of its socket pair: commands in, batched events out."""

    def __init__(self, beat_s: float) -> None:
        self._beat_s = beat_s
        self._frames = Frames()
        self._transport: asyncio.Transport | None = None
        self._out: list[list[Any]] = []
        self._flushing = False
        self._paused = False
        self._calls: dict[int, worker_stream.WorkerCall] = {}
        self._starting: dict[int, asyncio.Task[None]] = {}
        self._unheard = _Unheard()
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass
        self._transport = stream
        stream.set_write_buffer_limits(high=HIGH_WATER_BYTES)
        self._beat()

    def _beat(self) -> None:
        """An empty message every beat: the agent takes a silent reader for a hung one."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(frame([]))
            asyncio.get_running_loop().call_later(self._beat_s, self._beat)

    def data_received(self, data: bytes) -> None:
        try:
            commands = self._frames.feed(data)
        except ValueError as exc:
            log.error("reader.garbled", error=str(exc))
            assert self._transport is not None
            self._transport.abort()
            return
        for command in commands:
            if command[0] == START:
                call_id = command[1]
                self._starting[call_id] = asyncio.ensure_future(self._run(call_id, *command[2:]))
            elif command[0] == CLOSE:
                self._close(command[1])

    def connection_lost(self, exc: Exception | None) -> None:
        for call in list(self._calls.values()):
            call.close()
        for task in self._starting.values():
            task.cancel()
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True
        for call in self._calls.values():
            call.pause()

    def resume_writing(self) -> None:
        self._paused = False
        for call in self._calls.values():
            call.resume()

    # ---- the calls ---------------------------------------------------------------------------

    async def _run(
        self,
        call_id: int,
        url: str,
        payload: dict[str, Any],
        incremental: bool,
        logprobs: bool,
        connect_timeout_s: float,
        headers: list[list[str]],
    ) -> None:
        try:
            call = await worker_stream.start(
                url,
                payload,
                incremental=incremental,
                on_event=partial(self._event, call_id),
                on_logprobs=partial(self._logprobs, call_id) if logprobs else None,
                heard=self._unheard,
                connect_timeout_s=connect_timeout_s,
                headers=[(name, value) for name, value in headers],
            )
        except WorkerFailed as exc:  # unreachable
            self._ended(call_id, exc)
            return
        except Exception as exc:  # a bug of ours, not the worker's: the agent must still hear the end
            log.exception("reader.start_failed")
            self._ended(call_id, ReaderLost(f"the reader could not start the call: {type(exc).__name__}"))
            return
        finally:
            self._starting.pop(call_id, None)
        self._calls[call_id] = call
        if self._paused:
            call.pause()
        try:
            await call.done
            self._send([DONE, call_id])
        except asyncio.CancelledError:
            pass  # closed: the agent asked, or it is gone
        except (WorkerFailed, WorkerRejected) as exc:
            self._ended(call_id, exc)
        finally:
            self._calls.pop(call_id, None)

    def _close(self, call_id: int) -> None:
        call = self._calls.pop(call_id, None)
        if call is not None:
            call.close()
        starting = self._starting.pop(call_id, None)
        if starting is not None:
            starting.cancel()

    def _event(
        self, call_id: int, text: str, ids: list[int], completion: int, prompt: int, finish: Any, cached: int
    ) -> None:
        self._send([EVENT, call_id, text, ids, completion, prompt, finish, cached])

    def _logprobs(self, call_id: int, chosen: list[float], top: list[tuple[tuple[int, float], ...]]) -> None:
        self._send([LOGPROBS, call_id, chosen, top])

    def _ended(self, call_id: int, exc: WorkerFailed | WorkerRejected) -> None:
        self._send(_ended_entry(call_id, exc))

    def _send(self, entry: list[Any]) -> None:
        """Into this turn's message, written once the turn's callbacks are done."""
        self._out.append(entry)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flushing = False
        out, self._out = self._out, []
        if self._transport is None or self._transport.is_closing():
            return
        for at in range(0, len(out), ENTRIES_PER_MESSAGE):
            part = out[at : at + ENTRIES_PER_MESSAGE]
            try:
                message = frame(part)
            except (TypeError, ValueError, OverflowError):  # an event msgpack cannot carry
                message = frame(self._carried(part))
            self._transport.write(message)

    def _carried(self, entries: list[list[Any]]) -> list[list[Any]]:
        """`entries`, each that cannot be encoded (a number past 64 bits in a finish reason, say)
        replaced by its call's end as a worker failure, that call closed: the others go on."""
        kept = []
        for entry in entries:
            try:
                encode(entry)
            except (TypeError, ValueError, OverflowError) as exc:
                call_id = entry[1]
                log.warning("reader.unsendable_event", error=str(exc))
                self._close(call_id)
                entry = _ended_entry(
                    call_id, WorkerFailed(f"an event the agent cannot carry: {exc}", connection_lost=True)
                )
            kept.append(entry)
        return kept


def _ended_entry(call_id: int, exc: WorkerFailed | WorkerRejected) -> list[Any]:
    """The ENDED entry that tells the agent how a call ended: the error's code, its message, and
    whether its connection is gone (so the worker dropped the request)."""
    code = next(i for i, kind in enumerate(ERRORS) if isinstance(exc, kind))  # the subclass first
    return [ENDED, call_id, code, str(exc), getattr(exc, "connection_lost", False)]


async def serve(args: argparse.Namespace) -> int:
    link = AgentLink(args.beat_s)
    sock = socket.socket(fileno=args.fd)
    await asyncio.get_running_loop().create_connection(lambda: link, sock=sock)
    await link.closed
    return 0


def main(argv: list[str] | None = None) -> int:
    # A terminal's Ctrl-C reaches the whole process group: the agent decides when its readers stop
    # (it closes their socket pairs as it drains), so they do not die under its draining streams.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    p = argparse.ArgumentParser(prog="python -m nodes.agent.reader", description=__doc__)
    p.add_argument("--fd", type=int, required=True, help="this process's end of the agent's socket pair")
    p.add_argument("--beat-s", type=runtime.positive_float, required=True, help="write at least this often")
    return runtime.run(serve, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
