"""The schedulers' state as they push it (WatchState), from one replica at a time.

The replicas are active-active with soft state, so any one of them shows the federation; the
dashboard watches the first that answers and moves to the next when its stream fails or falls
silent, as the gateway does. A push is a few KB every WATCH_PUSH_S: the page sees a drain or a
site going down within a second, with no polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc
import structlog

from core import wire
from core.mtls import Tls
from core.pki import SCHEDULER
from core.runtime import GRPC_CHANNEL_OPTIONS

WATCH_PUSH_S = 0.25  # the replica pushes its state this often
WATCH_SILENCE_S = 3.0  # twelve pushes missed: the replica is lost, the next one is watched
RETRY_S = 1.0  # after every replica failed, try them again this much later

log = structlog.get_logger("dashboard")

OnState = Callable[[wire.FederationState, str], None]


async def follow(addresses: Sequence[str], tls: Tls, on_state: OnState, on_lost: Callable[[], None]) -> None:
    """Call `on_state(state, replica)` for every push, until cancelled; `on_lost()` each time no
    replica answers."""
    channels = [tls.channel(address, SCHEDULER, GRPC_CHANNEL_OPTIONS) for address in addresses]
    try:
        while True:
            for address, channel in zip(addresses, channels, strict=True):
                try:
                    await _watch(address, wire.SchedulerStub(channel), on_state)
                except grpc.aio.AioRpcError as exc:
                    log.warning(
                        "dashboard.scheduler_lost", scheduler=address, reason=exc.code().name, details=exc.details()
                    )
                except TimeoutError:
                    log.warning("dashboard.scheduler_lost", scheduler=address, reason="silent")
            on_lost()
            await asyncio.sleep(RETRY_S)
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


async def _watch(address: str, stub: wire.SchedulerStub, on_state: OnState) -> None:
    """Read one replica's pushes until its stream ends, fails or falls silent."""
    call = stub.WatchState(wire.state_request_to_pb(WATCH_PUSH_S))
    try:
        first = True
        while True:
            async with asyncio.timeout(WATCH_SILENCE_S):
                message = await call.read()
            if message is grpc.aio.EOF:
                return
            if first:
                log.info("dashboard.scheduler_watched", scheduler=address)
                first = False
            on_state(wire.federation_state_from_pb(message), address)
    finally:
        call.cancel()
