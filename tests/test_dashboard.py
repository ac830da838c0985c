"""`fedctl dashboard` in a real browser: a federation, the dashboard as its own process, and
Debian's headless Chromium driven by selenium through the system chromedriver (nothing is
downloaded at run time). The page must show both sites with their capacity, follow a
`fedctl site drain` within 3 s, load nothing from elsewhere, and take a drill's marks while
refusing what is not one."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from core import wire
from core.config import load
from core.processes import Child, start_python
from federation.admin import fetch_state
from federation.dashboard.board import Board
from federation.dashboard.gateway_scrape import parse
from federation.dashboard.latency import Histogram, quantile
from federation.drills.dashboard_marks import DashboardMarks
from federation.embedded import Federation
from tests.conftest import SITES, fedctl
from tests.test_federation import _config

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
needs_chromium = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)",
)
PAGE_WAIT_S = 10.0  # the first state and the first rates, on a slow CI machine
DRAIN_SEEN_WITHIN_S = 3.0  # the bound: from the drain command's return to the page


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Federation]]:
    """A small federation (4 GPUs a site, 10x speed) and `fedctl dashboard` watching it."""
    path, _ = _config(tmp_path_factory.mktemp("dashboard"), SITES)
    federation = Federation(load(path))
    board: Child | None = None
    try:
        federation.up()
        board = start_python("fedctl dashboard", "federation.cli", ["dashboard", "--config", str(path), "--port", "0"])
        yield str(board.ready["dashboard"]), path, federation
    finally:
        if board is not None:
            assert board.stop() == 0
        federation.down()


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    # The driver's path given: selenium-manager (which would download one) never runs.
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


# The page as it is at one instant (it re-renders its rows on every push, so elements found
# one by one may be gone by the time they are read).
READ_PAGE = """
const rows = {};
for (const row of document.querySelectorAll("tr[data-site]")) {
  rows[row.dataset.site] = {};
  for (const cell of row.querySelectorAll("td[data-field]")) rows[row.dataset.site][cell.dataset.field] = cell.textContent;
}
const events = [...document.querySelectorAll("#events li")].map((item) => [item.dataset.kind, item.textContent]);
return { rows, events };
"""


def _page(browser: webdriver.Chrome) -> tuple[dict[str, dict[str, str]], list[tuple[str, str]]]:
    """Each site's cells by field, and the events as (kind, text)."""
    read = browser.execute_script(READ_PAGE)
    return read["rows"], [tuple(event) for event in read["events"]]


