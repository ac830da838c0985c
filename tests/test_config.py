"""fedctl's configuration: the built-in default and clear errors for bad files."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import DEFAULT_YAML, ConfigError, parse
from core.processes import PROJECT_ROOT
from federation.bench.run import bench_config
from federation.gateway.__main__ import parse_args as gateway_args


def test_default_is_the_embedded_federation() -> None:
    """The default: two sites of 16 GPUs in Korea and Oregon, 130 ms apart, gateway on 8080."""
    c = parse(DEFAULT_YAML)
    assert [(s.name, s.region, s.gpu, s.gpus) for s in c.sites] == [
        ("kr-mi300x", "ap-northeast-2", "mi300x", 16),
        ("us-mi355x", "us-west-2", "mi355x", 16),
    ]
    assert c.gateway.port == 8080 and c.rtt_between("us-west-2", "ap-northeast-2") == 130.0


BAD_CONFIGS = [
    ("gateway: 8080", "gateway: Input should be a valid dictionary"),
    ("gateway: {port: http}", "gateway.port: Input should be a valid integer"),
    ("gateway: {port: 70000}", "gateway.port: Input should be less than or equal to 65535"),
    (
        "sites: [{name: a, region: r, gpu: h100, gpus: 1, agent_port: 1}]",
        "sites[0].gpu: Input should be 'mi300x' or 'mi355x'",
    ),
    (
        "sites: [{name: a, region: r, gpu: mi300x, gpus: 0, agent_port: 1}]",
        "sites[0].gpus: Input should be greater than or equal to 1",
    ),
    (
        "sites: [{name: a, region: r, gpu: mi300x, gpus: '2', agent_port: 1}]",
        "sites[0].gpus: Input should be a valid integer",
    ),
    (
        "sites: [{name: a, region: r, gpu: mi300x, gpus: 2, agent_port: 1, readers: -1}]",
        "sites[0].readers: Input should be greater than or equal to 0",
    ),
    ("sites: []", "sites: List should have at least 1 item"),
    ("links: [{between: [a], rtt_ms: 5}]", "links[0].between[1]: Field required"),
    ("{{{", "not valid YAML"),
    ("scheduler: {policy: fastest}", "scheduler.policy must be one of"),
    ("speed: true", "speed: Input should be a valid number"),
    ("gatewya: {port: 8080}", "gatewya: Extra inputs are not permitted"),  # a typo is not a default
    ("timings: {agent: {coalesce_s: 0}}", "timings.agent.coalesce_s: Input should be greater than 0"),
    ("timings: {gateway: {route_timout_s: 5}}", "timings.gateway.route_timout_s: Unexpected keyword argument"),
    ("scheduler: {replicas: 2, addresses: [a:1]}", "scheduler.addresses names 1, one per replica (2)"),
    ("scheduler: {addresses: [nowhere]}", "scheduler.addresses[0]: 'nowhere' is not host:port"),
    (
        "sites: [{name: a, region: r, gpu: mi300x, gpus: 1, agent_port: 1, workers: docker}]",
        "sites[0].workers",
    ),
    ("tls: {ca: ca.crt}", "tls.certs: Field required"),
]


@pytest.mark.parametrize(("text", "fragment"), BAD_CONFIGS)
def test_bad_configs_are_explained(text: str, fragment: str) -> None:
    """Each malformed config raises ConfigError naming the problem."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse(text)


