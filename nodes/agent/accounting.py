"""The work a site's workers say they did, from their own /metrics: what the schedulers learn the
site's speed from (scheduler/capacity.py).

A real SGLang worker with --enable-metrics counts its own work as it goes (0.5.23,
`SchedulerMetricsCollector`): every forward pass (`cuda_graph_passes_total`, by mode), the
tokens each decode-only pass produced and each prefill pass computed or found in the prefix
cache (`realtime_tokens_total`, by mode), and the wall time it sat with nothing to run
(`scheduler_idle_seconds_total`); its decode batch and that batch's KV are gauges renewed at
its log points (`num_running_reqs`, `decode_sum_seq_lens`). Two reads of them bracket a
stretch of its work: passes, sequences decoded, KV attended, prompt tokens prefilled, and the
seconds it was busy doing it. With the GPU's step model (`a·passes + b·sequences + κ·KV +
ρ·prefill`) that says how fast the GPU runs, whenever and however bunched the agent reads
its tokens, and a wave of resumed streams prefilling their contexts is work done, not a
slower GPU.

Only time comes from the agent: the stretch between two reads. A read is timed by when it
was asked for and when its answer was in (the worker counted in between), so a stretch is
kept only when that uncertainty is a small part of it (TIMING_ERROR): an agent whose loop
stalls around a read makes that read useless, not misleading, and the next read spans the
stall. A stretch ends only once a pass has ended in it: at a tenth of real speed one pass
can outlast several reads, and a stretch cut inside it would hold its time but not its work. SGLang records idle time late (at most a second after, at its next event), so a
stretch in which the worker idled for more than a small part (IDLE_FRACTION) is left out
rather than read as slow, and so is one that starts or ends at a read where the worker ran
nothing (its decode batch 0, as SGLang shows an idle scheduler): the idle before its first
request, or after its last, may be published only after the next read, and the stretch would
hold that idle as busy time (a site that joined idle read 3.5 times too slow on its first
requests; add-site, #40; a site whose streams were all aborted after a blackhole read 0.66 of
its speed). The stretch starts afresh at the next read; a worker that runs no decode batch at
all (prompts only) gives no stretch, and its site keeps the prior or the probe.

The KV a decode pass attends is the batch's ΣL over its size, both from the same decode log
point (`decode_sum_seq_lens` is renewed only there, every 40 decode passes, while the running
gauge is renewed at every prefill pass and zeroed when idle). So the per-sequence KV is taken
when ΣL changes, with the running gauge of that read, and kept until ΣL changes again: ΣL of a
164-request batch over a gauge that fell to 1 would read one sequence attending 95 k tokens.

Under --enable-mixed-chunk (the emulator's step) a prefill pass also decodes the running
batch, and SGLang counts none of that decode; those sequences are taken as the batch its
gauge last showed, renewed at every prefill pass.
"""

from __future__ import annotations

from core.wire import WorkDone
from nodes.agent.sglang import Accounting

# A stretch counts when the reads' timing leaves it at most this uncertain: 3 % of a 1-s read
# interval is 30 ms of round trip. A stretch that fails this is not lost: the next read's
# stretch starts from the same earlier read, and is longer.
TIMING_ERROR = 0.03
# A stretch is read only while the worker worked through it: SGLang's idle time is recorded
# up to a second late, so a stretch with some idle may hold more idle than its counter says.
IDLE_FRACTION = 0.2
# A read this long after the one a stretch would start from starts afresh: the worker's
# counters over that long say nothing about its speed now.
MAX_STRETCH_S = 30.0
# A worker with requests that ends no pass for LONG_PASS_FACTOR times its recent pass (and at
# least LONG_PASS_MIN_S) is that slow now (a brownout deep enough, a GPU nearly hung): the
# stretch closes with the time and no pass, rather than waiting for the pass to end. A pass
# carrying a whole prefill chunk lasts ~8 decode passes on an MI300X, and a slowed-down
# emulator stretches every pass alike, so the bound is the worker's own pace, not a time.
LONG_PASS_FACTOR = 10.0
LONG_PASS_MIN_S = 5.0
RECENT_PASSES = 0.2  # how much of each stretch's pass time the recent pass takes in


class WorkMeter:
    """One worker's reads, turned into the stretches of work they bracket."""

    def __init__(self) -> None:
        self._last: Accounting | None = None
        self._pass_s = 0.0  # the worker's recent pass, busy seconds per pass (0: none seen yet)
        self._sum_seq_lens = -1  # the ΣL the per-sequence KV was taken at (-1: none yet)
        self._per_sequence = 0.0  # KV tokens a decoding sequence attends, as of that ΣL

    def reset(self) -> None:
        """The worker restarted: its counters start again from 0."""
        self._last, self._pass_s, self._sum_seq_lens, self._per_sequence = None, 0.0, -1, 0.0

    def _track_per_sequence(self, now: Accounting) -> None:
        """Renew the per-sequence KV at a read that shows a new decode log point's ΣL."""
        if now.running_requests > 0 and now.decode_context_tokens != self._sum_seq_lens:
            self._sum_seq_lens = now.decode_context_tokens
            self._per_sequence = now.decode_context_tokens / now.running_requests

    def add(self, now: Accounting, mixed_chunk: bool) -> WorkDone | None:
        """The work done since the read the stretch starts from, or None when this read closes no
        stretch: the stretch then starts afresh here (the worker idled, restarted, or the last
        read is too old), or from the same earlier read (this one's timing is too uncertain, or
        the worker is still in the middle of a pass)."""
        last = self._last
        self._track_per_sequence(now)
        if last is None:
            self._last = now
            return None
        span_s = (now.sent_at + now.received_at - last.sent_at - last.received_at) / 2.0
        uncertain_s = (now.received_at - now.sent_at + last.received_at - last.sent_at) / 2.0
        if uncertain_s > TIMING_ERROR * span_s and span_s <= MAX_STRETCH_S:
            return None
        passes = now.decode_passes + now.prefill_passes - last.decode_passes - last.prefill_passes
        decoded = now.decode_tokens - last.decode_tokens
        prefilled = now.prefill_tokens - last.prefill_tokens
        cached = now.cached_tokens - last.cached_tokens
        idle_s = now.idle_s - last.idle_s
        restarted = min(passes, decoded, prefilled, cached, idle_s) < 0  # its counters went back
        idled = idle_s > IDLE_FRACTION * span_s or min(last.running_requests, now.running_requests) <= 0
        if restarted or span_s > MAX_STRETCH_S or idled:
            self._last = now
            return None
        long_pass_s = max(LONG_PASS_MIN_S, LONG_PASS_FACTOR * self._pass_s)
        if passes <= 0 and not (span_s >= long_pass_s and now.running_requests):
            return None  # a pass longer than the stretch: the next read spans it
        self._last = now
        if passes > 0:
            pass_s = (span_s - idle_s) / passes
            self._pass_s = pass_s if not self._pass_s else self._pass_s + RECENT_PASSES * (pass_s - self._pass_s)
        sequences = decoded
        if mixed_chunk:
            sequences += (now.prefill_passes - last.prefill_passes) * now.running_requests
        return WorkDone(
            busy_s=span_s - idle_s,
            passes=round(passes),
            decode_seqs=sequences,
            context_ktokens=sequences * self._per_sequence / 1000.0,
            prefill_tokens=round(prefilled),
            cached_tokens=round(cached),
        )
