"""The faults a drill injects into a running embedded federation, and how each is detected.

Each fault acts on real processes the way the failure would: a crashed site's agent is
killed (its emulated workers die with it), a partition resets and refuses every connection
on the site's WAN links (scheduler reports and gateway streams alike), a brownout makes every
worker of the site 4x slower, a worker loss kills 4 of its 16 workers, a scheduler crash kills
replicas, a drain is the operator's `fedctl site drain`.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from federation import admin, wire
from federation.embedded import Federation

BROWNOUT_FACTOR = 4.0
WORKERS_LOST = 4
HTTP_TIMEOUT_S = 5.0


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S).read()


def _post_all(urls: list[str], body: dict) -> None:
    """The same fault to several workers at once, as a site-wide failure strikes them."""
    with ThreadPoolExecutor(len(urls)) as pool:
        list(pool.map(lambda url: _post(url, body), urls))


def site_states(federation: Federation) -> dict[str, wire.SiteState]:
    """The sites as the first live scheduler replica sees them ({} when none answers)."""
    state, _ = admin.replicas_state(_live_schedulers(federation))
    return {s.name: s for s in state.sites} if state else {}


def _live_schedulers(federation: Federation) -> list[str]:
    c = federation.config
    return [address for i, address in enumerate(c.scheduler_addresses) if federation.child(f"scheduler {i}").alive()]


@dataclass
class Fault:
    """One drill's fault. `inject` at the fault time; `heal` (if any) `heal_after_s` GPU
    seconds later; `detected` is polled from the fault on, until it says True."""

    site: str
    federation: Federation
    heal_after_s: float | None = None
    capacity_before: float = 0.0

    def inject(self) -> None:
        raise NotImplementedError

    def heal(self) -> None:
        pass

    def detected(self) -> bool:
        raise NotImplementedError

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

    def _workers(self) -> list[str]:
        site = next(s for s in self.federation.config.sites if s.name == self.site)
        assert site.worker_port is not None, "drills pin each site's worker ports"
        return [f"http://{self.federation.config.host}:{site.worker_port + i}" for i in range(site.gpus)]

    def _site_down(self) -> bool:
        state = site_states(self.federation).get(self.site)
        return state is None or state.status is wire.SiteStatus.DOWN


class SiteCrash(Fault):
    def inject(self) -> None:
        self.federation.child(f"agent {self.site}").proc.send_signal(signal.SIGKILL)

    def detected(self) -> bool:
        return self._site_down()

    @property
    def capacity_factor(self) -> float:
        return 0.0


class SitePartition(Fault):
    def _links(self):
        return [c for c in self.federation.children if c.name.startswith("link") and self.site in c.name]

    def inject(self) -> None:
        links = self._links()
        if not links:
            raise ValueError(f"{self.site} has no WAN link to cut (it is in the gateway's region)")
        for link in links:
            link.proc.send_signal(signal.SIGUSR1)

    def heal(self) -> None:
        for link in self._links():
            link.proc.send_signal(signal.SIGUSR2)

    def detected(self) -> bool:
        return self._site_down()

    @property
    def capacity_factor(self) -> float:
        return 0.0


class SiteBrownout(Fault):
    slowdown: float = BROWNOUT_FACTOR

    def inject(self) -> None:
        _post_all([url + "/_emulator/faults" for url in self._workers()], {"slowdown": self.slowdown})

    def heal(self) -> None:
        _post_all([url + "/_emulator/faults" for url in self._workers()], {"slowdown": 1.0})

    @property
    def capacity_factor(self) -> float | None:
        return 1.0 / self.slowdown

    def detected(self) -> bool:
        state = site_states(self.federation).get(self.site)
        return state is not None and state.capacity_tok_s < 0.9 * self.capacity_before


class WorkerLoss(Fault):
    def inject(self) -> None:
        _post_all([url + "/_emulator/die" for url in self._workers()[:WORKERS_LOST]], {})

    def detected(self) -> bool:
        state = site_states(self.federation).get(self.site)
        return state is not None and state.healthy_workers <= state.total_workers - WORKERS_LOST

    @property
    def capacity_factor(self) -> float:
        site = next(s for s in self.federation.config.sites if s.name == self.site)
        return (site.gpus - WORKERS_LOST) / site.gpus


class SchedulerCrash(Fault):
    """Kills replica 0 at the fault; with `all_replicas`, the rest `heal_after_s` later (the
    'heal' here is the second blow). Detected when the gateway watches another replica, or
    says it is degraded."""

    def inject(self) -> None:
        self.federation.child("scheduler 0").proc.send_signal(signal.SIGKILL)

    def heal(self) -> None:
        for i in range(1, self.federation.config.scheduler_replicas):
            self.federation.child(f"scheduler {i}").proc.send_signal(signal.SIGKILL)

    def detected(self) -> bool:
        health = admin.gateway_health(self.federation.config)
        first = self.federation.config.scheduler_addresses[0]
        return health.get("status") == "degraded" or (bool(health.get("scheduler")) and health["scheduler"] != first)


class Drain(Fault):
    def inject(self) -> None:
        admin.drain(_live_schedulers(self.federation), self.site)

    def detected(self) -> bool:
        state = site_states(self.federation).get(self.site)
        return state is not None and state.status is wire.SiteStatus.DRAINING

    @property
    def capacity_factor(self) -> float:
        return 0.0


SCENARIOS: dict[str, Callable[..., Fault]] = {
    "site-crash": SiteCrash,
    "site-partition": SitePartition,
    "site-brownout": SiteBrownout,
    "worker-loss": WorkerLoss,
    "scheduler-crash": SchedulerCrash,
    "drain": Drain,
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
