"""The one endpoint: OpenAI's API and SGLang's /generate over the whole federation (and
SGLang's information endpoints, `native_info`).

A request is checked (`jobs`), routed by a scheduler replica (`schedulers`), then streamed
from the chosen site's agent (`upstream`) — from another site if that one fails
(`failover`) — and relayed to the client (`responses`). The request id is bound at entry
and travels to the scheduler and the agent; one `request.done` line per request says how
it went.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import redis
import structlog
from aiohttp import web

from core import supervise, tiers, wire
from core.errors import BadRequest, FederationError, RequestTimeout, TooBusy, Unauthorized
from core.gpus import MODEL_CONTEXT_TOKENS
from core.mtls import INSECURE, Tls
from core.policy import PREFIX_AWARE_POLICY
from core.settings import GatewayTimings
from federation.gateway import admission, jobs, metrics
from federation.gateway.admission import MAX_HELD, Admission
from federation.gateway.answers import Answer, answer_for, sse
from federation.gateway.edge import EdgeLimits
from federation.gateway.failover import FailoverConfig, Generation, SiteBreakers
from federation.gateway.keys import Keys, KeyTable
from federation.gateway.keystore import StoreKeys, async_client
from federation.gateway.limits import KeyLimiter, Limiter
from federation.gateway.native_info import NativeInfo
from federation.gateway.quota import RegionQuota
from federation.gateway.record import Arrival, RequestRecord
from federation.gateway.responses import Collected, SseClient, WriteBatch
from federation.gateway.schedulers import Schedulers
from federation.gateway.upstream import Upstream

log = structlog.get_logger("gateway")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    scheduler_addresses: tuple[str, ...]  # the replicas, asked in this order
    model: str = "openai/gpt-oss-120b"
    context_tokens: int = MODEL_CONTEXT_TOKENS
    ttft_budget_ms: float = 0.0  # latency mode when > 0 (a request's X-TTFT-Budget-Ms overrides it)
    max_held: int = MAX_HELD  # requests held for a site that can meet their budget, at most
    patience_s: Mapping[tiers.Tier, float] = field(
        default_factory=lambda: dict(tiers.PATIENCE_S)
    )  # throughput mode, by tier
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    policy: str = PREFIX_AWARE_POLICY  # what degraded mode decides with; a baseline's sends no prefix hashes
    rtt_s: dict[tuple[str, str], float] = field(default_factory=dict)  # and the round trips it weighs
    timings: GatewayTimings = GatewayTimings()
    tls: Tls = INSECURE  # to the schedulers and the agents
    api_keys: Path | None = None  # None: no key needed (an open endpoint, said loudly at start)
    limits_db: Path | None = None  # where processes sharing the port keep the keys' limits (None: here only)
    region: str = ""  # this gateway's region: its store among quota_stores
    # each region's quota store (Redis URL): keys and their limits shared by every gateway of
    # every region (quota.py; api_keys and limits_db are then unused). Empty: api_keys' file.
    quota_stores: Mapping[str, str] = field(default_factory=dict)
    admin_routes: bool = True  # /health and /metrics on this listener (else on the admin listener only)
    edge: EdgeLimits = field(default_factory=EdgeLimits)  # what one client connection may hold


CONFIG_KEY = web.AppKey("config", GatewayConfig)
UPSTREAM_KEY = web.AppKey("upstream", Upstream)
SCHEDULERS_KEY = web.AppKey("schedulers", Schedulers)
ADMISSION_KEY = web.AppKey("admission", Admission)
BREAKERS_KEY = web.AppKey("breakers", SiteBreakers)
WRITES_KEY = web.AppKey("writes", WriteBatch)
KEYS_KEY = web.AppKey("keys", KeyTable)
LIMITER_KEY = web.AppKey("limiter", KeyLimiter)
HOLDER_KEY = "api_key"  # the request's key: (name, limits)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json", headers=headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error object with its status; never a stack trace."""
    try:
        return await handler(request)
    except FederationError as exc:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, TooBusy) else None
        response = _json(exc.body(), exc.status, headers)
        if isinstance(exc, RequestTimeout):
            response.force_close()  # the rest of that body is not awaited on this connection
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = {"error": {"message": exc.reason, "type": "invalid_request_error", "param": None, "code": None}}
        return _json(body, exc.status)
    except Exception:  # a bug of ours: the client still gets JSON, the log gets the trace
        log.exception("request.internal_error", path=request.path)
        error = FederationError("Internal error in the gateway; the request was not completed.")
        return _json(error.body(), error.status)


