"""Service tiers (core/tiers.py, issue #46): `service_tier` parsed against the key's default and
ceiling, refused with 403 naming the field above it; the tier said back in the response; queues
served by tier; the tier carried on the wire to the sites and to SGLang's request priority."""

from __future__ import annotations

import subprocess
import sys
from collections import deque
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core import wire
from core.errors import BadRequest, NotAllowed
from core.tiers import SGLANG_PRIORITY, Tier, TieredQueue, from_sglang_priority, resolve, sglang_priority
from federation.gateway import keys
from nodes.emulator.prefix_cache import CacheConfig, PrefixCache, PriorityScheduling
from nodes.emulator.schedule_policy import order_waiting
from nodes.emulator.sequence import Sequence
from tests.test_api_keys import _gateway
from tests.test_federation import MODEL


def test_a_tier_is_what_is_asked_within_the_ceiling_and_auto_is_the_keys_default() -> None:
    assert resolve(None) is Tier.DEFAULT and resolve("auto", default=Tier.FLEX) is Tier.FLEX
    assert resolve("priority") is Tier.PRIORITY  # no key: every tier
    assert resolve("flex", ceiling=Tier.DEFAULT) is Tier.FLEX
    with pytest.raises(NotAllowed) as refused:
        resolve("priority", ceiling=Tier.DEFAULT)
    assert refused.value.status == 403 and refused.value.param == "service_tier"
    assert "'priority'" in refused.value.message and "'default'" in refused.value.message
    with pytest.raises(BadRequest) as bad:
        resolve("scale")
    assert bad.value.param == "service_tier"


def test_a_keys_tiers_default_to_default_and_a_default_above_the_ceiling_is_refused() -> None:
    plain = keys.KeyLimits()
    assert plain.tier(None) is Tier.DEFAULT and plain.tier("flex") is Tier.FLEX
    with pytest.raises(NotAllowed):
        plain.tier("priority")  # a key may ask for priority only when allowed
    batch = keys.KeyLimits(default_tier="flex", max_tier="priority")
    assert batch.tier("auto") is Tier.FLEX and batch.tier("priority") is Tier.PRIORITY
    with pytest.raises(keys.KeyFileError, match="above max_tier"):
        keys.changed(plain, {"default_tier": "priority"})


def test_a_tiered_queue_serves_each_tier_in_arrival_order_priority_first() -> None:
    queue: TieredQueue[str] = TieredQueue()
    for tier, item in ((Tier.FLEX, "f1"), (Tier.DEFAULT, "d1"), (Tier.PRIORITY, "p1"), (Tier.FLEX, "f2")):
        queue.append(tier, item)
    queue.append(Tier.PRIORITY, "p2")
    assert list(queue) == ["p1", "p2", "d1", "f1", "f2"] and len(queue) == 5
    assert queue.remove(Tier.DEFAULT, "d1") and not queue.remove(Tier.DEFAULT, "d1")
    assert queue.head() == "p1" and queue.waiting(Tier.FLEX) == 2
    assert [queue.popleft() for _ in range(4)] == ["p1", "p2", "f1", "f2"]
    assert not queue and queue.head() is None
    with pytest.raises(IndexError):
        queue.popleft()
    for tier, item in ((Tier.FLEX, "f1"), (Tier.FLEX, "f2"), (Tier.DEFAULT, "d1"), (Tier.PRIORITY, "p1")):
        queue.append(tier, item)
    # full: an arriving priority request gives up the newest flex one, then default ones
    assert [queue.pop_newest_below(Tier.PRIORITY) for _ in range(3)] == ["f2", "f1", "d1"]
    assert queue.pop_newest_below(Tier.PRIORITY) is None and queue.pop_newest_below(Tier.FLEX) is None


def test_sglang_priorities_let_priority_preempt_flex_only_at_sglangs_default_threshold() -> None:
    threshold = 10  # --priority-scheduling-preemption-threshold's default; SGLang preempts above it
    assert SGLANG_PRIORITY[Tier.PRIORITY] - SGLANG_PRIORITY[Tier.FLEX] > threshold
    assert SGLANG_PRIORITY[Tier.PRIORITY] - SGLANG_PRIORITY[Tier.DEFAULT] <= threshold
    assert SGLANG_PRIORITY[Tier.DEFAULT] - SGLANG_PRIORITY[Tier.FLEX] <= threshold
    assert sglang_priority(Tier.PRIORITY, False) > sglang_priority(Tier.FLEX, False)
    assert sglang_priority(Tier.PRIORITY, True) < sglang_priority(Tier.FLEX, True)  # low values first
    # a native /generate's own SGLang priority names its tier, larger first
    assert [from_sglang_priority(p) for p in (-5, 0, 1, 10, 19, 20, 99)] == [Tier.FLEX] * 2 + [Tier.DEFAULT] * 3 + [
        Tier.PRIORITY
    ] * 2


