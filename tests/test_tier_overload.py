"""Overload by rule (issue #46): a request waits at a site only behind the work of its own service
tier and the tiers above, so the expected delay the policy weighs is its tier's; in throughput
mode a tier's patience refuses (429, Retry-After) a request no site would start in time, before
the request is charged anywhere. Flex is refused first, then default, and priority only when
priority work alone fills the sites."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import openai
import pydantic
import pytest

from core import runtime, wire
from core.config import GatewaySection
from core.policy import RouteContext, SiteLoad, least_expected_delay
from core.settings import SchedulerTimings
from core.tiers import Tier, ahead_of
from federation import admin, status_view
from federation.bench import tiers as tiers_bench
from federation.bench.client import Result
from federation.gateway import keys
from scheduler.registry import Registry
from tests.test_api_keys import _gateway, _routed
from tests.test_federation import MODEL

CAPACITY = 10_000.0
SLOTS = 10
NO_WAN = RouteContext({}, turn=0)


def _site(name: str, by_tier: tuple[int, ...], tokens_each: int = 100) -> SiteLoad:
    requests = sum(by_tier)
    return SiteLoad(
        name,
        "r",
        f"{name}:1",
        CAPACITY,
        outstanding_tokens=requests * tokens_each,
        outstanding_requests=requests,
        slots=SLOTS,
        outstanding_by_tier=by_tier,
    )


def _req(tier: Tier, **kw) -> wire.RouteRequest:
    return wire.RouteRequest("r", prompt_tokens=0, max_tokens=100, tier=tier, **kw)


def test_a_request_waits_only_behind_its_own_tier_and_those_above() -> None:
    """30 requests at a site of 10 slots, 5 priority, 15 default and 10 flex: flex waits behind all
    30 (21 completions), default behind 20 (11), priority for the first slot that frees (1)."""
    site = _site("a", (5, 15, 10))
    per_completion_s = 100 / CAPACITY
    for tier, completions in ((Tier.FLEX, 21), (Tier.DEFAULT, 11), (Tier.PRIORITY, 1)):
        decision = least_expected_delay([site], _req(tier), NO_WAN)
        assert decision is not None and decision.expected_delay_s == pytest.approx(completions * per_completion_s)
    assert [ahead_of(t, (5, 15, 10), 30) for t in Tier] == [5, 20, 30]
    assert [ahead_of(t, (), 30) for t in Tier] == [30, 30, 30]  # a site that does not say: all of it


def test_each_tier_goes_where_its_own_tier_starts_soonest() -> None:
    """Site a queues default work, site b priority work: a priority request goes to a (nothing of
    its tier there), a default one to b (less default-or-better work), flex to b (less work)."""
    a, b = _site("a", (0, 30, 0)), _site("b", (20, 0, 5))
    chosen = {tier: least_expected_delay([a, b], _req(tier), NO_WAN) for tier in Tier}
    assert {tier: d.site for tier, d in chosen.items() if d} == {Tier.PRIORITY: "a", Tier.DEFAULT: "b", Tier.FLEX: "b"}


def test_an_idle_slot_starts_any_tier_at_once() -> None:
    """With free slots nobody waits, whatever the tiers of the work running."""
    decision = least_expected_delay([_site("a", (0, 0, 9))], _req(Tier.FLEX), NO_WAN)
    assert decision is not None and decision.expected_delay_s == 0.0


def test_a_route_past_its_patience_is_not_taken() -> None:
    """`max_delay_s` bounds the expected delay a route may take; a dry run takes none; 0: no bound."""
    soon, late = wire.RouteDecision("a", "a:1", 1.0, "x"), wire.RouteDecision("a", "a:1", 61.0, "x")
    patient = _req(Tier.FLEX, max_delay_s=60.0)
    assert patient.commits(soon) and not patient.commits(late) and patient.over_patience(late)
    assert _req(Tier.FLEX).commits(late)
    assert not _req(Tier.FLEX, dry_run=True).commits(soon)
    back = wire.route_request_from_pb(wire.route_request_to_pb(patient))
    assert back.max_delay_s == 60.0 and back.tier is Tier.FLEX


def test_the_registry_counts_each_sites_work_by_tier_reported_and_in_transit() -> None:
    """A report's counts by tier, plus the routes the agent has not acknowledged yet, each in its
    tier; a route asked again leaves its first site's tier; a site that does not say its tiers has
    none (all its work counts for every tier), and so does its state on the wire."""
    reg = Registry("openai/gpt-oss-120b", SchedulerTimings())
    reg.register(wire.SiteRegistration("us", "us-west-2", "mi355x", 16, "us:1", "openai/gpt-oss-120b"))
    reg.register(wire.SiteRegistration("kr", "ap-northeast-2", "mi300x", 16, "kr:1", "openai/gpt-oss-120b"))
    reg.apply_report(wire.SiteReport("us", 16, 16, outstanding_requests=3, outstanding_by_tier=(1, 2, 0)), now=1.0)
    reg.apply_report(wire.SiteReport("kr", 16, 16, outstanding_requests=3), now=1.0)
    reg.record_route("us", wire.RouteRequest("p", 10, tier=Tier.PRIORITY), now=1.1)
    reg.record_route("us", wire.RouteRequest("f", 10, tier=Tier.FLEX), now=1.1)
    reg.record_route("kr", wire.RouteRequest("x", 10, tier=Tier.FLEX), now=1.1)
    by_name = {s.name: s for s in reg.states()}
    assert by_name["us"].outstanding_by_tier == (2, 2, 1) and by_name["kr"].outstanding_by_tier == ()
    reg.record_route("kr", wire.RouteRequest("f", 10, tier=Tier.FLEX), now=1.2)  # "f" routed again
    assert {s.name: s for s in reg.states()}["us"].outstanding_by_tier == (2, 2, 0)
    took = wire.SiteReport("us", 16, 16, outstanding_requests=4, outstanding_by_tier=(2, 2), received_ids=("p",))
    reg.apply_report(took, now=1.3)  # an older agent's two tiers; "p" taken
    assert {s.name: s for s in reg.states()}["us"].outstanding_by_tier == (2, 2, 0)
    loads = {load.site: load for load in reg.routable()}
    assert loads["us"].outstanding_by_tier == (2, 2, 0) and loads["kr"].outstanding_by_tier == ()
    state = wire.site_state_from_pb(wire.site_state_to_pb(by_name["us"]))
    assert state.outstanding_by_tier == (2, 2, 1)
    flood = wire.report_to_pb(wire.SiteReport("us", outstanding_by_tier=(1,) * 1000))
    assert wire.report_from_pb(flood).outstanding_by_tier == (1, 1, 1)  # no more counts than tiers


def test_patience_is_told_per_tier_and_refused_clearly() -> None:
    """`--patience-s TIER=S` and the config file's `gateway.patience_s` take a tier and seconds >= 0."""
    assert runtime.patience_arg("flex=30") == (Tier.FLEX, 30.0)
    assert runtime.patience_arg("priority=0") == (Tier.PRIORITY, 0.0)
    for bad in ("scale=3", "flex", "flex=-1", "flex=nan", "flex=soon"):
        with pytest.raises(argparse.ArgumentTypeError):
            runtime.patience_arg(bad)
    assert GatewaySection(patience_s={"default": 120}).patience_s == {"default": 120.0}
    with pytest.raises(pydantic.ValidationError, match="patience_s"):
        GatewaySection(patience_s={"batch": 10})
    with pytest.raises(pydantic.ValidationError, match="patience_s"):
        GatewaySection(patience_s={"flex": -1})


