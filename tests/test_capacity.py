"""The capacity estimator learns how fast a site's GPUs run from the workers' own accounting of
their work; the prior is only where it starts, and physics and the agent bound it.

These feed it reports built from the GPU step model (tests/test_capacity_recorded.py feeds it
reports recorded from real agents over emulated workers)."""

from __future__ import annotations

import dataclasses

from core.gpus import PROFILES, GpuProfile
from core.settings import SchedulerTimings
from core.wire import SiteRegistration, SiteReport, WorkDone
from scheduler.capacity import (
    FAST_BOUND,
    HARD_BOUND,
    SUSTAINED_S,
    CapacityEstimator,
    full_batch_tok_s,
    prior_capacity_tok_s,
)
from scheduler.registry import Registry
from scheduler.workload import REFERENCE, Workload, WorkloadMix

MODEL = "openai/gpt-oss-120b"

REPORT_S = 0.25


class Site:
    """Reports of a site of `workers` GPUs running steady steps of `batch` requests holding
    `context` tokens each, `prefill` prompt tokens per step, at `speed` times the pace of
    `runs_as`; its workers' accounting summed as the agent sums it."""

    def __init__(self, runs_as: GpuProfile, workers: int = 16, speed: float = 1.0, name: str = "s") -> None:
        self.runs_as, self.workers, self.speed, self.name = runs_as, workers, speed, name
        self.work = WorkDone()
        self.relayed = 0
        self.loop_cpu_s = 0.0
        self.at = 0.0  # seconds reported

    def run(
        self,
        est: CapacityEstimator,
        seconds: float,
        batch: float,
        context: float = 1200.0,
        prefill: float = 0.0,
        healthy: int | None = None,
        loop_busy: float = 0.1,
        mix: WorkloadMix | None = None,
        **report: float,
    ) -> None:
        healthy = self.workers if healthy is None else healthy
        step_s = self.runs_as.step_ms(batch, batch * context, prefill) / 1000.0 / self.speed
        passes = REPORT_S / step_s * healthy
        for _ in range(round(seconds / REPORT_S)):
            done = WorkDone(
                REPORT_S * healthy,
                round(passes),
                passes * batch,
                passes * batch * context / 1000,
                round(passes * prefill),
            )
            self.work = self.work + done
            self.relayed += round(passes * batch)
            self.loop_cpu_s += loop_busy * REPORT_S
            self.at += REPORT_S
            site = SiteReport(
                self.name,
                healthy_workers=healthy,
                total_workers=self.workers,
                running_requests=round(healthy * batch),
                context_tokens=round(healthy * batch * context),
                work=self.work,
                accounting_workers=healthy,
                loop_cpu_s=self.loop_cpu_s,
                relayed_tokens_total=self.relayed,
                generation_tokens_total=self.relayed,
                prompt_tokens_total=round(self.relayed * prefill / batch),  # what finishing requests prefilled
                delivered_tok_s=healthy * batch / step_s,
                **report,  # type: ignore[arg-type]
            )
            if mix is not None:
                mix.observe(site, self.at)
            est.observe(site, REPORT_S)


def test_a_site_as_fast_as_declared_is_estimated_at_its_declared_model() -> None:
    """16 MI355X whose accounting matches the MI355X step model, at a part-full batch: the
    estimate is the declared GPUs' model, whatever the load."""
    est = CapacityEstimator.for_site("mi355x", 16)
    Site(PROFILES["mi355x"]).run(est, 20, batch=300)
    assert est.evidence == "accounting"
    assert abs(est.full_site_tok_s / est.declared_model_tok_s - 1) < 0.01


def test_a_site_slower_than_declared_loses_its_share_within_30_s() -> None:
    """Declared 16 x MI355X, running at an MI300X's pace (its accounting's steps take an MI300X's
    time): within 30 s the estimate is near an MI300X site's, not an MI355X's (~4.5 x more).
    Read through the MI355X's step shape (a smaller fixed cost) it is within 30 %."""
    est = CapacityEstimator.for_site("mi355x", 16)
    Site(PROFILES["mi300x"]).run(est, 30, batch=128, prefill=400)
    truth = 16 * full_batch_tok_s(PROFILES["mi300x"], REFERENCE)
    assert abs(est.capacity_tok_s(16, 16) / truth - 1) < 0.3


