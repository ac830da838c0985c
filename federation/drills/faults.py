"""The faults a drill injects, and how each is detected.

In the embedded default each fault acts on real processes the way the failure would: a
crashed site's agent is killed (its emulated workers die with it), a partition resets and
refuses every connection on the site's WAN links (scheduler reports and gateway streams
alike), a brownout makes every worker of the site 4x slower, a worker loss kills 4 of its 16
workers, a scheduler crash kills replicas, a CPU starve stops the site's agent (SIGSTOP) for
40 ms of every 100 until the load ends. In an operator's federation the operator's command
does it. A drain is `fedctl site drain` on either. Detection reads what an operator can read:
the schedulers' state and the gateway's /health.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import grpc
import psutil

from core import wire
from core.config import SiteConfig
from core.processes import free_port_block
from federation import admin
from federation.drills.target import DrillError, Target
from federation.embedded import Federation
from federation.linkproxy import BLACKHOLE_SIGNAL

BROWNOUT_FACTOR = 4.0
WORKERS_LOST = 4
JOINING_REGION, JOINING_GPU, JOINING_GPUS = "eu-central-1", "mi355x", 8  # add-site's new site
# cpu-starve: the agent stopped this long of every period. Long beside its event loop's turns
# and its report interval (0.25 s), far below what a heartbeat takes to miss (a site is down
# after 1 s of silence): a busy neighbour or a throttled cgroup, not a dead agent.
STARVE_MS, STARVE_PERIOD_MS = 40.0, 100.0
HTTP_TIMEOUT_S = 5.0


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S).read()


def _post_all(urls: list[str], body: dict) -> None:
    """The same fault to several workers at once, as a site-wide failure strikes them."""
    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda url: _post(url, body), urls))


@dataclass
class Fault:
    """One drill's fault at one site. `inject` at the fault time; `heal` (if the fault `heals`)
    the drill's `--heal-after-s` later; `detected` is polled from the fault on, until it says True. Against
    the embedded default a fault breaks our own processes; against an operator's federation it
    runs the operator's command for it."""

    site: str
    target: Target
    before: wire.SiteState | None = None  # the site as the schedulers saw it just before the fault
    heals: ClassVar[bool] = False
    needs_scheduler_links: ClassVar[bool] = (
        False  # the embedded federation must route every call to a replica through a link
    )

    def inject(self) -> None:
        if self.target.inject_command:
            self.target.run(self.target.inject_command, self.site)
        else:
            self._inject(self.target.own(f"inject {type(self).__name__}"))

    def heal(self) -> None:
        if self.target.heal_command:
            self.target.run(self.target.heal_command, self.site)
        elif self.target.federation is not None:
            self._heal(self.target.federation)

    def _inject(self, federation: Federation) -> None:
        raise NotImplementedError

    def _heal(self, federation: Federation) -> None:
        pass

    def end(self) -> None:
        """The load is over (or the drill failed): a fault that lasts until then stops. Always called."""

    def detected(self) -> bool:
        raise NotImplementedError

    def detected_age_s(self) -> float | None:
        """How long ago, by the schedulers' clock, the change `detected` saw happened; None when
        the fault has no such clock (detection is then when the poll saw it)."""
        return None

    def _status_age_s(self) -> float | None:
        state = self._state()
        return state.status_age_s if state is not None else None

    def _workers_age_s(self) -> float | None:
        state = self._state()
        return state.workers_age_s if state is not None and state.workers_age_s >= 0 else None

    def surviving(self, before_tok_s: dict[str, float]) -> dict[str, float]:
        """Of each site's delivered rate before the fault, what survives it."""
        kept = self.capacity_factor
        if kept is None:
            return dict(before_tok_s)
        return {k: v * kept if k == self.site else v for k, v in before_tok_s.items()}

    @property
    def capacity_factor(self) -> float | None:
        """What the fault leaves of the site's capacity (0: it takes no more work); None when
        the fault is not the site's (a scheduler crash)."""
        return None

    def _state(self) -> wire.SiteState | None:
        return self.target.site_states().get(self.site)

    def _workers(self, federation: Federation) -> list[str]:
        site = next(s for s in federation.config.sites if s.name == self.site)
        assert site.worker_port is not None, "drills pin each site's worker ports"
        return [f"http://{federation.config.host}:{site.worker_port + i}" for i in range(site.gpus)]

    def _site_down(self) -> bool:
        state = self._state()
        return state is None or state.status is wire.SiteStatus.DOWN


class SiteCrash(Fault):
    def _inject(self, federation: Federation) -> None:
        federation.child(f"agent {self.site}").proc.send_signal(signal.SIGKILL)

    def detected(self) -> bool:
        return self._site_down()

    detected_age_s = Fault._status_age_s

    @property
    def capacity_factor(self) -> float:
        return 0.0


