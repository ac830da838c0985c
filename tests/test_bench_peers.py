"""The benchmark's peer: the real sglang-router, flat over emulated workers, remote ones behind a WAN link."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from core import config
from core.processes import StartFailed
from federation.bench import client
from federation.bench.peers import FlatRouter
from federation.bench.workload import LengthDistribution, WorkloadSpec
from nodes.emulator.launch import EmulatorProcess

RTT_MS = 130
CONFIG = config.parse(
    f"""
model: openai/gpt-oss-120b
host: 127.0.0.1
speed: 10
gateway: {{port: 8080, region: us-west-2}}
links:
  - {{between: [ap-northeast-2, us-west-2], rtt_ms: {RTT_MS}}}
sites:
  - {{name: kr-mi300x, region: ap-northeast-2, gpu: mi300x, gpus: 2, agent_port: 50061}}
  - {{name: us-mi355x, region: us-west-2, gpu: mi355x, gpus: 2, agent_port: 50062}}
""",
    "test config",
)


@pytest.mark.timeout(60)
async def test_round_robin_serves_exact_streams_and_leaves_no_process() -> None:
    """Eight streamed completions through the router all end with exactly the tokens asked for;
    round robin sends half to the remote site, and those pay the link's round trip before their
    first token; the remote workers are listed only behind the link. On exit no child process
    is left."""
    own_children = {p.pid for p in psutil.Process().children(recursive=True)}
    samples = WorkloadSpec(8, prompt=LengthDistribution(100, 0.5), output=LengthDistribution(40, 0.5)).samples()
    with FlatRouter(CONFIG, "round_robin") as router:
        ours = [child.pid for child in router.children]
        emulators = [c for c in router.children if isinstance(c, EmulatorProcess)]
        async with client.session() as http:
            model = await client.served_model(http, router.endpoint)
            async with http.http.get(router.endpoint.removesuffix("/v1") + "/workers") as resp:
                listed = {w["url"] for w in (await resp.json())["workers"]}
            results = await asyncio.gather(*(client.send(http, router.endpoint, CONFIG.model, s) for s in samples))
    assert model == CONFIG.model
    assert router.endpoint.startswith("http://127.0.0.1:") and router.endpoint.endswith("/v1")
    assert [(r.error, r.output_tokens) for r in results] == [(None, s.output_tokens) for s in samples]
    kr, us = emulators  # sites in config order
    assert set(us.urls) <= listed and not set(kr.urls) & listed and len(listed) == 4
    ttft_s = sorted(r.first_token - r.started for r in results if r.first_token is not None)
    assert len(ttft_s) == 8 and ttft_s[4] >= RTT_MS / 1000, ttft_s  # the slower half crossed the link

    assert not any(psutil.pid_exists(pid) for pid in ours)
    assert {p.pid for p in psutil.Process().children(recursive=True)} == own_children


def test_unknown_policy_is_refused() -> None:
    """A policy the comparison does not run is a ValueError before any process starts."""
    with pytest.raises(ValueError, match="round_robin"):
        FlatRouter(CONFIG, "random")


def test_a_router_that_cannot_start_is_a_start_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """A router that exits at once (here: a flag it rejects) raises StartFailed quoting its log,
    and the workers already started are stopped."""
    own_children = {p.pid for p in psutil.Process().children(recursive=True)}
    one_site = config.parse(
        "gateway: {region: us-west-2}\nsites: [{name: us, region: us-west-2, gpu: mi355x, gpus: 1, agent_port: 50062}]"
    )
    monkeypatch.setattr("federation.bench.peers.ROUTER_FLAGS", ("--no-such-flag",))
    with pytest.raises(StartFailed, match=r"(?s)sglang-router exited during start-up.*no-such-flag"):
        FlatRouter(one_site, "round_robin").__enter__()
    assert {p.pid for p in psutil.Process().children(recursive=True)} == own_children
