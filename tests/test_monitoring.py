"""The Grafana board in monitoring/ asks only for what the processes serve: every metric a panel
queries is a family of docs/METRICS.md, under Prometheus' naming rules.

The panels' PromQL is read with `promql-parser` (GreptimeDB's Rust PromQL parser, from PyPI),
not with a regex: the metric names are those of the vector selectors in the parsed expression,
so a function, a label or a legend is never taken for a metric, and a query that does not parse
fails the test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import promql_parser

from core.processes import PROJECT_ROOT

DASHBOARD = PROJECT_ROOT / "monitoring/grafana/dashboards/federation.json"
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
