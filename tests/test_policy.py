"""Routing policy and registry as plain values: no servers."""

from __future__ import annotations

import time

from core.policy import (
    RouteContext,
    SiteLoad,
    least_expected_delay,
    least_outstanding,
    round_robin,
    static_weights,
)
from core.settings import SchedulerTimings
from core.tiers import Tier
from core.wire import RouteRequest, SiteRegistration, SiteReport, SiteStatus
from scheduler.registry import RegistrationRefused, Registry

KR = SiteLoad("kr", "ap-northeast-2", "kr:1", capacity_tok_s=50_000, outstanding_tokens=0)
US = SiteLoad("us", "us-west-2", "us:1", capacity_tok_s=226_000, outstanding_tokens=0)
RTT = RouteContext({("ap-northeast-2", "us-west-2"): 0.13, ("us-west-2", "ap-northeast-2"): 0.13}, turn=0)


def _req(**kw) -> RouteRequest:
    return RouteRequest(request_id="r", prompt_tokens=100, **kw)


def test_idle_sites_prefer_the_larger_capacity() -> None:
    """With nothing queued, the site that drains a request fastest wins."""
    assert least_expected_delay([KR, US], _req(max_tokens=500), RTT).site == "us"


def test_queued_work_over_capacity_moves_traffic() -> None:
    """Once the big site holds more work per unit of capacity, the small one is chosen."""
    busy_us = SiteLoad("us", "us-west-2", "us:1", 226_000, outstanding_tokens=600_000)
    decision = least_expected_delay([KR, busy_us], _req(max_tokens=500), RTT)
    assert decision.site == "kr"
    assert decision.expected_delay_s == (0 + 500) / 50_000


def test_client_region_adds_the_wan_round_trip() -> None:
    """A Korean client's request goes to Korea when the US would only win by less than the RTT."""
    slightly_busy_us = SiteLoad("us", "us-west-2", "us:1", 226_000, outstanding_tokens=1_000)
    req = _req(max_tokens=500, client_region="ap-northeast-2")
    assert least_expected_delay([KR, slightly_busy_us], req, RTT).site == "kr"
    assert least_expected_delay([KR, slightly_busy_us], _req(max_tokens=500), RTT).site == "us"


def test_a_flex_request_goes_where_capacity_is_spare_in_any_region() -> None:
    """The same Korean client's request at the flex tier counts no round trip: it goes to the US
    site that would start it sooner, leaving Korea's room to interactive work; priority and
    default ones stay near."""
    slightly_busy_us = SiteLoad("us", "us-west-2", "us:1", 226_000, outstanding_tokens=1_000)
    for tier, site in ((Tier.FLEX, "us"), (Tier.DEFAULT, "kr"), (Tier.PRIORITY, "kr")):
        req = _req(max_tokens=500, client_region="ap-northeast-2", tier=tier)
        assert least_expected_delay([KR, slightly_busy_us], req, RTT).site == site, tier


def test_excluded_and_empty() -> None:
    """Excluded sites are skipped; with none left there is no decision."""
    assert least_expected_delay([KR, US], _req(exclude_sites=("us",)), RTT).site == "kr"
    assert least_expected_delay([KR], _req(exclude_sites=("kr",)), RTT) is None


def test_baselines_ignore_what_they_claim_to_ignore() -> None:
    """Round robin alternates blind to capacity; least_outstanding counts requests, not capacity;
    static_weights divides by the declared capacity even when the measured one differs."""
    turns = [round_robin([KR, US], _req(), RouteContext({}, turn=t)).site for t in range(4)]
    assert turns == ["kr", "us", "kr", "us"]
    busy_kr = SiteLoad("kr", "ap-northeast-2", "kr:1", 50_000, 0, outstanding_requests=3)
    busy_us = SiteLoad("us", "us-west-2", "us:1", 226_000, 0, outstanding_requests=4)
    assert least_outstanding([busy_kr, busy_us], _req(), RTT).site == "kr"
    # Declared as 16 x MI355X, measured at MI300X speed: only static_weights still trusts the label.
    mislabelled = SiteLoad("us", "us-west-2", "us:1", 50_000, 100_000, prior_capacity_tok_s=226_000)
    kr = SiteLoad("kr", "ap-northeast-2", "kr:1", 50_000, 50_000, prior_capacity_tok_s=50_000)
    assert static_weights([kr, mislabelled], _req(max_tokens=500), RTT).site == "us"
    assert least_expected_delay([kr, mislabelled], _req(max_tokens=500), RTT).site == "kr"


