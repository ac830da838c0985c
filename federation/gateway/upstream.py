"""The gateway's gRPC clients: ask a scheduler for a site, then stream from that site's agent.

Channels are created once, inside the running loop, and kept; gRPC status codes become
the federation's errors here, so the HTTP layer sees one error tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_random_exponential

from federation import wire
from federation.errors import BadRequest, NoCapacity, UpstreamFailed

# A decision takes the scheduler milliseconds, but an Offline burst (~24 k requests at once)
# keeps the gateway's own loop busy for seconds before it reads the answer: each attempt
# gets this long, and a timed-out or refused attempt is retried, with jitter, for up to
# ROUTE_BUDGET_S before the client is told no site is available.
ROUTE_TIMEOUT_S = 10.0
ROUTE_BUDGET_S = 30.0
ROUTE_RETRY_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})
# The agent bounds its own waits on the worker (30 min to the first token, 60 s between
# events); these are a little longer, so the agent's clearer error arrives first.
FIRST_CHUNK_TIMEOUT_S = 1900.0
BETWEEN_CHUNKS_TIMEOUT_S = 90.0
STATE_TIMEOUT_S = 2.0


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", request_id),)


class Upstream:
    def __init__(self, scheduler_address: str) -> None:
        self.scheduler_address = scheduler_address
        self._scheduler_channel = grpc.aio.insecure_channel(scheduler_address)
        self._scheduler = wire.SchedulerStub(self._scheduler_channel)
        self._agents: dict[str, tuple[grpc.aio.Channel, wire.SiteAgentStub]] = {}

    async def close(self) -> None:
        await self._scheduler_channel.close()
        for channel, _ in self._agents.values():
            await channel.close()

    async def route(self, req: wire.RouteRequest) -> wire.RouteDecision:
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda e: isinstance(e, grpc.aio.AioRpcError) and e.code() in ROUTE_RETRY_CODES),
            wait=wait_random_exponential(multiplier=0.05, max=2.0),
            stop=stop_after_delay(ROUTE_BUDGET_S),
            reraise=True,
        )
        message = wire.route_request_to_pb(req)

        async def attempt():  # a coroutine: tenacity would hand back grpc's call object unawaited
            return await self._scheduler.Route(message, timeout=ROUTE_TIMEOUT_S, metadata=_metadata(req.request_id))

        try:
            pb = await retrying(attempt)
        except grpc.aio.AioRpcError as exc:
            raise NoCapacity(f"no site available: {exc.details() or exc.code().name}") from None
        return wire.decision_from_pb(pb)

    async def state(self) -> wire.FederationState:
        try:
            return wire.federation_state_from_pb(
                await self._scheduler.GetState(wire.state_request_to_pb(), timeout=STATE_TIMEOUT_S)
            )
        except grpc.aio.AioRpcError as exc:
            raise NoCapacity(f"scheduler unreachable: {exc.code().name}") from None

    def _agent(self, address: str) -> wire.SiteAgentStub:
        if address not in self._agents:
            channel = grpc.aio.insecure_channel(address)
            self._agents[address] = (channel, wire.SiteAgentStub(channel))
        return self._agents[address][1]

    async def generate(self, address: str, req: wire.GenerateRequest) -> AsyncIterator[wire.GenerateChunk]:
        """The site's chunks; closing this generator cancels the call (and the worker's request).
        Every wait is bounded: a site that goes silent fails the request instead of hanging it."""
        call = self._agent(address).Generate(wire.generate_request_to_pb(req), metadata=_metadata(req.request_id))
        limit_s = FIRST_CHUNK_TIMEOUT_S
        try:
            while True:
                try:
                    async with asyncio.timeout(limit_s):
                        pb = await call.read()
                except TimeoutError:
                    raise UpstreamFailed(f"site at {address} sent nothing for {limit_s:.0f} s") from None
                if pb is grpc.aio.EOF:
                    return
                limit_s = BETWEEN_CHUNKS_TIMEOUT_S
                yield wire.chunk_from_pb(pb)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise BadRequest(exc.details() or "the site refused the request") from None
            raise UpstreamFailed(f"site at {address} failed: {exc.details() or exc.code().name}") from None
        finally:
            call.cancel()
