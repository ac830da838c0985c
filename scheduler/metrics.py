"""The scheduler's Prometheus metrics (docs/METRICS.md): what it decides, counted as it
decides, and every site as it sees it, read from the registry when scraped (a site's state
costs nothing between scrapes)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core.cpu_clock import CpuCollector
from core.wire import SiteStatus
from scheduler.registry import Registry

_STATES = [s.label for s in SiteStatus]


class SitesCollector(Collector):
    """Each registered site's state, capacity and load, as `fedctl status` shows them."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ("site",)) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"federation_scheduler_site_{name}", doc, labels=list(labels))

        state = gauge("state", "1 for the site's current state, 0 for the others.", ("site", "state"))
        info = gauge("info", "1 per registered site, with its region and GPU type.", ("site", "region", "gpu"))
        evidence = gauge("capacity_evidence", "1 for what the capacity figure rests on.", ("site", "evidence"))
        workers = gauge("workers", "The site's workers: health=healthy or total.", ("site", "health"))
        routed = CounterMetricFamily(
            "federation_scheduler_site_routed_requests", "Requests routed to the site.", labels=["site"]
        )
        simple = {
            "gpus": gauge("gpus", "GPUs the site declared."),
            "capacity_tok_s": gauge("capacity_tokens_per_second", "Measured capacity, output tokens/s."),
            "prior_capacity_tok_s": gauge(
                "prior_capacity_tokens_per_second", "The declared GPUs' prior capacity, output tokens/s."
            ),
            "agent_ceiling_tok_s": gauge(
                "agent_ceiling_tokens_per_second",
                "What the site's agent can relay while its loop runs at a whole core and caps the site's "
                "capacity, output tokens/s (0: not at its ceiling).",
            ),
            "clock_speed": gauge(
                "clock_speed", "The site's declared clock: 1 for real GPUs, an emulated site's speed."
            ),
            "admit_window": gauge("admit_window", "Slow start: the slots routing may fill (0: all)."),
            "slots": gauge("slots", "Running-request slots of the site's workers."),
            "last_report_age_s": gauge("report_age_seconds", "Since the site's last report (-1: none yet)."),
            "outstanding_requests": gauge("outstanding_requests", "Routed and not yet finished."),
            "outstanding_tokens": gauge("outstanding_tokens", "Output tokens the outstanding requests may produce."),
            "queued_requests": gauge("queued_requests", "Waiting at the site for a worker."),
        }
        for s in self.registry.states():
            for label in _STATES:
                state.add_metric([s.name, label], 1.0 if s.status.label == label else 0.0)
            info.add_metric([s.name, s.region, s.gpu], 1.0)
            evidence.add_metric([s.name, s.capacity_evidence or "none"], 1.0)
            workers.add_metric([s.name, "healthy"], s.healthy_workers)
            workers.add_metric([s.name, "total"], s.total_workers)
            routed.add_metric([s.name], s.routed_requests)
            for field, family in simple.items():
                family.add_metric([s.name], getattr(s, field))
        yield from (state, info, evidence, workers, routed, *simple.values())


class SchedulerMetrics:
    """One scheduler's metrics, in a registry of its own (a test may run several in one process)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = CollectorRegistry()
        self.routes = Counter(
            "federation_scheduler_routes",
            "Route answers: outcome=routed (a site chosen and charged), dry_run (asked only), too_long (the soonest "
            "start past the request's max_delay_s: not charged, its gateway refuses it), no_site (nothing routable).",
            ["site", "outcome"],
            registry=self.registry,
        )
        self.route_decision = Histogram(
            "federation_scheduler_route_decision_seconds",
            "Time to decide one Route in this process.",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=self.registry,
        )
        self.reports = Counter(
            "federation_scheduler_reports",
            "Site reports applied: what this replica absorbs grows with the sites and their cadence.",
            registry=self.registry,
        )
        self.refused_registrations = Counter(
            "federation_scheduler_registrations_refused",
            "Sites that asked to join and were refused.",
            registry=self.registry,
        )
        self.registry.register(SitesCollector(registry))
        self.registry.register(CpuCollector("federation_scheduler_cpu_seconds", {}))
