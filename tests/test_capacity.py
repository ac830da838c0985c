"""The capacity estimator learns what a site delivers; the prior is only where it starts."""

from __future__ import annotations

from core import pace
from core.gpus import PROFILES
from core.wire import SiteReport
from scheduler.capacity import CapacityEstimator, full_batch_tok_s, prior_capacity_tok_s
from scheduler.workload import REFERENCE, Workload, WorkloadMix

REPORT_S = 0.25


def _run(est: CapacityEstimator, seconds: float, **report: float) -> None:
    for _ in range(round(seconds / REPORT_S)):
        est.observe(SiteReport("s", **report), REPORT_S)


def test_a_saturated_site_that_is_slower_than_declared_loses_share_within_30_s() -> None:
    """Declared 16 x MI355X, delivering like 16 x MI300X with requests waiting: within 30 s the
    estimate is within 5 % of what it delivers."""
    declared, real = prior_capacity_tok_s("mi355x", 16), prior_capacity_tok_s("mi300x", 16)
    est = CapacityEstimator(declared, declared)
    _run(est, 30, healthy_workers=16, total_workers=16, queued_requests=40, delivered_tok_s=real)
    assert abs(est.capacity_tok_s(16, 16) / real - 1) < 0.05


def test_idle_sites_keep_their_estimate_and_busy_ones_raise_it() -> None:
    """A site with room to spare delivering little proves nothing (the estimate stays); one that
    delivers more than believed raises it, saturated or not."""
    est = CapacityEstimator(100_000, 100_000)
    _run(est, 60, healthy_workers=16, total_workers=16, queued_requests=0, delivered_tok_s=10_000)
    assert est.capacity_tok_s(16, 16) == 100_000
    _run(est, 30, healthy_workers=16, total_workers=16, queued_requests=0, delivered_tok_s=150_000)
    assert est.capacity_tok_s(16, 16) > 145_000


def test_a_burst_of_tokens_relayed_late_does_not_raise_the_estimate() -> None:
    """An agent whose loop stalled relays the tokens held up all at once: its 5-s rate shows a
    spike for 5 s. More than believed must hold longer than that before it counts, and then
    counts at the least it was."""
    est = CapacityEstimator(100_000, 100_000)
    idle = dict(healthy_workers=16, total_workers=16, queued_requests=0)
    _run(est, 5, **idle, delivered_tok_s=160_000)
    _run(est, 5, **idle, delivered_tok_s=90_000)
    assert est.capacity_tok_s(16, 16) == 100_000
    _run(est, 10, **idle, delivered_tok_s=130_000)
    _run(est, 1, **idle, delivered_tok_s=120_000)
    assert 100_000 < est.capacity_tok_s(16, 16) <= 120_000 and est.evidence == "delivered"


def test_saturation_must_settle_before_it_lowers_the_estimate() -> None:
    """The first seconds of saturation show a throughput average still full of idle time: they
    must not drag the estimate down."""
    est = CapacityEstimator(100_000, 100_000)
    _run(est, 4, healthy_workers=16, total_workers=16, queued_requests=10, delivered_tok_s=20_000)
    assert est.capacity_tok_s(16, 16) == 100_000


def test_a_queue_beside_free_slots_is_not_saturation() -> None:
    """A wave of arrivals waits a moment at a site running half its slots: what it delivers then
    says nothing of its capacity. Once its requests fill every slot (decoding, or prefilling:
    SGLang counts those as waiting), the same queue is saturation."""
    est = CapacityEstimator(200_000, 200_000)
    half = dict(healthy_workers=16, total_workers=16, slots=16384, queued_requests=9, kv_usage=0.3)
    _run(est, 30, **half, running_requests=8192, delivered_tok_s=70_000)
    assert est.capacity_tok_s(16, 16) == 200_000
    prefilling = {**half, "queued_requests": 4000}
    _run(est, 30, **prefilling, running_requests=12384, delivered_tok_s=180_000)
    assert abs(est.capacity_tok_s(16, 16) / 180_000 - 1) < 0.05 and est.evidence == "saturated"


def test_a_wave_being_prefilled_is_not_read_as_a_slow_gpu() -> None:
    """A joining site takes thousands of requests at once: while their prompts are prefilled
    (SGLang shows them waiting) its decoding requests step slowly, each step carrying a full
    prefill chunk. Read as such, that is no evidence of a slow GPU: the estimate is what the
    declared GPUs' model delivers, within a few per cent."""
    est = CapacityEstimator.for_site("mi355x", 16)
    per_gpu = 4000 / 16
    step_ms = PROFILES["mi355x"].step_ms(per_gpu, per_gpu * 1600, PROFILES["mi355x"].chunked_prefill_tokens)
    wave = dict(healthy_workers=16, total_workers=16, slots=16384, running_requests=4000, queued_requests=3000)
    _run(est, 30, **wave, context_tokens=4000 * 1600, delivered_tok_s=16 * per_gpu * 1000 / step_ms)
    assert abs(est.capacity_tok_s(16, 16) / est.declared_model_tok_s - 1) < 0.03


