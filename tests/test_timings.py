"""Each component's waits come from one frozen settings object, set from the config file's
`timings:` section: a process started with other timings behaves by them, and a wrong one is
refused at start with the field named."""

from __future__ import annotations

import subprocess
import sys

import grpc

from core import wire
from core.config import DEFAULT_YAML, parse
from core.deployment import timings_args
from core.processes import PROJECT_ROOT, free_port_block, start_python
from core.settings import SchedulerTimings, to_json
from federation.embedded import Federation


def test_a_scheduler_tells_sites_the_report_interval_it_was_given() -> None:
    """The scheduler's report interval (what a registering site is told) is its timings'."""
    port = free_port_block(1)
    timings = SchedulerTimings(report_interval_s=0.4, heartbeat_timeout_s=1.6)
    scheduler = start_python(
        "scheduler", "scheduler", ["--insecure", "--port", str(port), "--timings", to_json(timings)]
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            registration = wire.SiteRegistration("s", "r", "mi300x", 1, "127.0.0.1:9", "openai/gpt-oss-120b")
            answer = wire.SchedulerStub(channel).RegisterSite(wire.registration_to_pb(registration), timeout=10)
        assert answer.report_interval_s == 0.4
    finally:
        scheduler.stop(10)


def test_a_wrong_timing_is_refused_at_start_with_its_name() -> None:
    cases = [
        (
            ["scheduler", "--insecure", "--timings", '{"heartbeat_timeout_s": -1}'],
            "heartbeat_timeout_s: Input should be greater than 0",
        ),
        (
            ["federation.gateway", "--insecure", "--scheduler", "127.0.0.1:1", "--timings", '{"route_timout_s": 1}'],
            "route_timout_s",
        ),
        (
            ["nodes.agent", "--insecure", "--site", "s", "--timings", '{"reader_beat_s": 6.0}'],
            "reader_silent_s must exceed two reader_beat_s",
        ),
        (
            ["scheduler", "--insecure", "--timings", '{"max_skipped_checks": 0}'],
            "max_skipped_checks: Input should be greater than or equal to 1",
        ),
    ]
    for (module, *args), message in cases:
        done = subprocess.run(
            [sys.executable, "-m", module, *args], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        assert message in done.stderr and "Traceback" not in done.stderr


def test_the_config_file_sets_what_each_process_is_started_with() -> None:
    """Only a component whose timings the file changes gets `--timings`, with every field."""
    config = parse(
        "gateway: {region: r}\ntimings: {agent: {coalesce_s: 0.05}}\n"
        "sites: [{name: a, region: r, gpu: mi300x, gpus: 1, agent_port: 9000}]"
    )
    assert timings_args(config.timings.gateway) == [] and timings_args(config.timings.scheduler) == []
    flag, value = timings_args(config.timings.agent)
    assert flag == "--timings" and '"coalesce_s": 0.05' in value and '"health_interval_s": 1.0' in value


def test_pings_to_the_schedulers_outlive_the_longest_control_link() -> None:
    """A ping unanswered for less than the round trip would fail every healthy connection on a
    long link (a 1.5-s one dropped Korea's reports at once): the embedded federation raises the
    agents' and the gateway's ping timeouts past its longest control link."""
    config = parse(
        "gateway: {region: us-west-2}\nlinks: [{between: [ap-northeast-2, us-west-2], rtt_ms: 1500}]\n"
        "sites: [{name: a, region: ap-northeast-2, gpu: mi300x, gpus: 1, agent_port: 9000}]"
    )
    timings = Federation(config).config.timings
    assert timings.agent.scheduler_ping_s == 2.5 and timings.gateway.scheduler_ping_s == 2.5
    assert Federation(parse(DEFAULT_YAML)).config.timings.agent.scheduler_ping_s == 1.23  # 230 ms, Korea-Frankfurt
