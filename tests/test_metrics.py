"""Every process's /metrics (docs/METRICS.md), read as Prometheus reads them: the schedulers'
and agents' over mutual TLS with an operator's certificate, refused to anyone else."""

from __future__ import annotations

import ssl
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core import pki
from core.config import load
from core.metrics_endpoint import client_ssl_context
from core.pki import OPERATOR, SCHEDULER, Identity, Role
from core.processes import free_port_block
from federation.embedded import Federation

MODEL = "openai/gpt-oss-120b"
SITES = (("kr-mi300x", "ap-northeast-2", "mi300x"), ("us-mi355x", "us-west-2", "mi355x"))


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Federation]:
    first = free_port_block(4 + 2 * 3)
    lines = [
        f"model: {MODEL}",
        "speed: 10",
        f"gateway: {{port: {first}, region: us-west-2}}",
        f"scheduler: {{port: {first + 1}, region: us-west-2, metrics_port: {first + 2}}}",
        "links: [{between: [ap-northeast-2, us-west-2], rtt_ms: 20}]",
        "sites:",
    ]
    for i, (name, region, gpu) in enumerate(SITES):
        port = first + 4 + 3 * i
        lines.append(
            f"  - {{name: {name}, region: {region}, gpu: {gpu}, gpus: 2, agent_port: {port}, "
            f"metrics_port: {port + 1}, worker_port: {first + 10 + 2 * i}}}"
        )
    path = tmp_path_factory.mktemp("metrics") / "federation.yaml"
    path.write_text("\n".join(lines) + "\n")
    federation = Federation(load(path))
    federation.up()
    yield federation
    federation.down()


def _families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def _value(samples: list, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def _scrape(url: str, context: ssl.SSLContext | None, server: Identity | None) -> tuple[int, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        async with http.get(url, ssl=context, server_hostname=server.server_name if server else None) as resp:
            return resp.status, await resp.text()


def _tls_of(fed: Federation, identity: Identity) -> ssl.SSLContext:
    assert fed.ca is not None
    creds = fed.ca.tls(identity).creds
    assert creds is not None
    return client_ssl_context(creds)


async def test_every_process_says_what_it_did(fed: Federation) -> None:
    """After a few answers: the scheduler counted its routes and shows both sites with their
    capacity; each agent counted what it relayed; the gateway timed the Route, the first chunk
    and the tokens after it, per site."""
    client = openai.AsyncOpenAI(base_url=fed.config.gateway_url + "/v1", api_key="unused")
    for i in range(6):
        await client.completions.create(
            model=MODEL, prompt=f"story {i}", max_tokens=20, extra_body={"ignore_eos": True}
        )
    operator = _tls_of(fed, OPERATOR)
    c = fed.config
    status, text = await _scrape(f"https://{c.host}:{c.scheduler.metrics_port}/metrics", operator, SCHEDULER)
    assert status == 200
    scheduler = _families(text)
    routes = scheduler["federation_scheduler_routes"]
    assert _value(routes, "federation_scheduler_routes_total", outcome="routed") >= 6
    assert (
        _value(
            scheduler["federation_scheduler_route_decision_seconds"],
            "federation_scheduler_route_decision_seconds_count",
        )
        >= 6
    )
    capacity = scheduler["federation_scheduler_site_capacity_tokens_per_second"]
    for name, *_ in SITES:
        assert _value(capacity, "federation_scheduler_site_capacity_tokens_per_second", site=name) > 0
        assert (
            _value(
                scheduler["federation_scheduler_site_state"],
                "federation_scheduler_site_state",
                site=name,
                state="ready",
            )
            == 1
        )
    _assert_cpu(scheduler["federation_scheduler_cpu_seconds"], "federation_scheduler_cpu_seconds_total")
    relayed = 0.0
    for site in c.sites:
        status, text = await _scrape(
            f"https://{c.host}:{site.metrics_port}/metrics", operator, Identity(Role.SITE, site.name)
        )
        assert status == 200
        agent = _families(text)
        relayed += _value(agent["federation_agent_relayed_tokens"], "federation_agent_relayed_tokens_total")
        workers = agent["federation_agent_workers"]
        assert _value(workers, "federation_agent_workers", health="healthy") == 2
        _assert_cpu(agent["federation_agent_cpu_seconds"], "federation_agent_cpu_seconds_total", site=site.name)
    assert relayed >= 6 * 20  # the calibration probes' tokens too
    async with aiohttp.ClientSession() as http:
        async with http.get(c.gateway_url + "/metrics") as resp:
            gateway = _families(await resp.text())
    ttft = gateway["federation_gateway_ttft_seconds"]
    assert _value(ttft, "federation_gateway_ttft_seconds_count") == 6
    assert _value(gateway["federation_gateway_tpot_seconds"], "federation_gateway_tpot_seconds_count") == 6
    assert _value(gateway["federation_gateway_route_seconds"], "federation_gateway_route_seconds_count") == 6
    assert _value(gateway["federation_gateway_degraded"], "federation_gateway_degraded") == 0
    _assert_cpu(gateway["federation_gateway_cpu_seconds"], "federation_gateway_cpu_seconds")


def _assert_cpu(samples: list, name: str, **labels: str) -> None:
    """A process's CPU: its event loop's thread (what runs on one core) within the whole process's."""
    loop, process = (_value(samples, name, part=part, **labels) for part in ("loop", "process"))
    assert 0 < loop <= process, (loop, process)


@pytest.mark.parametrize("caller", ["gateway", "site", "none"])
async def test_only_operators_read_a_schedulers_or_agents_metrics(fed: Federation, caller: str) -> None:
    """A gateway's or a site's certificate gets a 403; no certificate gets no TLS session;
    plain HTTP gets nothing."""
    c = fed.config
    urls = [
        (f"{c.host}:{c.scheduler.metrics_port}", SCHEDULER),
        (f"{c.host}:{c.sites[0].metrics_port}", Identity(Role.SITE, c.sites[0].name)),
    ]
    for address, server in urls:
        if caller == "none":
            assert fed.ca is not None
            bare = ssl.create_default_context(cafile=str(fed.ca.directory / pki.CA_CERT))
            with pytest.raises(aiohttp.ClientError):
                await _scrape(f"https://{address}/metrics", bare, server)
            with pytest.raises(aiohttp.ClientError):
                await _scrape(f"http://{address}/metrics", None, None)
            continue
        identity = Identity(Role.GATEWAY) if caller == "gateway" else Identity(Role.SITE, c.sites[1].name)
        status, text = await _scrape(f"https://{address}/metrics", _tls_of(fed, identity), server)
        assert status == 403 and "federation_" not in text