def test_a_wave_of_prefill_is_work_not_a_slow_gpu() -> None:
    """A wave of resumed streams re-prefilling their contexts: every step carries a full chunk of
    prefill, and the decode batch steps slowly. The accounting counts the prefill as work done,
    so the estimate stays at the declared model; the delivered rate, read alone, halves."""
    profile = PROFILES["mi355x"]
    est = CapacityEstimator.for_site("mi355x", 16)
    site = Site(profile)
    site.run(est, 20, batch=900)
    before = est.full_site_tok_s
    site.run(est, 20, batch=250, prefill=profile.chunked_prefill_tokens, queued_requests=3000)
    assert abs(est.full_site_tok_s / before - 1) < 0.01


def test_a_browned_out_site_loses_its_share_within_10_s() -> None:
    """Its GPUs slowed 4-fold: its workers' busy seconds hold 4 times the work's model time, and
    the estimate is a quarter of what it was within 10 s."""
    est = CapacityEstimator.for_site("mi355x", 16)
    site = Site(PROFILES["mi355x"])
    site.run(est, 20, batch=900, prefill=4000)
    before = est.full_site_tok_s
    site.speed = 0.25
    site.run(est, 10, batch=900, prefill=4000)
    assert abs(est.full_site_tok_s / (before / 4) - 1) < 0.1


def test_reports_late_and_bunched_change_nothing() -> None:
    """An agent stalled for 3 s sends no report, then one carrying 3 s of accounting at once:
    the estimate is what it was (only the workers' own counts enter it, not when they came)."""
    est = CapacityEstimator.for_site("mi300x", 16)
    site = Site(PROFILES["mi300x"])
    site.run(est, 20, batch=200, prefill=1000)
    before = est.full_site_tok_s
    held = Site(PROFILES["mi300x"])
    held.work = site.work
    held.run(CapacityEstimator.for_site("mi300x", 16), 3, batch=200, prefill=1000)  # the stall's work, unreported
    est.observe(SiteReport("s", healthy_workers=16, total_workers=16, work=held.work, accounting_workers=16), 3.0)
    site.work = held.work
    site.run(est, 2, batch=200, prefill=1000)
    assert abs(est.full_site_tok_s / before - 1) < 0.01


def test_lost_workers_lower_capacity_at_once() -> None:
    """A site with 12 of 16 workers healthy delivers three quarters of its capacity, and the 12's
    accounting keeps the estimate per worker where it was."""
    est = CapacityEstimator.for_site("mi355x", 16)
    site = Site(PROFILES["mi355x"])
    site.run(est, 20, batch=900)
    full = est.capacity_tok_s(16, 16)
    site.run(est, 20, batch=900, healthy=12)
    assert abs(est.capacity_tok_s(12, 16) / (0.75 * full) - 1) < 0.01


def test_no_estimate_rises_past_the_physics_bound_without_sustained_evidence() -> None:
    """Accounting that says the GPUs run 3 times faster than declared (a misread, or a site that
    under-declared) lifts the estimate only to FAST_BOUND x the declared model until it has held
    for SUSTAINED_S; then to what it says, never past HARD_BOUND."""
    est = CapacityEstimator.for_site("mi300x", 16)
    site = Site(PROFILES["mi300x"], speed=3.0)
    site.run(est, SUSTAINED_S - 5, batch=200)
    assert abs(est.full_site_tok_s / (FAST_BOUND * est.declared_model_tok_s) - 1) < 0.01
    site.run(est, 20, batch=200)
    assert abs(est.full_site_tok_s / (3 * est.declared_model_tok_s) - 1) < 0.02
    site.speed = 10.0
    site.run(est, 60, batch=200)
    assert abs(est.full_site_tok_s / (HARD_BOUND * est.declared_model_tok_s) - 1) < 0.01


def test_an_emulated_sites_clock_scales_its_prior_and_its_bound() -> None:
    """A site emulated at a twentieth of real speed declares it: its prior is a twentieth, and its
    accounting at that clock reads as its declared GPUs, not as a GPU 20 times slower."""
    est = CapacityEstimator.for_site("mi355x", 16, clock_speed=0.05)
    assert est.prior_tok_s == 0.05 * prior_capacity_tok_s("mi355x", 16)
    Site(PROFILES["mi355x"], speed=0.05).run(est, 20, batch=900)
    assert abs(est.full_site_tok_s / (0.05 * est.declared_model_tok_s) - 1) < 0.01


