"""Inside a site, the agent sends a request to the worker likely to hold its prompt's prefix (as
the sglang-router's cache_aware policy does, with its thresholds), and balances the rest by
load (nodes/agent/pool.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from core import wire
from core.prefixes import prefix_hashes
from federation.gateway.upstream import SiteStream, Upstream
from nodes.emulator.launch import launch
from tests.test_completed_work import _answer
from tests.test_readers import _agent


async def _worker_of(upstream: Upstream, port: int, name: str, ids: list[int]) -> str:
    """The worker the agent gave this request to (its first delta says)."""
    worker = ""

    def deliver(stream: SiteStream, delta: wire.TokenDelta) -> None:
        nonlocal worker
        worker = worker or delta.worker

    params = {"max_new_tokens": 8, "ignore_eos": True}
    request = wire.GenerateRequest(name, len(ids), params, input_ids=tuple(ids), prefix_hashes=prefix_hashes(ids))
    await _answer(upstream, port, request, deliver)
    return worker


@pytest.mark.timeout(120)
async def test_requests_sharing_a_prefix_go_to_one_worker_and_others_spread() -> None:
    """Three groups of six questions, each group after its own 1,024-token system prompt, all
    asked at once: every group's questions go to one worker (its first question's), where by
    load alone they would spread; 12 prompts sharing nothing go round the four workers by load."""
    workers = launch(["--profile", "mi355x", "--workers", "4", "--speed", "20"])
    agent, port, _ = _agent(workers.urls, readers=0)
    upstream = Upstream()
    try:
        asked = [(g, q) for q in range(6) for g in range(3)]  # interleaved: by load they would spread
        chosen = await asyncio.gather(
            *(
                _worker_of(upstream, port, f"g{g}q{q}", [10_000 + 7 * g + i for i in range(1024)] + [q] * 40)
                for g, q in asked
            )
        )
        by_group = {g: {w for (gg, _), w in zip(asked, chosen, strict=True) if gg == g} for g in range(3)}
        assert all(len(w) == 1 for w in by_group.values()), by_group
        distinct = Counter(
            await asyncio.gather(
                *(_worker_of(upstream, port, f"d{i}", [20_000 + 1000 * i + j for j in range(1024)]) for i in range(12))
            )
        )
        assert len(distinct) == 4 and max(distinct.values()) <= 4, distinct
    finally:
        await upstream.close()
        agent.stop()
        workers.stop()