def test_registry_refuses_another_model_and_tracks_states() -> None:
    """A site serving another model is refused with the reason; reports make a site ready, draining
    keeps it out of routing, and a broken stream marks it down at once."""
    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    try:
        reg.register(SiteRegistration("x", "r", "mi355x", 8, "x:1", "other/model"))
    except RegistrationRefused as exc:
        assert "other/model" in str(exc)
    else:
        raise AssertionError("registration of another model was accepted")
    reg.register(SiteRegistration("us", "us-west-2", "mi355x", 16, "us:1", "openai/gpt-oss-120b"))
    assert reg.routable() == []
    reg.apply_report(SiteReport("us", healthy_workers=12, total_workers=16), now=10.0)
    assert [s.site for s in reg.routable()] == ["us"]
    assert reg.routable()[0].capacity_tok_s == 14155.0 * 16 * 12 / 16
    reg.set_draining("us", True)
    assert reg.routable() == [] and reg.states()[0].status is SiteStatus.DRAINING
    reg.set_draining("us", False)
    assert reg.expire(now=10.5) == [] and reg.expire(now=11.5) == ["us"]
    reg.apply_report(SiteReport("us", healthy_workers=16, total_workers=16), now=12.0)
    reg.disconnected("us")
    assert reg.states()[0].status is SiteStatus.DOWN


def test_states_say_how_long_ago_status_and_workers_changed() -> None:
    """By the scheduler's clock, so an observer that asks late (a drill's poll) still learns when."""
    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    reg.register(SiteRegistration("us", "us-west-2", "mi355x", 16, "us:1", "openai/gpt-oss-120b"))
    assert reg.states()[0].workers_age_s == -1.0  # no report yet
    now = time.monotonic()
    reg.apply_report(SiteReport("us", healthy_workers=16, total_workers=16), now=now)
    time.sleep(0.2)
    reg.apply_report(SiteReport("us", healthy_workers=16, total_workers=16), now=time.monotonic())
    state = reg.states()[0]
    assert state.status is SiteStatus.READY and 0.2 <= state.status_age_s < 1.0  # ready since the first
    assert 0.2 <= state.workers_age_s < 1.0  # the same workers: no change since the first report
    reg.apply_report(SiteReport("us", healthy_workers=14, total_workers=16), now=time.monotonic())
    reg.disconnected("us")
    state = reg.states()[0]
    assert state.status is SiteStatus.DOWN and state.status_age_s < 0.1 and state.workers_age_s < 0.1


def test_a_report_older_than_a_route_does_not_erase_it() -> None:
    """Routes the agent has not taken yet stay counted until a report acknowledges them."""
    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    reg.register(SiteRegistration("us", "us-west-2", "mi355x", 16, "us:1", "openai/gpt-oss-120b"))
    reg.apply_report(SiteReport("us", healthy_workers=16, total_workers=16), now=1.0)
    reg.record_route("us", RouteRequest("a", prompt_tokens=10, max_tokens=300), now=1.1)
    reg.record_route("us", RouteRequest("b", prompt_tokens=10, max_tokens=500), now=1.1)
    reg.apply_report(SiteReport("us", 16, 16, outstanding_requests=1, outstanding_tokens=290, received_ids=("a",)), 1.2)
    state = reg.states()[0]
    assert (state.outstanding_requests, state.outstanding_tokens) == (2, 290 + 500)
    reg.apply_report(SiteReport("us", 16, 16, outstanding_requests=2, outstanding_tokens=700, received_ids=("b",)), 1.4)
    assert (reg.states()[0].outstanding_requests, reg.states()[0].outstanding_tokens) == (2, 700)


def test_a_slow_route_stays_counted_until_its_call_arrives() -> None:
    """Under a burst on a busy machine calls reach the agent a minute after their routes (13 k
    of them did in a bench run): counted as in transit all that time, not written off, while
    the calls the agent took meanwhile (acknowledged by id) stop counting as in transit."""
    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    reg.register(SiteRegistration("us", "us-west-2", "mi355x", 16, "us:1", "openai/gpt-oss-120b"))
    for i in range(10):
        reg.record_route("us", RouteRequest(f"r{i}", prompt_tokens=10, max_tokens=100), now=1.0)
    took_two = SiteReport("us", 16, 16, outstanding_requests=2, outstanding_tokens=200, received_ids=("r0", "r1"))
    reg.apply_report(took_two, now=61.0)
    assert (reg.states()[0].outstanding_requests, reg.states()[0].outstanding_tokens) == (2 + 8, 200 + 800)
    reg.apply_report(
        SiteReport(
            "us",
            16,
            16,
            outstanding_requests=10,
            outstanding_tokens=1000,
            received_ids=tuple(f"r{i}" for i in range(2, 10)),
        ),
        now=62.0,
    )
    assert (reg.states()[0].outstanding_requests, reg.states()[0].outstanding_tokens) == (10, 1000)


