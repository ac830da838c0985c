"""Keeps the site registered with every scheduler replica and streams its load to each.

The reports leave from a process of their own. A scheduler declares a site down after 1 s
without a report, and the agent's process can be stopped for longer than that while the site is
healthy and working: a collection of its millions of objects (as under the worker-loss drill's
burst of resumed streams: docs/BENCHMARKS.md, "Failover drills"), or its event loop running
gRPC's and uvloop's compiled code for long stretches without letting a reporting thread take the
interpreter lock. So the agent's loop hands the reporter process a snapshot of its load every
LOOP_TICK_S (`ReportFeed`; a thread of the agent writes it to the pipe, so a reporter that stops
reading can never block the loop: snapshots not yet taken are merged into the next), and the
reporter process (`_reporter_main`) sends the latest one to each replica on the replica's
interval, from threads that share nothing with the busy agent.

It stays honest about the agent: a snapshot older than LOOP_STALL_LIMIT_S means the agent's
loop is hung, not busy, and the reports stop, so the schedulers see the site down. When the
agent process dies, the pipe closes, the reporter cancels its streams and exits: the
schedulers see the streams break at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import grpc
import structlog

from core import logs, runtime, wire
from core.credential import bearer
from core.mtls import INSECURE, Tls
from core.pki import SCHEDULER
from core.settings import AgentTimings

log = structlog.get_logger("agent.reporter")

# The reporter's waits are AgentTimings'. A loop busy `loop_stall_limit_s` (5 s) is hung, not
# busy: the stalls the drills' bursts cause are shorter (docs/BENCHMARKS.md, "Failover drills").

# A replica that refuses the site (its model, its credential, its certificate): an error, not a blip.
REFUSED_CODES = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
)
# Request ids waiting for a reporter that does not read (each snapshot carries the calls taken
# since the one before): beyond this the oldest are dropped; the schedulers forget routes never
# acknowledged after a while anyway (SchedulerTimings.in_transit_limit_s).
MAX_PENDING_IDS = 100_000
# The paces a replica may ask for (COMMAND_REPORT_EVERY): none of ours asks less than its
# timings' 0.25 s, nor more than a few seconds, which would leave the site down between reports.
REPORT_INTERVAL_BOUNDS_S = (0.05, 5.0)


class ReporterDied(Exception):
    """The process that sends the site's reports is gone."""