class SitePartition(Fault):
    """The site's WAN links reset every connection, and each new one, until healed."""

    heals = True
    link_signal: ClassVar[signal.Signals] = signal.SIGUSR1  # what the link proxies are told

    def _inject(self, federation: Federation) -> None:
        links = federation.links_of(self.site)
        if not links:
            raise DrillError(f"{self.site} has no WAN link to break (it is in the gateway's region)")
        for link in links:
            link.proc.send_signal(self.link_signal)

    def _heal(self, federation: Federation) -> None:
        for link in federation.links_of(self.site):
            link.proc.send_signal(signal.SIGUSR2)

    def detected(self) -> bool:
        return self._site_down()

    detected_age_s = Fault._status_age_s

    @property
    def capacity_factor(self) -> float:
        return 0.0


class SiteBlackhole(SitePartition):
    """The site's WAN links drop every byte both ways, connections left open (no reset): found
    by the schedulers' heartbeat (its reports stop) and the gateways' keepalive pings."""

    link_signal = BLACKHOLE_SIGNAL


class AllWorkersLost(Fault):
    """Every worker of the site dies while it holds a queue; its agent lives on, with no worker."""

    def _inject(self, federation: Federation) -> None:
        _post_all([url + "/_emulator/die" for url in self._workers(federation)], {})

    def detected(self) -> bool:
        state = self._state()
        return state is None or state.status is wire.SiteStatus.DOWN or state.healthy_workers == 0

    def detected_age_s(self) -> float | None:
        state = self._state()
        if state is None or state.status is wire.SiteStatus.DOWN:
            return self._status_age_s()
        return self._workers_age_s()

    @property
    def capacity_factor(self) -> float:
        return 0.0


class SiteBrownout(Fault):
    """Every worker of the site slowed `slowdown`-fold. Detected when the schedulers' capacity
    for it falls under 0.9 of what it was: its workers' own accounting shows their passes
    taking longer (scheduler/capacity.py)."""

    slowdown: float = BROWNOUT_FACTOR

    def _inject(self, federation: Federation) -> None:
        _post_all([url + "/_emulator/faults" for url in self._workers(federation)], {"slowdown": self.slowdown})

    @property
    def capacity_factor(self) -> float | None:
        return 1.0 / self.slowdown

    def detected(self) -> bool:
        state, before = self._state(), self.before
        if state is None or before is None:
            return False
        return state.capacity_tok_s < 0.9 * before.capacity_tok_s


class WorkerLoss(Fault):
    """WORKERS_LOST of the site's workers die; of a smaller site, all but one (a site that loses
    every worker is the all-workers-lost drill)."""

    @staticmethod
    def lost_of(workers: int) -> int:
        return min(WORKERS_LOST, workers - 1)

    @property
    def _lost(self) -> int:
        return self.lost_of(self.before.total_workers) if self.before is not None else WORKERS_LOST

    def _inject(self, federation: Federation) -> None:
        _post_all([url + "/_emulator/die" for url in self._workers(federation)[: self._lost]], {})

    def detected(self) -> bool:
        state = self._state()
        return state is not None and state.healthy_workers <= state.total_workers - self._lost

    detected_age_s = Fault._workers_age_s

    @property
    def capacity_factor(self) -> float | None:
        if self.before is None or not self.before.total_workers:
            return None
        return (self.before.total_workers - self._lost) / self.before.total_workers


class SchedulerCrash(Fault):
    """Kills replica 0 at the fault; then the rest `--heal-after-s` later (the 'heal' here is the
    second blow). Detected when the gateway watches another replica than it did before the
    fault (the address it dials: a link's, when links carry its calls), or says it is degraded."""

    heals = True
    watched_before: str | None = None

    def inject(self) -> None:
        self.watched_before = self.target.gateway_health().get("scheduler")
        super().inject()

    def _inject(self, federation: Federation) -> None:
        federation.child("scheduler 0").proc.send_signal(signal.SIGKILL)

    def _heal(self, federation: Federation) -> None:
        for i in range(1, federation.config.scheduler.replicas):
            federation.child(f"scheduler {i}").proc.send_signal(signal.SIGKILL)

    def detected(self) -> bool:
        health = self.target.gateway_health()
        watched = health.get("scheduler")
        return health.get("status") == "degraded" or (bool(watched) and watched != self.watched_before)


