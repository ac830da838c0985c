"""Failover without loss, through real processes: a stream cut mid-answer by a site crash is
resumed on the other site; a site whose link to the gateway is cut is retried around before
the first token; a site's 4xx never counts against it; scheduler replicas fail over, and with
none left the gateway routes from the last state it saw (degraded)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from core import tokens, wire
from core.pki import Identity, Role
from core.processes import free_port_block, start_python
from federation import admin
from federation.drills.faults import poll_until
from federation.drills.sampler import gateway_counters, site_tokens
from federation.embedded import Federation
from tests.conftest import KOREAN, SITES, fedctl
from tests.test_federation import MODEL

GATEWAY = Identity(Role.GATEWAY)


def _endpoint(fed: Federation) -> str:
    return fed.config.gateway_url


def _counter(fed: Federation, name: str) -> float:
    return gateway_counters(_endpoint(fed) + "/metrics").get(name, 0.0)


@pytest.mark.timeout(120)
async def test_stream_cut_by_a_site_crash_completes_on_the_other_site(make_federation) -> None:
    """A streamed completion whose site is killed mid-answer (agent and workers) goes on from
    the other site: the client's one stream holds exactly the tokens usage reports, all 600 it
    asked for, and the gateway counts one resumed stream, and the tokens each site wrote. The
    two sites load the model in two weight formats (their recipes'): the answer resumes by its
    token ids across them. (A Korean client: the answer begins at the slower site, which is
    killed, and the rest comes from the faster one, in a quarter of the time the other way
    round takes.)"""
    fed, _ = make_federation(speed=1)
    formats = {
        s.name: (s.weight_format, s.checkpoint)
        for s in admin.fetch_state(fed.config.scheduler_addresses[0], fed.operator).sites
    }
    assert formats == {"kr-mi300x": ("fp8", "lmsys/gpt-oss-120b-bf16"), "us-mi355x": ("mxfp4", MODEL)}
    async with openai.AsyncOpenAI(base_url=_endpoint(fed) + "/v1", api_key="unused", max_retries=0) as client:
        raw = await client.completions.with_raw_response.create(
            model=MODEL,
            prompt="Tell me about rivers.",
            max_tokens=600,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers=KOREAN,
        )
        site = raw.headers["x-federation-site"]
        text, usage, finish, killed = "", None, None, False
        async for event in raw.parse():
            if event.choices:
                text += event.choices[0].text
                finish = event.choices[0].finish_reason or finish
            if event.usage:
                usage = event.usage
            if text and not killed:
                fed.child(f"agent {site}").proc.send_signal(signal.SIGKILL)
                killed = True
    assert killed and usage is not None
    assert usage.completion_tokens == 600 == len(tokens.encode(text))
    assert finish == "length"
    assert _counter(fed, "federation_gateway_resumed_total") == 1
    by_site = site_tokens(gateway_counters(_endpoint(fed) + "/metrics"))
    other = next(name for name, _, _ in SITES if name != site)
    assert by_site[site] > 0 and by_site[other] > 0 and by_site[site] + by_site[other] == 600, by_site


@pytest.mark.timeout(120)
async def test_streams_cut_by_a_dead_worker_continue_at_the_same_site(make_federation) -> None:
    """A site whose worker is killed mid-answer is not a failed site: its agent stops using the
    worker, and the cut streams continue at once on the site's other workers, with exact usage,
    no retry, and no circuit opened (the one site here could not be avoided anyway). The agent
    launched its workers (`--launch`, as `fedctl up` does): it starts the dead one again, and
    the site is back to every worker healthy, its capacity whole."""
    fed, _ = make_federation(speed=1, sites=[("us-mi355x", "us-west-2", "mi355x")], launch=True)
    site = next(s for s in fed.config.sites if s.name == "us-mi355x")
    agent = psutil.Process(fed.child("agent us-mi355x").pid)
    worker = next(p for p in agent.children() if str(site.worker_port) in p.cmdline())
    # Ready once one worker is up and probed; every stream must find this one up too.
    assert poll_until(lambda: _site_state(fed).healthy_workers == 4, 30.0) is not None
    started, begun = asyncio.Event(), set()  # every stream has its first tokens: none is retried
    async with openai.AsyncOpenAI(base_url=_endpoint(fed) + "/v1", api_key="unused", max_retries=0) as client:

        async def one() -> tuple[str, int]:
            stream = await client.completions.create(
                model=MODEL,
                prompt="Tell me about rivers.",
                max_tokens=300,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage = "", 0
            async for event in stream:
                if event.choices:
                    text += event.choices[0].text
                    begun.add(id(stream))
                    if len(begun) == 6:
                        started.set()
                if event.usage:
                    usage = event.usage.completion_tokens
            return text, usage

        answers = asyncio.gather(*(one() for _ in range(6)))
        await started.wait()
        worker.kill()
        for text, usage in await answers:
            assert usage == 300 == len(tokens.encode(text))
    assert _counter(fed, "federation_gateway_resumed_total") >= 1
    assert _counter(fed, "federation_gateway_retries_total") == 0
    assert _counter(fed, "federation_gateway_requests_total{outcome=ok}") == 6  # none failed

    assert poll_until(lambda: _site_state(fed).healthy_workers == 4, 30.0) is not None
    back = _site_state(fed)  # its capacity is the measured estimate's whole, not 3/4 of it
    assert (back.total_workers, back.loading_workers, back.status) == (4, 0, wire.SiteStatus.READY)
    workers = [p.pid for p in agent.children() if "nodes.emulator" in p.cmdline()]
    assert worker.pid not in workers and len(workers) == 4  # started again


def _site_state(fed: Federation, name: str = "us-mi355x") -> wire.SiteState:
    state = admin.fetch_state(fed.config.scheduler_addresses[0], fed.operator)
    return next(s for s in state.sites if s.name == name)


@pytest.mark.timeout(120)
async def test_a_worker_that_cannot_be_reached_is_left_for_another(make_federation, capfd) -> None:
    """Requests sent to a worker whose port closed before its health check noticed cannot
    connect: the agent gives each to another of its workers, as if new. Neither the client nor
    the gateway sees it: every answer whole, no retry."""
    fed, _ = make_federation(speed=1, sites=[("us-mi355x", "us-west-2", "mi355x")], faults=True)
    site = next(s for s in fed.config.sites if s.name == "us-mi355x")
    async with openai.AsyncOpenAI(base_url=_endpoint(fed) + "/v1", api_key="unused", max_retries=0) as client:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://{fed.config.host}:{site.worker_port}/_emulator/die", json={}) as resp:
                assert resp.status == 200, await resp.text()
        answers = await asyncio.gather(
            *(
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=20, extra_body={"ignore_eos": True})
                for _ in range(8)
            )
        )
    assert all(a.usage.completion_tokens == 20 for a in answers)
    assert _counter(fed, "federation_gateway_retries_total") == 0
    assert "generate.worker_unreachable" in capfd.readouterr().err


@pytest.mark.timeout(120)
async def test_a_site_the_gateway_cannot_reach_is_retried_around(make_federation) -> None:
    """With the gateway's link to Korea cut (the scheduler still hears Korea, so still routes
    there), every request is retried on the US site before its first token: all 12 answered,
    retries counted, and Korea's circuit opens after its third failure."""
    fed, _ = make_federation(scheduler="policy: round_robin")
    fed.child("link gateway->kr-mi300x").proc.send_signal(signal.SIGUSR1)
    async with openai.AsyncOpenAI(base_url=_endpoint(fed) + "/v1", api_key="unused", max_retries=0) as client:
        answers = await asyncio.gather(
            *(
                client.completions.with_raw_response.create(
                    model=MODEL, prompt="Hi", max_tokens=20, extra_body={"ignore_eos": True}
                )
                for _ in range(12)
            )
        )
    assert {a.headers["x-federation-site"] for a in answers} == {"us-mi355x"}
    assert all(a.parse().usage.completion_tokens == 20 for a in answers)
    retries = _counter(fed, "federation_gateway_retries_total")
    assert 1 <= retries <= 6  # Korea's share of 12 round-robin routes, until its circuit opened


