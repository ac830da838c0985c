"""SGLang 0.5.23's accounting of its own work (`--enable-metrics`), replayed over the engine's
stretches of steps. Paths are under `sglang/srt/`; `reporter` is
`managers/scheduler_components/metrics_reporter.py`, `results` its `batch_result_processor.py`.

The counters move with every forward pass, as its result is processed:

- `realtime_tokens_total{mode}`: a prefill pass adds its chunk to `prefill_compute` and its
  prefix-cache hits to `prefill_cache` (`reporter.report_prefill_stats`); a decode pass adds the
  tokens it generated, one per sequence, to `decode` (`report_decode_stats`). A zero delta is
  skipped (`increment_realtime_tokens`), so a mode is absent until it has counted something;
  with no prefix cache here, `prefill_cache` never appears.
- `prefill_effective_tokens_total{mode}`: the chunk again, less the tokens of requests prefilled
  again after a retraction (`reprocessed_log_input_tokens`, counted for a request whose
  `retracted_stain` is set: `managers/schedule_policy.py` `_update_prefill_budget`), as `input`;
  the cache tiers (`device_hit`, `host_hit`, `storage_hit`) stay 0. All four are created at 0.
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
  queue (a request leaves it when a chunk first takes it), the KV in use after the pass, and
  `gen_throughput` the last one computed, or 0 once no decode log point came for 30 s
  (`_current_gen_throughput`); `num_retracted_reqs` is the size of the last retraction since
  the previous log point (then 0 again); `decode_sum_seq_lens` is kept;
- every `decode_log_interval` (40) decode passes (`report_decode_stats`): the batch, the queue,
  its ΣL (`decode_sum_seq_lens`, which is also the KV in use: each sequence's slot for the token
  being decoded is allocated), and `gen_throughput`: tokens of decode passes since the previous
  such point over the wall time since it (idle and prefill time included);
- when the scheduler goes idle (`_maybe_log_idle_metrics`), if the running gauge still shows
  requests, or 30 s after the last publication: zero running, queue, KV and `gen_throughput`.

`utilization` is 0: SGLang computes it only from `max_running_requests_under_SLO`, which nothing
sets (`reporter._calculate_utilization`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from nodes.emulator.engine import Stretch

DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default: decode passes between log points
# SGLang's decode cuda-graph batch limit on GPUs of >= 160 GB (MI300X, MI355X), before the cap
# by --max-running-requests.
CUDA_GRAPH_MAX_BS = 512
IDLE_RECORD_INTERVAL_S = 1.0  # SGLang publishes idle time at an event >= this long after the last
GEN_THROUGHPUT_STALE_S = 30.0  # a prefill log point zeroes gen_throughput this long after a decode one
IDLE_LOG_INTERVAL_S = 30.0  # an idle scheduler republishes its gauges this often


@dataclass(slots=True)
class ReportState:
    """SGLang's reporter and collector state after the engine's work up to `at`."""

    at: float  # the engine's timeline is replayed up to here
    # counters
    prefill_compute_tokens: int = 0
    decode_tokens: int = 0
    effective_input_tokens: int = 0
    prefill_passes: int = 0
    decode_graph_passes: int = 0
    decode_eager_passes: int = 0
    idle_published_s: float = 0.0
    # gauges, as last published (SchedulerStats at log_stats)
    running: int = 0
    queued: int = 0
    used_tokens: int = 0
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

    def __init__(self, started_at: float, max_running_requests: int) -> None:
        self.graph_max_batch = min(CUDA_GRAPH_MAX_BS, max_running_requests)
        self.state = ReportState.start(started_at)

    def on_stretch(self, stretch: Stretch) -> None:
        self._stretch(self.state, stretch, stretch.k_max)

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
        s.effective_input_tokens += shape.prefill_tokens - shape.reprocessed_tokens
        if t - s.decode_logged_at > GEN_THROUGHPUT_STALE_S:
            s.last_gen_throughput = 0.0
        used = shape.context_tokens + shape.prefill_kv_tokens + shape.prefill_tokens
        self._log(s, t, shape.batch, shape.queued, used, s.last_gen_throughput, s.decode_sum_seq_lens)

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
        self._log(s, t, batch, stretch.shape.queued, seq_lens, s.last_gen_throughput, seq_lens)

    def _log(self, s: ReportState, t: float, running: int, queued: int, used: int, gen: float, seq_lens: int) -> None:
        """log_stats at a batch's log point; the retraction count goes out with it."""
        s.running, s.queued, s.used_tokens, s.gen_throughput = running, queued, used, gen
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
            s.running = s.queued = s.used_tokens = 0
            s.gen_throughput = 0.0
            s.logged_at = logged + (math.ceil((until - logged) / IDLE_LOG_INTERVAL_S) - 1) * IDLE_LOG_INTERVAL_S
        first = max(s.idle_recorded_at + IDLE_RECORD_INTERVAL_S, start)
        if first < until:
            repeats = math.ceil((until - first) / IDLE_RECORD_INTERVAL_S) - 1
            s.idle_recorded_at = first + repeats * IDLE_RECORD_INTERVAL_S
            s.idle_published_s = s.idle_s + (s.idle_recorded_at - start)
        s.idle_s += until - start
        s.at = until