class ReportFeed:
    """The agent's side: starts the reporter process and feeds it snapshots of the load."""

    def __init__(
        self,
        registration: wire.SiteRegistration,
        make_report: Callable[[], wire.SiteReport],
        credential: str = "",
        timings: AgentTimings = AgentTimings(),
        tls: Tls = INSECURE,
    ) -> None:
        self.registration = registration
        self.timings = timings
        self.make_report = make_report
        self.credential = credential
        self.tls = tls
        self._conn: Connection | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._ready = threading.Condition()
        self._pending: wire.SiteReport | None = None  # the next snapshot for the sending thread
        self._registration: wire.SiteRegistration | None = None  # a new one for the sending thread
        self._closing = False
        self._dead = threading.Event()  # the pipe broke: the reporter process is gone

    def start(self, scheduler_addresses: list[str]) -> None:
        # spawn, not fork: a forked copy of a process running gRPC is not safe to use.
        context = multiprocessing.get_context("spawn")
        receiver, self._conn = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_reporter_main,
            args=(self.registration, scheduler_addresses, self.credential, self.timings, self.tls, receiver),
            name=f"reporter {self.registration.name}",
            daemon=True,
        )
        self._process.start()
        receiver.close()  # the child's end; ours is the sender
        self._sender = threading.Thread(target=self._send_forever, name="report feed", daemon=True)
        self._sender.start()

    async def feed_forever(self) -> None:
        """A snapshot every tick, handed to the sending thread. Raises ReporterDied if the
        reporter process died: the site can no longer be seen as up, so the agent stops too."""
        assert self._conn is not None, "start() first"
        while not self._dead.is_set():
            self._offer(self.make_report())
            await asyncio.sleep(self.timings.loop_tick_s)
        raise ReporterDied(f"site {self.registration.name}: the reporter process died")

    def _offer(self, report: wire.SiteReport) -> None:
        """The latest snapshot, with the ids of any the thread has not sent yet."""
        with self._ready:
            if self._pending is not None and self._pending.received_ids:
                ids = (*self._pending.received_ids, *report.received_ids)[-MAX_PENDING_IDS:]
                report = dataclasses.replace(report, received_ids=ids)
            self._pending = report
            self._ready.notify()

    def reregister(self, registration: wire.SiteRegistration) -> None:
        """The site registers again with what it now knows (its join probe's result, once its
        launched workers came up): before any snapshot offered after this call."""
        with self._ready:
            self._registration = registration
            self._ready.notify()

    def _send_forever(self) -> None:
        """The thread: writes each snapshot (and a new registration, first) to the pipe (blocking
        only itself when the reporter does not read), until the pipe closes."""
        assert self._conn is not None
        while True:
            with self._ready:
                while self._pending is None and self._registration is None and not self._closing:
                    self._ready.wait()
                if self._closing:
                    return
                sent = [m for m in (self._registration, self._pending) if m is not None]
                self._registration = self._pending = None
            try:
                for message in sent:
                    self._conn.send(message)
            except (OSError, ValueError):  # the reporter died (or we closed the pipe)
                self._dead.set()
                return

    def stop(self) -> None:
        """Closing the pipe tells the reporter to cancel its streams and exit."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.join(self.timings.reporter_stop_s)
            if self._process.is_alive():
                self._process.kill()


class Snapshots:
    """The reporter process's side of the pipe: the latest snapshot and when it came, and for
    each replica reported to, the calls taken since its last report (each snapshot carries
    only those since the one before, and every replica must hear of every call)."""

    def __init__(self, conn: Connection, stall_limit_s: float) -> None:
        self.stall_limit_s = stall_limit_s
        self.conn = conn
        self.latest: wire.SiteReport | None = None
        self.registration: wire.SiteRegistration | None = None  # the agent's newest, if it sent one
        self.registration_version = 0
        self.received_at = time.monotonic()
        self._lock = threading.Lock()
        self._unreported: dict[str, list[str]] = {}  # replica address -> request ids
        # Bumped when a snapshot's healthy workers differ from the one before: reported at once,
        # not at the next interval (a site losing workers must be seen within a second).
        self.urgent_version = 0
        self._urgent_changed = threading.Condition(self._lock)

    def receive_forever(self) -> None:
        """Until the agent stops, or dies (either closes the pipe)."""
        try:
            while True:
                snapshot = self.conn.recv()
                if isinstance(snapshot, wire.SiteRegistration):
                    with self._lock:
                        self.registration, self.registration_version = snapshot, self.registration_version + 1
                        self.urgent_version += 1  # every replica's stream registers it before its next report
                        self._urgent_changed.notify_all()
                    continue
                with self._lock:
                    for ids in self._unreported.values():
                        ids.extend(snapshot.received_ids)
                    if self.latest is not None and _urgent(self.latest, snapshot):
                        self.urgent_version += 1
                        self._urgent_changed.notify_all()
                    self.latest = snapshot
                    self.received_at = time.monotonic()
        except (EOFError, OSError):
            return

    def follow(self, replica: str) -> None:
        """Start collecting calls for a replica just registered with: it knows no route before."""
        with self._lock:
            self._unreported[replica] = []

    def forget(self, replica: str) -> None:
        """A replica out of reach: its registration ends, and so does its collection."""
        with self._lock:
            self._unreported.pop(replica, None)

    def report_for(self, replica: str) -> wire.SiteReport | None:
        """The latest snapshot with every call taken since this replica's last report."""
        with self._lock:
            if self.latest is None:
                return None
            received = self._unreported.pop(replica, None)
            if received is not None:  # not a replica just forgotten
                self._unreported[replica] = []
            return dataclasses.replace(self.latest, received_ids=tuple(received or ()))

    def wait_for_urgent(self, seen: int, timeout_s: float) -> int:
        """Until an urgent change (`_urgent`) after version `seen`, or `timeout_s` passes; the
        version now."""
        with self._urgent_changed:
            self._urgent_changed.wait_for(lambda: self.urgent_version != seen, timeout_s)
            return self.urgent_version

    @property
    def stalled(self) -> bool:
        return time.monotonic() - self.received_at > self.stall_limit_s


def _urgent(before: wire.SiteReport, now: wire.SiteReport) -> bool:
    """A change the schedulers must hear before the next interval."""
    return now.healthy_workers != before.healthy_workers