class SchedulerBlackhole(SchedulerCrash):
    """Replica 0's packets dropped on every path to it (the drill puts a link of ours on each);
    then every replica's `--heal-after-s` later. Detected as scheduler-crash is."""

    needs_scheduler_links: ClassVar[bool] = True

    def _inject(self, federation: Federation) -> None:
        for link in federation.links_to_scheduler(0):
            link.proc.send_signal(BLACKHOLE_SIGNAL)

    def _heal(self, federation: Federation) -> None:
        for i in range(1, federation.config.scheduler.replicas):
            for link in federation.links_to_scheduler(i):
                link.proc.send_signal(BLACKHOLE_SIGNAL)


class Drain(Fault):
    """The operator's own `fedctl site drain`: the same on any federation, no command needed."""

    def inject(self) -> None:
        admin.drain(self.target.live_schedulers(), self.target.operator, self.site)

    def detected(self) -> bool:
        state = self._state()
        return state is not None and state.status is wire.SiteStatus.DRAINING

    detected_age_s = Fault._status_age_s

    @property
    def capacity_factor(self) -> float:
        return 0.0


class Starver:
    """A thread that stops a process (SIGSTOP) for `stop_s` of every `period_s` and lets it run
    (SIGCONT) in between, until `stop()`; it leaves the process running however it ends (stopped,
    an error, the process gone). psutil sends the signals: it refuses a pid that now names
    another process."""

    def __init__(self, pid: int, stop_s: float, period_s: float) -> None:
        self.process = psutil.Process(pid)
        self.stop_s, self.period_s = stop_s, period_s
        self.stops = 0  # how many times it stopped the process
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"starve {pid}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
        self._continue()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                self.process.suspend()
                self.stops += 1
                self._done.wait(self.stop_s)
                self.process.resume()
                self._done.wait(self.period_s - self.stop_s)
        except psutil.NoSuchProcess:
            pass  # it died (or was killed): nothing left to starve
        finally:
            self._continue()

    def _continue(self) -> None:
        try:
            self.process.resume()
        except psutil.NoSuchProcess:
            pass


class CpuStarve(Fault):
    """The site's agent gets no CPU for `starve_ms` of every `period_ms`, from the fault to the
    end of the load (its workers, other processes, run on): what a noisy neighbour, a throttled
    cgroup or a long pause of its runtime does to it. Its GPUs lose nothing, so the estimate
    should hold and routing should not turn from the site. `detected` is an overreaction: the
    schedulers no longer have the site READY (never, in a good run)."""

    starve_ms: float = STARVE_MS
    period_ms: float = STARVE_PERIOD_MS
    starver: Starver | None = None

    def _inject(self, federation: Federation) -> None:
        agent = federation.child(f"agent {self.site}")
        self.starver = Starver(agent.pid, self.starve_ms / 1000, self.period_ms / 1000)
        self.starver.start()

    def end(self) -> None:
        if self.starver is not None:
            self.starver.stop()

    def detected(self) -> bool:
        state = self._state()
        return state is None or state.status is not wire.SiteStatus.READY

    detected_age_s = Fault._status_age_s

    @property
    def capacity_factor(self) -> float:
        return 1.0


class SiteJoin(Fault):
    """Not a fault: capacity arriving. A new site (8 emulated MI355X in eu-central-1, its round
    trips from the config's links) joins under load, as `fedctl site add --emulate` adds one;
    against an operator's federation, their --inject command starts their site's agent.
    Detected when it is ready at the schedulers; it then earns its share by slow start."""

    def _inject(self, federation: Federation) -> None:
        ports = free_port_block(1 + JOINING_GPUS)
        federation.add_site(SiteConfig(self.site, JOINING_REGION, JOINING_GPU, JOINING_GPUS, ports, ports + 1))

    def detected(self) -> bool:
        state = self._state()
        return state is not None and state.status is wire.SiteStatus.READY

    detected_age_s = Fault._status_age_s

    def surviving(self, before_tok_s: dict[str, float]) -> dict[str, float]:
        return dict(before_tok_s)  # every site keeps what it had; the new one adds to it


SCENARIOS: dict[str, Callable[..., Fault]] = {
    "site-crash": SiteCrash,
    "site-partition": SitePartition,
    "site-brownout": SiteBrownout,
    "worker-loss": WorkerLoss,
    "scheduler-crash": SchedulerCrash,
    "scheduler-blackhole": SchedulerBlackhole,
    "site-blackhole": SiteBlackhole,
    "all-workers-lost": AllWorkersLost,
    "drain": Drain,
    "add-site": SiteJoin,
    "cpu-starve": CpuStarve,
}


def poll_until(check: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> float | None:
    """Wall seconds until `check()` held, None if it never did within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if check():
                return time.monotonic() - start
        except (grpc.RpcError, OSError):
            pass
        time.sleep(every_s)
    return None
