"""SGLang's Prometheus metrics for one emulated GPU, as SGLang 0.5.23 with --enable-metrics
exports them.

The scheduler's counters and gauges (its accounting of its work, and the load it last logged)
follow SGLang's own cadence, replayed over the engine's stretches of steps by
`nodes/emulator/reporter.py`, which says what each one counts and when it moves, with the
SGLang source behind it. In short: a step with a prompt chunk (which, the emulator's step being
SGLang's --enable-mixed-chunk batch, also decodes every running sequence) is one prefill pass,
`cuda_graph_passes_total{mode="prefill_none"}`, its chunk in `realtime_tokens_total{mode=
"prefill_compute"}`, its prefix-cache hits in `{mode="prefill_cache"}` (and, but for retracted
requests', in `prefill_effective_tokens_total{mode="device_hit"}` and the `cache_hit_rate` gauge)
and its decode in no counter; a step without one is a decode pass, its batch in
`realtime_tokens_total{mode="decode"}`, in a graph up to 512 sequences. The gauges are held
between SGLang's log points (each prefill pass, every 40th decode pass, going idle), not read at
scrape time: among them the KV pools, FULL and sliding-window, where cached KV nobody locks is
evictable, not used (`num_used_tokens` and `token_usage` are the fuller pool's). Idle seconds are
published at most once a second. The radix cache's eviction counters appear with its first
eviction. The request histograms and counters (the tokenizer's, `cached_tokens_total` among them)
are filled at request milestones; inter-token latency is observed once per finished request with a weight of
`tokens - 1` (the mean gap), which keeps the cost per request rather than per token while
giving the same sum and count SGLang would.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from nodes.emulator.engine import Engine
from nodes.emulator.reporter import Pools, Reporter, ReportState
from nodes.emulator.sequence import Sequence
from nodes.emulator.stretch import KvShape, Stretch

# SGLang 0.5.23's bucket boundaries (seconds) for its latency histograms.
TTFT_BUCKETS_S = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS_S = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.010,
    0.015,
    0.020,
    0.025,
    0.030,
    0.035,
    0.040,
    0.060,
    0.080,
    0.100,
    0.200,
    0.400,
    0.600,
    0.800,
    1,
    2,
    4,
    6,
    8,
)
E2E_BUCKETS_S = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
    600,
    1200,
    1800,
    2400,
)
# SGLang's eviction_duration_seconds buckets (seconds): one device eviction pass.
EVICTION_BUCKETS_S = (
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.006,
    0.007,
    0.008,
    0.009,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
)
QUEUE_BUCKETS_S = (
    0.0,
    0.001,
    0.005,
    0.010,
    0.050,
    0.100,
    0.200,
    0.500,
    1,
    2,
    3,
    4,
    5,
    10,
    15,
    20,
    30,
    40,
    50,
    60,
    70,
    80,
    90,
    100,
    200,
    300,
    400,
    500,
    600,
    700,
    800,
    900,
    1000,
    1200,
    1400,
    1600,
    1800,
    2000,
    2500,
    3000,
)


class _Histogram:
    """A cumulative histogram that accepts weighted observations."""

    def __init__(self, bounds: Seq[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, weight: int = 1) -> None:
        if weight <= 0:
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += weight
        self.total += value * weight

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip(self.bounds, self.counts, strict=False):  # counts ends with +Inf
            running += n
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class _PerStream:
    """What SGLang labels with is_streaming: one set for streaming requests, one for not."""

    def __init__(self) -> None:
        self.ttft = _Histogram(TTFT_BUCKETS_S)
        self.e2e = _Histogram(E2E_BUCKETS_S)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests = 0


class WorkerMetrics:
    """EngineListener + Prometheus collector for one emulated worker."""

    def __init__(self, model_name: str) -> None:
        self.tokenizer_labels = {"model_name": model_name, "engine_type": "unified"}
        self.scheduler_labels = {**self.tokenizer_labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self.engine: Engine | None = None
        self.reporter: Reporter | None = None
        self.by_stream = {"true": _PerStream(), "false": _PerStream()}
        self.itl = _Histogram(ITL_BUCKETS_S)
        self.queue = _Histogram(QUEUE_BUCKETS_S)
        self.aborted_requests = 0
        self.cached_tokens = 0  # the tokenizer's cached_tokens_total{cache_source="device"}
        self.evicted_tokens = 0
        self.eviction_seconds = _Histogram(EVICTION_BUCKETS_S)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def _for(self, seq: Sequence) -> _PerStream:
        return self.by_stream["true" if seq.streaming else "false"]

    # EngineListener
    def on_first_token(self, seq: Sequence) -> None:
        assert seq.first_token_at is not None and seq.admitted_at is not None
        self._for(seq).ttft.observe(seq.first_token_at - seq.arrived_at)
        self.queue.observe(seq.admitted_at - seq.queued_at)

    def on_finish(self, seq: Sequence) -> None:
        assert seq.finished_at is not None
        stats = self._for(seq)
        stats.requests += 1
        stats.prompt_tokens += seq.prompt_tokens
        stats.generation_tokens += seq.generated
        stats.e2e.observe(seq.finished_at - seq.arrived_at)
        self.cached_tokens += seq.cached_tokens
        if seq.first_token_at is not None and seq.generated > 1:
            gap = (seq.finished_at - seq.first_token_at) / (seq.generated - 1)
            self.itl.observe(gap, seq.generated - 1)

    def on_abort(self, seq: Sequence) -> None:
        self.aborted_requests += 1

    def on_stretch(self, stretch: Stretch) -> None:
        assert self.reporter is not None
        self.reporter.on_stretch(stretch)

    def on_idle(self, kv: KvShape, at: float) -> None:
        assert self.reporter is not None
        self.reporter.on_idle(kv, at)

    def on_flush(self) -> None:
        """SGLang's flush_cache resets the reporter's decode counts (`reset_metrics`)."""
        assert self.reporter is not None
        self.reporter.reset_decode_counts()

    def on_eviction(self, tokens: int, seconds: float) -> None:
        """One eviction pass of the prefix cache (SGLang's update_eviction_metrics)."""
        self.evicted_tokens += tokens
        self.eviction_seconds.observe(seconds)

    def attach(self, engine: Engine) -> None:
        """Report on `engine` (whose listener this is) from its start."""
        self.engine = engine
        self.reporter = Reporter(
            engine.started_at, engine.max_running_requests, engine.kv_capacity_tokens, engine.pools.swa_capacity
        )
        engine.pools.on_eviction = self.on_eviction

    def recent_cache_hit_rate(self) -> float:
        assert self.engine is not None and self.reporter is not None
        return self.reporter.recent_cache_hit_rate(self.engine.now())

    def report(self) -> ReportState:
        """The scheduler's counters and its last logged gauges, as of now."""
        engine, reporter = self.engine, self.reporter
        assert engine is not None and reporter is not None
        now = engine.now()
        return reporter.view(now, engine.stretch_in_progress(now))

    def gen_throughput(self) -> float:
        """The gen_throughput gauge: output tokens/s of decode passes, as SGLang last logged it."""
        return self.report().gen_throughput

    def last_gen_throughput(self) -> float:
        """SGLang's last computed gen_throughput (its server_info's), which an idle log point
        does not zero."""
        return self.report().last_gen_throughput

    @staticmethod
    def _work_counters(r: ReportState, sched: tuple[list[str], list[str]]) -> Iterator[Metric]:
        """The scheduler's per-pass counters; a labelled sample appears once SGLang would have
        created it (the effective-token modes and idle seconds at start, the rest at their first
        non-zero increment)."""

        def by_mode(name: str, doc: str, values: dict[str, float], seeded: bool) -> CounterMetricFamily:
            c = CounterMetricFamily(f"sglang:{name}", doc, labels=[*sched[0], "mode"])
            for mode, value in values.items():
                if value or seeded:
                    c.add_metric([*sched[1], mode], value)
            return c

        yield by_mode(
            "realtime_tokens",
            "Tokens processed by forward passes, by mode.",
            {
                "prefill_compute": r.prefill_compute_tokens,
                "prefill_cache": r.prefill_cache_tokens,
                "decode": r.decode_tokens,
            },
            seeded=False,
        )
        yield by_mode(
            "prefill_effective_tokens",
            "Prefill tokens less those of retracted requests prefilled again, by cache tier.",
            {"input": r.effective_input_tokens, "device_hit": r.device_hit_tokens, "host_hit": 0, "storage_hit": 0},
            seeded=True,
        )
        yield by_mode(
            "cuda_graph_passes",
            "Forward passes, by mode and whether they ran in a graph.",
            {
                "prefill_none": r.prefill_passes,
                "decode_cuda_graph": r.decode_graph_passes,
                "decode_none": r.decode_eager_passes,
            },
            seeded=False,
        )
        idle = CounterMetricFamily(
            "sglang:scheduler_idle_seconds", "Wall time with nothing running or queued.", labels=sched[0]
        )
        idle.add_metric(sched[1], r.idle_published_s)
        yield idle

    @staticmethod
    def _pool_gauges(
        pools: Pools, engine: Engine, gauge: Callable[[str, str, float], GaugeMetricFamily]
    ) -> Iterator[Metric]:
        """SGLang's pool gauges as last logged (pool_stats_observer.update_scheduler_stats)."""
        full_cap, swa_cap = engine.kv_capacity_tokens, engine.pools.swa_capacity
        full_usage = pools.full_used / full_cap
        swa_usage = pools.swa_used / swa_cap if swa_cap else 0.0
        yield gauge(
            "num_used_tokens",
            "KV tokens in use at the last log point (the fuller pool).",
            max(pools.full_used, pools.swa_used),
        )
        yield gauge("max_total_num_tokens", "Tokens the FULL KV pool holds.", full_cap)
        yield gauge("max_total_num_tokens_swa", "Tokens the sliding-window KV pool holds.", swa_cap)
        yield gauge(
            "token_usage", "Usage of the fuller KV pool at the last log point.", round(max(full_usage, swa_usage), 2)
        )
        yield gauge("full_token_usage", "FULL KV pool usage at the last log point.", full_usage)
        yield gauge("swa_token_usage", "Sliding-window KV pool usage at the last log point.", swa_usage)
        yield gauge("kv_used_tokens", "FULL KV tokens in use.", pools.full_used)
        yield gauge("kv_evictable_tokens", "FULL KV tokens cached and evictable.", pools.full_evictable)
        yield gauge("kv_available_tokens", "FULL KV tokens free.", full_cap - pools.full_used - pools.full_evictable)
        yield gauge("swa_used_tokens", "Sliding-window KV tokens in use.", pools.swa_used)
        yield gauge("swa_evictable_tokens", "Sliding-window KV tokens cached and evictable.", pools.swa_evictable)
        yield gauge(
            "swa_available_tokens",
            "Sliding-window KV tokens free.",
            swa_cap - pools.swa_used - pools.swa_evictable if swa_cap else 0,
        )

    def _eviction_metrics(self) -> Iterator[Metric]:
        """The radix cache's collector: created at the first eviction (labels as SGLang's)."""
        if not self.evicted_tokens:
            return
        labels = (["cache_type", "tp_rank", "pp_rank", "dp_rank"], ["UnifiedRadixCache", "0", "0", "0"])
        c = CounterMetricFamily("sglang:evicted_tokens", "Device KV token slots freed by eviction.", labels=labels[0])
        c.add_metric(labels[1], self.evicted_tokens)
        yield c
        m = HistogramMetricFamily(
            "sglang:eviction_duration_seconds", "End-to-end time of a device eviction pass.", labels=labels[0]
        )
        m.add_metric(labels[1], self.eviction_seconds.buckets(), self.eviction_seconds.total)
        yield m

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        assert engine is not None
        sched = (list(self.scheduler_labels), list(self.scheduler_labels.values()))
        tok = (list(self.tokenizer_labels), list(self.tokenizer_labels.values()))
        streaming = (tok[0] + ["is_streaming"], [tok[1] + ["true"], tok[1] + ["false"]])

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=sched[0])
            g.add_metric(sched[1], value)
            return g

        def per_stream_counter(name: str, doc: str, attr: str) -> CounterMetricFamily:
            c = CounterMetricFamily(f"sglang:{name}", doc, labels=streaming[0])
            for values, stats in zip(streaming[1], self.by_stream.values(), strict=True):
                c.add_metric(values, getattr(stats, attr))
            return c

        def per_stream_histogram(name: str, doc: str, attr: str) -> HistogramMetricFamily:
            m = HistogramMetricFamily(f"sglang:{name}", doc, labels=streaming[0])
            for values, stats in zip(streaming[1], self.by_stream.values(), strict=True):
                h = getattr(stats, attr)
                m.add_metric(values, h.buckets(), h.total)
            return m

        def histogram(name: str, doc: str, h: _Histogram, labels: tuple[list[str], list[str]]) -> HistogramMetricFamily:
            m = HistogramMetricFamily(f"sglang:{name}", doc, labels=labels[0])
            m.add_metric(labels[1], h.buckets(), h.total)
            return m

        r = self.report()
        yield gauge("num_running_reqs", "Requests in the decode batch at the last log point.", r.running)
        yield gauge("num_queue_reqs", "Requests in the waiting queue at the last log point.", r.queued)
        yield from self._pool_gauges(r.pools, engine, gauge)
        yield gauge("gen_throughput", "Output tokens/s of decode passes between decode log points.", r.gen_throughput)
        yield gauge("cache_hit_rate", "Prefix cache hit rate of the last prefill pass.", r.cache_hit_rate)
        yield gauge("decode_sum_seq_lens", "Sum of the decode batch's sequence lengths.", r.decode_sum_seq_lens)
        yield gauge("utilization", "Load over the SLO running-request limit (unset in SGLang: 0).", 0.0)
        yield gauge("num_retracted_reqs", "Requests retracted since the log point before.", r.retracted)
        yield from self._work_counters(r, sched)
        yield per_stream_counter("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens")
        yield per_stream_counter("generation_tokens", "Number of generation tokens processed.", "generation_tokens")
        yield per_stream_counter("num_requests", "Number of requests processed.", "requests")
        c = CounterMetricFamily("sglang:num_aborted_requests", "Number of requests aborted.", labels=tok[0])
        c.add_metric(tok[1], self.aborted_requests)
        yield c
        if self.cached_tokens:
            c = CounterMetricFamily(
                "sglang:cached_tokens", "Number of cached prompt tokens by source.", labels=[*tok[0], "cache_source"]
            )
            c.add_metric([*tok[1], "device"], self.cached_tokens)
            yield c
        yield from self._eviction_metrics()
        yield per_stream_histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"
        )
        yield histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl, tok)
        yield per_stream_histogram(
            "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", "e2e"
        )
        yield histogram("queue_time_seconds", "Histogram of queueing time in seconds.", self.queue, sched)
