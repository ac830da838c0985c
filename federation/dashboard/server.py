"""The dashboard's HTTP side: the page and its vendored assets, the SSE stream that updates it,
and POST /api/mark for a drill's marks. The watch and the scrapes run as background tasks of the
app (started and cancelled with it) and feed one Board; what changes is pushed to every open
page at once.

Local-only by default: it binds 127.0.0.1 and, bound to a loopback address, answers only
requests addressed to one (a page elsewhere cannot reach it through a rebound DNS name).
Bound elsewhere it says so loudly: anyone who reaches the port reads the federation's state
and can put marks on it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from core import logs, runtime, wire
from core.config import Config
from core.mtls import Tls
from federation import watch
from federation.admin import Refused
from federation.dashboard import gateway_scrape, marks
from federation.dashboard.board import Board, Event
from federation.dashboard.gateway_scrape import GatewaySample

STATIC_DIR = Path(__file__).parent / "static"
MAX_PAGES = 16  # open SSE streams at once; one more is answered 503
PAGE_QUEUE_MESSAGES = 256  # a page this far behind (a stalled tab) is dropped; reloading it catches up
HEARTBEAT_S = 15.0  # an SSE comment keeps idle proxies and the browser's connection open
SHUTDOWN_GRACE_S = 1.0  # the SSE streams are cut at shutdown, not waited for
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
EXPOSED_WARNING = "the dashboard is bound to a non-loopback address: anyone who reaches it reads the federation's state and can post marks"

log = structlog.get_logger("dashboard")


@dataclass(frozen=True, slots=True)
class DashboardConfig:
    config: Config  # regions, links and round trips, the sites' declared shape
    schedulers: tuple[str, ...]
    operator: Tls
    gateway_url: str  # http://host:port: /metrics is scraped there
    bind: str = "127.0.0.1"
    port: int = 8070


class Pages:
    """The open SSE streams: each page has a bounded queue of messages to send."""

    def __init__(self) -> None:
        self._queues: set[asyncio.Queue[bytes | None]] = set()

    def open(self) -> asyncio.Queue[bytes | None] | None:
        """A queue for a new page; None when MAX_PAGES are open."""
        if len(self._queues) >= MAX_PAGES:
            return None
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(PAGE_QUEUE_MESSAGES)
        self._queues.add(queue)
        return queue

    def close(self, queue: asyncio.Queue[bytes | None]) -> None:
        self._queues.discard(queue)

    def send(self, kind: str, data: Any) -> None:
        message = sse(kind, data)
        for queue in list(self._queues):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:  # that page stopped reading: its stream is ended
                self._queues.discard(queue)
                queue.get_nowait()
                queue.put_nowait(None)


def sse(kind: str, data: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


BOARD_KEY = web.AppKey("board", Board)
PAGES_KEY = web.AppKey("pages", Pages)


WATCH_PUSH_S = 0.25  # the watched replica pushes its state this often: the page sees a drain within a second


async def _follow(
    dashboard: DashboardConfig,
    on_state: Callable[[wire.FederationState, str], None],
    on_lost: Callable[[], None],
) -> None:
    """The schedulers' pushes, from one replica at a time (federation/watch.py), until cancelled."""
    try:
        async for update in watch.updates(dashboard.schedulers, dashboard.operator, WATCH_PUSH_S):
            if update.state is None:
                on_lost()
                continue
            watched = next((a for a, how in update.replicas.items() if how == "watching"), "")
            on_state(update.state, watched)
    except Refused as exc:
        log.error("dashboard.refused", error=str(exc))
        on_lost()


