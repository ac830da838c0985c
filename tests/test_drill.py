"""`fedctl drill`, small: a fault under closed-loop load through the whole federation, with the
issue's JSON keys and a PNG timeline (the real drills are longer; see docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from core.pki import Identity, Role
from tests.conftest import SITES, fedctl
from tests.test_federation import _config

KEYS = {
    "scenario",
    "requests_sent",
    "requests_ok",
    "requests_failed",
    "lost",
    "retries",
    "resumed",
    "detection_s",
    "recovery_s",
    "output_tokens_per_s_before",
    "output_tokens_per_s_during",
    "output_tokens_per_s_after",
}


SMALL = ["--open-requests", "60", "--output-mean", "40", "--warmup-s", "2", "--before-s", "2", "--after-s", "6"]


def _fedctl_drill(tmp_path: Path, scenario: str, *args: str) -> subprocess.CompletedProcess:
    out, png = tmp_path / "drill.json", tmp_path / "drill.png"
    return fedctl("drill", scenario, *SMALL, *args, "--json", str(out), "--png", str(png))


def _report(tmp_path: Path, proc: subprocess.CompletedProcess) -> dict:
    """The drill's JSON, once its run is checked: exit 0, a PNG, and its summary table last on
    stderr, saying what the JSON says was lost."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "drill.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "drill.json").read_text())
    table = proc.stderr[proc.stderr.rindex(f"fedctl drill {report['scenario']} ({report['site']})") :]
    assert f"{report['requests_failed']} failed, {report['lost']} lost" in table, table
    return report


def _drill(tmp_path: Path, scenario: str, *args: str, scheduler: str = "replicas: 2") -> dict:
    path, _ = _config(tmp_path, SITES, scheduler=scheduler)
    common = ["--config", str(path), "--speed", "10", "--heal-after-s", "3"]
    return _report(tmp_path, _fedctl_drill(tmp_path, scenario, *common, *args))


def _measured_against_truth(report: dict, sites: set[str]) -> None:
    """The estimator's keys, well formed: each site's capacity error a finite, non-negative
    mean and max over at least one bin (not how small: the real drills measure that), each
    site's truth said, and after ÷ surviving the ratio of the report's own two keys."""
    assert set(report["capacity_error"]) == sites, report["capacity_error"]
    for error in report["capacity_error"].values():
        assert set(error) == {"mean", "max", "bins"} and error["bins"] >= 1
        assert math.isfinite(error["max"]) and 0 <= error["mean"] <= error["max"]
    assert set(report["capacity_truth_before"]) <= sites and all(
        v > 0 for v in report["capacity_truth_before"].values()
    )
    ratio = report["output_tokens_per_s_after"] / report["surviving_tokens_per_s"]
    assert report["after_over_surviving"] == pytest.approx(ratio, abs=1e-4)


@pytest.mark.timeout(180)
def test_site_crash_drill_loses_nothing(tmp_path: Path) -> None:
    """Korea's agent and workers are killed under load: the crash is seen within a second, the
    requests it held are resumed or retried on the US site, and none is lost or failed. (Round
    robin keeps half the requests at Korea: with this light load, least expected delay sent it
    so few that at the crash it sometimes held none, and there was nothing to resume.)"""
    report = _drill(tmp_path, "site-crash", scheduler="replicas: 2, policy: round_robin")
    assert KEYS <= set(report) and report["policy"] == "round_robin"  # the config's, not the drill's default
    assert report["scenario"] == "site-crash" and report["site"] == "kr-mi300x"
    assert report["requests_sent"] > 60 and report["requests_failed"] == 0 and report["lost"] == 0, report["errors"]
    assert report["detection_s"] is not None and report["detection_s"] <= 1.0
    assert report["resumed"] + report["retries"] >= 1
    assert report["output_tokens_per_s_before"] > 0 and report["output_tokens_per_s_after"] > 0
    assert report["per_site_tokens_per_s_before"]["kr-mi300x"] > 0  # counted by the site that wrote them
    assert report["per_site_tokens_per_s_after"]["kr-mi300x"] == 0
    _measured_against_truth(report, {"kr-mi300x", "us-mi355x"})  # the crashed site: its bins before the crash
    assert report["capacity_truth_after"]["kr-mi300x"] == 0


@pytest.mark.timeout(180)
def test_a_running_federation_is_drilled_with_the_operators_command(tmp_path: Path, make_federation) -> None:
    """`--endpoint` drills a federation the drill did not start: the operator's `--inject`
    command kills Korea's agent, the drill finds the schedulers through the gateway's /health,
    sees the crash within a second, and no request is lost. It presents the operator's
    certificate it is given."""
    fed, _ = make_federation(scheduler="replicas: 2")
    agent = fed.child("agent kr-mi300x").proc.pid
    inject = f'test "$FEDCTL_DRILL_SITE" = kr-mi300x && kill -9 {agent}'
    proc = _fedctl_drill(
        tmp_path,
        "site-crash",
        *("--endpoint", fed.config.gateway_url, "--speed", "10", "--inject", inject),
        *fed.tls_flags(Identity(Role.OPERATOR)),  # what the operator presents to the schedulers
    )
    report = _report(tmp_path, proc)
    assert report["site"] == "kr-mi300x" and not fed.child("agent kr-mi300x").alive()
    assert report["requests_sent"] > 60 and report["requests_failed"] == 0 and report["lost"] == 0, report["errors"]
    assert report["detection_s"] is not None and report["detection_s"] <= 1.0
    assert report["per_site_tokens_per_s_after"]["kr-mi300x"] == 0
    # An operator's GPUs: no truth to measure the estimator against, and the report says so.
    assert report["capacity_error"] is None and "--endpoint" in report["capacity_error_note"]
    ratio = report["output_tokens_per_s_after"] / report["surviving_tokens_per_s"]
    assert report["after_over_surviving"] == pytest.approx(ratio, abs=1e-4)