@pytest.mark.timeout(150)
async def test_a_request_past_its_tiers_patience_gets_429_and_is_charged_nowhere(
    shared_federation, tmp_path: Path
) -> None:
    """A gateway whose flex requests may wait no time at all (a patience of a microsecond: the
    prefill alone is longer) refuses each flex request with the openai client's RateLimitError,
    a Retry-After and its own error code, and no site is charged for it; the default and priority
    requests of the same gateway are served. While priority streams run, the schedulers' state
    counts them in their tier."""
    fed, _ = shared_federation
    key_file = tmp_path / "keys.json"
    key = keys.add(key_file, "web", keys.KeyLimits(max_tier="priority"))
    gateway, port = _gateway(fed, key_file, "--patience-s", "flex=0.000001")
    try:
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) as client:

            async def complete(tier: str, max_tokens: int = 4):
                return await client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "Hello " * 200}],
                    max_tokens=max_tokens,
                    service_tier=tier,  # type: ignore[arg-type]
                    extra_body={"ignore_eos": True},
                )

            before = _routed(fed)
            with pytest.raises(openai.RateLimitError) as refused:
                await complete("flex")
            assert refused.value.body["code"] == "tier_patience_exceeded"
            assert int(refused.value.response.headers["Retry-After"]) >= 1
            assert _routed(fed) == before  # decided, but charged at no site
            assert (await complete("default")).service_tier == "default"
            assert (await complete("priority")).service_tier == "priority"

            long = [asyncio.ensure_future(complete("priority", max_tokens=5000)) for _ in range(3)]
            try:
                async with asyncio.timeout(30):
                    while True:
                        state, _ = admin.replicas_state(fed.config.scheduler_addresses, fed.operator)
                        assert state is not None
                        running = [s.outstanding_by_tier for s in state.sites if s.outstanding_by_tier]
                        if sum(t[Tier.PRIORITY] for t in running) == 3:
                            break
                        await asyncio.sleep(0.2)
                assert all(t[Tier.DEFAULT] == t[Tier.FLEX] == 0 for t in running)
            finally:
                for task in long:
                    task.cancel()
                await asyncio.gather(*long, return_exceptions=True)
    finally:
        gateway.stop()


