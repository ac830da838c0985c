"""The Scheduler gRPC service: registration, report streams, Route, state, admin.

Decides, never carries tokens. Errors map to gRPC status codes here and only here.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import structlog

from core import runtime, supervise, wire
from core.authz import UNGUARDED, Guard
from core.credential import presented
from core.policy import POLICIES, RouteContext, least_expected_delay
from core.policy_columns import least_expected_delay_columns
from core.settings import SchedulerTimings
from scheduler import spans
from scheduler.metrics import SchedulerMetrics
from scheduler.registry import RegistrationRefused, Registry, UnknownSite

log = structlog.get_logger("scheduler")

# Checks skipped in a row for lag, at most: a scheduler lagging all the time (a flood of calls)
# must still mark dead sites down, if later than it would idle.
NO_SITE = "no site is ready to serve"
MIN_PUSH_S = 0.05  # a watcher asking for its state more often than this gets it this often


class _StreamRefused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class SchedulerService(wire.SchedulerServicer):
    def __init__(
        self,
        model: str,
        rtt_s: Mapping[tuple[str, str], float],
        policy: str = "least_expected_delay",
        *,
        tokenizer: str = "",
        checkpoints: Sequence[str] | None = None,
        join_credential: str = "",
        timings: SchedulerTimings = SchedulerTimings(),
        guard: Guard = UNGUARDED,
    ) -> None:
        self.timings = timings
        self.guard = guard
        self.registry = Registry(model, timings, tokenizer, checkpoints)
        self.metrics = SchedulerMetrics(self.registry)
        self.join_credential = join_credential  # "": any site may join (a federation on one machine)
        self.rtt_s = dict(rtt_s)
        self.policy = POLICIES[policy]
        self._decisions = 0
        self._commands: dict[str, asyncio.Queue[wire.SchedulerCommand]] = {}
        self._pushed: tuple[float, object] = (-1.0, None)  # the tick a state was last pushed at, and it
        self._site_pbs: dict[str, tuple[int, Any]] = {}  # each site's state as last pushed: (its version, protobuf)

    def start_expiry(self) -> asyncio.Task[None]:
        """The sweep that marks silent sites down, restarted if it ever raises (core.supervise):
        without it a site that died would be routed to forever."""
        return supervise.restarting("scheduler.expire", self.expire_forever)

    async def expire_forever(self) -> None:
        """Mark silent sites down; runs for the life of the server. A check that comes late
        means this process was stalled (an Offline burst of Route calls): the reports that
        arrived meanwhile have not been read yet, so that check is skipped, not trusted (up to
        timings.max_skipped_checks in a row: after those, whatever still has not reported is down)."""
        checked_at, skipped = time.monotonic(), 0
        while True:
            await asyncio.sleep(self.timings.expiry_check_s)
            now = time.monotonic()
            lag_s, checked_at = now - checked_at - self.timings.expiry_check_s, now
            if lag_s > self.timings.stall_tolerance_s and skipped < self.timings.max_skipped_checks:
                skipped += 1
                log.warning("scheduler.stalled", lag_s=round(lag_s, 3))
                continue
            skipped = 0
            for name in self.registry.expire(now):
                log.warning("site.down", site=name, reason="no report within heartbeat timeout")

    async def RegisterSite(self, request, context):
        reg = wire.registration_from_pb(request)
        await self.guard.admit(context, "RegisterSite", site=reg.name)
        if not presented(context, self.join_credential):
            reason = f"site {reg.name!r} did not present this federation's join credential"
            self.registry.refuse(reg.name, reason)
            self.metrics.refused_registrations.inc()
            log.warning("site.refused", site=reg.name, reason=reason)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        try:
            site = self.registry.register(reg)
        except RegistrationRefused as exc:
            self.metrics.refused_registrations.inc()
            log.warning("site.refused", site=reg.name, reason=str(exc))
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        for paced in self.registry.pace():
            queue = self._commands.get(paced.registration.name)
            if queue is not None:
                queue.put_nowait(
                    wire.SchedulerCommand(wire.Command.REPORT_EVERY, "report budget", paced.report_interval_s)
                )
        log.info(
            "site.registered",
            site=reg.name,
            region=reg.region,
            gpu=reg.gpu,
            gpus=reg.gpus,
            agent=reg.agent_address,
            prior_capacity_tok_s=site.prior_capacity_tok_s,
        )
        return wire.registered_to_pb(wire.Registered(reg.name, site.prior_capacity_tok_s, site.report_interval_s))

    async def Report(self, request_iterator, context):
        """Reports in, commands out. The stream's end marks the site down at once."""
        await self.guard.admit(context, "Report")
        if not presented(context, self.join_credential):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "reports need this federation's join credential")
        commands: asyncio.Queue[wire.SchedulerCommand] = asyncio.Queue()
        reader = asyncio.ensure_future(self._read_reports(request_iterator, commands, context))
        getter: asyncio.Future[wire.SchedulerCommand] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(commands.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    break
                yield wire.command_to_pb(getter.result())
            reader.result()
        except _StreamRefused as exc:
            await context.abort(exc.code, exc.message)
        finally:
            for task in (getter, reader):
                if task is not None:
                    task.cancel()

    async def _read_reports(
        self, request_iterator, commands: asyncio.Queue[wire.SchedulerCommand], context: grpc.aio.ServicerContext
    ) -> None:
        name: str | None = None
        try:
            async for msg in request_iterator:
                report = wire.report_from_pb(msg)
                if name is None:
                    refused = self.guard.refusal(context, "Report", site=report.site)
                    if refused is not None:
                        raise _StreamRefused(*refused)
                    if report.site not in self.registry.sites:
                        raise _StreamRefused(grpc.StatusCode.NOT_FOUND, f"site {report.site!r} is not registered")
                    name = report.site
                    self._commands[name] = commands
                    log.info("site.connected", site=name)
                elif report.site != name:
                    raise _StreamRefused(grpc.StatusCode.INVALID_ARGUMENT, "one report stream per site")
                try:
                    self.registry.apply_report(report, time.monotonic())
                    self.metrics.reports.inc()
                except UnknownSite:
                    raise _StreamRefused(grpc.StatusCode.NOT_FOUND, f"site {name!r} was removed") from None
        finally:
            if name is not None and self._commands.get(name) is commands:
                del self._commands[name]
                self.registry.disconnected(name)
                log.warning("site.down", site=name, reason="report stream ended")

    async def Route(self, request, context):
        await self.guard.admit(context, "Route")
        decision = self._decide(wire.route_request_from_pb(request))
        if decision is None:
            # Not UNAVAILABLE: that is what a gateway retries (the scheduler itself unreachable).
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_SITE)
        return wire.decision_to_pb(decision)

    async def RouteStream(self, request_iterator, context) -> AsyncIterator:
        """Route's decisions, many per message on one call: each message's answers go back as one."""
        await self.guard.admit(context, "RouteStream")
        async for message in request_iterator:
            if len(message.calls) > runtime.ROUTE_CALLS_PER_MESSAGE:
                limit = runtime.ROUTE_CALLS_PER_MESSAGE
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {limit} routes in one message")
            calls = wire.route_calls_from_pb(message)
            yield wire.route_answers_to_pb([spans.answered(self._answer, call) for call in calls])

    def _answer(self, call: wire.RouteCall) -> wire.RouteAnswer:
        decision = self._decide(call.request)
        if decision is None:
            return wire.RouteAnswer(call.number, None, grpc.StatusCode.FAILED_PRECONDITION.value[0], NO_SITE)
        return wire.RouteAnswer(call.number, decision)

    def _decide(self, req: wire.RouteRequest) -> wire.RouteDecision | None:
        """The site for `req` (None: no site is ready), counted if the request takes it (not a
        dry run, nor a wait past the request's `max_delay_s`: its gateway refuses it)."""
        started = time.perf_counter()
        cached = self.registry.prefixes.holders(req.prefix_hashes)
        context = RouteContext(self.rtt_s, self._decisions, cached)
        if self.policy is least_expected_delay:  # the same decision, by columns (core/policy_columns.py)
            decision = least_expected_delay_columns(self.registry.columns, req, context)
        else:
            decision = self.policy(self.registry.routable(), req, context)
        if decision is None:
            self.metrics.routes.labels("", "no_site").inc()
            return None
        committed = req.commits(decision)
        if committed:
            self._decisions += 1
            self.registry.record_route(decision.site, req, time.monotonic())
        self.metrics.route_decision.observe(time.perf_counter() - started)
        outcome = "routed" if committed else "dry_run" if req.dry_run else "too_long"
        self.metrics.routes.labels(decision.site, outcome).inc()
        return decision

    def _state(self) -> wire.FederationState:
        return wire.FederationState(
            self.registry.states(), self.registry.model, tuple(self.registry.refused.values()), time.time()
        )

    def _state_to_push(self) -> Any:
        """The state as protobuf, each site's rebuilt only if its version moved since the last
        push (the rest only has its outstanding work and ages brought up to now): a thousand
        sites' states took ~24 ms to build afresh, ten times a second, on the loop routes wait on."""
        now, registry, cached, sites = time.monotonic(), self.registry, self._site_pbs, []
        for name, s in registry.sites.items():
            built = cached.get(name)
            if built is None or built[0] != s.version:
                built = cached[name] = (s.version, wire.site_state_to_pb(registry.state_of(s)))
            outstanding = (s.outstanding_requests, s.outstanding_tokens, s.routed_requests)
            sites.append(wire.site_state_pb_now(built[1], outstanding, s.outstanding_by_tier, registry.ages(s, now)))
        for name in [n for n in cached if n not in registry.sites]:
            del cached[name]
        return wire.federation_state_pb(sites, registry.model, tuple(registry.refused.values()), time.time())

    async def GetState(self, request, context):
        await self.guard.admit(context, "GetState")
        return wire.federation_state_to_pb(self._state())

    async def WatchState(self, request, context) -> AsyncIterator:
        """The state at once, then at every tick of the interval asked for (the first at least an
        interval later). Ticks are the same instants for every watcher of an interval, and the
        state pushed at a tick is built once for all of them, through the same per-site cache as
        the first: with a thousand sites a state takes milliseconds to build, which each of many
        gateways would otherwise cost every tenth of a second."""
        await self.guard.admit(context, "WatchState")
        interval = max(wire.state_request_from_pb(request), MIN_PUSH_S)
        loop = asyncio.get_running_loop()
        yield self._state_to_push()
        tick = math.ceil((loop.time() + interval) / interval) * interval  # never sooner than an interval after
        while True:
            await asyncio.sleep(tick - loop.time())
            if self._pushed[0] != tick:
                self._pushed = (tick, self._state_to_push())
            yield self._pushed[1]
            tick = (math.floor(loop.time() / interval) + 1) * interval

    async def _admin(self, request, context, command: wire.Command):
        await self.guard.admit(context, f"{command.name.title()}Site")
        name = wire.site_ref_from_pb(request)
        try:
            if command is wire.Command.REMOVE:
                site = self.registry.remove(name)
            else:
                site = self.registry.set_draining(name, command is wire.Command.DRAIN)
        except UnknownSite:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no site named {name!r}")
        queue = self._commands.get(name)
        if queue is not None:
            queue.put_nowait(wire.SchedulerCommand(command, "operator"))
        log.info("site.admin", site=name, command=command.name.lower())
        return wire.site_state_to_pb(self.registry.state_of(site))

    async def DrainSite(self, request, context):
        return await self._admin(request, context, wire.Command.DRAIN)

    async def UndrainSite(self, request, context):
        return await self._admin(request, context, wire.Command.UNDRAIN)

    async def RemoveSite(self, request, context):
        return await self._admin(request, context, wire.Command.REMOVE)
