"""The gateway's side of the scheduler replicas: ask one for each route, fail over between
them, watch the federation's state, and keep routing from the last state seen when none
answers (degraded mode).

Replicas are active-active and their state is soft (rebuilt from the agents' reports), so
any of them can decide. The gateway sticks to one until it stops answering, then tries the
next at once. With none reachable it decides itself, with the same policy, from the last
state it watched plus the routes it made since: the sites keep serving, only the view ages.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import time
from collections import defaultdict
from collections.abc import Mapping

import grpc
import structlog
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_random_exponential

from core import runtime, tracing, wire
from core.errors import NoCapacity
from core.mtls import INSECURE, Tls
from core.pki import SCHEDULER
from core.policy import POLICIES, RouteContext, SiteLoad
from core.settings import GatewayTimings
from core.tiers import Tier
from core.work import expected_output_tokens
from federation.gateway import metrics
from federation.gateway.routestream import RouteFailed, RouteStream

log = structlog.get_logger("gateway")

# A decision takes the scheduler milliseconds, but an Offline burst (~24 k requests at once)
# keeps the gateway's own loop busy for seconds before it reads the answer: each attempt
# gets `route_timeout_s`, and a round in which no replica answered in time is retried, with
# jitter, for up to `route_budget_s` (GatewayTimings).
# A replica that refuses connections is dead, and one whose packets are dropped looks the
# same once a keepalive ping goes unanswered (UNAVAILABLE within two keepalive periods) or an
# attempt runs out of time: the next replica is asked at once, and when none answers the
# gateway routes from the last state (degraded mode).
# A replica killed in the middle of a call ends it as often with INTERNAL ("Internal error from
# Core": grpc-core's word for a connection that broke mid-frame) as with UNAVAILABLE: 7 routes
# of 43,000 were failed so when `fedctl simulate` killed the replica they were asked of.
FAILOVER_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL})
# State is pushed every `state_push_s`: a site down is known here within ~0.1 s of the scheduler.
# A watched replica that sends nothing for `watch_silence_s` is cut off (its packets dropped,
# not refused): the watch moves to the next, and routes skip it until it is watched again.


def _no_routes_yet() -> tuple[int, int, tuple[int, ...]]:
    return (0, 0, (0,) * len(Tier))


class RoundTimedOut(Exception):
    """Every replica asked ran out of time, while the watch still hears one."""


class Schedulers:
    def __init__(
        self,
        addresses: list[str],
        policy: str = "least_expected_delay",
        rtt_s: Mapping[tuple[str, str], float] | None = None,
        timings: GatewayTimings = GatewayTimings(),
        tls: Tls = INSECURE,
    ) -> None:
        if not addresses:
            raise ValueError("at least one scheduler address is needed")
        self.addresses = list(addresses)
        self.timings = timings
        options = (
            runtime.keepalive_options(timings.scheduler_ping_s) + runtime.GRPC_CHANNEL_OPTIONS
        )  # a blackholed replica is found
        self._channels = [tls.channel(a, SCHEDULER, options) for a in self.addresses]
        self._stubs = [wire.SchedulerStub(c) for c in self._channels]
        self._routes = [RouteStream(stub) for stub in self._stubs]  # one open call per replica
        self._current = 0  # the replica asked first
        self._silent: set[int] = set()  # replicas the watch found cut off: routes skip them
        self._policy = POLICIES[policy]
        self._rtt_s = dict(rtt_s or {})  # the schedulers' round trips: decisions made here weigh them too
        self.state: wire.FederationState | None = None  # the last state watched
        self.state_at = 0.0
        self.watching: str | None = None  # the replica the watch reads now; None: none reachable
        self._local_routes = 0  # routes decided here while degraded
        # Routes since the last state, per site: (requests, tokens, requests of each tier).
        self._local_load: dict[str, tuple[int, int, tuple[int, ...]]] = defaultdict(_no_routes_yet)
        self._watch: asyncio.Task | None = None
        self._fresh = asyncio.Event()  # set by each state watched

    @property
    def route_messages_sent(self) -> int:
        """RouteStream messages written to every replica (each carries one route or more)."""
        return sum(routes.messages_sent for routes in self._routes)

    @property
    def degraded(self) -> bool:
        """No replica answers: routes come from the last state watched."""
        return self.watching is None and self._watch is not None

    def start(self) -> None:
        self._watch = asyncio.ensure_future(self._watch_forever())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for routes in self._routes:
            await routes.close()
        for channel in self._channels:
            await channel.close()

    # ---- routing -----------------------------------------------------------------------

    async def route(self, req: wire.RouteRequest) -> wire.RouteDecision:
        """A decision from the first replica that answers; from the last state when none does."""
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, RoundTimedOut)),
            wait=wait_random_exponential(multiplier=0.05, max=2.0),
            stop=stop_after_delay(self.timings.route_budget_s),
            reraise=True,
        )
        try:
            return await runtime.retried(retrying, self._route_on_any, req)
        except RouteFailed as exc:
            raise NoCapacity(f"no site available: {exc.details}") from None
        except RoundTimedOut:
            raise NoCapacity(f"no scheduler replica decided within {self.timings.route_budget_s:.0f} s") from None

    async def _route_on_any(self, req: wire.RouteRequest) -> wire.RouteDecision:
        """The first replica not known to be cut off that answers; the last state when none does
        (RoundTimedOut when some only ran out of time while the watch still hears one: the
        gateway's own loop is busy, not the replicas gone)."""
        trace_context = tracing.outgoing()
        calls = metrics.ROUTE_CALLS.labels("dry_run" if req.dry_run else "route")
        timed_out = False
        for i in range(len(self._routes)):
            index = (self._current + i) % len(self._routes)
            if index in self._silent:
                continue
            calls.inc()
            try:
                decision = await self._routes[index].route(req, self.timings.route_timeout_s, trace_context)
            except RouteFailed as exc:
                if exc.code not in FAILOVER_CODES:
                    raise
                timed_out |= exc.code is grpc.StatusCode.DEADLINE_EXCEEDED
                continue
            if index != self._current:
                log.warning("scheduler.failover", to=self.addresses[index], request_id=req.request_id)
                self._current = index
            return decision
        if timed_out and self.watching is not None:
            raise RoundTimedOut
        return self._route_locally(req)

    def _route_locally(self, req: wire.RouteRequest) -> wire.RouteDecision:
        """Degraded mode: the same policy over the last state, plus what was routed since."""
        if self.state is None:
            raise NoCapacity("no scheduler reachable, and none was ever seen: no site is known")
        decision = self.estimate(req)
        if decision is None:
            raise NoCapacity("no scheduler reachable, and no site was ready when one last answered")
        if req.commits(decision):
            self._local_routes += 1
            self.count_routed(decision.site, req)
        return dataclasses.replace(decision, reason="degraded")

    def estimate(self, req: wire.RouteRequest) -> wire.RouteDecision | None:
        """The policy's decision here, without asking a replica: over the last state watched plus
        the routes counted since (None: no state yet, or no site ready in it)."""
        if self.state is None:
            return None
        loads = []
        for s in self.state.sites:
            if s.status is not wire.SiteStatus.READY:
                continue
            requests, tokens, tiers = self._local_load[s.name]
            loads.append(
                SiteLoad(
                    s.name,
                    s.region,
                    s.agent_address,
                    s.capacity_tok_s,
                    s.outstanding_tokens + tokens,
                    s.outstanding_requests + requests,
                    s.prior_capacity_tok_s,
                    s.slots,
                    s.prefill_s_per_token,
                    s.admit_window,
                    tuple(map(operator.add, s.outstanding_by_tier, tiers)),
                )
            )
        return self._policy(loads, req, RouteContext(self._rtt_s, self._local_routes))

    def count_routed(self, site: str, req: wire.RouteRequest) -> None:
        """A route to `site` the next state cannot show yet: estimates count it until then."""
        requests, tokens, tiers = self._local_load[site]
        tiers = tuple(n + (tier is req.tier) for tier, n in zip(Tier, tiers, strict=True))
        self._local_load[site] = (requests + 1, tokens + expected_output_tokens(req.max_tokens), tiers)

    async def state_changed(self, timeout_s: float) -> None:
        """Returns at the next state watched, or after `timeout_s`."""
        self._fresh.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._fresh.wait()

    # ---- state ---------------------------------------------------------------------------

    async def get_state(self) -> wire.FederationState:
        """The state from the first replica that answers."""
        for stub in self._stubs:
            try:
                pb = await stub.GetState(wire.state_request_to_pb(), timeout=self.timings.state_timeout_s)
            except grpc.aio.AioRpcError:
                continue
            return wire.federation_state_from_pb(pb)
        raise NoCapacity("no scheduler reachable")

    async def _watch_forever(self) -> None:
        while True:
            for i in range(len(self._stubs)):
                index = (self._current + i) % len(self._stubs)
                try:
                    await self._watch_one(index)
                except (grpc.aio.AioRpcError, TimeoutError) as exc:
                    self._lost(index, exc)
                except Exception:  # a bug (a state we cannot read): this replica is skipped, the watch goes on
                    log.exception("scheduler.watch_failed", scheduler=self.addresses[index])
                    self._lost(index, None)
            if self.watching is not None:
                log.warning("scheduler.degraded", reason="no scheduler replica reachable")
                self.watching = None
            await asyncio.sleep(self.timings.watch_retry_s)

    async def _watch_one(self, index: int) -> None:
        """Read one replica's pushed state until it fails or falls silent for `watch_silence_s`.
        Silence while this loop itself was stalled (an Offline burst, a long collection) is not
        the replica's: a wait that ends `loop_stall_s` late starts over instead."""
        call = self._stubs[index].WatchState(wire.state_request_to_pb(self.timings.state_push_s))
        loop = asyncio.get_running_loop()
        read: asyncio.Future | None = None
        try:
            while True:
                read = asyncio.ensure_future(call.read())
                due = loop.time() + self.timings.watch_silence_s
                while not read.done():
                    await asyncio.wait({read}, timeout=max(0.0, due - loop.time()))
                    if not read.done() and loop.time() >= due:
                        if loop.time() - due < self.timings.loop_stall_s:
                            raise TimeoutError
                        due = loop.time() + self.timings.watch_silence_s
                pb = read.result()
                if pb is grpc.aio.EOF:
                    return
                if self.watching != self.addresses[index] or index in self._silent:
                    log.info("scheduler.watching", scheduler=self.addresses[index])
                    self.watching = self.addresses[index]
                    self._silent.discard(index)
                    self._current = index
                self._seen(wire.federation_state_from_pb(pb))
        finally:
            call.cancel()
            if read is not None and not read.done():
                read.cancel()

    def _lost(self, index: int, exc: BaseException | None) -> None:
        """The watched replica failed or went silent: routes skip it until it is watched again
        (the watch tries the next at once; degraded mode begins when none answers)."""
        if index not in self._silent:
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "silent" if exc else "error"
            log.warning("scheduler.lost", scheduler=self.addresses[index], reason=why)
        self._silent.add(index)

    def _seen(self, state: wire.FederationState) -> None:
        self.state, self.state_at = state, time.monotonic()
        self._local_load.clear()
        self._fresh.set()