@pytest.mark.timeout(120)
async def test_the_time_a_site_held_a_request_is_not_in_its_retry_budget(make_federation) -> None:
    """Korea, behind a 1.5-s round trip, holds a request longer than the gateway's whole retry
    budget (0.2 s here) and then dies: the request is still retried, at the US, and answered.
    The budget is for looking for a site, not for waiting at one (queued behind thousands, a
    request may wait minutes before its worker dies)."""
    fed, _ = make_federation(rtt_ms=1500)
    schedulers = list(fed.config.scheduler_addresses)
    port = free_port_block(1)
    args = ["--port", str(port), "--model", MODEL, "--retry-budget-s", "0.2", *fed.tls_flags(GATEWAY)]
    gateway = start_python(
        "gateway", "federation.gateway", [*args, *(a for s in schedulers for a in ("--scheduler", s))]
    )
    try:
        assert await asyncio.to_thread(admin.drain, schedulers, fed.operator, "us-mi355x") == schedulers
        async with openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0
        ) as client:
            answer = asyncio.ensure_future(
                client.completions.create(model=MODEL, prompt="far", max_tokens=8, extra_body={"ignore_eos": True})
            )
            await asyncio.sleep(0.4)  # on its way to Korea, 0.75 s each way
            assert await asyncio.to_thread(admin.drain, schedulers, fed.operator, "us-mi355x", False) == schedulers
            fed.child("agent kr-mi300x").proc.send_signal(signal.SIGKILL)
            assert (await answer).usage.completion_tokens == 8
        counters = gateway_counters(f"http://127.0.0.1:{port}/metrics")
        assert counters.get("federation_gateway_retries_total", 0) >= 1
        assert counters.get("federation_gateway_resumed_total", 0) == 0
    finally:
        gateway.stop()


