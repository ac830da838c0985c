"""The gateway's gRPC client of the sites' agents: one generation's chunks from one site.

Channels are created once, inside the running loop, and kept; gRPC status codes become
the federation's errors here, so the HTTP layer sees one error tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from federation import runtime, wire
from federation.errors import BadRequest, SiteWorkerFailed, UpstreamFailed

# The agent bounds its own waits on the worker (30 min to the first token, 60 s between
# events); these are a little longer, so the agent's clearer error arrives first.
FIRST_CHUNK_TIMEOUT_S = 1900.0
BETWEEN_CHUNKS_TIMEOUT_S = 90.0
# A site that crashed or was cut off resets its connections, and its streams fail at once. One
# whose packets just stop (a partition that drops them) is found by HTTP/2 pings: unanswered
# for KEEPALIVE_TIMEOUT_MS, every stream on the connection fails and its requests move on.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


def _metadata(request_id: str) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", request_id),)


class Upstream:
    """Channels to the sites' agents, one per address, kept for the gateway's life."""

    def __init__(self) -> None:
        self._agents: dict[str, tuple[grpc.aio.Channel, wire.SiteAgentStub]] = {}

    async def close(self) -> None:
        for channel, _ in self._agents.values():
            await channel.close()

    def _agent(self, address: str) -> wire.SiteAgentStub:
        if address not in self._agents:
            channel = grpc.aio.insecure_channel(address, options=KEEPALIVE_OPTIONS + runtime.GRPC_CHANNEL_OPTIONS)
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
            if exc.code() == grpc.StatusCode.ABORTED:  # the agent's word for "one worker broke"
                raise SiteWorkerFailed(f"site at {address}: {exc.details()}") from None
            raise UpstreamFailed(f"site at {address} failed: {exc.details() or exc.code().name}") from None
        finally:
            call.cancel()
