"""SGLang 0.5.23's prefix cache (RadixAttention) in the emulator, against cases worked out by hand
from SGLang's rules (nodes/emulator/radix_cache.py, prefix_cache.py) and, where the notes ran
SGLang's own tree, against what it gave: the tree alone, then requests through the engine, then a
real emulator process through aiohttp and the official `openai` client.

GPT-OSS keeps a sliding window of W = 127 tokens beside its full attention: a cached prefix is a
legal hit only where the 127 tokens before it still hold live sliding-window KV, which the tree
keeps only at the ends of what requests inserted."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.gpus import PROFILES
from nodes.emulator.engine import Engine
from nodes.emulator.launch import EmulatorProcess, launch
from nodes.emulator.prefix_cache import CacheConfig
from nodes.emulator.radix_cache import RadixTree, pack_ids
from nodes.emulator.sequence import Sequence
from tests.test_emulator_accounting import _metrics
from tests.test_engine import _Kept

W = 127  # GPT-OSS's sliding window as SGLang's tree keeps it


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 200_000) for _ in range(n)]


def _swa_tree(page: int = 1) -> RadixTree:
    return RadixTree(page_size=page, window=W)


def _prefill_checkpoint(tree: RadixTree, ids: list[int], protected: int = 0):
    """What a request that computed `ids` inserts at the end of its prefill: its SWA cursor is one
    window behind its end, so only the last window stays live; it then holds the prefix."""
    inserted = tree.insert(b"", pack_ids(ids), protected=protected, swa_from=len(ids) - 1 - W)
    return tree.lock(inserted.node)


# ---- the tree alone --------------------------------------------------------------


def test_identical_prompt_hits_all_but_its_last_token() -> None:
    """A 1,000-token prompt cached at its prefill's end: the same prompt hits 999 (the last token
    is always computed), the prompt and more hits 1,000, and nothing was there before."""
    tree = _swa_tree()
    a = _ids(1000, 1)
    assert tree.match(b"", pack_ids(a), 999).length == 0
    _prefill_checkpoint(tree, a)
    assert tree.match(b"", pack_ids(a), 999).length == 999
    longer = a + _ids(100, 2)
    assert tree.match(b"", pack_ids(longer), len(longer) - 1).length == 1000


def test_partial_share_is_no_hit_for_the_first_sharer_then_the_branch_point() -> None:
    """A prompt sharing only A's first 500 tokens gets 0: at 500 the window behind holds no live
    sliding-window KV (A kept only its last 128 tokens'). Its match finds the FULL KV there, so its
    own prefill checkpoint inserts only up to 500 and brings the window before it back; from then
    on a prompt sharing those 500 tokens hits 500. A tree of full attention alone hits 500 at once."""
    tree = _swa_tree()
    a = _ids(1000, 1)
    _prefill_checkpoint(tree, a)
    c = a[:500] + _ids(300, 3)
    first = tree.match(b"", pack_ids(c), len(c) - 1)
    assert (first.length, first.full_length, first.branch) == (0, 500, 500)
    _prefill_checkpoint(tree, c[:500])  # the insert stops at the branch point
    d = a[:500] + _ids(50, 4)
    assert tree.match(b"", pack_ids(d), len(d) - 1).length == 500

    full_only = RadixTree(window=None)
    full_only.insert(b"", pack_ids(a), protected=0, swa_from=0)
    assert full_only.match(b"", pack_ids(c), len(c) - 1).length == 500


def test_a_finished_answer_is_cached_with_its_prompt() -> None:
    """A 1,000-token prompt answered with 600 tokens caches 1,599 tokens at its finish (all but
    the last token, which has no KV), its SWA live behind the decode cursor (1,384, after jumps of
    128). A follow-up holding prompt and answer hits 1,599; one that diverges inside the answer
    hits only 1,000, the prompt's end, where the prefill left a live window (full attention
    alone: 1,300). The cache then holds 343 tokens of evictable SWA: 128 + 215."""
    tree = _swa_tree()
    a, out = _ids(1000, 1), _ids(600, 5)
    lock = _prefill_checkpoint(tree, a)
    tree.insert(b"", pack_ids(a + out[:599]), protected=1000, swa_from=1384)
    tree.unlock(lock)
    follow = a + out + _ids(40, 6)
    assert tree.match(b"", pack_ids(follow), len(follow) - 1).length == 1599
    diverged = a + out[:300] + _ids(40, 7)
    assert tree.match(b"", pack_ids(diverged), len(diverged) - 1).length == 1000
    assert (tree.full_evictable, tree.swa_evictable, tree.full_protected) == (1599, 343, 0)

    full_only = RadixTree(window=None)
    full_only.insert(b"", pack_ids(a + out[:599]), protected=0, swa_from=0)
    assert full_only.match(b"", pack_ids(diverged), len(diverged) - 1).length == 1300


def test_pages_floor_hits_and_inserts() -> None:
    """With 16-token pages an identical 1,000-token prompt hits 992 (999 floored), and the request
    inserted only its 992 whole-page tokens; 64-token pages: 960."""
    for page, hit in ((16, 992), (64, 960)):
        tree = RadixTree(page_size=page, window=None)
        a = _ids(1000, 1)
        tree.insert(b"", pack_ids(a), protected=0, swa_from=0)
        assert tree.full_tokens == hit
        assert tree.match(b"", pack_ids(a), 999).length == hit


def test_namespaces_never_share() -> None:
    """The same tokens under another extra_key or cache_salt are another prefix."""
    tree = _swa_tree()
    a = _ids(300, 1)
    tree.insert(b"", pack_ids(a), protected=0, swa_from=0)
    assert tree.match(b"salt", pack_ids(a), 299).length == 0
    tree.insert(b"salt", pack_ids(a), protected=0, swa_from=0)
    assert tree.match(b"salt", pack_ids(a), 299).length == 299
    assert tree.full_tokens == 600


def test_lru_evicts_the_least_recently_used_whole_leaf_first() -> None:
    """Three cached prompts, unlocked: eviction takes whole leaves, least recently used first; a
    match counts as use; a parent whose last child goes becomes a leaf in its turn."""
    tree = RadixTree(window=None)
    x, y, z = _ids(100, 1), _ids(100, 2), _ids(100, 3)
    leaf = {
        name: tree.insert(b"", pack_ids(ids), protected=0, swa_from=0).node
        for name, ids in zip("xyz", (x, y, z), strict=True)
    }
    tree.match(b"", pack_ids([*x, 5]), 100)  # x is used again (all of it): y is now the oldest
    assert tree.evict(1) == 100
    assert [leaf[name].dead for name in "xyz"] == [False, True, False]
    branch = tree.insert(b"", pack_ids(x[:60] + _ids(40, 4)), protected=0, swa_from=0).node  # splits x at 60
    tree.match(b"", pack_ids([*z, 5]), 100)
    assert tree.evict(1) == 40 and leaf["x"].dead  # x's tail (x's last use), whole
    assert tree.evict(1) == 40 and branch.dead  # the newer branch
    assert tree.evict(1) == 60  # their parent, a leaf now, older than z's use
    assert not leaf["z"].dead and tree.full_tokens == 100 and tree.evicted_tokens_total == 240


def test_a_locked_prefix_is_not_evicted_and_counts_as_protected() -> None:
    """A request holding a prefix keeps it (and its ancestors) through any eviction; what no one
    holds is evictable and goes; the prefix is protected, not evictable, until it is let go."""
    tree = RadixTree(window=None)
    x, y = _ids(100, 1), _ids(100, 2)
    held = tree.insert(b"", pack_ids(x), protected=0, swa_from=0)
    tree.insert(b"", pack_ids(y), protected=0, swa_from=0)
    lock = tree.lock(tree.match(b"", pack_ids(x), 99).node)
    assert (tree.full_protected, tree.full_evictable) == (99, 101)  # the match split off x's last token
    assert tree.evict(10**6) == 101
    assert tree.match(b"", pack_ids(x), 99).length == 99
    tree.unlock(lock)
    assert (tree.full_protected, tree.full_evictable) == (0, 99)
    assert held.node.dead and tree.evict(10**6) == 99


def test_a_tombstone_inside_a_window_breaks_the_hit_until_the_window_is_back() -> None:
    """Under sliding-window pressure unlocked windows go: the internal nodes that held A's live
    window become tombstones and A's prompt no longer hits, though its FULL KV stays; a request
    that recomputed it brings the window back with its insert."""
    tree = _swa_tree()
    a = _ids(1000, 1)
    tree.unlock(_prefill_checkpoint(tree, a))
    b = a + _ids(200, 2)
    tree.insert(b"", pack_ids(b), protected=0, swa_from=1200)  # a child below A's window: no live SWA
    assert tree.match(b"", pack_ids(a), 999).length == 999
    assert tree.evict_swa(1) == 1  # the least recently used: A's last token, split off by the match
    assert tree.evict_swa(200) == 127 and tree.swa_evictable == 0
    assert tree.match(b"", pack_ids([*a, 7]), 1000).length == 0 and tree.full_tokens == 1200
    tree.insert(b"", pack_ids(a), protected=0, swa_from=1000 - 1 - W)
    assert tree.match(b"", pack_ids([*a, 7]), 1000).length == 1000


def test_the_tree_and_its_heaps_stay_bounded_by_the_pool() -> None:
    """20,000 prompts cached one after another in a pool of 20,000 tokens, each evicting the
    oldest: the tree never holds more than the pool, and the eviction heap no more than twice its
    nodes (plus a constant); nor does the SWA heap, kept from the first SWA shortfall on, though
    FULL eviction alone deletes the nodes it files."""
    from nodes.emulator.radix_cache import HEAP_SLACK

    tree, pool = _swa_tree(), 20_000
    rng = random.Random(7)
    for i in range(20_000):
        prompt = [i, *(rng.randrange(1000, 200_000) for _ in range(rng.randrange(100, 400)))]
        short = tree.full_tokens + len(prompt) - pool
        if short > 0:
            tree.evict(short)
        lock = _prefill_checkpoint(tree, prompt)
        tree.unlock(lock)
        assert tree.full_tokens <= pool
    assert len(tree._heap) <= 2 * tree.nodes + HEAP_SLACK
    tree.evict_swa(1)  # the SWA heap exists from the first SWA shortfall on
    for _ in range(2000):
        lock = _prefill_checkpoint(tree, [rng.randrange(1000, 200_000) for _ in range(300)])
        tree.unlock(lock)
        tree.evict(max(0, tree.full_tokens - pool))
    assert tree._swa_heap is not None and len(tree._swa_heap) <= 2 * tree.nodes + HEAP_SLACK
    assert tree.evicted_tokens_total > 20_000 * 100 - pool


# ---- requests through the engine ----------------------------------------------------


@pytest.fixture
async def run_engine() -> AsyncIterator:
    tasks: list[asyncio.Task] = []

    def start(**kwargs: Any) -> Engine:
        kwargs.setdefault("speed", 200.0)
        engine = Engine(PROFILES["mi355x"], **kwargs)
        tasks.append(asyncio.create_task(engine.run()))
        return engine

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _request(prompt: list[int], answer: list[int], rid: str = "r") -> Sequence:
    """A request with these prompt ids that answers with these ids (ignoring EOS)."""
    out = pack_ids(answer)
    return Sequence(
        rid=rid,
        prompt_tokens=len(prompt),
        target_tokens=len(answer),
        max_new_tokens=len(answer),
        arrived_at=asyncio.get_running_loop().time(),
        ids=pack_ids(prompt),
        output_ids=lambda n: out[: 4 * n],
    )


async def _serve(engine: Engine, *seqs: Sequence) -> None:
    for seq in seqs:
        engine.submit(seq)
    await asyncio.wait_for(asyncio.gather(*(s.done for s in seqs)), 30)


async def test_a_request_hits_what_an_earlier_one_left(run_engine) -> None:
    """A 1,000-token prompt asked again after the first answer finished hits 999 tokens
    (cached_tokens); its prefill step computes one token and counts 999 as cache hits; a prompt
    sharing only the first 500 gets 0 (the sliding-window rule), the next one sharing them 500."""
    kept = _Kept()
    engine = run_engine(listener=kept)
    a = _ids(1000, 1)
    first = _request(a, _ids(20, 2))
    await _serve(engine, first)
    again = _request(a, _ids(20, 3))
    await _serve(engine, again)
    assert (first.cached_tokens, again.cached_tokens) == (0, 999)
    last_prefill = [s.shape for s in kept.stretches if s.shape.prefill_tokens][-1]
    assert (last_prefill.prefill_tokens, last_prefill.cached_tokens) == (1, 999)
    sharer, later = _request(a[:500] + _ids(300, 4), [1, 2]), _request(a[:500] + _ids(50, 5), [1, 2])
    await _serve(engine, sharer)
    await _serve(engine, later)
    assert (sharer.cached_tokens, later.cached_tokens) == (0, 500)


async def test_full_attention_alone_shares_any_prefix(run_engine) -> None:
    """Without a sliding window (a model of full attention alone) the first sharer of a prefix
    hits it; with --disable-radix-cache nothing hits."""
    engine = run_engine(cache=CacheConfig(sliding_window=None))
    a = _ids(1000, 1)
    await _serve(engine, _request(a, [1, 2]))
    sharer = _request(a[:500] + _ids(300, 4), [1, 2])
    await _serve(engine, sharer)
    assert sharer.cached_tokens == 500
    off = run_engine(cache=CacheConfig(disable_radix_cache=True))
    await _serve(off, _request(a, [1, 2]))
    again = _request(a, [1, 2])
    await _serve(off, again)
    assert again.cached_tokens == 0 and off.cache.tree.full_tokens == 0


async def test_a_follow_up_turn_hits_prompt_and_answer(run_engine) -> None:
    """A turn whose prompt is the previous prompt, its 600-token answer and more hits 1,599 tokens
    (all but the answer's last, which has no KV); one that diverges inside the answer hits the
    previous prompt only. The finished answer is cached KV nobody holds: evictable, not in use."""
    engine = run_engine()
    a, answer = _ids(1000, 1), _ids(600, 2)
    await _serve(engine, _request(a, answer))
    pools = engine.pool_usage()
    assert (pools.full_used, pools.full_evictable, pools.swa_used, pools.swa_evictable) == (0, 1599, 0, 343)
    follow = _request(a + answer + _ids(40, 3), [1, 2])
    await _serve(engine, follow)
    diverged = _request(a + answer[:300] + _ids(40, 4), [1, 2])
    await _serve(engine, diverged)
    assert (follow.cached_tokens, diverged.cached_tokens) == (1599, 1000)


async def test_every_prefill_chunk_is_cached(run_engine) -> None:
    """A 20,000-token prompt is prefilled in chunks of 16,384; the first chunk enters the cache
    when it is done, so a later prompt sharing 18,000 tokens hits the chunk's 16,384."""
    engine = run_engine()
    a = _ids(20_000, 1)
    await _serve(engine, _request(a, [1, 2]))
    sharer = _request(a[:18_000] + _ids(100, 2), [1, 2])
    await _serve(engine, sharer)
    assert sharer.cached_tokens == 16_384


async def test_requests_admitted_together_do_not_share(run_engine) -> None:
    """Two identical prompts admitted in the same step both compute it: neither is in the cache
    until a step has run."""
    engine = run_engine()
    a = _ids(1000, 1)
    twins = _request(a, [1, 2], "x"), _request(a, [1, 2], "y")
    await _serve(engine, *twins)
    assert [t.cached_tokens for t in twins] == [0, 0]


async def test_evictable_cache_is_evicted_before_anything_is_retracted(run_engine) -> None:
    """With a 5,000-token pool holding 4,000 cached tokens nobody uses, a 3,000-token prompt
    that will answer 1,500 tokens is admitted at once (cached KV counts as free) and runs to its
    end: the cache gives way, least recently used first, and nothing is retracted."""
    engine = run_engine(kv_capacity_tokens=5000)
    old, older = _ids(2000, 1), _ids(2000, 2)
    await _serve(engine, _request(older, [1]))
    await _serve(engine, _request(old, [1]))
    assert engine.cache.tree.full_evictable == 4000
    big = _request(_ids(3000, 3), _ids(1500, 4))
    await _serve(engine, big)
    tree = engine.cache.tree
    assert engine.retractions == 0 and big.admitted_at is not None
    assert tree.evicted_tokens_total >= 3000 + 1500 - 1000
    assert tree.match(b"", pack_ids(older), 1999).length == 0, "the older prompt went first"


async def test_retraction_keeps_cached_tokens_and_replays_from_the_cache(run_engine) -> None:
    """16 answers outgrow a 40,000-token pool: requests are retracted (nothing of them is
    inserted), go to the back of the queue and are admitted again, matching what the cache still
    holds of their prompts; their cached_tokens stay what their first admission found (0: every
    prompt is new), the hits of their replays are counted apart, and every answer finishes."""
    kept = _Kept()
    engine = run_engine(speed=500.0, kv_capacity_tokens=40_000, listener=kept)
    seqs = [_request(_ids(500, i), _ids(3000, 100 + i), f"r{i}") for i in range(16)]
    await _serve(engine, *seqs)
    shapes = [s.shape for s in kept.stretches]
    assert engine.retractions > 0 and all(s.cached_tokens == 0 for s in seqs)
    replay_hits = sum(s.reprocessed_cached_tokens for s in shapes)
    assert replay_hits > 0 and sum(s.cached_tokens for s in shapes) == replay_hits
    assert sum(s.prefill_tokens - s.reprocessed_tokens for s in shapes) == 16 * 500
    assert [engine.generated_tokens(s) for s in seqs] == [3000] * 16


async def test_short_sequences_fill_the_sliding_window_pool_first(run_engine) -> None:
    """A 50-token prompt decoding: shorter than a window and a jump, it holds as much KV in the
    sliding-window pool as in the full one, which is 0.8 of it, so the SWA pool's usage is what
    token_usage reports. Once past a window and a jump of output, SWA keeps that much while the
    full pool grows with every token, and the full pool is the fuller."""
    engine = run_engine(speed=5.0, kv_capacity_tokens=10_000)
    seq = _request(_ids(50, 1), _ids(2000, 2))
    engine.submit(seq)
    await seq.first_token
    await asyncio.sleep(0.05)
    now = engine.now()  # one instant for both reads: the clock moves between two calls
    out, pools = engine.generated_tokens(seq, now), engine.pool_usage(now)
    assert 1 < out < 200 and pools.full_used == pools.swa_used == 50 + out
    assert (pools.full_capacity, pools.swa_capacity) == (10_000, 8_000)
    assert pools.usage == pools.swa_used / 8_000 and pools.num_used_tokens == 50 + out
    reached = asyncio.get_running_loop().create_future()
    engine.call_at_tokens(seq, 600, lambda: reached.done() or reached.set_result(None))
    await reached
    now = engine.now()  # one instant for both reads: the clock moves between two calls
    out, pools = engine.generated_tokens(seq, now), engine.pool_usage(now)
    assert (pools.full_used, pools.swa_used) == (50 + out, 50 + 255)
    assert pools.usage == pools.full_used / 10_000
    engine.abort(seq, "done")


async def test_lpm_admits_the_longest_cached_prefix_first(run_engine) -> None:
    """With one request at a time, a queue of a new prompt and then one whose prompt is cached is
    served in arrival order under fcfs, and the cached one first under lpm."""
    for policy, first in (("fcfs", "new"), ("lpm", "cached")):
        engine = run_engine(max_running_requests=1, cache=CacheConfig(schedule_policy=policy))
        a = _ids(2000, 1)
        await _serve(engine, _request(a, [1]))
        busy = _request(_ids(100, 2), _ids(200, 3))
        engine.submit(busy)
        await busy.first_token
        new, cached = _request(_ids(2000, 4), [1], "new"), _request([*a, 9], [1], "cached")
        await _serve(engine, new, cached, busy)
        assert min((new, cached), key=lambda s: s.admitted_at).rid == first


# ---- a real emulator -----------------------------------------------------------------

MODEL = "openai/gpt-oss-120b"


@pytest.fixture
def reporting() -> Iterator[EmulatorProcess]:
    """One MI300X worker of the test's own, at its real speed, with --enable-cache-report."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--enable-cache-report"])
    yield emu
    emu.stop()


@pytest.fixture
def plain() -> Iterator[EmulatorProcess]:
    """One MI300X worker of the test's own, as SGLang starts by default (no cache report)."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", "20"])
    yield emu
    emu.stop()


def _long_message(seed: int) -> str:
    """A user message of some 3,000 tokens that no other test sends."""
    return " ".join(f"w{seed}x{i}" for i in range(1000))


async def test_openai_usage_reports_cached_tokens_with_the_flag(reporting: EmulatorProcess) -> None:
    """With --enable-cache-report, the official client reads usage.prompt_tokens_details
    .cached_tokens: 0 the first time (present even then), the prompt less its last token the
    second, for chat and completions, whole and streamed."""
    async with openai.AsyncOpenAI(base_url=reporting.urls[0] + "/v1", api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": _long_message(1)}]
        seen = []
        for _ in range(2):
            resp = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
            assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
            seen.append((resp.usage.prompt_tokens_details.cached_tokens, resp.usage.prompt_tokens))
        (first, prompt_tokens), (second, _) = seen
        assert prompt_tokens > 2000 and (first, second) == (0, prompt_tokens - 1)

        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, stream=True, stream_options={"include_usage": True}
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert usage[-1].prompt_tokens_details.cached_tokens == prompt_tokens - 1

        prompt = _ids(2500, 11)
        cached = []
        for _ in range(2):
            completion = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=3)
            assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
            cached.append(completion.usage.prompt_tokens_details.cached_tokens)
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
        usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
        assert [*cached, usage[-1].prompt_tokens_details.cached_tokens] == [0, 2499, 2499]


async def _sse_usage(http: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """The usage object of a streamed answer's last usage chunk, as sent."""
    usage = None
    async with http.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
    assert usage is not None
    return usage


async def test_without_the_flag_usage_carries_no_cached_tokens(plain: EmulatorProcess) -> None:
    """Without --enable-cache-report SGLang leaves the cache out of OpenAI usage: null in a chat
    answer and its streamed usage chunk, absent from a streamed completion's; /generate's
    meta_info still says cached_tokens and, with a hit, cached_tokens_details by tier."""
    url = plain.urls[0]
    async with aiohttp.ClientSession() as http:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": _long_message(2)}], "max_tokens": 3}
        for _ in range(2):
            async with http.post(url + "/v1/chat/completions", json=chat) as resp:
                assert (await resp.json())["usage"]["prompt_tokens_details"] is None
        usage = await _sse_usage(http, url + "/v1/chat/completions", chat)
        assert "prompt_tokens_details" in usage and usage["prompt_tokens_details"] is None
        usage = await _sse_usage(
            http, url + "/v1/completions", {"model": MODEL, "prompt": _ids(500, 12), "max_tokens": 3}
        )
        assert "prompt_tokens_details" not in usage
        body = {"input_ids": _ids(700, 13), "sampling_params": {"max_new_tokens": 3}}
        metas = []
        for _ in range(2):
            async with http.post(url + "/generate", json=body) as resp:
                metas.append((await resp.json())["meta_info"])
        assert [(m["cached_tokens"], m["cached_tokens_details"]) for m in metas] == [
            (0, None),
            (699, {"device": 699, "host": 0}),
        ]


async def _ttft(http: aiohttp.ClientSession, url: str, ids: list[int]) -> float:
    """Seconds from sending a streamed /generate to its first event."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}
    started = time.monotonic()
    async with http.post(url + "/generate", json=body) as resp:
        first = None
        async for line in resp.content:
            if line.startswith(b"data: {"):
                first = first or time.monotonic()
    assert first is not None
    return first - started


async def test_a_hit_skips_the_prefill_and_shows_in_metrics(reporting: EmulatorProcess) -> None:
    """An 8,000-token prompt sent again starts answering sooner by the prefill of the 7,999
    tokens the cache holds (the step model's 0.029 ms a token on an MI300X, ~232 ms), and the
    metrics say so: the last prefill pass's hit rate is 7,999 / 8,000, the cached tokens are
    counted as prefill_cache and device hits, and /v1/loads reads the same hit rate."""
    url = reporting.urls[0]
    prompt = _ids(8000, 21)
    async with aiohttp.ClientSession() as http:
        miss = await _ttft(http, url, prompt)
        hit = await _ttft(http, url, prompt)
        saved = PROFILES["mi300x"].rho_ms * 7999 / 1000
        assert miss - hit == pytest.approx(saved, abs=0.08), (miss, hit)
        m = await _metrics(http, url)
        assert m[("sglang:cache_hit_rate", "")] == pytest.approx(7999 / 8000)
        assert m[("sglang:realtime_tokens_total", "prefill_cache")] == 7999
        assert m[("sglang:prefill_effective_tokens_total", "device_hit")] == 7999
        assert m[("sglang:realtime_tokens_total", "prefill_compute")] == 8001
        async with http.get(url + "/v1/loads") as resp:
            load = (await resp.json())["loads"][0]
        assert load["cache_hit_rate"] == round(7999 / 8000, 4)
        assert (load["num_used_tokens"], load["token_usage"]) == (0, 0.0)


async def test_the_pool_gauges_count_cached_kv_as_evictable_and_evictions_show() -> None:
    """A 3,000-token pool. A 1,500-token prompt answered with 3 tokens leaves 1,502 tokens cached;
    the same prompt again, at its prefill pass's log point, holds the 1,499 it hit and the one it
    computed (used), the rest of the cache being evictable (3: the prompt's last token and 2 of
    the answer); in the SWA pool it holds one window of the hit and its token (128). The tokenizer
    counts its device hits in cached_tokens_total. A 2,000-token prompt that does not fit beside
    the cache evicts it (whole leaves), which the radix cache's counters say."""
    emu = launch(["--profile", "mi300x", "--workers", "1", "--speed", "20", "--max-total-tokens", "3000"])
    try:
        url = emu.urls[0]
        first = {"input_ids": _ids(1500, 41), "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
        async with aiohttp.ClientSession() as http:
            for _ in range(2):
                async with http.post(url + "/generate", json=first) as resp:
                    assert resp.status == 200
            text = await (await http.get(url + "/metrics")).text()
            m = {
                (s.name, s.labels.get("cache_source", "")): s.value
                for f in text_string_to_metric_families(text)
                for s in f.samples
            }
            assert m[("sglang:cached_tokens_total", "device")] == 1499
            assert m[("sglang:max_total_num_tokens_swa", "")] == 2400
            gauges = ("kv_used_tokens", "kv_evictable_tokens", "swa_used_tokens", "num_used_tokens")
            assert [m[(f"sglang:{name}", "")] for name in gauges] == [1500, 3, 128, 1500]
            big = {"input_ids": _ids(2000, 42), "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            async with http.post(url + "/generate", json=big) as resp:
                assert resp.status == 200
            text = await (await http.get(url + "/metrics")).text()
        m = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert m["sglang:evicted_tokens_total"] >= 1000 and m["sglang:eviction_duration_seconds_count"] >= 1
    finally:
        emu.stop()


async def test_flush_cache_empties_the_cache_only_when_idle(plain: EmulatorProcess) -> None:
    """/flush_cache answers 400 while a request runs and changes nothing; idle, it answers 200
    and the prompt cached before hits nothing. /server_info says how the cache is set up."""
    url = plain.urls[0]
    prompt = _ids(1500, 31)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 3}}
    async with aiohttp.ClientSession() as http:
        async with http.post(url + "/generate", json=body) as resp:
            assert resp.status == 200
        long_one = {"input_ids": _ids(50, 32), "stream": True, "sampling_params": {"max_new_tokens": 100_000}}
        async with http.post(url + "/generate", json=long_one) as running:
            await running.content.readline()
            async with http.post(url + "/flush_cache") as resp:
                assert resp.status == 400
            running.close()
        await asyncio.sleep(0.2)  # the disconnect aborts it
        async with http.post(url + "/generate", json=body) as resp:
            assert (await resp.json())["meta_info"]["cached_tokens"] == 1499, "the failed flush changed nothing"
        async with http.get(url + "/flush_cache") as resp:
            assert resp.status == 200 and (await resp.text()).startswith("Cache flushed.")
        async with http.post(url + "/generate", json=body) as resp:
            assert (await resp.json())["meta_info"]["cached_tokens"] == 0
        async with http.get(url + "/server_info") as resp:
            info = await resp.json()
    assert {k: info[k] for k in ("disable_radix_cache", "page_size", "schedule_policy", "radix_eviction_policy")} == {
        "disable_radix_cache": False,
        "page_size": 1,
        "schedule_policy": "fcfs",
        "radix_eviction_policy": "lru",
    }
    assert (info["enable_cache_report"], info["swa_full_tokens_ratio"]) == (False, 0.8)
    memory = info["internal_states"][0]["memory_usage"]
    assert memory == {"token_capacity": 970_000, "token_capacity_swa": 776_000}