def test_an_agent_at_its_cpu_ceiling_caps_its_site() -> None:
    """An agent whose loop runs at 95 % of a core relays no more than it does per CPU-second: the
    site's capacity is capped there, and says so; below its ceiling it caps nothing."""
    est = CapacityEstimator.for_site("mi355x", 16)
    site = Site(PROFILES["mi355x"])
    site.run(est, 20, batch=100, loop_busy=0.5)
    assert est.agent_ceiling_tok_s == 0 and est.shown_evidence(16, 16) == "accounting"
    site.run(est, 20, batch=100, loop_busy=0.95)
    relayed_tok_s = 16 * 100 / (PROFILES["mi355x"].step_ms(100, 100 * 1200, 0) / 1000)
    assert abs(est.capacity_tok_s(16, 16) / (relayed_tok_s / 0.95) - 1) < 0.02
    assert est.capacity_tok_s(16, 16) < est.full_site_tok_s and est.shown_evidence(16, 16) == "agent_ceiling"


def test_without_accounting_a_saturated_site_is_what_it_delivers() -> None:
    """Workers that export no accounting: the estimate moves only when the site is saturated
    (requests waiting with every slot full) for SETTLE_S, to what it delivers."""
    declared, real = prior_capacity_tok_s("mi355x", 16), prior_capacity_tok_s("mi300x", 16)
    est = CapacityEstimator.for_site("mi355x", 16)
    full = dict(healthy_workers=16, total_workers=16, slots=4096, running_requests=4096, delivered_tok_s=real)
    for _ in range(round(4 / REPORT_S)):
        est.observe(SiteReport("s", **full, queued_requests=40), REPORT_S)
    assert est.full_site_tok_s == declared  # not yet settled
    for _ in range(round(30 / REPORT_S)):
        est.observe(SiteReport("s", **full, queued_requests=40), REPORT_S)
    assert abs(est.capacity_tok_s(16, 16) / real - 1) < 0.05 and est.evidence == "saturated"


def test_a_probe_sets_the_starting_point_within_the_bound() -> None:
    """The calibration probe's decode rate replaces the declared prior before any traffic; a
    probe spoilt into an absurd rate (a stalled loop's burst read 450 M tok/s) is held to the
    physics bound."""
    est = CapacityEstimator.for_site("mi355x", 16)
    context = 32 * 600
    est.calibrate(32, context, 1000.0 * 32 / PROFILES["mi300x"].step_ms(32, context, 0))
    assert est.evidence == "probe"
    assert est.capacity_tok_s(16, 16) < 0.4 * est.prior_tok_s
    est.calibrate(16, 16 * 288, 450e6 / 16)
    assert est.full_site_tok_s == FAST_BOUND * est.declared_model_tok_s


# 1,000-token prompts, 200-token answers: a running request holds ~1,100 tokens on average.
SHORT_ANSWERS = Workload(prompt_per_output=5.0, context_per_request=1100.0)


def _steady_mi355x_site(est: CapacityEstimator, mix: WorkloadMix, work: Workload, seconds: float) -> None:
    """Reports from 16 MI355X with every slot decoding `work` at the GPU model's pace, the
    requests they finish counted as SGLang counts them, seen by the mix and the estimator."""
    batch = PROFILES["mi355x"].max_running_requests
    Site(PROFILES["mi355x"]).run(
        est, seconds, batch, work.context_per_request, batch * work.prompt_per_output, mix=mix, slots=16 * batch
    )


def test_the_workload_mix_is_learned_from_finished_requests() -> None:
    """Until enough has finished, the MLPerf-like reference shape; then the prompt tokens per
    output token and the context per running request the sites report."""
    mix = WorkloadMix()
    assert mix.current == REFERENCE
    _steady_mi355x_site(CapacityEstimator.for_site("mi355x", 16, mix), mix, SHORT_ANSWERS, 30)
    assert abs(mix.current.prompt_per_output / 5.0 - 1) < 0.01
    assert abs(mix.current.context_per_request / 1100.0 - 1) < 0.01


