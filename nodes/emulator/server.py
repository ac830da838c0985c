"""HTTP servers for emulated workers: one aiohttp app per GPU, all in one process.

Also the drill faults, under /_emulator/ where nobody mistakes them for SGLang:
`GET /_emulator/state`, `POST /_emulator/faults` (slowdown, unhealthy, hang) and
`POST /_emulator/die` (the port closes and every open connection is reset, as when
an SGLang process is killed). The two that break a worker exist only when the emulator is
started with `--enable-faults` (a drill's federation): anyone who reaches a worker's port could
call them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from nodes.emulator import native_api, openai_api
from nodes.emulator.params import BodyError
from nodes.emulator.streaming import OUTBOX_KEY, Outbox
from nodes.emulator.web_common import WORKER_KEY, json_response, openai_error, read_json_object
from nodes.emulator.worker import EmulatedWorker, Faults, WorkerConfig

ADMIN_PREFIX = "/_emulator/"
SERVER_KEY = web.AppKey("server", object)


@web.middleware
async def body_error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A body that is not the JSON a route expects: SGLang's FastAPI 400, on every route."""
    try:
        return await handler(request)
    except BodyError as exc:
        return openai_error(str(exc), err_type="Bad Request")


@web.middleware
async def fault_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """A hung worker accepts connections and never answers (until the client gives up)."""
    worker = request.app[WORKER_KEY]
    if worker.faults.hang and not request.path.startswith(ADMIN_PREFIX):
        await asyncio.get_running_loop().create_future()
    return await handler(request)


def _state(worker: EmulatedWorker) -> dict[str, Any]:
    e, f = worker.engine, worker.faults
    return {
        "profile": worker.config.profile.name,
        "port": worker.config.port,
        "speed": worker.config.speed,
        "faults": {"slowdown": f.slowdown, "unhealthy": f.unhealthy, "hang": f.hang, "dead": f.dead},
        "engine": {
            "running": len(e.running),
            "prefilling": len(e.prefilling),
            "waiting": len(e.waiting),
            "waiting_retracted": sum(1 for s in e.waiting if s.retractions),  # back in the queue mid-answer
            "kv_used_tokens": e.kv_used_tokens(),
            "kv_evictable_tokens": e.cache.tree.full_evictable,
            "kv_capacity_tokens": e.kv_capacity_tokens,
            "max_running_requests": e.max_running_requests,
            "emitted_tokens": e.emitted_tokens_total(),
            "retractions": e.retractions,
            "preemptions": e.preemptions,  # running requests sent back for waiting ones of a higher priority
        },
    }


async def handle_state(request: web.Request) -> web.Response:
    return json_response(_state(request.app[WORKER_KEY]))


async def handle_faults(request: web.Request) -> web.Response:
    worker = request.app[WORKER_KEY]
    body = await read_json_object(request)
    unknown = set(body) - {"slowdown", "unhealthy", "hang"}
    if unknown:
        return openai_error(f"unknown fault field(s): {sorted(unknown)}; use slowdown, unhealthy, hang")
    slowdown = body.get("slowdown", worker.faults.slowdown)
    if isinstance(slowdown, bool) or not isinstance(slowdown, int | float) or slowdown < 1:
        return openai_error(f"slowdown must be a number >= 1 (1 = full speed), got {slowdown!r}")
    for flag in ("unhealthy", "hang"):
        if not isinstance(body.get(flag, False), bool):
            return openai_error(f"{flag} must be true or false, got {body[flag]!r}")
    worker.set_slowdown(float(slowdown))
    worker.faults.unhealthy = body.get("unhealthy", worker.faults.unhealthy)
    worker.faults.hang = body.get("hang", worker.faults.hang)
    return json_response(_state(worker))


DIE_DELAY_S = 0.05  # let the /_emulator/die answer leave before the port closes


async def handle_die(request: web.Request) -> web.Response:
    server: WorkerServer = request.app[SERVER_KEY]  # type: ignore[assignment]
    server.die_soon(DIE_DELAY_S)
    return json_response({"dying": True})


class WorkerServer:
    """One emulated GPU behind its own port."""

    def __init__(self, config: WorkerConfig, faults: Faults | None = None, *, fault_endpoints: bool = False) -> None:
        self.config = config
        self.worker = EmulatedWorker(config, faults)
        app = web.Application(middlewares=[body_error_middleware, fault_middleware], client_max_size=64 * 1024**2)
        app[WORKER_KEY] = self.worker
        app[OUTBOX_KEY] = Outbox()
        app[native_api.FLUSHING_KEY] = asyncio.Event()
        app[SERVER_KEY] = self
        for method, path, handler in native_api.ROUTES + openai_api.ROUTES:
            app.router.add_route(method, path, handler)
        app.router.add_get(ADMIN_PREFIX + "state", handle_state)
        if fault_endpoints:  # anyone reaching the port could break the worker: drills only
            app.router.add_post(ADMIN_PREFIX + "faults", handle_faults)
            app.router.add_post(ADMIN_PREFIX + "die", handle_die)
        # Cancel a handler when its client disconnects, so the request is aborted
        # at the engine (aiohttp's test server does this; run_app does not by default).
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self._site: web.TCPSite | None = None
        self._die_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.worker.start()
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, self.config.host, self.config.port, backlog=4096, reuse_address=True)
        await self._site.start()

    def die_soon(self, delay_s: float) -> None:
        async def later() -> None:
            await asyncio.sleep(delay_s)
            await self.die()

        if self._die_task is None:
            self._die_task = asyncio.get_running_loop().create_task(later())

    async def die(self) -> None:
        """Like a killed process: the port closes and open connections are reset."""
        if self.worker.faults.dead:
            return
        self.worker.faults.dead = True
        if self._site is not None:
            await self._site.stop()
        server = self._runner.server
        if server is not None:
            for handler in server.connections:
                if handler.transport is not None:
                    handler.transport.abort()
        await self.worker.stop()

    async def stop(self) -> None:
        await self.worker.stop()
        await self._runner.cleanup()
