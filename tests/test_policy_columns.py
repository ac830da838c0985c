"""`least_expected_delay_columns` decides exactly as `least_expected_delay` (core/policy.py):
the scheduler routes with the columns, a gateway in degraded mode and the policy simulation with
the loop, and a thousand sites must not change a decision. Held over generated federations:
sites with and without slots, in slow start, full, excluded, holding a prompt's prefix, saying
their outstanding work by tier or not, or not routable (a row whose site went down), and clients in known and unknown regions."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core.policy import RouteContext, SiteLoad, least_expected_delay
from core.policy_columns import SiteColumns, least_expected_delay_columns
from core.tiers import Tier
from core.wire import RouteRequest

REGIONS = ("kr", "us", "eu")
RTT = {(a, b): 0.001 if a == b else 0.13 for a in REGIONS for b in REGIONS if (a, b) != ("eu", "kr")}


def _split(requests: int, draw) -> tuple[int, ...]:
    """`requests` shared among the tiers, as a site's report says them."""
    priority = draw(st.integers(0, requests))
    default = draw(st.integers(0, requests - priority))
    return (priority, default, requests - priority - default)


@st.composite
def sites(draw) -> list[tuple[SiteLoad, bool]]:
    count = draw(st.integers(1, 12))
    out = []
    for i in range(count):
        slots = draw(st.sampled_from([0, 1, 8, 64, 256]))
        requests = draw(st.integers(0, 400))
        load = SiteLoad(
            site=f"s{i}",
            region=draw(st.sampled_from(REGIONS)),
            agent_address=f"127.0.0.1:{1000 + i}",
            capacity_tok_s=draw(st.sampled_from([0.0, 500.0, 3108.0 * 8, 14155.0 * 16, 1e5 / 3])),
            outstanding_tokens=draw(st.integers(0, 500_000)) if requests else 0,
            outstanding_requests=requests,
            prior_capacity_tok_s=3108.0,
            slots=slots,
            prefill_s_per_token=draw(st.sampled_from([0.0, 1e-5, 3.3e-5])),
            window=draw(st.sampled_from([0, 0, 1, 4, 32])),
            outstanding_by_tier=draw(st.sampled_from([(), _split(requests, draw)])),
        )
        out.append((load, draw(st.booleans())))  # False: not routable now (down, draining)
    return out


@settings(max_examples=400, deadline=None)
@given(
    federation=sites(),
    client=st.sampled_from(["", "kr", "us", "eu", "mars"]),
    prompt=st.integers(0, 8192),
    max_tokens=st.sampled_from([0, 1, 200, 1278, 20_000]),
    tier=st.sampled_from(list(Tier)),
    data=st.data(),
)
def test_the_columns_decide_exactly_as_the_loop(federation, client, prompt, max_tokens, tier, data) -> None:
    columns = SiteColumns()
    for load, _ in federation:
        columns.put(load.site, load)  # every site has a row in the order it first came ...
    for load, routable in federation:
        if not routable:
            columns.put(load.site, None)  # ... and one that went down keeps it, empty
    routable_loads = [load for load, routable in federation if routable]
    names = [load.site for load, _ in federation]
    excluded = tuple(data.draw(st.lists(st.sampled_from(names), max_size=3, unique=True)))
    cached = data.draw(st.dictionaries(st.sampled_from(names), st.sampled_from([0, 64, 192, 256, 1024, 8192])))
    req = RouteRequest("r", prompt, max_tokens, client_region=client, exclude_sites=excluded, tier=tier)
    ctx = RouteContext(RTT, 0, cached)
    assert least_expected_delay_columns(columns, req, ctx) == least_expected_delay(routable_loads, req, ctx)


def test_a_site_back_from_down_keeps_its_row_and_the_table_grows() -> None:
    """Rows are kept in the order sites first came, through downs and growth past the arrays."""
    columns = SiteColumns()
    loads = [SiteLoad(f"s{i}", "kr", "a", 100.0, i) for i in range(40)]
    for load in loads:
        columns.put(load.site, load)
    columns.put("s3", None)
    columns.put("s3", loads[3])
    assert columns.rows["s3"] == 3 and len(columns) == 40 and bool(columns.ready[:40].all())
    req = RouteRequest("r", 10, 100)
    assert least_expected_delay_columns(columns, req, RouteContext({}, 0)) == least_expected_delay(
        loads, req, RouteContext({}, 0)
    )