def test_each_site_is_scaled_to_the_mix_it_runs() -> None:
    """Routing sends long prompts where prefill is cheap, so each site runs a mix of its own:
    two MI355X sites, one finishing short answers to long prompts and one MLPerf-like work, are
    each scaled to theirs (the drills measured ~550-token prompts at the MI300X site and ~1,130 at
    the MI355X one); a site that has finished nothing yet has the federation's mix."""
    mix = WorkloadMix()
    long_prompts = CapacityEstimator.for_site("mi355x", 16, mix, site="a")
    reference = CapacityEstimator.for_site("mi355x", 16, mix, site="b")
    newcomer = CapacityEstimator.for_site("mi355x", 16, mix, site="c")
    batch = PROFILES["mi355x"].max_running_requests
    a, b = Site(PROFILES["mi355x"], name="a"), Site(PROFILES["mi355x"], name="b")
    for _ in range(30):  # the two sites report side by side, a second at a time
        a.run(long_prompts, 1, batch, SHORT_ANSWERS.context_per_request, batch * 5.0, mix=mix, slots=16 * batch)
        b.run(
            reference,
            1,
            batch,
            REFERENCE.context_per_request,
            batch * REFERENCE.prompt_per_output,
            mix=mix,
            slots=16 * batch,
        )
    assert abs(mix.of("a").prompt_per_output / 5.0 - 1) < 0.01
    assert abs(mix.of("b").prompt_per_output / REFERENCE.prompt_per_output - 1) < 0.01
    assert mix.of("c") == mix.current  # between the two: what both finished
    assert long_prompts.workload_factor() < newcomer.workload_factor() < reference.workload_factor()
    assert long_prompts.workload_factor() < 0.7 and abs(reference.workload_factor() - 1) < 0.01


def test_a_site_back_from_an_outage_keeps_its_shape() -> None:
    """Site a finishes short answers to long prompts, b MLPerf-like work; a goes silent for 60 s
    (a blackhole) and comes back running only young requests, which finish nothing for another
    60 s. Its shape is still its own, not the federation's (b's, by then): the site-blackhole
    drill read Korea on the federation's mix, 13 % low, for the whole window after the heal."""
    mix = WorkloadMix()
    batch = PROFILES["mi355x"].max_running_requests
    a, b = Site(PROFILES["mi355x"], name="a"), Site(PROFILES["mi355x"], name="b")
    est_a = CapacityEstimator.for_site("mi355x", 16, mix, site="a")
    est_b = CapacityEstimator.for_site("mi355x", 16, mix, site="b")
    reference = (batch, REFERENCE.context_per_request, batch * REFERENCE.prompt_per_output)
    for _ in range(30):
        a.run(est_a, 1, batch, SHORT_ANSWERS.context_per_request, batch * 5.0, mix=mix, slots=16 * batch)
        b.run(est_b, 1, *reference, mix=mix, slots=16 * batch)
    b.run(est_b, 60, *reference, mix=mix, slots=16 * batch)  # a is silent
    for second in range(60):  # a is back: its counters move no further, nothing has finished
        young = SiteReport(
            "a",
            healthy_workers=16,
            total_workers=16,
            running_requests=16 * batch,
            context_tokens=round(16 * batch * 300),
            generation_tokens_total=a.relayed,
            prompt_tokens_total=round(a.relayed * 5.0),
            relayed_tokens_total=a.relayed + (second + 1) * 16 * batch * 40,
        )
        mix.observe(young, b.at + second)
        b.run(est_b, 1, *reference, mix=mix, slots=16 * batch)
    assert abs(mix.current.prompt_per_output / REFERENCE.prompt_per_output - 1) < 0.05  # b's, by now
    assert abs(mix.of("a").prompt_per_output / 5.0 - 1) < 0.01