def _reporter_main(
    registration: wire.SiteRegistration,
    scheduler_addresses: list[str],
    credential: str,
    timings: AgentTimings,
    tls: Tls,
    conn: Connection,
) -> None:
    """The reporter process: report to every replica until the agent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the agent, and the agent stops us
    logs.configure()
    snapshots = Snapshots(conn, timings.loop_stall_limit_s)
    reporter = Reporter(registration, snapshots, credential, timings, tls)
    reporter.start(scheduler_addresses)
    snapshots.receive_forever()
    reporter.stop()


class Reporter:
    """One thread per scheduler replica: register, open the report stream, send the latest
    snapshot every interval, obey commands that come back; on any failure, back off and
    start over. What the operator said through one replica holds at all of them: a drain is in
    every registration until an undrain (a replica that restarted learns it), and a removal
    ends the reports to every replica (one that was down then does not take the site back)."""

    def __init__(
        self,
        registration: wire.SiteRegistration,
        snapshots: Snapshots,
        credential: str,
        timings: AgentTimings,
        tls: Tls = INSECURE,
    ) -> None:
        self.timings = timings
        self.tls = tls
        self.registration = registration  # as the agent started it (`_register`: as it is now)
        self.draining = registration.draining  # the operator's word, through any replica
        self.snapshots = snapshots
        self.metadata = bearer(credential)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._calls: set[grpc.Future] = set()  # open report streams, cancelled at stop
        # Each replica's report interval, as it said at registration or since (REPORT_EVERY).
        self._intervals: dict[str, float] = {}

    def start(self, scheduler_addresses: list[str]) -> None:
        for address in scheduler_addresses:
            thread = threading.Thread(target=self._run, args=(address,), name=f"reporter {address}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self.stop_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=self.timings.reconnect_max_s)

    def stop_all(self) -> None:
        """Every replica's thread ends: its stream is cancelled, and it does not register again."""
        self._stop.set()
        for call in list(self._calls):
            call.cancel()

    def _run(self, scheduler_address: str) -> None:
        """Stay registered with one scheduler and report to it, until it removes the site or we stop."""
        attempt = 0
        options = (
            runtime.keepalive_options(self.timings.scheduler_ping_s) + runtime.GRPC_CHANNEL_OPTIONS
        )  # a blackholed replica is found
        with self.tls.sync_channel(scheduler_address, SCHEDULER, options) as channel:
            stub = wire.SchedulerStub(channel)
            while not self._stop.is_set():
                call = None
                try:
                    version = self.snapshots.registration_version
                    registered = self._register(stub)
                    log.info("reporter.registered", scheduler=scheduler_address, site=registered.site)
                    attempt = 0
                    self.snapshots.follow(scheduler_address)
                    self._intervals[scheduler_address] = registered.report_interval_s
                    reports = self._reports(scheduler_address, stub, version)
                    call = stub.Report(reports, metadata=self.metadata)
                    self._calls.add(call)
                    for msg in call:
                        command = wire.command_from_pb(msg)
                        log.info("reporter.command", scheduler=scheduler_address, command=command.command.name.lower())
                        if command.command is wire.Command.REMOVE:
                            self.stop_all()  # removed by an operator: stay away from every replica until restarted
                            return
                        if command.command is wire.Command.REPORT_EVERY:
                            self._pace(scheduler_address, command.report_interval_s)
                        if command.command in (wire.Command.DRAIN, wire.Command.UNDRAIN):
                            self.draining = command.command is wire.Command.DRAIN
                        # Draining needs nothing else here: the schedulers stop routing to the
                        # site and the agent finishes what it has.
                    if self._stop.is_set():
                        return
                except grpc.RpcError as exc:
                    if self._stop.is_set():
                        return  # our own cancel
                    refused = exc.code() in REFUSED_CODES
                    level = log.error if refused else log.warning
                    level(
                        "reporter.disconnected", scheduler=scheduler_address, code=exc.code().name, detail=exc.details()
                    )
                except Exception:  # a bug (a message we cannot read): reported, and the stream starts over
                    log.exception("reporter.failed", scheduler=scheduler_address)
                finally:
                    self._calls.discard(call)
                    self.snapshots.forget(scheduler_address)
                attempt += 1
                delay = min(self.timings.reconnect_max_s, self.timings.reconnect_base_s * 2**attempt)
                self._stop.wait(delay * random.uniform(0.5, 1.0))

    def _pace(self, scheduler_address: str, interval_s: float) -> None:
        """Report to that replica every `interval_s` from now on (a replica keeping its sites'
        reports within its budget); a pace no replica of ours would ask for is refused."""
        if not REPORT_INTERVAL_BOUNDS_S[0] <= interval_s <= REPORT_INTERVAL_BOUNDS_S[1]:
            log.warning("reporter.pace_refused", scheduler=scheduler_address, interval_s=interval_s)
            return
        self._intervals[scheduler_address] = interval_s

    def _register(self, stub: wire.SchedulerStub) -> wire.Registered:
        """Register what the agent last said the site is, drained or not as the operator said."""
        registration = dataclasses.replace(self.snapshots.registration or self.registration, draining=self.draining)
        pb = wire.registration_to_pb(registration)
        return wire.registered_from_pb(
            stub.RegisterSite(pb, timeout=self.timings.register_timeout_s, metadata=self.metadata)
        )

    def _reports(self, scheduler_address: str, stub: wire.SchedulerStub, version: int) -> Iterator:
        """One report per interval while the agent's loop is alive, and one at once on an urgent
        change (its workers' health); a new registration from the agent is
        registered before the next report; ends the stream when we stop."""
        sent_at, seen = time.monotonic(), self.snapshots.urgent_version
        while not self._stop.is_set():
            if version != self.snapshots.registration_version:
                version = self.snapshots.registration_version
                self._register(stub)  # a failure ends the stream: registered again from the start
                log.info("reporter.registered_again", scheduler=scheduler_address)
            if self.snapshots.stalled:
                stalled_s = round(time.monotonic() - self.snapshots.received_at, 1)
                log.warning("reporter.loop_stalled", stalled_s=stalled_s)
            elif (latest := self.snapshots.report_for(scheduler_address)) is not None:
                report = wire.report_to_pb(latest)
                now = time.monotonic()
                # gRPC took this long to ask for the next one (a paced replica's interval is long on purpose)
                if now - sent_at > max(self.timings.late_report_s, 3 * self._intervals[scheduler_address]):
                    log.warning("reporter.late", gap_s=round(now - sent_at, 2))
                sent_at = now
                yield report
            seen = self.snapshots.wait_for_urgent(seen, self._intervals[scheduler_address])
