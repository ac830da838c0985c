"""The Grafana board and the Prometheus scrape config in monitoring/ ask only for what the
processes serve: every metric a panel queries is a family of docs/METRICS.md, under Prometheus'
naming rules, and is in some process's /metrics on a live federation; every scrape job reaches
a process of docker-compose.yml on the port where it serves /metrics, checking the name on that
process's certificate and presenting an operator's.

The panels' PromQL is read with `promql-parser` (GreptimeDB's Rust PromQL parser, from PyPI),
not with a regex: the metric names are those of the vector selectors in the parsed expression,
so a function, a label or a legend is never taken for a metric, and a query that does not parse
fails the test.
"""

from __future__ import annotations

import json
import re
import ssl
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import promql_parser
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from core import pki
from core.config import load
from core.processes import PROJECT_ROOT, free_port_block
from federation.embedded import Federation
from tests.conftest import SITES
from tests.test_compose import _certificates, _compose, _federation
from tests.test_federation import MODEL, _config

DASHBOARD = PROJECT_ROOT / "monitoring/grafana/dashboards/federation.json"
SCRAPE_CONFIG = PROJECT_ROOT / "monitoring/prometheus.yml"
METRICS_DOC = PROJECT_ROOT / "docs/METRICS.md"
GRAFANA_RANGE = re.compile(r"\$(\{__(rate_interval|interval|range)\}|__(rate_interval|interval|range)\b)")
FAMILY_ROW = re.compile(r"^\| `(federation_\w+)` \| (counter|gauge|histogram) \|", re.MULTILINE)


def served_as(family: str, kind: str) -> set[str]:
    """The sample names a family is served as in Prometheus' text format: a counter `x_total`
    (or `x`, as a parser names its family) as `x_total`; a histogram `h` as `h_bucket`, `h_sum`
    and `h_count`; a gauge as itself."""
    if kind == "counter":
        return {family.removesuffix("_total") + "_total"}
    if kind == "histogram":
        return {f"{family}_bucket", f"{family}_sum", f"{family}_count"}
    return {family}


def _panels(dashboard: dict) -> Iterator[dict]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def queried(expr: str) -> list[str | None]:
    """The metric name of every vector selector in `expr` (None for one that names none), with
    Grafana's range variables read as a minute."""
    names: list[str | None] = []

    def visit(node: promql_parser.Expr) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            names.append(node.name)

    promql_parser.walk(promql_parser.parse(GRAFANA_RANGE.sub("1m", expr)), visit)
    return names


def _dashboard_metrics() -> dict[str, set[str]]:
    """Each panel's title and the metrics its queries read."""
    dashboard = json.loads(DASHBOARD.read_text())
    return {
        panel["title"]: {name for target in panel["targets"] for name in queried(target["expr"])}
        for panel in _panels(dashboard)
        if panel.get("targets")
    }