GATEWAY_METRICS = """\
# HELP federation_gateway_tier_requests_total Requests finished, by service tier and outcome.
# TYPE federation_gateway_tier_requests_total counter
federation_gateway_tier_requests_total{outcome="ok",tier="priority"} 10.0
federation_gateway_tier_requests_total{outcome="refused",tier="flex"} 4.0
federation_gateway_tier_requests_total{outcome="ok",tier="flex"} 6.0
# HELP federation_gateway_tier_held_requests Requests held, by service tier.
# TYPE federation_gateway_tier_held_requests gauge
federation_gateway_tier_held_requests{tier="default"} 3.0
# HELP federation_gateway_tier_ttft_seconds From arrival to first chunk, by service tier.
# TYPE federation_gateway_tier_ttft_seconds histogram
federation_gateway_tier_ttft_seconds_bucket{le="0.1",tier="priority"} 5.0
federation_gateway_tier_ttft_seconds_bucket{le="0.2",tier="priority"} 10.0
federation_gateway_tier_ttft_seconds_bucket{le="+Inf",tier="priority"} 10.0
federation_gateway_tier_ttft_seconds_count{tier="priority"} 10.0
federation_gateway_tier_ttft_seconds_sum{tier="priority"} 1.2
"""


def test_fedctl_status_shows_each_tiers_queue_and_latency() -> None:
    """Per tier: the requests outstanding at every site (the schedulers' counts), and from the
    gateway's /metrics those it holds, those it finished by outcome and their TTFT percentiles
    (interpolated in the buckets); without the gateway those are unknown, shown as "-"."""
    sites = tuple(
        wire.SiteState(
            name, "r", "mi355x", 8, "a:1", wire.SiteStatus.READY, 1.0, 5, 50, 0, 8, 8, 0.1, outstanding_by_tier=by
        )
        for name, by in (("a", (1, 2, 2)), ("b", (0, 4, 1)), ("c", ()))
    )
    state = wire.FederationState(sites, "m")
    rows = status_view.tier_rows(state, GATEWAY_METRICS)
    assert [rows[t]["at_sites"] for t in ("priority", "default", "flex")] == [1, 6, 3]
    assert rows["priority"]["ok"] == 10 and rows["flex"]["refused"] == 4 and rows["default"]["held"] == 3
    assert rows["priority"]["ttft_p50_ms"] == 100.0 and rows["priority"]["ttft_p99_ms"] == pytest.approx(198.0)
    assert rows["default"]["ttft_p50_ms"] is None
    blind = status_view.tier_rows(state, None)
    assert blind["flex"]["at_sites"] == 3 and blind["flex"]["ok"] is None
    table = status_view.state_table(state, {"s:1": "ok"}, None)
    assert "ttft_p99_ms" in table and "did not answer" in table
    assert status_view.state_body(state, {}, GATEWAY_METRICS)["sites"][0]["outstanding_by_tier"] == {
        "priority": 1,
        "default": 2,
        "flex": 2,
    }