@pytest.mark.timeout(180)
def test_a_site_that_joins_under_load_takes_its_share_and_fails_nothing(tmp_path: Path) -> None:
    """add-site: 8 emulated MI355X in eu-central-1 join the loaded federation; it is ready at
    the schedulers within the drill, is routed work, and no request fails; the report has the
    issue's keys."""
    # 30 GPU-s after the addition (3 s of wall time at speed 10): a slow machine's join took most
    # of 10 of them, and the newcomer had no tokens left to count in the window.
    report = _drill(tmp_path, "add-site", "--after-s", "30")
    assert KEYS | {"throughput_ratio", "converge_s", "standalone"} <= set(report)
    assert report["site"] == "eu-mi355x" and report["detection_s"] is not None
    assert report["requests_failed"] == 0 and report["lost"] == 0, report["errors"]
    assert report["per_site_tokens_per_s_after"]["eu-mi355x"] > 0
    assert set(report["standalone"]) == {"kr-mi300x", "us-mi355x", "eu-mi355x"}
    assert 0 < report["throughput_ratio"] <= 1.5
    # The new site is measured from 10 s after it joined, the others also before.
    _measured_against_truth(report, {"kr-mi300x", "us-mi355x", "eu-mi355x"})
    assert "eu-mi355x" not in report["capacity_truth_before"] and report["capacity_truth_after"]["eu-mi355x"] > 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["site-crash", "--endpoint", "http://127.0.0.1:9"], "needs --inject CMD"),
        (["drain", "--endpoint", "http://127.0.0.1:9", "--inject", "true"], "drain needs no --inject"),
        (["site-crash", "--inject", "true"], "--inject needs --endpoint"),
        (["add-site", "--site", "kr-mi300x"], "already in the federation"),
        (["worker-loss", "--config", "docs/configs/small-federation.yaml", "--site", "us-mi355x"], "has 1"),
        (["add-site", "--config", "docs/configs/small-federation.yaml"], "no `links` entry between eu-central-1"),
        (["cpu-starve", "--endpoint", "http://127.0.0.1:9"], "needs --inject CMD"),
        (["cpu-starve", "--starve-ms", "100"], "must be shorter than --starve-period-ms"),
        (["add-site", "--quick"], "--quick runs its own small federation"),
        (["site-crash", "--quick", "--endpoint", "http://127.0.0.1:9", "--inject", "true"], "not with add-site"),
    ],
)
def test_a_drill_that_cannot_be_run_says_why(args: list[str], said: str) -> None:
    """Arguments that make no drill are refused before anything starts, with the reason."""
    proc = fedctl("drill", *args, timeout_s=30)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scenario", ["site-blackhole", "all-workers-lost", "scheduler-blackhole"])
def test_silent_failures_lose_nothing(tmp_path: Path, scenario: str) -> None:
    """Packets dropped instead of refused (a site's WAN links; one scheduler replica, then all)
    and a site whose every worker dies while it holds a queue: each found, none lost or failed."""
    report = _drill(tmp_path, scenario)
    assert KEYS <= set(report) and report["scenario"] == scenario
    assert report["requests_sent"] > 60 and report["requests_failed"] == 0 and report["lost"] == 0, report["errors"]
    assert report["detection_s"] is not None
    if scenario.endswith("blackhole"):  # silence: no one can see it before a second of it
        assert report["detection_s"] >= 0.5, report["detection_s"]


@pytest.mark.timeout(180)
def test_a_starved_agent_loses_nothing_and_is_left_running(tmp_path: Path) -> None:
    """cpu-starve: the US site's agent is stopped (SIGSTOP) 40 ms of every 100 from the fault to
    the end of the load; no request fails or is lost, the site keeps a share of the tokens, its
    estimate is measured against its unchanged truth from 10 s on, and once the starving ends
    its agent is running (psutil's state, read by the drill before the federation stops)."""
    report = _drill(tmp_path, "cpu-starve", "--after-s", "14")
    assert KEYS <= set(report) and report["scenario"] == "cpu-starve" and report["site"] == "us-mi355x"
    assert report["requests_sent"] > 60 and report["requests_failed"] == 0 and report["lost"] == 0, report["errors"]
    assert report["agent_stops"] >= 50  # ~one every 100 ms for the 14 s of load after the fault
    assert report["agent_status_after"] not in (None, "stopped")
    assert 0 < report["site_share_before"] <= 1 and 0 < report["site_share_after"] <= 1
    _measured_against_truth(report, {"kr-mi300x", "us-mi355x"})
    assert report["site_capacity_error"] == report["capacity_error"]["us-mi355x"]
    assert report["capacity_error"]["us-mi355x"]["bins"] >= 3  # the before window's and after 10 s
    # Its GPUs lost nothing: its truth moves only with the mix it ran (each site's own, 5cacced).
    before, after = report["capacity_truth_before"]["us-mi355x"], report["capacity_truth_after"]["us-mi355x"]
    assert abs(after / before - 1) < 0.25, (before, after)