def build_app(dashboard: DashboardConfig) -> web.Application:
    middlewares = [_loopback_only] if _is_loopback(dashboard.bind) else []
    app = web.Application(middlewares=middlewares, client_max_size=marks.MAX_MARK_BYTES)
    board, pages = Board(dashboard.config, dashboard.gateway_url), Pages()
    app[BOARD_KEY], app[PAGES_KEY] = board, pages

    def publish(events: Sequence[Event]) -> None:
        for event in events:
            pages.send("event", asdict(event))
        pages.send("view", board.view())

    def on_state(state: wire.FederationState, scheduler: str) -> None:
        publish(board.on_state(state, scheduler, time.time()))

    def on_lost() -> None:
        board.on_schedulers_lost()
        publish(())

    def on_sample(sample: GatewaySample) -> None:
        point, events = board.on_scrape(sample)
        if point is not None:
            pages.send("point", asdict(point))
        publish(events)

    def on_unreachable(reason: str) -> None:
        board.on_gateway_unreachable(reason)
        publish(())

    async def background(app: web.Application) -> AsyncIterator[None]:
        tasks = [
            asyncio.create_task(_follow(dashboard, on_state, on_lost)),
            asyncio.create_task(
                gateway_scrape.scrape_forever(dashboard.gateway_url + "/metrics", on_sample, on_unreachable)
            ),
        ]
        yield
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    app.cleanup_ctx.append(background)
    app.router.add_get("/", index)
    app.router.add_get("/api/events", events)
    app.router.add_post("/api/mark", mark)
    app.router.add_static("/static/", STATIC_DIR)
    return app


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


@web.middleware
async def _loopback_only(request: web.Request, handler):
    """Bound to loopback, answer only requests addressed to loopback (DNS rebinding)."""
    if request.url.host not in LOOPBACK_NAMES:
        return web.json_response(
            {"error": f"this dashboard answers only at a loopback address, not {request.host!r}"}, status=421
        )
    return await handler(request)


async def index(request: web.Request) -> web.FileResponse:
    """The page; the browser is told to load nothing from anywhere else."""
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Content-Security-Policy": "default-src 'self'"})


async def events(request: web.Request) -> web.StreamResponse:
    """The page's live feed: a snapshot, then views, timeline points and events as they come."""
    pages = request.app[PAGES_KEY]
    queue = pages.open()
    if queue is None:
        raise web.HTTPServiceUnavailable(text=f"{MAX_PAGES} pages are open already")
    try:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(sse("snapshot", request.app[BOARD_KEY].snapshot()))
        while True:
            try:
                async with asyncio.timeout(HEARTBEAT_S):
                    message = await queue.get()
            except TimeoutError:
                message = b": still here\n\n"
            if message is None:  # dropped for falling behind
                return response
            await response.write(message)
    finally:
        pages.close(queue)


async def mark(request: web.Request) -> web.Response:
    """A mark on the timeline: 400 when the body is not one, 415 when not sent as JSON (a page
    elsewhere can POST plain text here without asking first; JSON it cannot)."""
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="send the mark as application/json")
    try:
        parsed = marks.parse(await request.read())
    except marks.BadMark as exc:
        return web.json_response({"error": str(exc)}, status=400)
    event = request.app[BOARD_KEY].add_mark(parsed)
    request.app[PAGES_KEY].send("event", asdict(event))
    log.info("dashboard.mark", label=parsed.label, at_unix_s=parsed.at_unix_s)
    return web.json_response(asdict(event), status=201)


def main(dashboard: DashboardConfig) -> int:
    """Serve until SIGTERM or Ctrl-C."""
    logs.configure()
    return asyncio.run(serve(dashboard))


async def serve(dashboard: DashboardConfig) -> int:
    if not _is_loopback(dashboard.bind):
        log.warning("dashboard.exposed", bind=dashboard.bind, warning=EXPOSED_WARNING)
    runner = web.AppRunner(
        build_app(dashboard), handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, dashboard.bind, dashboard.port).start()
    except OSError as exc:
        log.error("dashboard.bind_failed", bind=dashboard.bind, port=dashboard.port, error=str(exc))
        await runner.cleanup()
        return 1
    host = f"[{dashboard.bind}]" if ":" in dashboard.bind else dashboard.bind
    url = f"http://{host}:{runner.addresses[0][1]}"  # the port the system gave for --port 0
    runtime.announce_ready(dashboard=url, schedulers=list(dashboard.schedulers), gateway=dashboard.gateway_url)
    log.info("dashboard.serving", url=url)
    await runtime.stop_event().wait()
    await runner.cleanup()
    return 0
