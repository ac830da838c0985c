"""Per-key quotas across gateways and regions (#45), against real `redis-server`s and real
gateway processes, with the official OpenAI client: keys managed by `fedctl keys --redis` and
seen (and revoked) by every gateway within a second; one key's limit held by two gateways of a
region and one of another; a key homed in another region spent from leased slices, and a region
cut off from that home granting itself half a lease, once, after its slice expired; the
region's own store killed and back, with each gateway on its share meanwhile and a running
stream never failed; a client leaving during admission gives its key's share back."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis
import redis.asyncio

from core.pki import Identity, Role
from core.processes import Child, free_port_block, start_python
from core.tiers import Tier
from federation.drills.stores import RedisServer
from federation.embedded import Federation
from federation.gateway import keystore, quota
from federation.linkproxy import BLACKHOLE_SIGNAL
from tests.test_federation import MODEL

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None and not os.environ.get("CI"), reason="needs Debian's redis-server"
)


@pytest.fixture
def redis_servers(tmp_path: Path) -> Iterator[list[RedisServer]]:
    ports = free_port_block(2)
    servers = [RedisServer(port, tmp_path / str(port)) for port in (ports, ports + 1)]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.kill()


def _fedctl_keys(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "federation.cli", "keys", *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _gateway(fed: Federation, region: str, stores: dict[str, RedisServer]) -> tuple[Child, int]:
    port = free_port_block(1)
    args = ["--port", str(port), "--model", MODEL, "--region", region]
    args += [a for r, s in stores.items() for a in ("--quota-store", f"{r}={s.url}")]
    args += [a for s in fed.config.scheduler_addresses for a in ("--scheduler", s)]
    gateway = start_python("gateway with quotas", "federation.gateway", [*args, *fed.tls_flags(Identity(Role.GATEWAY))])
    return gateway, port


async def _ask(port: int, key: str, max_tokens: int = 2, stream: bool = False) -> int:
    """The output tokens of one completion; raises the client's error for a refusal."""
    async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0) as client:
        if not stream:
            done = await client.completions.create(
                model=MODEL, prompt="Hello", max_tokens=max_tokens, extra_body={"ignore_eos": True}
            )
            return done.usage.completion_tokens
        chunks = await client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = 0
        async for chunk in chunks:
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage


async def _admitted(port: int, key: str, tries: int) -> int:
    """How many of `tries` requests, one after another, were admitted before the first 429."""
    for n in range(tries):
        try:
            await _ask(port, key)
        except openai.RateLimitError as refused:
            assert refused.response.headers["Retry-After"].isdigit()
            return n
    return tries


@pytest.mark.timeout(120)
async def test_gateways_of_two_regions_hold_one_keys_limit_and_see_a_revocation_within_a_second(
    shared_federation, redis_servers: list[RedisServer]
) -> None:
    fed, _ = shared_federation
    stores = {"us": redis_servers[0], "kr": redis_servers[1]}
    given = [a for r, s in stores.items() for a in ("--redis", f"{r}={s.url}")]
    alice = _fedctl_keys("add", "alice", "--rpm", "60", *given)  # its home: us, the first given
    assert alice.startswith("fed-")
    listed = _fedctl_keys("list", *given)
    assert "alice" in listed and alice not in listed  # names and limits, never the key
    gateways = [_gateway(fed, "us", stores), _gateway(fed, "us", stores), _gateway(fed, "kr", stores)]
    ports = [port for _, port in gateways]
    try:
        # 60 a minute, a lease 3 requests: two gateways sharing a region's slice and one leasing
        # its own region's hold to the key's one minute together.
        admitted, started = 0, time.monotonic()
        for _ in range(40):
            for port in ports:
                admitted += await _admitted(port, alice, 1)
        refilled = time.monotonic() - started  # the bucket refills one a second meanwhile
        held = 2 * 3  # what the two regions' slices may still hold, taken from the budget, unspent
        assert 60 - held <= admitted <= 60 + refilled + 1, (admitted, refilled)
        with pytest.raises(openai.RateLimitError) as limited:
            await _ask(ports[0], alice)
        assert "(rpm 60)" in limited.value.body["message"]

        _fedctl_keys("set", "alice", "--rpm", "0", *given)  # no limit now
        await asyncio.sleep(1.2)
        assert await _admitted(ports[2], alice, 5) == 5

        _fedctl_keys("revoke", "alice", *given)
        revoked_at = time.monotonic()
        for port in ports:
            while True:
                try:
                    await _ask(port, alice)
                except openai.AuthenticationError:
                    break
                assert time.monotonic() - revoked_at < 1.0, "a revoked key was served after a second"
        assert time.monotonic() - revoked_at < 1.2
    finally:
        for gateway, _ in gateways:
            gateway.stop()