def _post(url: str, body: bytes, content_type: str = "application/json") -> int:
    request = urllib.request.Request(url + "/api/mark", body, {"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


@needs_chromium
@pytest.mark.timeout(60)
def test_the_page_shows_both_sites_and_a_drain_within_3_s(dashboard, browser) -> None:
    """Both sites appear with their measured and declared capacity and a share of it; after
    `fedctl site drain kr-mi300x` returns, the page says it is draining, its capacity share is
    0 % and the US site's 100 %, and the drain is in the events, within 3 s and no reload."""
    url, path, federation = dashboard
    state = fetch_state(federation.config.scheduler_addresses[0], federation.operator)
    priors = {s.name: f"{s.prior_capacity_tok_s:,.0f}" for s in state.sites}
    browser.get(url)

    def shown(site: str) -> bool:
        row = _page(browser)[0].get(site, {})
        measured, _, prior = row.get("capacity", "").partition(" / ")
        return (
            row.get("state") == "ready"
            and prior == priors[site]
            and float(measured.replace(",", "") or 0) > 0
            and row.get("capacity_share", "").endswith("%")
        )

    WebDriverWait(browser, PAGE_WAIT_S, poll_frequency=0.1).until(lambda _: all(shown(s) for s, _, _ in SITES))
    rows, _ = _page(browser)
    assert rows["kr-mi300x"]["capacity_share"] != "0.0 %"
    assert rows["kr-mi300x"]["gpus"] == "4 × MI300X"

    drained = fedctl("site", "drain", "kr-mi300x", "--config", str(path), timeout_s=30)
    assert drained.returncode == 0, drained.stderr

    def drain_shown(_: object) -> bool:
        rows, events = _page(browser)
        return (
            rows["kr-mi300x"]["state"] == "draining"
            and rows["kr-mi300x"]["capacity_share"] == "0.0 %"
            and rows["us-mi355x"]["capacity_share"] == "100.0 %"
            and any(kind == "drain" and "kr-mi300x draining" in text for kind, text in events)
        )

    WebDriverWait(browser, DRAIN_SEEN_WITHIN_S, poll_frequency=0.05).until(drain_shown)


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found += [value for name, value in attrs if name in ("src", "href") and value]


@needs_chromium
@pytest.mark.timeout(60)
def test_every_asset_comes_from_the_dashboard(dashboard, browser) -> None:
    """The HTML names only the dashboard's own paths, each of them is served, and what the
    browser actually loaded came from the dashboard's address and nowhere else."""
    url, _, _ = dashboard
    with urllib.request.urlopen(url + "/", timeout=5) as resp:
        html = resp.read().decode()
    links = _Links()
    links.feed(html)
    assert {"/static/uPlot.iife.min.js", "/static/dashboard.js"} <= set(links.found)
    for link in links.found:
        assert link.startswith("/") and not link.startswith("//"), link
        with urllib.request.urlopen(url + link, timeout=5) as resp:
            assert resp.status == 200
    browser.get(url)
    WebDriverWait(browser, PAGE_WAIT_S).until(lambda b: b.find_elements(By.CSS_SELECTOR, "#timeline canvas"))
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(name.startswith(url + "/") for name in loaded), loaded


@needs_chromium
@pytest.mark.timeout(60)
def test_marks_are_taken_and_bad_ones_refused(dashboard, browser, capsys: pytest.CaptureFixture[str]) -> None:
    """A drill's mark (posted as `fedctl drill --dashboard` posts it) shows on the page; a body
    that is not JSON, not a mark, too large or not sent as JSON is refused; a dashboard that
    cannot be reached fails nothing."""
    url, _, _ = dashboard
    now = time.time()
    assert _post(url, b'{"label": "cut"') == 400
    assert _post(url, json.dumps({"label": "x", "at_unix_s": now, "more": 1}).encode()) == 400
    assert _post(url, json.dumps({"label": "", "at_unix_s": now}).encode()) == 400
    assert _post(url, json.dumps({"label": "x", "at_unix_s": "now"}).encode()) == 400
    assert _post(url, json.dumps({"label": "x" * 5000, "at_unix_s": now}).encode()) == 413
    assert _post(url, json.dumps({"label": "x", "at_unix_s": now}).encode(), "text/plain") == 415
    browser.get(url)
    marks = DashboardMarks(url)
    marks.mark("site-crash (kr-mi300x)")
    marks.wait()
    WebDriverWait(browser, PAGE_WAIT_S, poll_frequency=0.1).until(
        lambda _: any(kind == "mark" and text.endswith("site-crash (kr-mi300x)") for kind, text in _page(browser)[1])
    )
    nowhere = DashboardMarks("http://127.0.0.1:9")  # the discard port: nothing listens
    nowhere.mark("lost")
    nowhere.wait()
    assert "mark 'lost' not posted to http://127.0.0.1:9/api/mark" in capsys.readouterr().err


SCRAPE = """\
# TYPE federation_gateway_output_tokens_total counter
federation_gateway_output_tokens_total{{site="kr-mi300x"}} {kr}
federation_gateway_output_tokens_total{{site="us-mi355x"}} {us}
# TYPE federation_gateway_resumed_total counter
federation_gateway_resumed_total {resumed}
# TYPE federation_gateway_ttft_seconds histogram
federation_gateway_ttft_seconds_bucket{{site="us-mi355x",le="0.1"}} {fast}
federation_gateway_ttft_seconds_bucket{{site="us-mi355x",le="1.0"}} {total}
federation_gateway_ttft_seconds_bucket{{site="us-mi355x",le="+Inf"}} {total}
federation_gateway_ttft_seconds_count{{site="us-mi355x"}} {total}
federation_gateway_ttft_seconds_sum{{site="us-mi355x"}} 1.0
"""


def _site(name: str, region: str, status: wire.SiteStatus, capacity_tok_s: float) -> wire.SiteState:
    return wire.SiteState(name, region, "mi300x", 4, "", status, capacity_tok_s, 0, 0, 0, 4, 4, 0.0)


def test_rates_shares_resumes_and_percentiles_from_two_scrapes() -> None:
    """Two scrapes a second apart: each site's tokens/s is its counter's increase and its share
    of the tokens follows; a draining site has no share of the capacity; a jump of the resumed
    counter is an event; TTFT percentiles come from the observations between the scrapes only
    (90 of 100 under 0.1 s: p50 inside the first bucket, p99 inside the second), and a site
    without the histogram has none."""
    board = Board(load(), "http://127.0.0.1:8080")
    sites = (
        _site("kr-mi300x", "ap-northeast-2", wire.SiteStatus.DRAINING, 100.0),
        _site("us-mi355x", "us-west-2", wire.SiteStatus.READY, 300.0),
    )
    assert board.on_state(wire.FederationState(sites, "m"), "127.0.0.1:50051", 999.0) == []
    first = parse(SCRAPE.format(kr=100, us=0, resumed=2, fast=1000, total=1000), 1000.0)
    second = parse(SCRAPE.format(kr=400, us=900, resumed=5, fast=1090, total=1100), 1001.0)
    assert board.on_scrape(first) == (None, [])
    point, events = board.on_scrape(second)
    assert point is not None and point.tok_s == {"kr-mi300x": 300.0, "us-mi355x": 900.0}
    assert [(e.kind, e.label) for e in events] == [("resume", "3 resumed")]
    rows = {row["name"]: row for region in board.view()["regions"] for row in region["sites"]}
    assert (rows["kr-mi300x"]["token_share"], rows["us-mi355x"]["token_share"]) == (0.25, 0.75)
    assert (rows["kr-mi300x"]["capacity_share"], rows["us-mi355x"]["capacity_share"]) == (0.0, 1.0)
    assert rows["us-mi355x"]["ttft_p50_s"] == pytest.approx(0.1 * 50 / 90)
    assert rows["us-mi355x"]["ttft_p99_s"] == pytest.approx(0.1 + 0.9 * (99 - 90) / 10)
    assert "ttft_p50_s" not in rows["kr-mi300x"]
    assert quantile(0.99, Histogram(((0.1, 0.0), (float("inf"), 0.0)))) is None
    assert quantile(0.99, Histogram(((0.1, 0.0), (float("inf"), 5.0)))) == 0.1  # past the last bound