def test_a_site_that_just_joined_has_the_federations_mix_until_it_is_steady() -> None:
    """Site b runs MLPerf-like work; n joins and relays as much as b, but its requests are young:
    for 60 s it finishes only a third of what it relays, short answers to long prompts (9 prompt
    tokens per output token). That is not its mix, and its capacity is not cut for it: it has
    the federation's. Once its completions keep pace with what it relays, the mix is its own."""
    mix = WorkloadMix()
    batch = PROFILES["mi355x"].max_running_requests
    b = Site(PROFILES["mi355x"], name="b")
    est_b = CapacityEstimator.for_site("mi355x", 16, mix, site="b")
    reference = (batch, REFERENCE.context_per_request, batch * REFERENCE.prompt_per_output)
    b.run(est_b, 30, *reference, mix=mix, slots=16 * batch)
    relayed = finished = prompts = 0
    for second in range(120):
        relayed += 16 * batch * 40  # tokens n relays a second
        done = 16 * batch * 40 // (3 if second < 60 else 1)  # the output of the answers it finished
        finished, prompts = finished + done, prompts + (9 if second < 60 else 5) * done
        young = SiteReport(
            "n",
            healthy_workers=16,
            total_workers=16,
            running_requests=16 * batch,
            context_tokens=16 * batch * 1100,
            relayed_tokens_total=relayed,
            generation_tokens_total=finished,
            prompt_tokens_total=prompts,
        )
        mix.observe(young, b.at + second)
        b.run(est_b, 1, *reference, mix=mix, slots=16 * batch)
        if second == 59:
            assert mix.of("n") == mix.current
    assert abs(mix.of("n").prompt_per_output / 5.0 - 1) < 0.1


def test_capacity_follows_the_shape_of_the_work() -> None:
    """An MI355X site decoding short answers to long prompts at its declared pace: each step also
    prefills the requests replacing those finishing, so it delivers ~40 % less than on MLPerf-like
    work. Its capacity says so, and the accounting, counting that prefill, does not read it as a
    slow GPU: the estimate in reference units stays at what the declared GPUs' model gives."""
    mix = WorkloadMix()
    est = CapacityEstimator.for_site("mi355x", 16, mix)
    _steady_mi355x_site(est, mix, SHORT_ANSWERS, 30)
    delivers = 16 * full_batch_tok_s(PROFILES["mi355x"], SHORT_ANSWERS)
    assert est.evidence == "accounting"
    assert abs(est.capacity_tok_s(16, 16) / delivers - 1) < 0.03
    assert delivers < 0.7 * 16 * full_batch_tok_s(PROFILES["mi355x"], REFERENCE)
    assert abs(est.full_site_tok_s / est.declared_model_tok_s - 1) < 0.03


def test_a_site_that_says_no_kv_cannot_break_the_mix() -> None:
    """A site that runs requests and finishes them but reports no KV in use (an agent that cannot
    read it, or a hostile one) leaves the context per request to the sites that say it: the mix
    never holds a context of 0, which every site's capacity divides by (a thousand simulated
    sites that said none broke every replica's state before this was checked)."""
    mix = WorkloadMix()
    for second in range(30):
        blind = SiteReport(
            "blind",
            healthy_workers=8,
            total_workers=8,
            running_requests=1000,
            generation_tokens_total=2000 * second,
            prompt_tokens_total=3000 * second,
        )
        mix.observe(blind, float(second))
    assert mix.current.context_per_request > 0 and mix.of("blind").context_per_request > 0
    estimator = CapacityEstimator.for_site("mi300x", 8, mix, site="blind")
    assert estimator.workload_factor() > 0


def test_a_site_registering_again_keeps_what_its_workers_showed() -> None:
    """A site back from a blackhole registers again: its estimate stays what its workers showed
    (its GPUs did not change while it was unreachable) rather than restarting from the prior and
    resting on its first seconds back. Its agent's counters, which restart with it, are read
    afresh. A site declaring other GPUs starts from its prior."""
    registry = Registry(MODEL, SchedulerTimings())
    declared = SiteRegistration("kr", "r", "mi300x", 16, "kr:1", MODEL)
    first = registry.register(declared)
    Site(PROFILES["mi300x"], speed=0.8).run(first.estimator, 30, batch=128)
    learned = first.estimator.full_site_tok_s
    assert abs(learned / first.estimator.declared_model_tok_s - 0.8) < 0.02
    back = registry.register(declared)
    assert (back.estimator.full_site_tok_s, back.estimator.evidence) == (learned, "accounting")
    Site(PROFILES["mi300x"], speed=0.8).run(back.estimator, 5, batch=128)  # a restarted agent: counters from 0
    assert abs(back.estimator.full_site_tok_s / learned - 1) < 0.01
    rebuilt = registry.register(dataclasses.replace(declared, gpus=8))
    assert rebuilt.estimator.evidence == "prior"
    assert rebuilt.estimator.full_site_tok_s == prior_capacity_tok_s("mi300x", 8)