def _fedctl_up(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "federation.cli", "up", "--config", str(config)],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_fedctl_reports_a_bad_config_without_a_traceback(tmp_path: Path) -> None:
    """`fedctl up --config BAD` exits 2 with one line saying what is wrong."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("gateway: 8080\nsites: [{name: a, gpus: 0}]\n")  # three problems, one line
    proc = _fedctl_up(bad)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "gateway: Input should be a valid dictionary" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (  # an agent on the gateway's port
            "sites: [{name: a, region: us-west-2, gpu: mi300x, gpus: 1, agent_port: 8080}]",
            "port 8080 is both the gateway's and a's agent's",
        ),
        (  # worker blocks that overlap
            "sites: [{name: a, region: us-west-2, gpu: mi300x, gpus: 4, agent_port: 9000, worker_port: 9100},"
            " {name: b, region: us-west-2, gpu: mi300x, gpus: 2, agent_port: 9001, worker_port: 9103}]",
            "port 9103 is both a's worker 3's and b's worker 0's",
        ),
        (  # the second scheduler replica on an agent's port
            "scheduler: {port: 50051, replicas: 2}\n"
            "sites: [{name: a, region: us-west-2, gpu: mi300x, gpus: 1, agent_port: 50052}]",
            "port 50052 is both scheduler replica 1's and a's agent's",
        ),
        (  # a region the links do not reach: not a silent 0-ms round trip
            "sites: [{name: a, region: sa-east-1, gpu: mi300x, gpus: 1, agent_port: 9000}]",
            "no `links` entry between sa-east-1 and us-west-2",
        ),
    ],
)
def test_clashes_and_missing_links_are_refused_when_read(text: str, fragment: str) -> None:
    """What would fail half-way through start-up (or run at a made-up 0 ms) fails when the file is read."""
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        parse("gateway: {port: 8080, region: us-west-2}\n" + text)


def test_fedctl_up_with_a_port_clash_exits_2_and_leaves_nothing_running(tmp_path: Path) -> None:
    """One line, exit 2, and no child process started."""
    bad = tmp_path / "clash.yaml"
    bad.write_text(
        "gateway: {port: 18080, region: us-west-2}\nscheduler: {port: 18051}\n"
        "sites: [{name: a, region: us-west-2, gpu: mi300x, gpus: 1, agent_port: 18051}]\n"
    )
    proc = _fedctl_up(bad)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "port 18051" in proc.stderr and "Traceback" not in proc.stderr
    assert subprocess.run(["pgrep", "-f", str(bad)], capture_output=True).returncode == 1  # none left


def test_control_server_stops_even_if_it_never_started(tmp_path: Path) -> None:
    """`fedctl up` failing before it serves its control socket still cleans it up (it used to hang)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path; from federation.control import ControlServer; "
            f"ControlServer(Path({str(tmp_path / 'c.sock')!r}), lambda r: {{}}).stop()",
        ],
        cwd=PROJECT_ROOT,
        timeout=20,
    )
    assert proc.returncode == 0 and not (tmp_path / "c.sock").exists()


def test_a_slowed_federation_stretches_the_data_path_not_the_control_plane() -> None:
    """At a twentieth of real speed the tokens' WAN round trips are 20 x longer (a wall second is
    a twentieth of a GPU second on their way), but the control plane's clocks are not slowed, so
    its links (sites' reports to the schedulers) keep the real round trip: a crashed Korean site
    is seen down as soon after the crash as it would be."""
    config = bench_config(None, 0.05, "least_expected_delay", 1)
    assert config.rtt_between("ap-northeast-2", "us-west-2") == 2600.0
    assert config.control_rtt_between("ap-northeast-2", "us-west-2") == 130.0
    assert parse(DEFAULT_YAML).control_rtt_between("ap-northeast-2", "us-west-2") == 130.0


SITE_A = "sites: [{name: a, region: us-west-2, gpu: mi300x, gpus: 1, agent_port: 9000}]\n"


def test_an_open_gateway_beyond_loopback_is_refused_unless_asked_for(capsys) -> None:
    """A gateway on every interface without API keys would serve anyone who reaches the port:
    the file is refused, and so is the gateway's command line (exit 2, one message naming the
    way out), unless keys are given or it is told to run open."""
    with pytest.raises(ConfigError, match=re.escape("gateway.open: true")):
        parse("host: 0.0.0.0\ngateway: {port: 8080, region: us-west-2}\n" + SITE_A)
    assert parse("host: 0.0.0.0\ngateway: {port: 8080, region: us-west-2, open: true}\n" + SITE_A).gateway.open
    assert not parse("host: ::1\ngateway: {port: 8080, region: us-west-2}\n" + SITE_A).gateway.open
    base = ["--scheduler", "127.0.0.1:50051", "--insecure"]
    for host in ("0.0.0.0", "10.1.2.3", "gw.example.net"):
        with pytest.raises(SystemExit) as exited:
            gateway_args([*base, "--host", host])
        assert exited.value.code == 2 and "--open" in capsys.readouterr().err
    assert gateway_args([*base, "--host", "0.0.0.0", "--open"]).open
    assert not gateway_args([*base, "--host", "localhost"]).open
