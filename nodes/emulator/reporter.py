"""SGLang 0.5.23's accounting of its own work (`--enable-metrics`), replayed over the engine's
stretches of steps. Paths are under `sglang/srt/`; `reporter` is
`managers/scheduler_components/metrics_reporter.py`, `results` its `batch_result_processor.py`.

The counters move with every forward pass, as its result is processed:

- `realtime_tokens_total{mode}`: a prefill pass adds its chunk to `prefill_compute` and the
  prefix-cache hits of the requests it admitted to `prefill_cache`, retracted ones prefilled
  again included (`reporter.report_prefill_stats`); a decode pass adds the tokens it generated,
  one per sequence, to `decode` (`report_decode_stats`). A zero delta is skipped
  (`increment_realtime_tokens`), so a mode is absent until it has counted something.
- `prefill_effective_tokens_total{mode}`: the chunk again, less the tokens of requests prefilled
  again after a retraction (`reprocessed_log_input_tokens`, counted for a request whose
  `retracted_stain` is set: `managers/schedule_policy.py` `_update_prefill_budget`), as `input`;
  the hits of the others as `device_hit`; `host_hit` and `storage_hit` (no HiCache) stay 0. All
  four are created at 0.
- `cache_hit_rate` (a gauge of the prefill log point): the last prefill pass's effective hits over
  its effective hits and input, 0.0 for a pass with none (a chunk going on, or only retracted
  requests). `/v1/loads` reads the same value; the hit rate over the prefill passes of the last
  15 s (`_CacheHitRateWindow`) only estimates the queue's uncached tokens there.
- `cuda_graph_passes_total{mode}`: one per pass. A decode pass runs in a graph when its batch is
  at most the graph's largest batch (`decode_cuda_graph_runner.can_run_graph`): 512 on GPUs of
  160 GB or more, lowered to --max-running-requests (`arg_groups/memory_hook.py`). A prefill
  pass never does on ROCm (`model_executor/cuda_graph_config.py` `default_prefill_backend`:
  breakable graphs on CUDA only), so it is `prefill_none`.
- `scheduler_idle_seconds_total`: wall time with nothing running or queued. The scheduler
  samples idle/active at its events (`reporter._record_scheduler_time`): each pass it launches
  (`scheduler.run_batch`), each request it receives, and every turn of its loop while idle (it
  spins: `--sleep-on-idle` is off). It publishes what it accumulated only at an event at least
  1 s after the previous publication (`_SCHEDULER_TIME_ACCOUNTING_INTERVAL_NS`), so the counter
  lags by up to a second while idle, and by up to a second plus one step while busy. It is
  created at 0.

The mixed step (`--enable-mixed-chunk`, which the emulator's step model is). A step that carries
a prompt chunk also decodes every running sequence. SGLang builds it as one batch:
`scheduler.get_new_batch_prefill` takes the prefill stats from the adder
(`PrefillStats.from_adder(adder, running_batch.reqs, ...)`, the running batch as it was
scheduled) and then `new_batch.mix_with_running(running_batch)`: forward mode MIXED, which
`ForwardMode.is_extend` counts as an extend. `scheduler.process_batch_result` therefore hands
it to `results.process_batch_result_prefill`, whose only report is `report_prefill_stats`: one
`prefill_none` pass and the chunk's tokens as `prefill_compute`. The running sequences it
decoded are counted nowhere: `realtime_tokens{mode="decode"}`, `num_generated_tokens` (what
`gen_throughput` divides) and `forward_ct_decode` (the decode log cadence) move only in
`results.process_batch_result_decode`. A step with no chunk is a decode pass: its batch goes to
`decode`, and the pass to `decode_cuda_graph` or `decode_none`. A retracted request's prefill
again is part of its chunk like any prompt (`prefill_compute`) and is left out of
`prefill_effective_tokens{mode="input"}`; `log_replay_tokens` (also in `prefill_compute`) is
the encoder-window replay of multimodal models, 0 here. (SGLang also takes the running batch's
size out of a mixed step's chunk budget; the emulator's step model keeps the full chunk.)

The gauges are not read at scrape time: SGLang sets them at its log points and holds them
(`SchedulerMetricsCollector.log_stats`):

- after each prefill pass (`report_prefill_stats`): `num_running_reqs` is the running batch when
  the step was scheduled (0 for a step with nothing decoding), `num_queue_reqs` the waiting
  queue (a request leaves it when a chunk first takes it), the pools after the pass, and
  `gen_throughput` the last one computed, or 0 once no decode log point came for 30 s
  (`_current_gen_throughput`); `num_retracted_reqs` is the size of the last retraction since
  the previous log point (then 0 again); `decode_sum_seq_lens` is kept;
- every `decode_log_interval` (40) decode passes (`report_decode_stats`): the batch, the queue,
  its ΣL (`decode_sum_seq_lens`), the pools as of that pass, and `gen_throughput`: tokens of
  decode passes since the previous such point over the wall time since it (idle and prefill time
  included);
- when the scheduler goes idle (`_maybe_log_idle_metrics`), if the running gauge still shows
  requests, or 30 s after the last publication: zero running, queue and `gen_throughput`, and the
  pools as they are then (nothing in use; the cache evictable).

The pools (`scheduler_components/pool_stats_observer.py`): per pool, used is capacity less
available and evictable; `num_used_tokens` is the larger pool's used, `token_usage` the larger
usage rounded to 2 decimals; `kv_*` are the FULL pool's, `swa_*` the SWA pool's. Within a
stretch the engine gives the pools at its first step and how they grow (nodes/emulator/stretch.py
`KvShape`); eviction is lazy, so the evictable count falls only once the steps have used up the
available KV.

`utilization` is 0: SGLang computes it only from `max_running_requests_under_SLO`, which nothing
sets (`reporter._calculate_utilization`).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from dataclasses import dataclass, field

from nodes.emulator.stretch import KvShape, Stretch

DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default: decode passes between log points
# SGLang's decode cuda-graph batch limit on GPUs of >= 160 GB (MI300X, MI355X), before the cap
# by --max-running-requests.
CUDA_GRAPH_MAX_BS = 512
IDLE_RECORD_INTERVAL_S = 1.0  # SGLang publishes idle time at an event >= this long after the last
GEN_THROUGHPUT_STALE_S = 30.0  # a prefill log point zeroes gen_throughput this long after a decode one
IDLE_LOG_INTERVAL_S = 30.0  # an idle scheduler republishes its gauges this often
CACHE_HIT_RATE_WINDOW_S = 15.0  # SGLANG_CACHE_HIT_RATE_WINDOW_SECONDS: the recent hit rate's window


@dataclass(frozen=True, slots=True)
class Pools:
    """The KV pools as a log point publishes them (SchedulerStats' pool fields)."""

    full_used: int = 0
    swa_used: int = 0
    full_evictable: int = 0
    swa_evictable: int = 0


@dataclass(slots=True)
class ReportState:
    """SGLang's reporter and collector state after the engine's work up to `at`."""

    at: float  # the engine's timeline is replayed up to here
    # counters
    prefill_compute_tokens: int = 0
    prefill_cache_tokens: int = 0
    decode_tokens: int = 0
    effective_input_tokens: int = 0
    device_hit_tokens: int = 0
    prefill_passes: int = 0
    decode_graph_passes: int = 0
    decode_eager_passes: int = 0
    idle_published_s: float = 0.0
    # gauges, as last published (SchedulerStats at log_stats)
    running: int = 0
    queued: int = 0
    pools: Pools = field(default_factory=Pools)
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    decode_sum_seq_lens: int = 0
    retracted: int = 0
    logged_at: float = 0.0  # collector.last_log_time
    # the reporter's own
    decode_passes_mod: int = 0  # forward_ct_decode modulo the log interval
    generated_since_log: int = 0  # num_generated_tokens
    decode_logged_at: float = 0.0  # last_decode_stats_tic
    last_gen_throughput: float = 0.0
    retracted_pending: int = 0  # num_retracted_reqs, not yet published
    idle_s: float = 0.0  # idle wall time up to `at`
    idle_recorded_at: float = 0.0  # when idle time was last published

    @classmethod
    def start(cls, t: float) -> ReportState:
        """A scheduler that starts idle at `t`."""
        return cls(at=t, logged_at=t, decode_logged_at=t, idle_recorded_at=t)


class Reporter:
    """Replays SGLang's reporting over the engine's stretches: `on_stretch` commits a stretch
    that ended; `view` adds the stretch in progress, or the idle time since, without committing."""

    def __init__(self, started_at: float, max_running_requests: int, full_capacity: int, swa_capacity: int) -> None:
        self.graph_max_batch = min(CUDA_GRAPH_MAX_BS, max_running_requests)
        self.full_capacity, self.swa_capacity = full_capacity, swa_capacity
        self.state = ReportState.start(started_at)
        self.idle_pools = Pools()  # what an idle log point publishes
        # (time, effective hits, effective hits + input) of committed prefill passes, 15 s of them
        self._hit_window: deque[tuple[float, int, int]] = deque()
        self._window_hits = self._window_total = 0

    def on_stretch(self, stretch: Stretch) -> None:
        self._stretch(self.state, stretch, stretch.k_max)
        shape = stretch.shape
        if shape.prefill_tokens:
            hits = shape.cached_tokens - shape.reprocessed_cached_tokens
            total = hits + shape.prefill_tokens - shape.reprocessed_tokens
            if total > 0:
                self._hit_window.append((stretch.end(), hits, total))
                self._window_hits += hits
                self._window_total += total

    def on_idle(self, kv: KvShape, at: float) -> None:
        """The engine is idle from `at` with these pools: the idle time before `at` is published
        with the pools it had (a flush empties them while idle)."""
        self._idle(self.state, at)
        self.idle_pools = Pools(0, 0, kv.full_evictable, kv.swa_evictable)

    def reset_decode_counts(self) -> None:
        """A flush resets the reporter's decode pass count and tokens (`reset_metrics`)."""
        self.state.decode_passes_mod = self.state.generated_since_log = 0

    def recent_cache_hit_rate(self, now: float) -> float:
        """The token-weighted hit rate of the prefill passes of the last 15 s."""
        window = self._hit_window
        while window and window[0][0] <= now - CACHE_HIT_RATE_WINDOW_S:
            _, hits, total = window.popleft()
            self._window_hits -= hits
            self._window_total -= total
        return self._window_hits / self._window_total if self._window_total else 0.0

    def view(self, now: float, in_progress: tuple[Stretch, int] | None) -> ReportState:
        """What a scrape at `now` reads: the committed state, then the steps of the stretch in
        progress completed by now, or the idle time up to now."""
        state = copy.copy(self.state)
        if in_progress is None:
            self._idle(state, now)
        else:
            self._stretch(state, *in_progress)
        return state

    # ---- one stretch ---------------------------------------------------------------

    def _stretch(self, s: ReportState, stretch: Stretch, passes: int) -> None:
        """`passes` steps of `stretch`, after the idle time before it."""
        self._idle(s, stretch.t0)
        shape = stretch.shape
        if shape.retracted:
            s.retracted_pending = shape.retracted
        if shape.prefill_tokens:
            if passes:
                self._prefill_pass(s, stretch, stretch.t0 + stretch.duration(1))
        else:
            self._decode_passes(s, stretch, passes)
        self._busy_events(s, stretch, passes)
        s.at = max(s.at, stretch.t0 + stretch.duration(passes))

    def _prefill_pass(self, s: ReportState, stretch: Stretch, t: float) -> None:
        """report_prefill_stats: a prefill or mixed pass, reported as it completes at `t`."""
        shape = stretch.shape
        s.prefill_passes += 1
        s.prefill_compute_tokens += shape.prefill_tokens
        s.prefill_cache_tokens += shape.cached_tokens
        effective_input = shape.prefill_tokens - shape.reprocessed_tokens
        hits = shape.cached_tokens - shape.reprocessed_cached_tokens
        s.effective_input_tokens += effective_input
        s.device_hit_tokens += hits
        s.cache_hit_rate = hits / (hits + effective_input) if hits + effective_input > 0 else 0.0
        if t - s.decode_logged_at > GEN_THROUGHPUT_STALE_S:
            s.last_gen_throughput = 0.0
        pools = self._pools(shape.kv, shape.batch, 1, shape.prefill_tokens)
        self._log(s, t, shape.batch, shape.queued, pools, s.last_gen_throughput, s.decode_sum_seq_lens)

    def _pools(self, kv: KvShape, batch: int, passes: int, prefill: int = 0) -> Pools:
        """The pools after `passes` passes of a stretch (a prefill pass's chunk allocated): ΣL grows
        by the batch each pass but the first, SWA as far as the sequences' windows let it; the
        evictable KV falls by what the allocations found short of the available."""
        full_used = kv.full_used + batch * (passes - 1) + prefill
        swa_used = min(kv.swa_used + kv.swa_growth * (passes - 1), kv.swa_used_limit) + prefill
        full_free = self.full_capacity - kv.full_used - kv.full_evictable
        full_evictable = max(0, kv.full_evictable - max(0, full_used - kv.full_used - full_free))
        swa_free = self.swa_capacity - kv.swa_used - kv.swa_evictable
        swa_evictable = max(0, kv.swa_evictable - max(0, swa_used - kv.swa_used - swa_free))
        return Pools(full_used, swa_used if self.swa_capacity else 0, full_evictable, swa_evictable)

    def _decode_passes(self, s: ReportState, stretch: Stretch, passes: int) -> None:
        """report_decode_stats for `passes` decode passes of one batch: the counters move with
        every pass, the gauges at the last log point among them (in closed form)."""
        batch = stretch.shape.batch
        s.decode_tokens += batch * passes
        if batch <= self.graph_max_batch:
            s.decode_graph_passes += passes
        else:
            s.decode_eager_passes += passes
        first = DECODE_LOG_INTERVAL - s.decode_passes_mod  # the pass that reaches a log point
        s.decode_passes_mod = (s.decode_passes_mod + passes) % DECODE_LOG_INTERVAL
        if first > passes:
            s.generated_since_log += batch * passes
            return
        last = first + (passes - first) // DECODE_LOG_INTERVAL * DECODE_LOG_INTERVAL
        t = stretch.t0 + stretch.duration(last)
        if last > first:  # the previous log point is in this stretch too
            s.retracted_pending = 0
            tokens, since = batch * DECODE_LOG_INTERVAL, stretch.t0 + stretch.duration(last - DECODE_LOG_INTERVAL)
        else:
            tokens, since = s.generated_since_log + batch * first, s.decode_logged_at
        if t > since:
            s.last_gen_throughput = tokens / (t - since)
        s.decode_logged_at = t
        s.generated_since_log = batch * (passes - last)
        seq_lens = stretch.shape.context_tokens + batch * (last - 1)  # ΣL of that pass
        pools = self._pools(stretch.shape.kv, batch, last)
        self._log(s, t, batch, stretch.shape.queued, pools, s.last_gen_throughput, seq_lens)

    def _log(
        self, s: ReportState, t: float, running: int, queued: int, pools: Pools, gen: float, seq_lens: int
    ) -> None:
        """log_stats at a batch's log point; the retraction count goes out with it."""
        s.running, s.queued, s.pools, s.gen_throughput = running, queued, pools, gen
        s.decode_sum_seq_lens = seq_lens
        s.retracted, s.retracted_pending = s.retracted_pending, 0
        s.logged_at = t

    def _busy_events(self, s: ReportState, stretch: Stretch, passes: int) -> None:
        """Idle time is published at the scheduler's events, here the launch of each pass (and
        the end of the last): the first one at least a second after the previous publication."""
        due = s.idle_recorded_at + IDLE_RECORD_INTERVAL_S
        while True:
            k = 0 if due <= stretch.t0 else stretch.completed(due)
            if stretch.t0 + stretch.duration(k) < due:
                k += 1
            if k > passes:
                return
            s.idle_recorded_at = stretch.t0 + stretch.duration(k)
            s.idle_published_s = s.idle_s
            due = s.idle_recorded_at + IDLE_RECORD_INTERVAL_S

    # ---- idle time -----------------------------------------------------------------

    def _idle(self, s: ReportState, until: float) -> None:
        """Idle from `s.at` to `until`: the idle log point, and idle time published at every
        turn of the spinning loop (continuously) a second after the previous publication."""
        start = s.at
        if until <= start:
            return
        logged = start if s.running else max(start, s.logged_at + IDLE_LOG_INTERVAL_S)
        if logged < until:  # zeroes whatever a batch left: nothing runs, waits or holds KV
            s.running = s.queued = 0
            s.pools = self.idle_pools
            s.gen_throughput = 0.0
            s.logged_at = logged + (math.ceil((until - logged) / IDLE_LOG_INTERVAL_S) - 1) * IDLE_LOG_INTERVAL_S
        first = max(s.idle_recorded_at + IDLE_RECORD_INTERVAL_S, start)
        if first < until:
            repeats = math.ceil((until - first) / IDLE_RECORD_INTERVAL_S) - 1
            s.idle_recorded_at = first + repeats * IDLE_RECORD_INTERVAL_S
            s.idle_published_s = s.idle_s + (s.idle_recorded_at - start)
        s.idle_s += until - start
        s.at = until