def test_the_tiers_benchs_report_orders_resumes_and_counts_refusals_apart() -> None:
    """`fedctl bench --workload tiers`'s JSON from plain results: per tier TTFT in GPU time (speed
    0.5: wall seconds count half), a 429 with Retry-After counted as refused, not failed; the
    streams the crash cut (begun at the crashed site, before it, ending after it) each with the
    wait it saw, the tiers ordered by it."""
    crash = tiers_bench.Crash("kr", at=100.0, after_s=50.0)

    def result(i: int, site: str, first: float | None, end: float, gap: float = 0.0, **kw) -> Result:
        return Result(i, 0.0, first, end, 10, site, longest_gap_s=gap, longest_gap_end=end if gap else None, **kw)

    results = [
        result(0, "kr", 1.0, 104.0, gap=1.0),  # priority, cut and resumed after 1 s
        result(1, "kr", 1.0, 110.0, gap=4.0),  # default, after 4 s
        result(2, "kr", 1.0, 130.0, gap=9.0),  # flex, after 9 s
        result(3, "us", 2.0, 120.0, gap=0.5),  # flex at the other site: not cut
        result(4, "kr", 1.0, 50.0),  # priority, over before the crash
        result(5, "", None, 0.1, error="HTTP 429: ...", refused=True),  # flex refused
        result(6, "", None, 0.1, error="HTTP 500: ..."),  # default failed
    ]
    tier_of = {0: Tier.PRIORITY, 1: Tier.DEFAULT, 2: Tier.FLEX, 3: Tier.FLEX, 4: Tier.PRIORITY, 5: Tier.FLEX}
    tier_of[6] = Tier.DEFAULT
    out = tiers_bench.report(results, tier_of, 0.5, tiers_bench.Rates(1000.0, 990.0, 7.5), crash)
    assert out["tiers"]["priority"] == {
        "ttft_p50_ms": 500.0,
        "ttft_p99_ms": 500.0,
        "requests_ok": 2,
        "refused": 0,
        "failed": 0,
    }
    assert (out["tiers"]["flex"]["refused"], out["tiers"]["flex"]["failed"]) == (1, 0)
    assert (out["tiers"]["default"]["refused"], out["tiers"]["default"]["failed"]) == (0, 1)
    resumes = out["crash"]["resumes"]
    assert [resumes[t]["cut"] for t in ("priority", "default", "flex")] == [1, 1, 1]
    assert [resumes[t]["gap_p50_ms"] for t in ("priority", "default", "flex")] == [500.0, 2000.0, 4500.0]
    assert out["crash"]["resume_order"] == ["priority", "default", "flex"]
    assert out["steady_over_offline"] == 0.99 and out["meets"] == {
        "priority": True,
        "flex": True,
        "steady": True,
        "priority_resumed_first": True,
    }
