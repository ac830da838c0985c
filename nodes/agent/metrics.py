"""The site agent's Prometheus metrics (docs/METRICS.md). Events per request (a Generate call,
a request's outcome, its wait for a worker) are counted as they happen; everything on the
token path (tokens relayed, the rate delivered) and the workers' health is read from the
agent's own state when scraped, so the per-token path pays nothing for it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from core.cpu_clock import CpuCollector
from nodes.agent.delivered import DeliveredRate
from nodes.agent.pool import WorkerPool

OUTCOMES = ("completed", "cancelled", "failed", "refused")
KINDS = ("prompt", "output")


class _StateCollector(Collector):
    def __init__(self, site: str, pool: WorkerPool, delivered: DeliveredRate) -> None:
        self.site, self.pool, self.delivered = site, pool, delivered

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        site, pool, delivered = self.site, self.pool, self.delivered
        relayed = CounterMetricFamily(
            "federation_agent_relayed_tokens", "Output tokens relayed to gateways.", labels=["site"]
        )
        relayed.add_metric([site], delivered.total)
        rate = GaugeMetricFamily(
            "federation_agent_delivered_tokens_per_second",
            "What the site delivers, output tokens/s, as last reported to the schedulers.",
            labels=["site"],
        )
        rate.add_metric([site], delivered.last_rate)
        depth = GaugeMetricFamily("federation_agent_queue_depth", "Requests waiting for a worker.", labels=["site"])
        depth.add_metric([site], pool.waiting)
        by_tier = GaugeMetricFamily(
            "federation_agent_tier_queue_depth",
            "Requests waiting for a worker, by service tier (served priority first).",
            labels=["site", "tier"],
        )
        for tier, count in pool.waiting_by_tier().items():
            by_tier.add_metric([site, tier], count)
        workers = GaugeMetricFamily(
            "federation_agent_workers",
            "The site's workers: health=healthy, loading (launched, not up yet) or total.",
            labels=["site", "health"],
        )
        workers.add_metric([site, "healthy"], pool.healthy_count)
        workers.add_metric([site, "total"], len(pool.workers))
        workers.add_metric([site, "loading"], sum(w.loading for w in pool.workers))
        each = GaugeMetricFamily(
            "federation_agent_worker_healthy",
            "1 while the worker passes its health checks.",
            labels=["site", "worker"],
        )
        for worker in pool.workers:
            each.add_metric([site, worker.url], 1.0 if worker.healthy else 0.0)
        yield from (relayed, rate, depth, by_tier, workers, each)


class AgentMetrics:
    """One agent's metrics, in a registry of its own (a test may run several in one process)."""

    def __init__(self, site: str, pool: WorkerPool, delivered: DeliveredRate) -> None:
        self.registry = CollectorRegistry()
        self.generate_calls = Counter(
            "federation_agent_generate_calls",
            "Generate calls opened (one per gateway process, multiplexed).",
            ["site"],
            registry=self.registry,
        ).labels(site)
        requests = Counter(
            "federation_agent_requests", "Requests finished, by outcome.", ["site", "outcome"], registry=self.registry
        )
        self.finished: dict[str, Callable[[], None]] = {o: requests.labels(site, o).inc for o in OUTCOMES}
        self.queue_wait = Histogram(
            "federation_agent_queue_wait_seconds",
            "A request's wait for a worker slot.",
            ["site"],
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300),
            registry=self.registry,
        ).labels(site)
        self.worker_unreachable = Counter(
            "federation_agent_worker_unreachable",
            "Calls to a worker that could not be made (the request tried on another).",
            ["site"],
            registry=self.registry,
        ).labels(site)
        completed = Counter(
            "federation_agent_completed_tokens",
            "Prompt and output tokens of the requests completed, as their clients asked for them (a resumed "
            "answer's prompt less what it had said, its output with it; cached prompt tokens not at all): the "
            "site's workload shape.",
            ["site", "kind"],
            registry=self.registry,
        )
        self.completed_prompt_tokens, self.completed_output_tokens = (completed.labels(site, k) for k in KINDS)
        self.worker_restarts = Counter(
            "federation_agent_worker_restarts",
            "Launched workers started again after their process died (--launch).",
            ["site"],
            registry=self.registry,
        ).labels(site)
        self.registry.register(_StateCollector(site, pool, delivered))
        self.registry.register(CpuCollector("federation_agent_cpu_seconds", {"site": site}))