@pytest.mark.timeout(120)
async def test_a_client_error_from_a_site_is_not_retried(make_federation) -> None:
    """A /generate whose sampling params the worker refuses gets the worker's 400, once: a
    client's mistake is neither retried nor held against the site."""
    fed, _ = make_federation()
    async with aiohttp.ClientSession() as http:
        for _ in range(4):
            body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "no_such_param": 1}}
            async with http.post(_endpoint(fed) + "/generate", json=body) as resp:
                assert resp.status == 400, await resp.text()
        async with http.post(_endpoint(fed) + "/generate", json={"text": "Hi"}) as resp:
            assert resp.status == 200
    assert _counter(fed, "federation_gateway_retries_total") == 0


def _status(path: Path) -> subprocess.CompletedProcess:
    return fedctl("status", "--config", str(path), timeout_s=30)


@pytest.mark.timeout(120)
async def test_scheduler_replicas_fail_over_then_degrade(make_federation) -> None:
    """Two scheduler replicas: with the first killed the gateway routes through the second;
    with both killed it routes from the last state it watched, says "degraded" in /health,
    and `fedctl status` says no replica answers. No request fails along the way."""
    fed, path = make_federation(scheduler="replicas: 2")
    async with aiohttp.ClientSession() as http:

        async def ask() -> dict:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8}
            async with http.post(_endpoint(fed) + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            async with http.get(_endpoint(fed) + "/health") as resp:
                return await resp.json()

        health = await ask()
        assert health["status"] == "ok" and health["scheduler"] == fed.config.scheduler_addresses[0]
        fed.child("scheduler 0").proc.send_signal(signal.SIGKILL)
        for _ in range(5):
            health = await ask()
        assert health["status"] == "ok" and health["scheduler"] == fed.config.scheduler_addresses[1]
        assert "unreachable" in _status(path).stdout
        fed.child("scheduler 1").proc.send_signal(signal.SIGKILL)
        for _ in range(5):
            health = await ask()
        assert health["status"] == "degraded" and set(health["ready_sites"]) == {"kr-mi300x", "us-mi355x"}
    status = _status(path)
    assert status.returncode == 1 and "no scheduler replica reachable" in status.stderr
    assert "degraded" in status.stderr


@pytest.mark.timeout(120)
async def test_a_site_across_a_slow_wan_link_joins_and_serves(make_federation) -> None:
    """Korea behind a 1.5-s round trip (a WAN at drill speed, or a busy peer): its reports
    reach the schedulers and the gateway's streams reach its agent, though a connection's
    handshake outlasts gRPC's reconnect backoff (each attempt once timed out at 200 ms)."""
    fed, _ = make_federation(rtt_ms=1500)
    body = {"model": MODEL, "prompt": "far", "max_tokens": 8, "ignore_eos": True}
    async with aiohttp.ClientSession() as http:
        for _ in range(40):  # until one lands in Korea (the policy prefers the closer, emptier US)
            async with http.post(_endpoint(fed) + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                if resp.headers["x-federation-site"] == "kr-mi300x":
                    return
    pytest.fail("no request was served by the site across the slow link")