def test_the_tier_travels_on_the_wire_and_an_unknown_one_is_default() -> None:
    for tier in Tier:
        request = wire.GenerateRequest("r-1", 3, {}, input_ids=(1, 2, 3), tier=tier)
        (start,) = wire.generate_command_from_pb(wire.generate_command_to_pb([(1, request)], ())).starts
        assert start[1].tier is tier
        route = wire.RouteRequest("r-1", 3, tier=tier)
        assert wire.route_request_from_pb(wire.route_request_to_pb(route)).tier is tier
    newer = wire.route_request_to_pb(wire.RouteRequest("r-1", 3))
    newer.tier = 7  # a tier a newer peer knows
    assert wire.route_request_from_pb(newer).tier is Tier.DEFAULT


def test_fedctl_keys_sets_and_lists_tiers_and_refuses_a_default_above_the_ceiling(tmp_path: Path) -> None:
    file = tmp_path / "keys.json"

    def fedctl(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "federation.cli", "keys", *args, "--file", str(file)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    assert fedctl("add", "batch", "--default-tier", "flex").returncode == 0
    assert fedctl("add", "web", "--max-tier", "priority").returncode == 0
    listed = fedctl("list").stdout
    assert "flex (<= default)" in listed and "default (<= priority)" in listed
    refused = fedctl("set", "batch", "--default-tier", "priority")
    assert refused.returncode == 2 and "above max_tier" in refused.stderr and "Traceback" not in refused.stderr
    assert keys.listed(file)["batch"].default_tier == "flex"
    assert fedctl("set", "batch", "--max-tier", "priority", "--default-tier", "priority").returncode == 0
    assert keys.listed(file)["batch"].default_tier == "priority"


@pytest.mark.timeout(120)
async def test_the_openai_client_gets_the_tier_used_and_a_403_above_its_keys_ceiling(
    shared_federation, tmp_path: Path
) -> None:
    fed, _ = shared_federation
    key_file = tmp_path / "keys.json"
    plain = keys.add(key_file, "plain", keys.KeyLimits())
    batch = keys.add(key_file, "batch", keys.KeyLimits(default_tier="flex"))
    web = keys.add(key_file, "web", keys.KeyLimits(max_tier="priority"))
    gateway, port = _gateway(fed, key_file)
    try:

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0)

        async def chat(key: str, **extra: str) -> str | None:
            async with client(key) as c:
                answer = await c.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **extra
                )
            return answer.service_tier

        assert await chat(plain) == "default"
        assert await chat(batch) == "flex"  # its default
        assert await chat(batch, service_tier="default") == "default"
        assert await chat(web, service_tier="priority") == "priority"
        with pytest.raises(openai.PermissionDeniedError) as refused:
            await chat(plain, service_tier="priority")
        assert refused.value.status_code == 403 and refused.value.body["param"] == "service_tier"
        with pytest.raises(openai.BadRequestError) as bad:
            await chat(plain, service_tier="scale")
        assert bad.value.body["param"] == "service_tier"

        async with client(web) as c:  # a stream says it on every chunk
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Hi"}],
                max_tokens=4,
                stream=True,
                service_tier="priority",
            )
            tiers = {chunk.service_tier async for chunk in stream}
        assert tiers == {"priority"}
        async with client(batch) as c:
            response = await c.responses.create(model=MODEL, input="Hi", max_output_tokens=16)
        assert response.service_tier == "flex"
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        done = {
            (s.labels["tier"], s.labels["outcome"]): s.value
            for s in families["federation_gateway_tier_requests"].samples
            if s.name.endswith("_total")
        }
        assert done[("priority", "ok")] == 2 and done[("flex", "ok")] == 2 and done[("default", "ok")] == 2
        firsts = {
            s.labels["tier"]: s.value
            for s in families["federation_gateway_tier_ttft_seconds"].samples
            if s.name.endswith("_count")
        }
        assert firsts == {"priority": 2, "default": 2, "flex": 2}
    finally:
        gateway.stop()


@pytest.mark.parametrize("low_first", [False, True])
@pytest.mark.parametrize("policy", ["fcfs", "lof"])
async def test_the_emulators_queue_is_sorted_as_sglangs_priority_scheduling_sorts_it(
    policy: str, low_first: bool
) -> None:
    """SGLang's calc_priority under --enable-priority-scheduling: by priority (larger first, or
    smaller with --schedule-low-priority-values-first), then fcfs by queue entry, lof by the
    longest max_new_tokens; a request with none has the least favoured priority of all."""
    config = PriorityScheduling(enabled=True, low_values_first=low_first)
    cache = PrefixCache(CacheConfig(schedule_policy=policy, priority=config))
    favoured, other = (0, 20) if low_first else (20, 0)
    asked = [
        ("none", None, 0.0, 10),
        ("other", other, 1.0, 10),
        ("fav-late", favoured, 3.0, 50),
        ("fav", favoured, 2.0, 10),
    ]
    waiting = deque(
        Sequence(rid, 8, 8, max_new, 0.0, queue_entry_at=at, priority=config.value_of(p))
        for rid, p, at, max_new in asked
    )
    order_waiting(cache, waiting, refresh=False)
    favoured_order = ["fav", "fav-late"] if policy == "fcfs" else ["fav-late", "fav"]
    assert [s.rid for s in waiting] == [*favoured_order, "other", "none"]
