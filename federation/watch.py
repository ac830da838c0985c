"""The federation's state as the scheduler replicas push it (`WatchState`), for an operator
watching it live (`fedctl status --watch`) rather than polling `GetState`.

One replica is watched at a time, since each holds the whole state. When it fails or falls
silent the next is watched; when none answers the watch says so and tries them all again, so an
operator watching through a scheduler restart sees it come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from core import wire
from core.mtls import Tls
from core.pki import SCHEDULER
from federation.admin import ADMIN_TIMEOUT_S, Refused

REFUSALS = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


@dataclass(frozen=True, slots=True)
class Update:
    state: wire.FederationState | None  # None: no replica answered
    # Each replica's address: "watching", or why it is not, as of the last time it was tried.
    replicas: dict[str, str]


async def updates(addresses: Sequence[str], tls: Tls, interval_s: float) -> AsyncIterator[Update]:
    """An Update each time the watched replica pushes its state (every `interval_s`), and one
    each round in which no replica answered. Raises Refused when a replica refuses the operator's
    certificate: watching again would not change its mind."""
    replicas = dict.fromkeys(addresses, "not watched")
    while True:
        for address in addresses:
            try:
                async for state in _pushed(address, tls, interval_s):
                    replicas[address] = "watching"
                    yield Update(state, dict(replicas))
                replicas[address] = "ended the watch"  # it is shutting down
            except grpc.aio.AioRpcError as exc:
                if exc.code() in REFUSALS:
                    raise Refused(f"{address}: {exc.details()}") from None
                replicas[address] = f"unreachable ({exc.code().name})"
            except TimeoutError:
                replicas[address] = "silent"
        yield Update(None, dict(replicas))
        await asyncio.sleep(interval_s)


async def _pushed(address: str, tls: Tls, interval_s: float) -> AsyncIterator[wire.FederationState]:
    """One replica's states until it ends the stream; TimeoutError when it pushes nothing for an
    interval and the admin calls' timeout (a replica stopped, or a link dropping its packets)."""
    silence_s = interval_s + ADMIN_TIMEOUT_S
    async with tls.channel(address, SCHEDULER) as channel:
        call = wire.SchedulerStub(channel).WatchState(wire.state_request_to_pb(interval_s))
        while True:
            async with asyncio.timeout(silence_s):
                pushed = await call.read()
            if pushed is grpc.aio.EOF:
                return
            yield wire.federation_state_from_pb(pushed)
