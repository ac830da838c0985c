"""Keeps the site registered with every scheduler replica and streams its load to each.

Each replica gets its own loop: register, open the report stream, send a report every
interval, obey commands that come back; on any failure, back off and start over.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable

import grpc
import structlog

from federation import wire

log = structlog.get_logger("agent.reporter")

RECONNECT_BASE_S = 0.2
RECONNECT_MAX_S = 5.0
REGISTER_TIMEOUT_S = 5.0


class Reporter:
    def __init__(
        self,
        registration: wire.SiteRegistration,
        make_report: Callable[[], wire.SiteReport],
    ) -> None:
        self.registration = registration
        self.make_report = make_report

    async def run(self, scheduler_address: str) -> None:
        """Stay registered with one scheduler and report to it, until it removes the site."""
        attempt = 0
        async with grpc.aio.insecure_channel(scheduler_address) as channel:
            stub = wire.SchedulerStub(channel)
            while True:
                try:
                    registered = wire.registered_from_pb(
                        await stub.RegisterSite(wire.registration_to_pb(self.registration), timeout=REGISTER_TIMEOUT_S)
                    )
                    log.info("reporter.registered", scheduler=scheduler_address, site=registered.site)
                    attempt = 0
                    call = stub.Report(self._reports(registered.report_interval_s))
                    async for msg in call:
                        command = wire.command_from_pb(msg)
                        log.info("reporter.command", scheduler=scheduler_address, command=command.command.name.lower())
                        if command.command is wire.Command.REMOVE:
                            return  # removed by an operator: stay away until restarted
                        # Drain needs nothing here: the scheduler stops routing to the site
                        # and the agent finishes what it has.
                except grpc.aio.AioRpcError as exc:
                    level = log.error if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else log.warning
                    level(
                        "reporter.disconnected", scheduler=scheduler_address, code=exc.code().name, detail=exc.details()
                    )
                attempt += 1
                delay = min(RECONNECT_MAX_S, RECONNECT_BASE_S * 2**attempt)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))

    async def _reports(self, interval_s: float) -> AsyncIterator:
        while True:
            yield wire.report_to_pb(self.make_report())
            await asyncio.sleep(interval_s)