@web.middleware
async def keys_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With keys configured, the API's paths need one (checked before the body is read)."""
    keys = request.app.get(KEYS_KEY)
    if keys is not None and request.path not in OPEN_PATHS:
        holder = keys.holder(request.headers.get("Authorization", ""))
        if holder is None:
            metrics.REFUSED_KEYS.labels("no_key", "").inc()
            given = "Authorization" in request.headers
            raise Unauthorized(
                "Incorrect API key provided." if given else "You didn't provide an API key: Authorization: Bearer KEY."
            )
        request[HOLDER_KEY] = holder
    return await handler(request)


OPEN_PATHS = frozenset({"/health", "/metrics"})


def _request_id(request: web.Request) -> str:
    given = request.headers.get("X-Request-Id", "")
    return given if wire.REQUEST_ID.match(given) else "req-" + uuid.uuid4().hex


async def _body(request: web.Request) -> dict[str, Any]:
    timeout_s = request.app[CONFIG_KEY].edge.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.read()
    except TimeoutError:
        raise RequestTimeout(f"The request body did not arrive within {timeout_s:g} s.") from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"The body is not valid JSON: {exc.msg} at position {exc.pos}.") from None
    if not isinstance(body, dict):
        raise BadRequest("The body must be a JSON object.")
    return body


async def _serve(request: web.Request, make_job: Callable[..., jobs.Job]) -> web.StreamResponse:
    app, config = request.app, request.app[CONFIG_KEY]
    received_unix_s, started = time.time(), time.monotonic()
    budget = admission.budget_s(request.headers.get(admission.BUDGET_HEADER), config.ttft_budget_ms)
    job = make_job(
        await _body(request),
        request_id=_request_id(request),
        served_model=config.model,
        context_tokens=config.context_tokens,
    )
    request_id = job.request.request_id  # the client's X-Request-Id or /generate's `rid`, when given
    holder = request.get(HOLDER_KEY)
    tier = holder[1].tier(job.service_tier) if holder else tiers.resolve(job.service_tier)  # no keys: any tier
    blind = config.policy != PREFIX_AWARE_POLICY  # a baseline routes blind to caches, at the sites too
    job = dataclasses.replace(
        job,
        request=dataclasses.replace(job.request, tier=tier, prefix_hashes=() if blind else job.request.prefix_hashes),
    )
    answer = answer_for(job)
    route = wire.RouteRequest(
        request_id,
        job.request.prompt_tokens,
        job.max_tokens,
        request.headers.get("X-Client-Region", ""),
        prefix_hashes=job.request.prefix_hashes,  # a resume keeps them: the original prompt's blocks lead its own
        tier=tier,
    )

    def headers() -> dict[str, str]:
        """Said once the answer has begun: which site, the hop from here to its agent, and the
        part of it until the route was decided (the rest is the start's way to the agent)."""
        hop_ms = max(0.0, (generation.accepted_unix_s - received_unix_s) * 1000) if generation.accepted_unix_s else 0.0
        route_ms = (generation.routed_at - started) * 1000 if generation.routed_at else 0.0
        timing = f"hop;dur={hop_ms:.2f}, route;dur={route_ms:.2f}"
        return {"X-Request-Id": request_id, "X-Federation-Site": answer.site, "Server-Timing": timing}

    out = SseClient(request, answer, app[WRITES_KEY], headers) if job.stream else Collected(answer, headers)
    generation = Generation(
        job,
        route,
        partial(app[ADMISSION_KEY].route, budget=budget),
        app[SCHEDULERS_KEY],
        app[UPSTREAM_KEY],
        app[BREAKERS_KEY],
        config.failover,
        out,
    )
    arrival = Arrival(request_id, request.path, request.headers, received_unix_s, started)
    record = await RequestRecord.opened(arrival, job, app.get(LIMITER_KEY), holder)  # done in `finally`
    outcome, error, refused = "error", None, False
    try:
        response = await _answered(generation, answer, out, started)
        outcome, error = ("error", answer.error) if answer.error else ("ok", None)
        return response
    except asyncio.CancelledError:
        outcome = "client_gone"
        raise
    except FederationError as exc:
        error, refused = exc.message, isinstance(exc, TooBusy)
        raise
    finally:
        record.done(outcome, error, answer, generation, out.first_chunk_at, refused)


async def _answered(
    generation: Generation, answer: Answer, out: SseClient | Collected, started: float
) -> web.StreamResponse:
    """The generation run, and its answer said to the client: a whole body, or the end of its
    stream. An error after the stream's first byte is an error event (`answer.error` says it);
    before it, the error is raised for the client to get as the response."""
    try:
        await generation.run()
    except FederationError as exc:
        if not isinstance(out, SseClient) or out.response is None:
            raise
        answer.error = exc.message
        return await out.end(sse(exc.body()))
    if isinstance(out, Collected):
        return _json(answer.body(time.monotonic() - started), headers=out.headers())
    if out.response is None:  # an answer with nothing to say (no tokens asked for)
        await out.opened(answer.site)
    try:
        closing = answer.closing_events()
    except FederationError as exc:
        answer.error, closing = exc.message, sse(exc.body())
    return await out.end(closing)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, jobs.chat_job)