@pytest.mark.timeout(150)
async def test_a_key_homed_elsewhere_is_leased_and_a_cut_off_region_spends_half_a_lease_of_its_own(
    shared_federation, redis_servers: list[RedisServer]
) -> None:
    fed, _ = shared_federation
    stores = {"kr": redis_servers[0], "us": redis_servers[1]}
    given = [a for r, s in stores.items() for a in ("--redis", f"{r}={s.url}")]
    bob = _fedctl_keys("add", "bob", "--rpm", "80", "--home", "kr", *given)  # a lease: 4 requests
    gateway, port = _gateway(fed, "us", stores)
    try:
        assert await _admitted(port, bob, 10) == 10  # slices leased from Korea as they are spent
        level = redis.Redis.from_url(stores["kr"].url).hget("fed:bucket:bob", "r")
        # the budget is spent at home (a few seconds refilled beside it)
        assert level is not None and float(level) < 80 - 7

        stores["kr"].kill()  # the home is cut off; wait out the slice's life
        await asyncio.sleep(quota.LEASE_TTL_S + 1)
        # What the slice still held has expired with it; the region grants itself half a lease, once.
        assert await _admitted(port, bob, 5) == 2
        with pytest.raises(openai.RateLimitError) as refused:
            await _ask(port, bob)
        assert refused.value.response.headers["Retry-After"].isdigit()

        stores["kr"].start()  # the home is back (its bucket full again): leases are granted once more
        deadline = time.monotonic() + 10
        while await _admitted(port, bob, 1) == 0:
            assert time.monotonic() < deadline, "no lease after the home came back"
            await asyncio.sleep(0.2)
    finally:
        gateway.stop()


@pytest.mark.timeout(150)
async def test_with_the_regions_store_down_each_gateway_takes_its_share_and_nothing_running_fails(
    shared_federation, redis_servers: list[RedisServer]
) -> None:
    fed, _ = shared_federation
    store = {"us": redis_servers[0]}
    carol = _fedctl_keys("add", "carol", "--rpm", "6", "--redis", f"us={store['us'].url}")
    (one, port1), (two, port2) = _gateway(fed, "us", store), _gateway(fed, "us", store)
    try:
        await asyncio.sleep(1.5)  # both gateways' heartbeats are in the store: each knows there are two
        long_stream = asyncio.create_task(_ask(port1, carol, max_tokens=300, stream=True))
        await asyncio.sleep(0.5)
        store["us"].kill()
        # The documented rule: each gateway admits on its own, at its share (6 a minute / 2 gateways).
        assert await _admitted(port1, carol, 6) == 3
        assert await _admitted(port2, carol, 6) == 3
        assert await long_stream == 300  # the stream that was running when the store died: whole

        store["us"].start()  # with what it had written (the keys among it)
        deadline = time.monotonic() + 10
        while True:  # the gateways read the store again and admit from it
            try:
                await _ask(port2, carol)
                break
            except openai.RateLimitError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.3)
    finally:
        one.stop()
        two.stop()


