"""SGLang's Prometheus metrics for one emulated GPU, read from the engine's true state.

Gauges are computed at scrape time from the engine, so they are exact. Histograms
are filled at request milestones; inter-token latency is observed once per finished
request with a weight of `tokens - 1` (the mean gap), which keeps the cost per
request rather than per token while giving the same sum and count SGLang would.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from nodes.emulator.engine import Engine, Sequence

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
DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval: gen_throughput is renewed after this many steps


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
        out, running = [], 0
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
        self.by_stream = {"true": _PerStream(), "false": _PerStream()}
        self.itl = _Histogram(ITL_BUCKETS_S)
        self.queue = _Histogram(QUEUE_BUCKETS_S)
        self.aborted_requests = 0
        # (when, steps, tokens emitted) at the last renewal of gen_throughput, and its value.
        self._throughput_mark: tuple[float, int, int] = (time.monotonic(), 0, 0)
        self._gen_throughput = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)  # type: ignore[arg-type]

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
        if seq.first_token_at is not None and seq.generated > 1:
            gap = (seq.finished_at - seq.first_token_at) / (seq.generated - 1)
            self.itl.observe(gap, seq.generated - 1)

    def on_abort(self, seq: Sequence) -> None:
        self.aborted_requests += 1

    def gen_throughput(self) -> float:
        """Output tokens/s as SGLang's scheduler sets it: renewed once every DECODE_LOG_INTERVAL
        steps, over the time since the previous renewal (idle time included), and held in between.
        Here it is renewed by the first read after the interval's last step: over at least that
        many steps, tokens and time both counted up to the read."""
        engine = self.engine
        assert engine is not None
        now = time.monotonic()
        steps, (t0, steps0, n0) = engine.steps_done(), self._throughput_mark
        if steps - steps0 >= DECODE_LOG_INTERVAL and now > t0:
            total = engine.emitted_tokens_total()
            self._gen_throughput = (total - n0) / (now - t0)
            self._throughput_mark = (now, steps, total)
        return self._gen_throughput

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

        used = engine.kv_used_tokens()
        running = engine.running_count
        yield gauge("num_running_reqs", "The number of running requests.", running)
        yield gauge("num_queue_reqs", "The number of requests in the waiting queue.", engine.waiting_count)
        yield gauge("num_used_tokens", "The number of used tokens.", used)
        yield gauge(
            "max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            engine.kv_capacity_tokens,
        )
        yield gauge("token_usage", "The token usage.", used / engine.kv_capacity_tokens)
        yield gauge("gen_throughput", "The generation throughput (token/s).", self.gen_throughput())
        yield gauge("cache_hit_rate", "The prefix cache hit rate.", 0.0)
        yield gauge(
            "utilization",
            "Fraction of the running-request limit in use.",
            running / engine.max_running_requests,
        )
        yield gauge("num_retracted_reqs", "The number of retracted requests.", engine.retractions)
        yield per_stream_counter("prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens")
        yield per_stream_counter("generation_tokens", "Number of generation tokens processed.", "generation_tokens")
        yield per_stream_counter("num_requests", "Number of requests processed.", "requests")
        c = CounterMetricFamily("sglang:num_aborted_requests", "Number of requests aborted.", labels=tok[0])
        c.add_metric(tok[1], self.aborted_requests)
        yield c
        yield per_stream_histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", "ttft"
        )
        yield histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl, tok)
        yield per_stream_histogram(
            "e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", "e2e"
        )
        yield histogram("queue_time_seconds", "Histogram of queueing time in seconds.", self.queue, sched)