def test_a_browned_out_site_with_a_queue_and_free_slots_loses_its_share() -> None:
    """A site whose GPUs slow 4-fold is still sent work: prompts wait at it while finished
    requests leave slots free, so it is neither idle nor full. Its decode batch, stepping 4
    times slower than the GPU model says with a full prefill chunk per step, cuts the estimate
    to about a quarter within 30 s."""
    est = CapacityEstimator.for_site("mi355x", 16)
    per_gpu = 800
    step_ms = PROFILES["mi355x"].step_ms(per_gpu, per_gpu * 1200, PROFILES["mi355x"].chunked_prefill_tokens)
    slowed = dict(healthy_workers=16, total_workers=16, slots=16384, running_requests=16 * per_gpu)
    _run(
        est,
        30,
        **slowed,
        queued_requests=2000,
        context_tokens=16 * per_gpu * 1200,
        delivered_tok_s=16 * per_gpu * 1000 / (4 * step_ms),
    )
    assert abs(est.capacity_tok_s(16, 16) / (est.declared_model_tok_s / 4) - 1) < 0.1 and est.evidence == "batch"


def test_a_browned_out_site_whose_arrivals_wait_for_its_slow_step_loses_its_share() -> None:
    """Slowed 4-fold, a site's steps take 4 times as long, and the few requests sent to replace
    those finishing wait longer for the next one: a handful wait at every report (at a drill's
    twentieth of real speed a step lasts seconds). That queue is the replacements, not a wave:
    the batch, read with the replacements' prefill, still gives the slowdown away."""
    mix = WorkloadMix()
    mix.current = Workload(prompt_per_output=5.0, context_per_request=1200.0)
    est = CapacityEstimator.for_site("mi355x", 16, mix)
    per_gpu, profile = 960, PROFILES["mi355x"]
    step_ms = profile.step_ms(per_gpu, per_gpu * 1200, per_gpu * 5)
    _run(
        est,
        30,
        healthy_workers=16,
        total_workers=16,
        slots=16384,
        running_requests=16 * per_gpu,
        queued_requests=16 * 3,
        context_tokens=16 * per_gpu * 1200,
        delivered_tok_s=16 * per_gpu * 1000 / (4 * step_ms),
    )
    assert abs(est.full_site_tok_s / (est.declared_model_tok_s / 4) - 1) < 0.1 and est.evidence == "batch"


def test_a_step_that_overruns_the_sites_pace_cuts_its_capacity_while_it_lasts() -> None:
    """A busy site at its declared pace, then a step still running after 5 times what that pace
    predicts (a brownout's first slowed step, whose tokens have not come yet): its capacity is
    cut to a fifth at once, the estimate the evidence built kept. Under OVERRUN_FACTOR times is
    no overrun, nor under OVERRUN_MIN_S more (the agent's loop lag), and the cut ends with the
    step."""
    mix = WorkloadMix()
    mix.current = Workload(prompt_per_output=5.0, context_per_request=1200.0)
    est = CapacityEstimator.for_site("mi355x", 16, mix)
    per_gpu, profile = 960, PROFILES["mi355x"]
    step_s = profile.step_ms(per_gpu, per_gpu * 1200, per_gpu * 5) / 1000
    busy = dict(
        healthy_workers=16,
        total_workers=16,
        slots=16384,
        running_requests=16 * per_gpu,
        context_tokens=16 * per_gpu * 1200,
        delivered_tok_s=16 * per_gpu / step_s,
    )
    _run(est, 30, **busy, step_age_s=step_s / 2)
    before = est.capacity_tok_s(16, 16)
    short = (0.95 * pace.OVERRUN_FACTOR * step_s, step_s + 0.9 * pace.OVERRUN_MIN_S)  # under each bound
    for short_of_an_overrun in short:
        _run(est, REPORT_S, **busy, step_age_s=short_of_an_overrun)
        assert abs(est.capacity_tok_s(16, 16) / before - 1) < 0.01 and not est.overdue
    _run(est, REPORT_S, **busy, step_age_s=5 * step_s)
    assert est.overdue and abs(est.capacity_tok_s(16, 16) / (before / 5) - 1) < 0.1
    _run(est, REPORT_S, **busy, step_age_s=step_s / 2)
    assert not est.overdue and abs(est.capacity_tok_s(16, 16) / before - 1) < 0.02


def test_lost_workers_lower_capacity_at_once() -> None:
    """A site with 12 of 16 workers healthy delivers three quarters of its capacity; what the
    12 deliver is read as the whole site's rate scaled up, so losing workers is not slowness."""
    est = CapacityEstimator(160_000, 160_000)
    assert est.capacity_tok_s(12, 16) == 120_000
    _run(est, 30, healthy_workers=12, total_workers=16, queued_requests=5, delivered_tok_s=120_000)
    assert abs(est.capacity_tok_s(16, 16) / 160_000 - 1) < 0.01


