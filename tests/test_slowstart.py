"""Slow start as a pure function of reports: the window grows only with what the site proves."""

from __future__ import annotations

from core.settings import SchedulerTimings
from core.wire import SiteRegistration, SiteReport
from scheduler.registry import Registry
from scheduler.slowstart import SlowStart

MODEL = "openai/gpt-oss-120b"

SLOTS = 8 * 1024
CAPACITY = 100_000.0  # tok/s at full batch
PER_SLOT = CAPACITY / SLOTS


def test_the_window_starts_at_what_the_probe_proved() -> None:
    """8 workers that each decoded a batch of 16 in the probe: 128 slots to fill at first."""
    start = SlowStart.begin(16, 8)
    assert start.window == 128


def test_it_doubles_only_while_the_site_decodes_its_window() -> None:
    """Requests still in prefill (nothing generated) earn nothing; decoding half the window earns
    a doubling; and so on until the window is the site's slots, when slow start ends."""
    start = SlowStart.begin(16, 8)
    start.observe(running=128, gen_tok_s=0.0, capacity_tok_s=CAPACITY, site_slots=SLOTS)
    assert start.window == 128
    doublings = 0
    while start.window:
        start.observe(
            running=start.window, gen_tok_s=start.window * PER_SLOT, capacity_tok_s=CAPACITY, site_slots=SLOTS
        )
        doublings += 1
    assert doublings == 6  # 128 -> 8,192, then no limit


def test_a_site_already_busy_is_trusted_with_what_it_runs() -> None:
    """A scheduler replica that restarts meets sites full of work: the window starts there."""
    start = SlowStart.begin(16, 8)
    start.observe(running=5000, gen_tok_s=0.0, capacity_tok_s=CAPACITY, site_slots=SLOTS)
    assert start.window == 5000


def test_a_site_that_does_not_say_its_slots_is_not_limited() -> None:
    start = SlowStart.begin(16, 8)
    start.observe(running=0, gen_tok_s=0.0, capacity_tok_s=CAPACITY, site_slots=0)
    assert start.window == 0


def test_only_a_site_joining_a_serving_federation_starts_slow() -> None:
    """Sites that register while nothing is served (a fresh federation) are not limited; one
    that joins while another site has work is."""
    reg = Registry(MODEL, SchedulerTimings())
    for name in ("kr", "us"):
        reg.register(SiteRegistration(name, "r", "mi355x", 8, f"{name}:1", MODEL, probe_batch=16))
    assert [s.admit_window for s in reg.states()] == [0, 0]
    reg.apply_report(SiteReport("us", 8, 8, outstanding_requests=300, slots=SLOTS), now=1.0)
    reg.register(SiteRegistration("eu", "r", "mi355x", 8, "eu:1", MODEL, probe_batch=16))
    assert {s.name: s.admit_window for s in reg.states()}["eu"] == 16 * 8
