"""What a site can deliver, in output tokens/s: a prior to start from, then what its workers say.

The GPU profile × GPU count (at the site's declared clock) is only where the estimate starts;
the calibration probe, when the site joins, moves it to what a small batch showed. From then
on the evidence is **the workers' own accounting of their work** (nodes/agent/accounting.py):
forward passes, sequences decoded, the KV they attended, prompt tokens prefilled, and the
seconds the workers were busy doing it, as SGLang counts them in its /metrics. The declared
GPU's step model says how long that work takes on such a GPU (`a·passes + b·sequences +
κ·KV + ρ·prefill`); the busy seconds say how long it took. Their ratio is how much faster or
slower than declared the GPUs run, and what the declared GPUs' model delivers on the
reference workload, scaled by it, is the estimate. Both sides are summed with a decay
(TIME_CONSTANT_S), so the ratio is a busy-weighted mean over the last seconds.

So nothing of when or how bunched the agent reads tokens enters it: an agent that stalls, a
burst relayed late, a wave of resumed streams re-prefilling their contexts (prefill is work
done, counted as such), a site whose load rises or falls. A worker that exports no such
accounting (SGLang without --enable-metrics) leaves its site on the prior or probe, moved
only by saturation: a site whose requests wait while its slots (or KV cache) are full
delivers exactly its capacity, so the rate its agent relayed, held for SETTLE_S, is evidence.

Bounded twice:
- by physics: no estimate rises above FAST_BOUND × the declared GPUs' model (at the site's
  clock) unless the evidence stays above it for SUSTAINED_S, and never above HARD_BOUND;
- by the agent: an agent whose event loop runs near a whole core (AGENT_BUSY) relays no more
  tokens than it does per CPU-second, so the site's capacity is capped there
  (`agent_ceiling_tok_s`), whatever its GPUs could give.

The estimate is kept per healthy worker, so a site that loses workers loses that share at
once. It is kept for the reference workload the priors were measured on (MLPerf-like) and
scaled, when asked, to the workload the federation runs now (`scheduler.workload`): the GPU
model says what the same GPUs deliver on each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from core.gpus import PROFILES, GpuProfile
from core.wire import SiteReport, WorkDone
from scheduler.workload import REFERENCE, Workload, WorkloadMix

# Output tokens/s per GPU in MLPerf Inference 6.1 gpt-oss-120b Server runs (REFERENCE.md §3).
PRIOR_TOK_S_PER_GPU: dict[str, float] = {"mi300x": 3108.0, "mi355x": 14155.0}
# How fast the accounting's evidence replaces the estimate: ~95 % after three time constants
# (15 s), inside the 30 s a mis-declared site may keep a wrong share ...
TIME_CONSTANT_S = 5.0
# ... and at least this many of its workers' passes: the agent reads a worker's counters once a
# second, and a pass counts in the stretch that ends after it, so a window of a few passes reads
# up to a read's interval of work too much or too little. A slowed-down emulator's pass lasts
# seconds (2.4 s at a twentieth of real speed); a real GPU's, a tenth of one.
WINDOW_PASSES = 8.0
# Worker-seconds of accounted work (decayed) before it speaks: a few stretches of one worker.
MIN_BUSY_S = 2.0
# A change of speed (a brownout, its end) shows first in the last seconds' accounting: when that
# says another speed than the estimate, by CHANGE_FACTOR or more, for CHANGE_HELD_S, the older
# evidence is dropped and the estimate restarts from the recent. A 5-s memory alone would still
# hold a third of the old speed 10 s after a 4-fold brownout. The recent window and the hold are
# at least RECENT_PASSES and HELD_PASSES passes, for the same reason as WINDOW_PASSES.
RECENT_TIME_CONSTANT_S = 1.5
RECENT_PASSES = 3.0
CHANGE_FACTOR = 1.3
CHANGE_HELD_S = 2.0
HELD_PASSES = 2.0
MAX_STEP_S = 2.0  # a long gap between reports must not count as a long observation
# The fallback without accounting: a site saturated this long delivers its capacity (the rate
# its agent relayed is averaged over its last 5 s, nodes.agent.delivered).
SETTLE_S = 5.0
# Full: a site holding this much of its slots' worth of requests (decoding, prefilling or
# waiting at its workers), or using this much of its KV cache.
FULL_FRACTION = 0.95
# Physics: at most this many times the declared GPUs' model without sustained evidence ...
FAST_BOUND = 1.5
SUSTAINED_S = 30.0  # ... evidence above it for this long lifts the bound ...
# ... to this, and never more: the fastest GPU we know runs 4.6x the slowest (REFERENCE.md §3),
# the most a mis-declared site can truly be faster than declared.
HARD_BOUND = 5.0
# An agent whose loop spends this share of a core or more is at its ceiling.
AGENT_BUSY = 0.9


def prior_capacity_tok_s(gpu: str, gpus: int) -> float:
    """Raises KeyError for a GPU we have no profile for."""
    return PRIOR_TOK_S_PER_GPU[gpu] * gpus


def decode_speed_ratio(
    profile: GpuProfile, batch: float, context_tokens: float, tok_s: float, prefill_tokens: float = 0.0
) -> float:
    """How many times faster than `profile` a GPU is that makes `tok_s` output tokens/s while
    decoding `batch` requests holding `context_tokens` of KV, each step also prefilling
    `prefill_tokens` (all per GPU)."""
    measured_step_ms = 1000.0 * batch / tok_s
    return profile.step_ms(round(batch), round(context_tokens), round(prefill_tokens)) / measured_step_ms


def work_ms(profile: GpuProfile, done: WorkDone) -> float:
    """How long `done` takes a worker of `profile` by its step model: each pass's fixed cost,
    each sequence decoded, each thousand KV tokens attended, each prompt token prefilled."""
    return (
        profile.a_ms * done.passes
        + profile.b_ms * done.decode_seqs
        + profile.kappa_ms * done.context_ktokens
        + profile.rho_ms * done.prefill_tokens
    )


def full_batch_tok_s(profile: GpuProfile, work: Workload) -> float:
    """What one GPU of `profile` delivers on `work` with its slots full (or its KV cache)."""
    batch = min(profile.max_running_requests, profile.kv_capacity_tokens / work.context_per_request)
    return 1000.0 * batch / profile.mixed_step_ms(batch, work.context_per_request, work.prompt_per_output)


def _full(report: SiteReport) -> bool:
    """As many requests as slots, or the KV cache (nearly) in use; a site that does not say its
    slots, if it queues. Prompts being prefilled count: SGLang shows them as waiting, not running."""
    held = report.running_requests + report.queued_requests
    slots_full = report.slots <= 0 or held >= FULL_FRACTION * report.slots
    return slots_full or report.kv_usage >= FULL_FRACTION


@dataclass(slots=True)
class CapacityEstimator:
    prior_tok_s: float  # declared: the GPU profile x count, at the site's clock
    full_site_tok_s: float  # the estimate with every worker healthy, on the reference workload
    profile: GpuProfile | None = None  # the declared GPU's step model: what the accounting is read with
    gpus: int = 0
    clock_speed: float = 1.0  # the site's declared clock (1: real GPUs)
    mix: WorkloadMix | None = None  # the workloads the sites run; None: the reference one
    site: str = ""  # whose mix in `mix` this estimate is scaled to
    evidence: str = "prior"  # what the estimate last moved on: prior, probe, accounting, saturated
    saturated_for_s: float = 0.0
    above_for_s: float = 0.0  # how long the evidence has stood above the fast bound
    agent_ceiling_tok_s: float = 0.0  # what the agent relays at most, while at its ceiling (0: not)
    workers: int = 0  # as last reported: with the GPUs, how many GPUs one worker spans
    _work: WorkDone | None = None  # the last report's cumulative accounting
    _model_ms: float = 0.0  # decayed: what the accounted work takes the declared GPUs ...
    _busy_ms: float = 0.0  # ... and what it took the workers, in how many passes
    _passes: float = 0.0
    _recent_model_ms: float = 0.0  # the same, over the last seconds
    _recent_busy_ms: float = 0.0
    _changed_for_s: float = 0.0  # how long the recent accounting has said another speed
    _agent: tuple[float, int] | None = None  # the last report's (loop CPU s, tokens relayed)
    _loop_cpu_s: float = 0.0  # decayed: the agent loop's CPU seconds, the wall seconds, the tokens
    _loop_wall_s: float = 0.0
    _relayed: float = 0.0

    @classmethod
    def for_site(
        cls, gpu: str, gpus: int, mix: WorkloadMix | None = None, clock_speed: float = 1.0, site: str = ""
    ) -> CapacityEstimator:
        prior = prior_capacity_tok_s(gpu, gpus) * clock_speed
        return cls(prior, prior, PROFILES.get(gpu), gpus, clock_speed, mix, site)

    @property
    def _tp(self) -> int:
        """GPUs per worker (tensor parallel), from the workers reported; 1 until known."""
        return max(1, self.gpus // self.workers) if self.workers else 1

    @property
    def declared_model_tok_s(self) -> float:
        """The declared GPUs on the reference workload as their step model has them, at real speed:
        what a speed read through that model (probe, accounting) scales."""
        if self.profile is None or self.gpus <= 0:
            return self.prior_tok_s / self.clock_speed
        tp = self._tp
        return self.gpus / tp * full_batch_tok_s(self.profile.tensor_parallel(tp), REFERENCE)

    def workload_factor(self) -> float:
        """What the site delivers on the workload it runs over what it delivers on the reference
        one (the unit the estimate is kept in)."""
        if self.profile is None or self.mix is None:
            return 1.0
        return full_batch_tok_s(self.profile, self.mix.of(self.site)) / full_batch_tok_s(self.profile, REFERENCE)

    def calibrate(self, batch_per_worker: float, context_per_worker: float, tok_s_per_worker: float) -> None:
        """A probe's result, when the site joins: the estimate starts from it instead of the prior."""
        if self.profile is None or batch_per_worker <= 0 or tok_s_per_worker <= 0:
            return
        ratio = decode_speed_ratio(self.profile, batch_per_worker, context_per_worker, tok_s_per_worker)
        self.full_site_tok_s = min(self.declared_model_tok_s * ratio, self._bound(FAST_BOUND))
        self.evidence = "probe"

    def carries_over_to(self, fresh: CapacityEstimator) -> bool:
        """Whether a site registering again (back from a blackhole or partition, or its agent
        restarted) keeps this estimate rather than `fresh`, its registration's prior or probe:
        it does when its workers' accounting or saturation has spoken and it declares the same
        GPUs. Its GPUs did not change by being unreachable, and a fresh estimate would rest on
        the first seconds back, when the site has only its orphaned streams' aborts and a trickle
        of new work to show (Korea read 0.54 of its speed after the site-blackhole drill's heal)."""
        same = (self.profile, self.gpus, self.clock_speed, self.prior_tok_s) == (
            fresh.profile,
            fresh.gpus,
            fresh.clock_speed,
            fresh.prior_tok_s,
        )
        return same and self.evidence in ("accounting", "saturated")

    def rebased(self) -> CapacityEstimator:
        """This estimate, its evidence kept, for a new registration: the agent's counters (which
        restart with it) are read afresh from its next report."""
        self._work, self._agent, self.saturated_for_s, self._changed_for_s = None, None, 0.0, 0.0
        return self

    def observe(self, report: SiteReport, dt_s: float) -> None:
        """Learn from one report covering `dt_s` seconds."""
        healthy, total = report.healthy_workers, report.total_workers
        if healthy <= 0 or total <= 0 or dt_s <= 0:
            return
        self.workers = total
        self._learn_agent(report, dt_s)
        if not self._learn_work(report.work, dt_s) and not report.accounting_workers:
            self._learn_saturation(report, dt_s)

    def _learn_work(self, work: WorkDone, dt_s: float) -> bool:
        """The workers' accounting since the last report; True if it moved the estimate."""
        last, self._work = self._work, work
        if last is None or self.profile is None:
            return False
        done = work - last
        if done.any_negative():
            return False  # the agent restarted: its totals start again from 0
        model_ms, busy_ms = work_ms(self.profile.tensor_parallel(self._tp), done), 1000.0 * done.busy_s
        pass_s = self._busy_ms / 1000.0 / self._passes if self._passes else 0.0  # a worker's recent pass
        step = min(dt_s, MAX_STEP_S)
        keep = math.exp(-step / max(TIME_CONSTANT_S, WINDOW_PASSES * pass_s))
        keep_recent = math.exp(-step / max(RECENT_TIME_CONSTANT_S, RECENT_PASSES * pass_s))
        self._model_ms, self._busy_ms = self._model_ms * keep + model_ms, self._busy_ms * keep + busy_ms
        self._passes = self._passes * keep + done.passes
        self._recent_model_ms = self._recent_model_ms * keep_recent + model_ms
        self._recent_busy_ms = self._recent_busy_ms * keep_recent + busy_ms
        if self._busy_ms < 1000.0 * MIN_BUSY_S:
            return False
        speed, recent = self._model_ms / self._busy_ms, self._recent_model_ms / max(self._recent_busy_ms, 1e-9)
        changed = self._recent_busy_ms >= 500.0 * MIN_BUSY_S and not 1 / CHANGE_FACTOR < recent / speed < CHANGE_FACTOR
        self._changed_for_s = self._changed_for_s + dt_s if changed else 0.0
        if self._changed_for_s >= max(CHANGE_HELD_S, HELD_PASSES * pass_s):
            self._passes *= self._recent_busy_ms / self._busy_ms  # as many passes as the recent window holds
            self._model_ms, self._busy_ms, self._changed_for_s = self._recent_model_ms, self._recent_busy_ms, 0.0
            speed = recent
        self._settle(self.declared_model_tok_s * speed, dt_s, 1.0, "accounting")
        return True

    def _learn_saturation(self, report: SiteReport, dt_s: float) -> None:
        """Without accounting: a site saturated for SETTLE_S delivers its capacity."""
        saturated = report.queued_requests > 0 and _full(report)
        self.saturated_for_s = self.saturated_for_s + dt_s if saturated else 0.0
        if self.saturated_for_s < SETTLE_S:
            return
        delivered = report.delivered_tok_s / report.healthy_workers * report.total_workers / self.workload_factor()
        weight = 1.0 - math.exp(-min(dt_s, MAX_STEP_S) / TIME_CONSTANT_S)
        self._settle(delivered, dt_s, weight, "saturated")

    def _settle(self, seen_tok_s: float, dt_s: float, weight: float, evidence: str) -> None:
        """Move the estimate `weight` of the way to what the evidence says, within the bounds."""
        fast = self._bound(FAST_BOUND)
        self.above_for_s = self.above_for_s + dt_s if seen_tok_s > fast else 0.0
        bound = self._bound(HARD_BOUND) if self.above_for_s >= SUSTAINED_S else fast
        self.full_site_tok_s += weight * (min(seen_tok_s, bound) - self.full_site_tok_s)
        self.evidence = evidence

    def _bound(self, multiple: float) -> float:
        return multiple * self.declared_model_tok_s * self.clock_speed

    def _learn_agent(self, report: SiteReport, dt_s: float) -> None:
        """Whether the agent's loop is at its ceiling, and what it relays per CPU-second then."""
        last, self._agent = self._agent, (report.loop_cpu_s, report.relayed_tokens_total)
        if last is None:
            return
        cpu_s, relayed = report.loop_cpu_s - last[0], report.relayed_tokens_total - last[1]
        if cpu_s < 0 or relayed < 0:
            self._loop_cpu_s = self._loop_wall_s = self._relayed = 0.0  # the agent restarted
            return
        keep = math.exp(-min(dt_s, MAX_STEP_S) / TIME_CONSTANT_S)
        self._loop_cpu_s = self._loop_cpu_s * keep + cpu_s
        self._loop_wall_s = self._loop_wall_s * keep + min(dt_s, MAX_STEP_S)
        self._relayed = self._relayed * keep + relayed
        at_ceiling = self._loop_cpu_s >= AGENT_BUSY * self._loop_wall_s > 0
        self.agent_ceiling_tok_s = self._relayed / self._loop_cpu_s if at_ceiling else 0.0

    def shown_evidence(self, healthy_workers: int, total_workers: int) -> str:
        """What the capacity rests on now: `agent_ceiling` while the agent caps it, else what the
        estimate last moved on."""
        if 0.0 < self.agent_ceiling_tok_s < self._gpu_capacity_tok_s(healthy_workers, total_workers):
            return "agent_ceiling"
        return self.evidence

    def prefill_s_per_token(self) -> float:
        """The GPU's prefill cost per prompt token, at the speed the site has shown."""
        if self.profile is None or self.full_site_tok_s <= 0:
            return 0.0
        return self.profile.rho_ms / 1000.0 * self.declared_model_tok_s / self.full_site_tok_s

    def _gpu_capacity_tok_s(self, healthy_workers: int, total_workers: int) -> float:
        full = self.full_site_tok_s * self.workload_factor()
        return full if total_workers <= 0 else full * healthy_workers / total_workers

    def capacity_tok_s(self, healthy_workers: int, total_workers: int) -> float:
        """What the site delivers now, on the federation's workload: a site that lost 4 of 16
        workers, three quarters; no more than its agent relays, at its ceiling."""
        gpus = self._gpu_capacity_tok_s(healthy_workers, total_workers)
        return min(gpus, self.agent_ceiling_tok_s) if self.agent_ceiling_tok_s > 0 else gpus
