"""The sites the scheduler knows, their states and the outstanding-work ledger.

State is soft: everything here is rebuilt from the agents' registrations and reports
within a report period, so a restarted scheduler replica needs no storage.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import structlog

from core.policy import SiteLoad
from core.policy_columns import SiteColumns
from core.prefixes import PrefixDirectory
from core.recipes import DEFAULT_RECIPES
from core.settings import SchedulerTimings
from core.tiers import Tier
from core.wire import RefusedSite, RouteRequest, SiteRegistration, SiteReport, SiteState, SiteStatus
from core.work import expected_output_tokens
from scheduler.capacity import CapacityEstimator
from scheduler.slowstart import SlowStart
from scheduler.workload import WorkloadMix

log = structlog.get_logger("scheduler.registry")

# Routes still in transit are those the agent has not taken yet. Under an Offline burst on a
# busy machine thousands of calls wait in the gateways' and the agent's gRPC queues, long after
# their routes (docs/BENCHMARKS.md, "The 0.971 explained"). Each report acknowledges the calls
# taken by request id, so a slow route stays counted however slow it is. A route still
# unacknowledged after this long never reached the site (its gateway died on the way): it stops
# counting, so such phantoms cannot pile up (SchedulerTimings.in_transit_limit_s).
PACE_STEP = 1.1  # sites are told a slower pace only when it is this much slower than theirs
REFUSALS_KEPT = 50  # enough for an operator to see every site that failed to join today


class RegistrationRefused(ValueError):
    """A site may not join: wrong model, unknown GPU, bad fields."""


class UnknownSite(KeyError):
    pass


@dataclass(slots=True)
class Site:
    registration: SiteRegistration
    estimator: CapacityEstimator
    slow_start: SlowStart
    _status: SiteStatus = SiteStatus.JOINING
    status_since: float = field(default_factory=time.monotonic)
    workers_since: float = 0.0  # when healthy_workers last changed (0: never reported)
    last_report_at: float = 0.0
    report: SiteReport | None = None
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    outstanding_by_tier: tuple[int, ...] = ()  # of its outstanding requests, by tier (): not said
    routed_requests: int = 0
    draining: bool = field(default=False)
    # Routes the agent has not acknowledged yet, by request id: (when, expected tokens, tier),
    # oldest first. Added to what it reports, so a report older than a route cannot erase it.
    in_transit: dict[str, tuple[float, int, Tier]] = field(default_factory=dict)
    # What routing weighs it by, kept from one report or route to the next (None: not routable):
    # computing a capacity per site per route cost milliseconds a route with a thousand sites.
    load: SiteLoad | None = None
    # Changed whenever what the site's state shows changes, but for its outstanding work, its
    # routes and the ages (a state pushed to watchers is rebuilt only for the sites whose version moved).
    version: int = 0
    report_interval_s: float = 0.25  # as it was last told: at registration, or paced since
    heartbeat_timeout_s: float = 1.0  # silent this long, it is down: as many intervals as the timings say

    @property
    def status(self) -> SiteStatus:
        return self._status

    @status.setter
    def status(self, status: SiteStatus) -> None:
        if status is not self._status:
            self._status, self.status_since = status, time.monotonic()

    @property
    def prior_capacity_tok_s(self) -> float:
        """Declared: the GPU profile x GPU count the estimate started from."""
        return self.estimator.prior_tok_s

    @property
    def workers(self) -> tuple[int, int]:
        """(healthy, total) as last reported; (0, 0) before any report."""
        return (self.report.healthy_workers, self.report.total_workers) if self.report else (0, 0)

    @property
    def capacity_tok_s(self) -> float:
        """Measured (see scheduler.capacity), scaled by the workers healthy now."""
        return self.estimator.capacity_tok_s(*self.workers)


class Registry:
    def __init__(
        self, model: str, timings: SchedulerTimings, tokenizer: str = "", checkpoints: Sequence[str] | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer or model  # SGLang's tokenizer path defaults to the model's
        # The checkpoints of `model` a site may load, each in its own weight format: a site that
        # resumes another's answer continues from its token ids, whatever the weights' format.
        known = [r.model_path for r in DEFAULT_RECIPES.values()] if checkpoints is None else checkpoints
        self.checkpoints = frozenset({model, *known})
        self.heartbeat_timeout_s = timings.heartbeat_timeout_s
        self.report_interval_s = timings.report_interval_s
        self.reports_per_s = timings.reports_per_s
        self.in_transit_limit_s = timings.in_transit_limit_s
        self.sites: dict[str, Site] = {}
        self.refused: dict[str, RefusedSite] = {}  # by site name, until that site joins
        self.workload = WorkloadMix()  # what each site's capacity is scaled to
        self.prefixes = PrefixDirectory()  # which site was sent which prompt prefixes (core/prefixes.py)
        self.columns = SiteColumns()  # the routable sites' loads as columns (least_expected_delay_columns)
        self._in_transit_at: dict[str, str] = {}  # request id -> the site it is in transit to
        self._versions = itertools.count(1)

    def refuse(self, name: str, reason: str) -> RegistrationRefused:
        """Remember why `name` was refused (for `fedctl status`); the error to raise. Only the
        latest REFUSALS_KEPT names: a caller without the credential chooses the name."""
        self.refused.pop(name, None)
        self.refused[name] = RefusedSite(name, reason, time.time())
        while len(self.refused) > REFUSALS_KEPT:
            del self.refused[next(iter(self.refused))]
        return RegistrationRefused(reason)

    def register(self, reg: SiteRegistration) -> Site:
        if not reg.name:
            raise RegistrationRefused("a site needs a name")
        if reg.model != self.model:
            raise self.refuse(
                reg.name, f"site {reg.name!r} serves {reg.model!r}, but this federation serves {self.model!r}"
            )
        if reg.checkpoint and reg.checkpoint not in self.checkpoints:
            raise self.refuse(
                reg.name,
                f"site {reg.name!r} loads checkpoint {reg.checkpoint!r}, which this federation does not know as "
                f"{self.model!r} (known: {', '.join(sorted(self.checkpoints))}; add it to the schedulers' --checkpoint)",
            )
        if reg.tokenizer and reg.tokenizer != self.tokenizer:
            raise self.refuse(
                reg.name,
                f"site {reg.name!r} tokenizes with {reg.tokenizer!r}, but this federation with {self.tokenizer!r}: "
                "token counts, resumed streams and capacity would not agree",
            )
        try:
            clock = reg.clock_speed if reg.clock_speed > 0 else 1.0  # a registration without it: real GPUs
            estimator = CapacityEstimator.for_site(reg.gpu, reg.gpus, self.workload, clock, reg.name)
            estimator.calibrate(reg.probe_batch, reg.probe_context_tokens, reg.probe_tok_s)
        except KeyError:
            raise self.refuse(reg.name, f"unknown GPU {reg.gpu!r}: use mi300x or mi355x") from None
        if reg.gpus < 1 or not reg.agent_address:
            raise self.refuse(reg.name, "a site needs at least one GPU and an agent address")
        self.refused.pop(reg.name, None)
        old = self.sites.get(reg.name)
        if old is not None and old.estimator.carries_over_to(estimator):
            estimator = old.estimator.rebased()
        # Slow start ramps a site into a federation that is serving; in a fresh one every site
        # is new, and windows would only skew the first traffic away from the capacity shares.
        serving = any(s.outstanding_requests for name, s in self.sites.items() if name != reg.name)
        site = Site(reg, estimator, SlowStart.begin(reg.probe_batch, reg.gpus) if serving else SlowStart(0))
        site.draining = reg.draining  # a replica that restarted hears it from the site
        self._pace_site(site, self._interval_for(len(self.sites) + (reg.name not in self.sites)))
        if old is not None:  # an agent that restarted keeps its counters and admin state
            site.routed_requests, site.draining = old.routed_requests, old.draining
            for request_id in old.in_transit:
                self._in_transit_at.pop(request_id, None)
        self.sites[reg.name] = site
        self.prefixes.forget(reg.name)  # an agent (re)starting: what its workers held is not known
        self._refresh(site)
        return site

    def _interval_for(self, sites: int) -> float:
        """The timings' report interval, or longer when `sites` would send more reports than the budget."""
        return max(self.report_interval_s, sites / self.reports_per_s)

    def _pace_site(self, site: Site, interval_s: float) -> None:
        """`site` reports every `interval_s`, and is down after as many silent intervals as at the timings'."""
        site.report_interval_s = interval_s
        site.heartbeat_timeout_s = self.heartbeat_timeout_s * interval_s / self.report_interval_s

    def pace(self) -> list[Site]:
        """The sites that must now report less often to keep every site's reports within the
        budget, paced so (told so by the caller). Only ever slower while a site stays registered,
        and only by a tenth or more at a time: a federation that grows by a site a second is not
        told a new pace every second."""
        wanted = self._interval_for(len(self.sites))
        slower = [s for s in self.sites.values() if wanted > PACE_STEP * s.report_interval_s]
        for site in slower:
            self._pace_site(site, wanted)
        return slower

    def get(self, name: str) -> Site:
        try:
            return self.sites[name]
        except KeyError:
            raise UnknownSite(name) from None

    def apply_report(self, report: SiteReport, now: float) -> None:
        site = self.get(report.site)
        self.workload.observe(report, now)
        if site.last_report_at:
            site.estimator.observe(report, now - site.last_report_at)
        if site.report is None or site.report.healthy_workers != report.healthy_workers:
            site.workers_since = now
        site.report = report
        site.last_report_at = now
        site.slow_start.observe(report.running_requests, report.delivered_tok_s, site.capacity_tok_s, report.slots)
        for request_id in report.received_ids:
            if site.in_transit.pop(request_id, None) is not None:
                self._in_transit_at.pop(request_id, None)
        while site.in_transit and next(iter(site.in_transit.values()))[0] < now - self.in_transit_limit_s:
            request_id = next(iter(site.in_transit))
            del site.in_transit[request_id]
            self._in_transit_at.pop(request_id, None)
        site.outstanding_requests = report.outstanding_requests + len(site.in_transit)
        site.outstanding_tokens = report.outstanding_tokens + sum(tokens for _, tokens, _ in site.in_transit.values())
        site.outstanding_by_tier = _by_tier(report.outstanding_by_tier, site.in_transit.values())
        site.status = self._live_status(site)
        self._refresh(site)

    def disconnected(self, name: str) -> None:
        """The report stream broke: route around the site at once."""
        site = self.sites.get(name)
        if site is not None:
            site.status = SiteStatus.DOWN
            self.prefixes.forget(name)
            self._refresh(site)

    def expire(self, now: float) -> list[str]:
        """Sites silent for longer than the heartbeat timeout go down; returns their names."""
        gone = []
        for site in self.sites.values():
            silent = now - site.last_report_at > site.heartbeat_timeout_s
            if site.status is not SiteStatus.DOWN and site.last_report_at and silent:
                site.status = SiteStatus.DOWN
                self.prefixes.forget(site.registration.name)
                self._refresh(site)
                gone.append(site.registration.name)
        return gone

    def set_draining(self, name: str, draining: bool) -> Site:
        site = self.get(name)
        site.draining = draining
        if site.status is not SiteStatus.DOWN:
            site.status = self._live_status(site)
        self._refresh(site)
        return site

    def remove(self, name: str) -> Site:
        site = self.get(name)
        del self.sites[name]
        self.workload.forget(name)
        self.prefixes.forget(name)
        site.status = SiteStatus.DOWN
        self._refresh(site)
        for request_id in site.in_transit:
            self._in_transit_at.pop(request_id, None)
        return site

    def routable(self) -> list[SiteLoad]:
        return [s.load for s in self.sites.values() if s.load is not None]

    def _refresh(self, site: Site) -> None:
        """Weigh `site` anew (its report, its status or its load changed)."""
        site.version = next(self._versions)
        if site.status is not SiteStatus.READY:
            site.load = None
        else:
            site.load = SiteLoad(
                site.registration.name,
                site.registration.region,
                site.registration.agent_address,
                site.capacity_tok_s,
                site.outstanding_tokens,
                site.outstanding_requests,
                site.prior_capacity_tok_s,
                site.report.slots if site.report else 0,
                site.estimator.prefill_s_per_token(),
                site.slow_start.window,
                site.outstanding_by_tier,
            )
        self.columns.put(site.registration.name, site.load)

    def _charge(self, site: Site) -> None:
        """Its outstanding work changed by a route: only those figures are weighed anew."""
        if site.load is not None:
            site.load = replace(
                site.load,
                outstanding_tokens=site.outstanding_tokens,
                outstanding_requests=site.outstanding_requests,
                outstanding_by_tier=site.outstanding_by_tier,
            )
            self.columns.put(site.registration.name, site.load)

    def record_route(self, name: str, req: RouteRequest, now: float) -> None:
        """Count a decision until the site's next report says what it really holds."""
        site = self.get(name)
        earlier = self._in_transit_at.get(req.request_id)
        other = self.sites.get(earlier) if earlier is not None else None
        if other is not None:  # a request routed again: its earlier route was never taken
            superseded = other.in_transit.pop(req.request_id, None)
            if superseded is not None:
                other.outstanding_requests -= 1
                other.outstanding_tokens -= superseded[1]
                other.outstanding_by_tier = _plus_one(other.outstanding_by_tier, superseded[2], -1)
                self._charge(other)
        tokens = expected_output_tokens(req.max_tokens)
        self.prefixes.record(name, req.prefix_hashes)
        site.routed_requests += 1
        site.in_transit[req.request_id] = (now, tokens, req.tier)
        self._in_transit_at[req.request_id] = name
        site.outstanding_requests += 1
        site.outstanding_tokens += tokens
        site.outstanding_by_tier = _plus_one(site.outstanding_by_tier, req.tier, 1)
        self._charge(site)

    def states(self) -> tuple[SiteState, ...]:
        return tuple(self.state_of(s) for s in self.sites.values())

    def _live_status(self, site: Site) -> SiteStatus:
        if site.draining:
            return SiteStatus.DRAINING
        report = site.report
        if report is not None and report.loading_workers and not report.healthy_workers:
            return SiteStatus.JOINING  # every worker still loading its model: no traffic, and not down
        return SiteStatus.READY

    @staticmethod
    def ages(s: Site, now: float) -> tuple[float, float, float]:
        """Seconds since its last report, its status changed, its healthy workers changed (-1: never)."""
        return (
            now - s.last_report_at if s.last_report_at else -1.0,
            now - s.status_since,
            now - s.workers_since if s.workers_since else -1.0,
        )

    @staticmethod
    def state_of(s: Site) -> SiteState:
        report_age_s, status_age_s, workers_age_s = Registry.ages(s, time.monotonic())
        r = s.registration
        return SiteState(
            name=r.name,
            region=r.region,
            gpu=r.gpu,
            gpus=r.gpus,
            agent_address=r.agent_address,
            status=s.status,
            capacity_tok_s=s.capacity_tok_s,
            outstanding_requests=s.outstanding_requests,
            outstanding_tokens=s.outstanding_tokens,
            routed_requests=s.routed_requests,
            healthy_workers=s.report.healthy_workers if s.report else 0,
            total_workers=s.report.total_workers if s.report else 0,
            last_report_age_s=report_age_s,
            prior_capacity_tok_s=s.prior_capacity_tok_s,
            capacity_evidence=s.estimator.shown_evidence(*s.workers),
            queued_requests=s.report.queued_requests if s.report else 0,
            slots=s.report.slots if s.report else 0,
            admit_window=s.slow_start.window,
            prefill_s_per_token=s.estimator.prefill_s_per_token(),
            status_age_s=status_age_s,
            workers_age_s=workers_age_s,
            checkpoint=r.checkpoint,
            weight_format=r.weight_format,
            loading_workers=s.report.loading_workers if s.report else 0,
            running_requests=s.report.running_requests if s.report else 0,
            kv_usage=s.report.kv_usage if s.report else 0.0,
            gen_throughput_tok_s=s.report.gen_throughput_tok_s if s.report else 0.0,
            context_tokens=s.report.context_tokens if s.report else 0,
            clock_speed=s.estimator.clock_speed,
            agent_ceiling_tok_s=s.estimator.agent_ceiling_tok_s,
            outstanding_by_tier=s.outstanding_by_tier,
        )


def _by_tier(reported: Sequence[int], in_transit: Iterable[tuple[float, int, Tier]]) -> tuple[int, ...]:
    """A site's outstanding requests by tier: as it reported them, with the routes it has not
    acknowledged yet; () when it does not say its tiers."""
    if not reported:
        return ()
    counts = [*reported, *[0] * (len(Tier) - len(reported))]
    for _, _, tier in in_transit:
        counts[tier] += 1
    return tuple(counts)


def _plus_one(by_tier: tuple[int, ...], tier: Tier, sign: int) -> tuple[int, ...]:
    """`by_tier` with one request of `tier` more (sign 1) or fewer (-1); () stays ()."""
    if not by_tier:
        return by_tier
    counts = list(by_tier)
    counts[tier] = max(0, counts[tier] + sign)
    return tuple(counts)
