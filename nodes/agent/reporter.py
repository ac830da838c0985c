"""Keeps the site registered with every scheduler replica and streams its load to each.

Each replica gets its own thread: register, open the report stream, send a report every
interval, obey commands that come back; on any failure, back off and start over.

Why threads, not tasks on the agent's event loop: a scheduler declares a site down after
1 s without a report, and under an Offline burst the agent's loop can be busy for longer
than that (tens of thousands of new streams at once) while the site is healthy and
working. A thread keeps the heartbeat on time. It is still honest about the loop: the loop
marks itself alive every fraction of a second (`LoopWatch`), and a loop stalled for
LOOP_STALL_LIMIT_S stops the reports, so a hung agent is still seen as down.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import structlog

from federation import runtime, wire

log = structlog.get_logger("agent.reporter")

RECONNECT_BASE_S = 0.2
RECONNECT_MAX_S = 1.0  # a site back from a partition rejoins within a second (registering is cheap)
REGISTER_TIMEOUT_S = 5.0
LOOP_TICK_S = 0.1
LATE_REPORT_S = 0.75  # a gap this long between reports risks the scheduler's 1 s heartbeat
# A loop busy this long is hung, not busy: the longest stall seen under a 24 k-request burst
# on two cores was ~2 s.
LOOP_STALL_LIMIT_S = 5.0


class LoopWatch:
    """When the agent's event loop last ran a turn, for the reporter threads to check."""

    def __init__(self) -> None:
        self.alive_at = time.monotonic()

    async def tick_forever(self) -> None:
        while True:
            self.alive_at = time.monotonic()
            await asyncio.sleep(LOOP_TICK_S)

    @property
    def stalled(self) -> bool:
        return time.monotonic() - self.alive_at > LOOP_STALL_LIMIT_S


class Reporter:
    def __init__(
        self,
        registration: wire.SiteRegistration,
        make_report: Callable[[], wire.SiteReport],
        watch: LoopWatch,
    ) -> None:
        self.registration = registration
        self.make_report = make_report
        self.watch = watch
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._calls: set[grpc.Future] = set()  # open report streams, cancelled at stop

    def start(self, scheduler_addresses: list[str]) -> None:
        for address in scheduler_addresses:
            thread = threading.Thread(target=self._run, args=(address,), name=f"reporter {address}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for call in list(self._calls):
            call.cancel()
        for thread in self._threads:
            thread.join(timeout=RECONNECT_MAX_S)

    def _run(self, scheduler_address: str) -> None:
        """Stay registered with one scheduler and report to it, until it removes the site or we stop."""
        attempt = 0
        with grpc.insecure_channel(scheduler_address, options=runtime.GRPC_CHANNEL_OPTIONS) as channel:
            stub = wire.SchedulerStub(channel)
            while not self._stop.is_set():
                call = None
                try:
                    registered = wire.registered_from_pb(
                        stub.RegisterSite(wire.registration_to_pb(self.registration), timeout=REGISTER_TIMEOUT_S)
                    )
                    log.info("reporter.registered", scheduler=scheduler_address, site=registered.site)
                    attempt = 0
                    call = stub.Report(self._reports(registered.report_interval_s))
                    self._calls.add(call)
                    for msg in call:
                        command = wire.command_from_pb(msg)
                        log.info("reporter.command", scheduler=scheduler_address, command=command.command.name.lower())
                        if command.command is wire.Command.REMOVE:
                            return  # removed by an operator: stay away until restarted
                        # Drain needs nothing here: the scheduler stops routing to the site
                        # and the agent finishes what it has.
                    if self._stop.is_set():
                        return
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return  # our own cancel
                    level = log.error if exc.code() == grpc.StatusCode.FAILED_PRECONDITION else log.warning
                    level(
                        "reporter.disconnected", scheduler=scheduler_address, code=exc.code().name, detail=exc.details()
                    )
                finally:
                    self._calls.discard(call)
                attempt += 1
                delay = min(RECONNECT_MAX_S, RECONNECT_BASE_S * 2**attempt)
                self._stop.wait(delay * random.uniform(0.5, 1.0))

    def _reports(self, interval_s: float) -> Iterator:
        """One report per interval while the agent's loop is alive; ends the stream when we stop."""
        sent_at = time.monotonic()
        while not self._stop.is_set():
            if self.watch.stalled:
                log.warning("reporter.loop_stalled", stalled_s=round(time.monotonic() - self.watch.alive_at, 1))
            else:
                report = wire.report_to_pb(self.make_report())
                now = time.monotonic()
                if now - sent_at > LATE_REPORT_S:  # gRPC took this long to ask for the next one
                    log.warning("reporter.late", gap_s=round(now - sent_at, 2))
                sent_at = now
                yield report
            self._stop.wait(interval_s)
