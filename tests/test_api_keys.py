"""API keys at the gateway, with the official OpenAI client: no key or a wrong one is a 401 in
OpenAI's shape, a key over its requests or tokens per minute or its requests at once is a 429
with Retry-After, each before any site is asked (the schedulers route nothing for them); limits
hold across gateway processes sharing a limits file; usage per key is in /metrics and on every
`request.done` line; /health and /metrics can move to an admin listener."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from core.pki import Identity, Role
from core.processes import Child, free_port_block, start_python
from federation import admin
from federation.drills.sampler import gateway_counters
from federation.embedded import Federation
from federation.gateway import keys
from tests.test_federation import MODEL


def _gateway(fed: Federation, key_file: Path, *extra: str) -> tuple[Child, int]:
    port = free_port_block(1)
    args = ["--port", str(port), "--model", MODEL, "--api-keys", str(key_file), *extra]
    args += [a for s in fed.config.scheduler_addresses for a in ("--scheduler", s)]
    return start_python(
        "gateway with keys", "federation.gateway", [*args, *fed.tls_flags(Identity(Role.GATEWAY))]
    ), port


def _routed(fed: Federation) -> int:
    state, _ = admin.replicas_state(fed.config.scheduler_addresses, fed.operator)
    assert state is not None
    return sum(s.routed_requests for s in state.sites)


def _client(port: int, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)


async def _ask(port: int, key: str, max_tokens: int = 4) -> openai.types.Completion:
    async with _client(port, key) as client:
        return await client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )


@pytest.mark.timeout(150)
async def test_keys_are_checked_and_limited_before_any_site_is_asked(
    shared_federation, tmp_path: Path, capfd, http: aiohttp.ClientSession
) -> None:
    fed, _ = shared_federation
    key_file = tmp_path / "keys.json"
    alice = keys.add(key_file, "alice", keys.KeyLimits(rpm=3))
    bob = keys.add(key_file, "bob", keys.KeyLimits(tpm=100))
    carol = keys.add(key_file, "carol", keys.KeyLimits(max_concurrent=1))
    gateway, port = _gateway(fed, key_file)
    try:
        before = _routed(fed)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as resp:  # no Authorization
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        for key in ("fed-not-a-key-of-ours", "sk-something-else"):
            with pytest.raises(openai.AuthenticationError) as refused:
                await _ask(port, key)
            assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
            assert refused.value.body["message"]
        assert _routed(fed) == before  # nothing was routed for them

        # alice: 3 requests a minute.
        for _ in range(3):
            assert (await _ask(port, alice)).usage.completion_tokens == 4
        before = _routed(fed)
        with pytest.raises(openai.RateLimitError) as limited:
            await _ask(port, alice)
        assert limited.value.code == "rate_limit_exceeded" and "(rpm 3)" in limited.value.body["message"]
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 20
        assert _routed(fed) == before

        # bob: 100 tokens a minute; an answer of 120 leaves him in debt, so the next must wait.
        assert (await _ask(port, bob, max_tokens=120)).usage.completion_tokens == 120
        with pytest.raises(openai.RateLimitError) as limited:
            await _ask(port, bob)
        assert "(tpm 100)" in limited.value.body["message"]

        # carol: one request at a time.
        async with _client(port, carol) as client:
            first = await client.completions.create(
                model=MODEL, prompt="Long", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
            )
            async for _ in first:  # it has begun
                break
            with pytest.raises(openai.RateLimitError):
                await _ask(port, carol)
            async for _ in first:  # read it to its end: carol's one request is over
                pass
        assert (await _ask(port, carol)).usage.completion_tokens == 4

        counters = gateway_counters(f"http://127.0.0.1:{port}/metrics")  # /metrics needs no key
        assert counters["federation_gateway_key_requests_total{key=alice,outcome=ok}"] == 3
        assert counters["federation_gateway_key_tokens_total{key=bob,kind=output}"] == 120
        assert counters["federation_gateway_refused_total{key=,reason=no_key}"] == 3
        assert counters["federation_gateway_refused_total{key=alice,reason=over_limit}"] == 1
    finally:
        gateway.stop(10)
    done = [json.loads(line) for line in capfd.readouterr().err.splitlines() if '"request.done"' in line]
    assert {d["key"] for d in done} >= {"alice", "bob", "carol"}


@pytest.mark.timeout(120)
async def test_limits_hold_across_gateway_processes_and_health_can_move(
    shared_federation, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Two gateways sharing a limits file: a key's 2 requests a minute are 2 across both. A
    key added while they run works within a second or two; SGLang's info endpoints need one too.
    With --admin-port, /health and /metrics answer there and not on the API's port."""
    fed, _ = shared_federation
    key_file, limits = tmp_path / "keys.json", str(tmp_path / "limits.sqlite")
    dave = keys.add(key_file, "dave", keys.KeyLimits(rpm=2))
    admin_port = free_port_block(1)
    one, port_one = _gateway(fed, key_file, "--limits-db", limits, "--admin-port", str(admin_port))
    two, port_two = _gateway(fed, key_file, "--limits-db", limits)
    try:
        await _ask(port_one, dave)
        await _ask(port_two, dave)
        for port in (port_one, port_two):
            with pytest.raises(openai.RateLimitError):
                await _ask(port, dave)
        erin = keys.add(key_file, "erin", keys.KeyLimits())
        await asyncio.sleep(1.5)  # each gateway looks at the file once a second
        assert (await _ask(port_two, erin)).usage.completion_tokens == 4
        for path, key in (("/server_info", "version"), ("/model_info", "model_path"), ("/v1/loads", "loads")):
            async with http.get(f"http://127.0.0.1:{port_two}{path}") as resp:
                assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
            async with http.get(
                f"http://127.0.0.1:{port_two}{path}", headers={"Authorization": f"Bearer {erin}"}
            ) as resp:
                assert resp.status == 200 and key in await resp.json()

        async with http.get(f"http://127.0.0.1:{admin_port}/health") as resp:
            assert (await resp.json())["status"] == "ok"
        for path in ("/health", "/metrics"):
            async with http.get(f"http://127.0.0.1:{port_one}{path}") as resp:
                assert resp.status == 404
    finally:
        one.stop(10)
        two.stop(10)