def _fedctl_keys_fails(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "federation.cli", "keys", *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    return done.stderr


def test_fedctl_keys_lists_sets_and_revokes_a_files_keys_and_refuses_bad_input(tmp_path: Path) -> None:
    file = str(tmp_path / "keys.json")
    key = _fedctl_keys("add", "erin", "--tpm", "1000", "--file", file)
    listed = _fedctl_keys("list", "--file", file)
    assert "erin" in listed and "1000" in listed and key not in listed
    assert " 5 " in _fedctl_keys("set", "erin", "--max-concurrent", "5", "--file", file)
    assert "no key named 'frank'" in _fedctl_keys_fails("revoke", "frank", "--file", file)
    assert "a key named 'erin' exists" in _fedctl_keys_fails("add", "erin", "--file", file)
    assert "give --rpm, --tpm, --max-concurrent, --default-tier or --max-tier" in _fedctl_keys_fails(
        "set", "erin", "--file", file
    )
    _fedctl_keys("revoke", "erin", "--file", file)
    assert "erin" not in _fedctl_keys("list", "--file", file)
    # A store that is not there is named, without a trace; a store given without its region is refused.
    assert "the store of us" in _fedctl_keys_fails("list", "--redis", f"us=redis://127.0.0.1:{free_port_block(1)}/0")
    assert "expected REGION=redis://" in _fedctl_keys_fails("list", "--redis", "redis://127.0.0.1:6379/0")
    assert "--home 'eu'" in _fedctl_keys_fails("add", "gus", "--home", "eu", "--redis", "us=redis://127.0.0.1:1/0")


@pytest.mark.timeout(120)
async def test_a_client_that_leaves_while_its_keys_share_is_taken_gives_it_back(
    shared_federation, redis_servers: list[RedisServer]
) -> None:
    """The first request of a key homed elsewhere waits for its region's slice; its client
    leaves meanwhile (the home is blackholed: the lease takes a second to give up and the region
    grants itself its own). The request's share (here its one running request of
    max_concurrent 1) is given back, so the next request is admitted."""
    fed, _ = shared_federation
    home, here = redis_servers
    link = start_python(
        "link to the home store",
        "federation.linkproxy",
        ["--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{home.port}", "--rtt-ms", "10"],
    )
    stores = {"kr": f"redis://{link.ready['listen']}/0", "us": here.url}
    dana = _fedctl_keys(
        "add", "dana", "--rpm", "600", "--max-concurrent", "1", "--home", "kr",
        *("--redis", f"kr={home.url}", "--redis", f"us={here.url}"),
    )  # fmt: skip
    port = free_port_block(1)
    args = ["--port", str(port), "--model", MODEL, "--region", "us"]
    args += [a for r, url in stores.items() for a in ("--quota-store", f"{r}={url}")]
    args += [a for s in fed.config.scheduler_addresses for a in ("--scheduler", s)]
    gateway = start_python("gateway", "federation.gateway", [*args, *fed.tls_flags(Identity(Role.GATEWAY))])
    try:
        os.kill(link.pid, BLACKHOLE_SIGNAL)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):  # the client gives up while the slice is being leased
                await _ask(port, dana)
        await asyncio.sleep(quota.HOME_TIMEOUT_S + 1)  # the lease given up, the region's own granted
        assert await _ask(port, dana) == 2  # max_concurrent 1: admitted only if the first gave its share back
    finally:
        gateway.stop()
        link.stop()


async def test_a_keys_tiers_are_kept_in_the_stores_and_served_by_every_gateway(
    redis_servers: list[RedisServer],
) -> None:
    """`fedctl keys add|set --default-tier --max-tier --redis` writes a key's service tiers to every
    region's store, and a gateway's table reads them back (core/tiers.py)."""
    stores = [a for i, s in enumerate(redis_servers) for a in ("--redis", f"r{i}={s.url}")]
    key = _fedctl_keys("add", "batch", "--default-tier", "flex", *stores)
    assert "flex (<= priority)" in _fedctl_keys("set", "batch", "--max-tier", "priority", *stores)
    for server in redis_servers:
        store = redis.asyncio.Redis.from_url(server.url)
        table = keystore.StoreKeys(store)
        await table.refresh()
        holder = table.holder(f"Bearer {key}")
        await store.aclose()
        assert holder is not None and holder[0] == "batch"
        limits = holder[1]
        assert limits.tier(None) is Tier.FLEX and limits.tier("priority") is Tier.PRIORITY