async def responses(request: web.Request) -> web.StreamResponse:
    return await _serve(request, jobs.responses_job)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, jobs.completion_job)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _serve(request, jobs.generate_job)


async def models(request: web.Request) -> web.Response:
    config = request.app[CONFIG_KEY]
    model = {
        "id": config.model,
        "object": "model",
        "created": 0,
        "owned_by": "inference-federation",
        "max_model_len": config.context_tokens,
    }
    return _json({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    """200 while requests can be served: "ok" with a scheduler, "degraded" when no scheduler
    replica answers and routes come from the last state seen; 503 when no site is ready."""
    schedulers = request.app[SCHEDULERS_KEY]
    state = schedulers.state
    if state is None:
        try:
            state = await schedulers.get_state()
        except FederationError as exc:
            return _json({"status": "unavailable", "reason": exc.message}, 503)
    ready = [s.name for s in state.sites if s.status is wire.SiteStatus.READY and s.healthy_workers > 0]
    body = {
        "status": "degraded" if schedulers.degraded else "ok",
        "scheduler": schedulers.watching,
        "schedulers": list(schedulers.addresses),
        "state_age_s": round(time.monotonic() - schedulers.state_at, 3) if schedulers.state_at else None,
        "ready_sites": ready,
    }
    if not ready:
        return _json({**body, "status": "no_ready_site"}, 503)
    return _json(body)


def build_app(config: GatewayConfig) -> web.Application:
    app = web.Application(middlewares=[errors_middleware, keys_middleware], client_max_size=64 * 1024**2)
    app[CONFIG_KEY] = config
    if config.quota_stores:
        table = StoreKeys(async_client(config.quota_stores[config.region]))
        quota = RegionQuota(config.region, dict(config.quota_stores), table.home)
        app[KEYS_KEY], app[LIMITER_KEY] = table, quota
        app.cleanup_ctx.append(partial(_quota_ctx, table, quota))
    elif config.api_keys is not None:
        app[KEYS_KEY] = Keys(config.api_keys)
        app[LIMITER_KEY] = Limiter(config.limits_db)

    async def upstream_ctx(app: web.Application):
        app[UPSTREAM_KEY] = Upstream(config.timings, max(config.rtt_s.values(), default=0.0), config.tls)
        app[SCHEDULERS_KEY] = Schedulers(
            list(config.scheduler_addresses), config.policy, config.rtt_s, config.timings, config.tls
        )
        app[SCHEDULERS_KEY].start()
        app[ADMISSION_KEY] = admission.Admission(app[SCHEDULERS_KEY], config.max_held, config.patience_s)
        app[BREAKERS_KEY] = SiteBreakers(config.timings.circuit_failures, config.timings.circuit_open_s)
        app[WRITES_KEY] = WriteBatch()
        flushing = metrics.start_flushing(lambda: app[SCHEDULERS_KEY].degraded, app[ADMISSION_KEY].held_by_tier)
        yield
        flushing.cancel()
        await asyncio.gather(flushing, return_exceptions=True)
        metrics.flush_relayed()
        metrics.process_exiting()
        await app[SCHEDULERS_KEY].close()
        await app[UPSTREAM_KEY].close()

    app.cleanup_ctx.append(upstream_ctx)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/generate", generate)
    app.router.add_get("/v1/models", models)
    NativeInfo(config.model, config.context_tokens, lambda: app[SCHEDULERS_KEY]).add_routes(app.router)
    if config.admin_routes:
        _admin_routes(app)
    return app


async def _quota_ctx(table: StoreKeys, quota: RegionQuota, app: web.Application) -> AsyncIterator[None]:
    """The keys read from the region's store before the first request (a gateway that knew no
    key would refuse every one), then kept fresh, and the quota's keeper running."""
    while True:
        try:
            await table.refresh()
            break
        except (redis.RedisError, OSError) as exc:
            log.warning("keys.store_unreachable", error=str(exc), serving="not yet: waiting for the keys")
            await asyncio.sleep(1.0)
    refreshing = supervise.restarting("gateway.keys", table.run)
    quota.start()
    yield
    refreshing.cancel()
    await asyncio.gather(refreshing, return_exceptions=True)
    await quota.close()


def _admin_routes(app: web.Application) -> None:
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics.handler)


def build_admin_app(served: web.Application) -> web.Application:
    """/health and /metrics on a listener of their own (`--admin-port`), for the gateway serving
    `served` (started first: its state is what /health reports)."""
    admin = web.Application(middlewares=[errors_middleware])

    async def share(admin: web.Application) -> None:
        admin[SCHEDULERS_KEY] = served[SCHEDULERS_KEY]

    admin.on_startup.append(share)
    _admin_routes(admin)
    return admin