def test_routes_that_never_arrive_stop_counting() -> None:
    """A route asked again supersedes the one its gateway never sent; a route whose call never
    reached the site (its gateway died on the way) stops counting after the limit."""
    IN_TRANSIT_LIMIT_S = SchedulerTimings().in_transit_limit_s

    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    for name, region in (("us", "us-west-2"), ("kr", "ap-northeast-2")):
        reg.register(SiteRegistration(name, region, "mi355x", 16, f"{name}:1", "openai/gpt-oss-120b"))
        reg.apply_report(SiteReport(name, healthy_workers=16, total_workers=16), now=1.0)
    reg.record_route("us", RouteRequest("retried", prompt_tokens=10, max_tokens=100), now=1.0)
    reg.record_route("kr", RouteRequest("retried", prompt_tokens=10, max_tokens=100), now=1.5)
    assert {s.name: s.outstanding_requests for s in reg.states()} == {"us": 0, "kr": 1}
    reg.record_route("us", RouteRequest("lost", prompt_tokens=10, max_tokens=100), now=2.0)
    reg.apply_report(SiteReport("us", 16, 16), now=2.0 + IN_TRANSIT_LIMIT_S - 1)
    assert reg.states()[0].outstanding_requests == 1
    reg.apply_report(SiteReport("us", 16, 16), now=2.0 + IN_TRANSIT_LIMIT_S + 1)
    assert reg.states()[0].outstanding_requests == 0


def _fill(sites: dict[str, SiteLoad], requests: int, max_tokens: int = 1278) -> dict[str, SiteLoad]:
    """Route `requests` one after another with nothing finishing, as an Offline burst does."""
    from dataclasses import replace

    for _ in range(requests):
        site = least_expected_delay(list(sites.values()), _req(max_tokens=max_tokens), RTT).site
        s = sites[site]
        sites[site] = replace(
            s, outstanding_requests=s.outstanding_requests + 1, outstanding_tokens=s.outstanding_tokens + max_tokens
        )
    return sites


def test_sites_with_free_slots_fill_in_proportion_to_their_slots() -> None:
    """Below saturation neither site is packed while the other sits half empty: after 10,000
    requests on 4,096 + 16,384 slots both are about equally full (~49 %)."""
    kr = SiteLoad("kr", "ap-northeast-2", "kr:1", 50_000, 0, slots=4096)
    us = SiteLoad("us", "us-west-2", "us:1", 226_000, 0, slots=16_384)
    sites = _fill({"kr": kr, "us": us}, 10_000)
    fills = {name: s.outstanding_requests / s.slots for name, s in sites.items()}
    assert abs(fills["kr"] - fills["us"]) < 0.03, fills


def test_past_saturation_no_site_idles_while_another_queues() -> None:
    """24,000 requests on 20,480 slots: both sites run full, and the queues beyond their slots
    are in proportion to their capacity (equal waits), not to their slots."""
    kr = SiteLoad("kr", "ap-northeast-2", "kr:1", 50_000, 0, slots=4096)
    us = SiteLoad("us", "us-west-2", "us:1", 226_000, 0, slots=16_384)
    sites = _fill({"kr": kr, "us": us}, 24_000)
    queued = {name: s.outstanding_requests - s.slots for name, s in sites.items()}
    assert min(queued.values()) > 0, queued
    assert abs(queued["us"] / queued["kr"] - 226 / 50) < 0.3, queued


def test_a_site_in_slow_start_takes_only_its_window_while_another_has_room() -> None:
    """A site that just joined has proven 128 of its 8,192 slots: of 2,000 new requests it
    takes about its window, and the rest go to the site that has room, though the newcomer's
    other slots are empty."""
    kr = SiteLoad("kr", "ap-northeast-2", "kr:1", 50_000, 0, slots=4096)
    eu = SiteLoad("eu", "us-west-2", "eu:1", 113_000, 0, slots=8192, window=128)
    sites = _fill({"kr": kr, "eu": eu}, 2_000)
    assert 128 <= sites["eu"].outstanding_requests <= 160, sites["eu"]


def test_refusals_are_kept_for_the_latest_names_only() -> None:
    """Anyone can knock with any name: the registry remembers the latest REFUSALS_KEPT refusals,
    and forgets a name's refusal once that site joins."""
    from scheduler.registry import REFUSALS_KEPT

    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    for i in range(REFUSALS_KEPT + 10):
        try:
            reg.register(SiteRegistration(f"s{i}", "r", "mi355x", 8, "x:1", "other/model"))
        except RegistrationRefused:
            pass
    assert len(reg.refused) == REFUSALS_KEPT and "s0" not in reg.refused
    last = f"s{REFUSALS_KEPT + 9}"
    reg.register(SiteRegistration(last, "r", "mi355x", 8, "x:1", "openai/gpt-oss-120b"))
    assert last not in reg.refused