def _decode_like_mi300x(est: CapacityEstimator, batch: int, seconds: float = 30) -> None:
    """Reports from 16 GPUs that decode `batch` requests each (1,600 tokens of context apiece)
    at an MI300X's pace, with no queue."""
    context = batch * 1600
    tok_s = 1000.0 * batch / PROFILES["mi300x"].step_ms(batch, context, 0)
    _run(
        est,
        seconds,
        healthy_workers=16,
        total_workers=16,
        running_requests=16 * batch,
        context_tokens=16 * context,
        delivered_tok_s=16 * tok_s,
    )


def test_a_site_slower_than_declared_loses_share_before_it_ever_queues() -> None:
    """Declared 16 x MI355X, running 128 requests per GPU at MI300X speed with no queue: the
    decode step at that batch gives it away, and within 30 s the estimate is near an MI300X
    site's, not an MI355X's (~4.5 x more). Read through the MI355X's step shape (a smaller fixed
    cost) the batch overstates it by ~25 %; the extra work that routes there makes it queue,
    and saturation evidence then finishes the job (the test above)."""
    est = CapacityEstimator.for_site("mi355x", 16)
    _decode_like_mi300x(est, 128)
    true_capacity = prior_capacity_tok_s("mi300x", 16)
    assert abs(est.capacity_tok_s(16, 16) / true_capacity - 1) < 0.3
    assert est.evidence == "batch"


def test_a_site_as_fast_as_declared_keeps_its_prior_from_batch_evidence() -> None:
    """An MI300X site running a part-full batch at MI300X speed is estimated near its prior:
    batch evidence scales the declared capacity, it does not mistake light load for slowness."""
    est = CapacityEstimator.for_site("mi300x", 16)
    _decode_like_mi300x(est, 100)
    assert abs(est.capacity_tok_s(16, 16) / est.prior_tok_s - 1) < 0.05


def test_a_probe_sets_the_starting_point() -> None:
    """The calibration probe's decode rate replaces the declared prior before any traffic."""
    est = CapacityEstimator.for_site("mi355x", 16)
    context = 32 * 600
    est.calibrate(32, context, 1000.0 * 32 / PROFILES["mi300x"].step_ms(32, context, 0))
    assert est.evidence == "probe"
    assert est.capacity_tok_s(16, 16) < 0.4 * est.prior_tok_s


# 1,000-token prompts, 200-token answers: a running request holds ~1,100 tokens on average.
SHORT_ANSWERS = Workload(prompt_per_output=5.0, context_per_request=1100.0)


def _steady_mi355x_site(est: CapacityEstimator, mix: WorkloadMix, work: Workload, seconds: float) -> None:
    """Reports from 16 MI355X with every slot decoding `work` at the GPU model's pace, the
    requests they finish counted as SGLang counts them, seen by the mix and the estimator."""
    profile, batch = PROFILES["mi355x"], PROFILES["mi355x"].max_running_requests
    tok_s = 16 * full_batch_tok_s(profile, work)
    for i in range(round(seconds / REPORT_S)):
        done = tok_s * REPORT_S * i
        report = SiteReport(
            "s", healthy_workers=16, total_workers=16, running_requests=16 * batch,
            context_tokens=round(16 * batch * work.context_per_request), delivered_tok_s=tok_s,
            slots=16 * batch, prompt_tokens_total=round(done * work.prompt_per_output), generation_tokens_total=round(done),
        )  # fmt: skip
        mix.observe(report, i * REPORT_S)
        est.observe(report, REPORT_S)


def test_the_workload_mix_is_learned_from_finished_requests() -> None:
    """Until enough has finished, the MLPerf-like reference shape; then the prompt tokens per
    output token and the context per running request the sites report."""
    mix = WorkloadMix()
    assert mix.current == REFERENCE
    _steady_mi355x_site(CapacityEstimator.for_site("mi355x", 16, mix), mix, SHORT_ANSWERS, 30)
    assert abs(mix.current.prompt_per_output / 5.0 - 1) < 0.01
    assert abs(mix.current.context_per_request / 1100.0 - 1) < 0.01


def test_capacity_follows_the_shape_of_the_work() -> None:
    """An MI355X site decoding short answers to long prompts at its declared pace: each step also
    prefills the requests replacing those finishing, so it delivers ~40 % less than on MLPerf-like
    work. Its capacity says so, and the batch evidence, counting that prefill, does not read it
    as a slow GPU: the estimate in reference units stays at what the declared GPUs' model gives."""
    mix = WorkloadMix()
    est = CapacityEstimator.for_site("mi355x", 16, mix)
    _steady_mi355x_site(est, mix, SHORT_ANSWERS, 30)
    delivers = 16 * full_batch_tok_s(PROFILES["mi355x"], SHORT_ANSWERS)
    assert est.evidence == "batch"
    assert abs(est.capacity_tok_s(16, 16) / delivers - 1) < 0.03
    assert delivers < 0.7 * 16 * full_batch_tok_s(PROFILES["mi355x"], REFERENCE)
    assert abs(est.full_site_tok_s / est.declared_model_tok_s - 1) < 0.03