def test_every_panel_queries_documented_families() -> None:
    """Each panel reads the board's Prometheus through the datasource variable, with queries
    that parse, and every metric they select is served by a family in docs/METRICS.md (a
    histogram through its _bucket/_sum/_count series, never by its bare name)."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 38
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = list(_panels(dashboard))
    assert len({p["id"] for p in panels}) == len(panels)
    documented = {
        name for family, kind in FAMILY_ROW.findall(METRICS_DOC.read_text()) for name in served_as(family, kind)
    }
    assert "federation_gateway_ttft_seconds_bucket" in documented  # the table was read
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]
    for title, metrics in _dashboard_metrics().items():
        assert metrics, title
        assert None not in metrics, f"{title}: a selector that names no metric"
        assert metrics <= documented, f"{title}: {sorted(metrics - documented)} not in docs/METRICS.md"


def _flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def _metrics_port(command: list[str]) -> int | None:
    """Where a service of the compose file serves /metrics (docs/METRICS.md): a scheduler's or an
    agent's on --metrics-port; the gateway's on --admin-port when given, else its API port."""
    module = command[2]
    if module == "federation.gateway":
        return int(_flag(command, "--admin-port") or _flag(command, "--port") or 0) or None
    if module in ("scheduler", "nodes.agent"):
        port = _flag(command, "--metrics-port")
        return int(port) if port else None
    return None


def _mounted_file(service: dict, path: str, root: Path) -> Path:
    """The file on the host that `service` mounts at `path` (with the compose file's `.` as `root`)."""
    for volume in service["volumes"]:
        host, container, _ = volume.split(":")
        if container == path:
            return root / host.removeprefix("./")
    raise AssertionError(f"nothing mounted at {path}")


def test_every_scrape_job_reaches_a_process_where_it_serves_metrics(tmp_path: Path) -> None:
    """The scrape targets are exactly the compose file's processes that serve /metrics, each at
    its service name and metrics port; the HTTPS ones check the name on the certificate that
    service mounts as its own and present files Prometheus mounts: the CA's certificate and an
    operator's certificate and key. Only the gateway is scraped over plain HTTP."""
    _certificates(tmp_path)
    compose = _compose()
    services, prometheus = _federation(compose), compose["services"]["prometheus"]
    scrape = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert _mounted_file(prometheus, "/etc/prometheus/prometheus.yml", PROJECT_ROOT) == SCRAPE_CONFIG
    serving = {f"{name}:{_metrics_port(s['command'])}" for name, s in services.items() if _metrics_port(s["command"])}
    links = {name for name, s in services.items() if s["command"][2] == "federation.linkproxy"}
    assert {s.split(":")[0] for s in serving} == set(services) - links  # every scheduler replica, agent, gateway
    scraped = set()
    for job in scrape["scrape_configs"]:
        targets = [t for static in job["static_configs"] for t in static["targets"]]
        scraped |= set(targets)
        for target in targets:
            assert target in serving, f"{job['job_name']}: {target} is no process's /metrics"
            service = services[target.split(":")[0]]
            if job.get("scheme") != "https":
                assert service["command"][2] == "federation.gateway", f"{job['job_name']}: {target} over plain HTTP"
                continue
            tls = job["tls_config"]
            own = pki.holder(_mounted_file(service, "/tls/own.crt", tmp_path).read_bytes())
            assert tls["server_name"] == own.server_name, target
            assert _mounted_file(prometheus, tls["ca_file"], tmp_path) == tmp_path / "federation-ca" / pki.CA_CERT
            assert pki.holder(_mounted_file(prometheus, tls["cert_file"], tmp_path).read_bytes()) == pki.OPERATOR
            assert _mounted_file(prometheus, tls["key_file"], tmp_path).name == f"{pki.OPERATOR.common_name}.key"
    assert scraped == serving


def _with_metrics_ports(path: Path) -> dict[str, int]:
    """Give the config at `path` metrics ports (the scheduler's first replica's and each site's);
    returns them by process: "scheduler" and each site's name."""
    config = yaml.safe_load(path.read_text())
    first = free_port_block(1 + len(config["sites"]))
    config["scheduler"]["metrics_port"] = first
    for i, site in enumerate(config["sites"], start=1):
        site["metrics_port"] = first + i
    path.write_text(yaml.safe_dump(config))
    return {"scheduler": first, **{site["name"]: site["metrics_port"] for site in config["sites"]}}


async def _scrape(http: aiohttp.ClientSession, url: str, **tls: object) -> set[str]:
    """The sample names the /metrics at `url` serves, families with no sample yet included."""
    async with http.get(url, **tls) as resp:
        assert resp.status == 200, f"{url}: {resp.status}"
        text = await resp.text()
    return {name for family in text_string_to_metric_families(text) for name in served_as(family.name, family.type)}


@pytest.mark.timeout(120)
async def test_every_queried_metric_is_in_some_process_metrics(tmp_path: Path) -> None:
    """On a live federation, after one request, every metric a panel queries is served by the
    gateway's /metrics (HTTP) or a scheduler's or an agent's (HTTPS, with the operator's
    certificate of the federation's CA, checking each one's certificate name)."""
    path, _ = _config(tmp_path, SITES)
    ports = _with_metrics_ports(path)
    fed = Federation(load(path))
    try:
        fed.up()
        tls = ssl.create_default_context(cafile=fed.ca.directory / pki.CA_CERT)
        name = pki.OPERATOR.common_name
        tls.load_cert_chain(fed.ca.directory / f"{name}.crt", fed.ca.directory / f"{name}.key")
        host, served = fed.config.host, set()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True}
            async with http.post(fed.config.gateway_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()
            served |= await _scrape(http, fed.config.gateway_url + "/metrics")
            scheduler = pki.SCHEDULER.server_name
            served |= await _scrape(
                http, f"https://{host}:{ports['scheduler']}/metrics", ssl=tls, server_hostname=scheduler
            )
            for site, _, _ in SITES:
                agent = pki.Identity(pki.Role.SITE, site).server_name
                served |= await _scrape(http, f"https://{host}:{ports[site]}/metrics", ssl=tls, server_hostname=agent)
    finally:
        fed.down()
    for title, metrics in _dashboard_metrics().items():
        assert metrics <= served, f"{title}: {sorted(metrics - served)} served by no process"
