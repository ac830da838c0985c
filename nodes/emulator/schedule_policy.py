"""The order SGLang 0.5.23 admits waiting requests in, per --schedule-policy, and what that order
does to the prefix cache (`managers/schedule_policy.py`, `SchedulePolicy.calc_priority`, run at the
start of each scheduling round).

- fcfs (the default): arrival order. No match at this point; but every 32nd round the first 128
  waiting requests are matched for their access times alone, last one first, so LRU eviction
  spares the prefixes the queue's head will want soonest (`_touch_waiting_prefixes`).
- lof: longest max_new_tokens first (a stable sort), with the same refresh.
- lpm: with at most 128 waiting (else fcfs), every waiting request is matched and the longest hit
  goes first. A request whose hit is at most 32 tokens is looked up in a scratch tree of the
  waiting requests before it: if it shares at least 32 tokens with one of them it goes last, so one
  of them fills the cache for the others (`_compute_prefix_matches`, in-batch prefix caching).
With the cache disabled, lpm is fcfs and nothing is refreshed.

With --enable-priority-scheduling (fcfs and lof only), the queue is sorted by each request's
priority first (larger first, unless --schedule-low-priority-values-first): fcfs then by when it
entered the queue (a retracted or preempted request re-enters it then), lof by the longest
max_new_tokens.

Then the prefill adder (`PrefillAdder`) takes requests in that order for the next step. With
priority preemption (SGLang's default under priority scheduling), a request that finds the batch
full by count preempts running requests (`preempt_to_schedule`, the engine's part).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nodes.emulator.prefix_cache import ceil_page, estimate_swa_tokens, floor_page
from nodes.emulator.radix_cache import RadixTree
from nodes.emulator.sequence import PREFILLING, SeqState

if TYPE_CHECKING:
    from nodes.emulator.kv_pools import KvPools
    from nodes.emulator.prefix_cache import PrefixCache, PriorityScheduling
    from nodes.emulator.sequence import Sequence

CLIP_MAX_NEW_TOKENS = 4096  # SGLang clips max_new_tokens to this when estimating KV need

WAITING_QUEUE_PREFIX_MATCH_MAX = 128  # lpm falls back to fcfs past this many waiting; the refresh's reach
WAITING_PREFIX_REFRESH_INTERVAL = 32  # rounds between two waiting-prefix refreshes
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32  # a hit at most this long is checked against the queue
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32  # sharing this much with a request before it: last


def refresh_block(rounds: int) -> int:
    """The block of WAITING_PREFIX_REFRESH_INTERVAL rounds that round number `rounds` (from 1;
    rounds that order the queue only) falls in: one refresh per block, at its first round."""
    return (rounds - 1) // WAITING_PREFIX_REFRESH_INTERVAL


def order_waiting(cache: PrefixCache, waiting: deque[Sequence], refresh: bool) -> None:
    """Order the queue for a round as the policy does, with its effects on the cache; `refresh`:
    a waiting-prefix refresh falls due in this round (or in a step since the last one)."""
    policy = cache.config.schedule_policy
    if policy == "lpm" and cache.enabled and len(waiting) <= WAITING_QUEUE_PREFIX_MATCH_MAX:
        _longest_prefix_first(cache, waiting)  # never under priority scheduling (CacheConfig refuses it)
        return
    key = _sort_key(policy, cache.config.priority)
    if key is not None:
        _reorder(waiting, sorted(waiting, key=key))
    if refresh and cache.enabled:
        for i in range(min(len(waiting), WAITING_QUEUE_PREFIX_MATCH_MAX) - 1, -1, -1):
            cache.touch(waiting[i])


def _sort_key(policy: str, priority: PriorityScheduling) -> Callable[[Sequence], Any] | None:
    """calc_priority's sort key for fcfs and lof, with or without priority scheduling (None: the
    queue stays in arrival order)."""
    if priority.enabled:
        sign = priority.sign
        if policy == "lof":
            return lambda s: (s.priority * sign, -s.max_new_tokens)
        return lambda s: (s.priority * sign, s.queue_entry_at)
    return (lambda s: -s.max_new_tokens) if policy == "lof" else None


def _longest_prefix_first(cache: PrefixCache, waiting: deque[Sequence]) -> None:
    scratch = RadixTree(page_size=cache.page)  # SGLang's simulated tree: FULL only, reset each round
    last: set[Sequence] = set()
    for seq in waiting:
        seq.matched = cache.match(seq).length
        if seq.matched <= IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD and seq.ids:
            key = cache.fill_key(seq, seq.prompt_tokens + seq.generated)
            shared = scratch.match(seq.namespace, key, seq.prompt_tokens + seq.generated).length
            if shared >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD:
                last.add(seq)
            else:
                scratch.insert(seq.namespace, key, protected=0, swa_from=0)
    _reorder(waiting, sorted(waiting, key=lambda s: math.inf if s in last else -s.matched))


def _reorder(waiting: deque[Sequence], order: list[Sequence]) -> None:
    waiting.clear()
    waiting.extend(order)


# ---- the prefill adder ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillRound:
    """What the adder put in the next step: its prompt tokens and those of retracted requests,
    the cache hits of the requests it admitted and those of retracted ones, and when the first
    request it could not look at yet arrives (inf: none)."""

    tokens: int = 0
    reprocessed: int = 0
    hits: int = 0
    rehits: int = 0
    next_arrival: float = math.inf


# Makes room for a waiting request by preempting running ones, given the KV tokens it lacks:
# (requests preempted, the KV reserve they freed), or None when it may not (the engine's).
Preempt = Callable[["Sequence", float], "tuple[int, float] | None"]


def add_prefill(
    cache: PrefixCache,
    pools: KvPools,
    waiting: deque[Sequence],
    prefilling: deque[Sequence],
    *,
    running: int,
    max_running: int,
    budget: int,
    step: int,
    context: Callable[[], int],
    reserved: float,
    now: float,
    preempt: Preempt | None = None,
) -> PrefillRound:
    """The next step's prompt chunks, as SGLang's prefill adder takes them
    (`managers/schedule_policy.py` `PrefillAdder`): the chunked request first, then waiting
    requests in order, each matched now, admitted while the running-request limit, the chunk
    budget and the KV pools allow; the first that does not fit ends the round (an idle GPU takes
    it anyway). A request is charged its uncached prompt, its output up to 4,096 and a page
    against the available and evictable KV, less `reserved` (what the running requests may still
    write) and what this round admitted; the SWA pool its own estimate. The prefix it gets from
    the cache is neither computed nor charged to the chunk budget; a request the budget cannot
    finish is cut on a page and goes on next round. `context`: the running requests' ΣL now.
    With `preempt`, a request that finds the batch full by count makes room by preemption, as
    SGLang's scheduler does under priority preemption: only then (a round cut short by the KV
    pools never preempts, SGLang's batch_is_full being reset each round), and charged what it
    would take less what the pools have left, from its last match."""
    page, window = cache.page, cache.window
    total = reprocessed = hits = rehits = 0
    offset, swa_offset = reserved, 0
    if prefilling:  # the chunked request goes on, with no new match
        seq = prefilling[0]
        seq.chunk = total = _cut(seq, budget, seq.prefill_left, page)
        budget -= total
        reprocessed = total if seq.retractions else 0
        if total < seq.prefill_left:
            return PrefillRound(total, reprocessed)
        offset += ceil_page(total, page) + page
    while waiting and budget > 0:
        seq = waiting[0]
        if seq.queued_at > now:
            return PrefillRound(total, reprocessed, hits, rehits, seq.queued_at)
        if running + len(prefilling) >= max_running:
            if preempt is None:
                break
            max_new = min(seq.max_new_tokens - seq.generated, CLIP_MAX_NEW_TOKENS)
            need = seq.prompt_tokens + seq.generated - seq.matched + max_new + page
            room = preempt(seq, need - (pools.full_capacity - pools.full_used(context()) - offset))
            if room is None:
                break
            running, offset = running - room[0], offset - room[1]
        match = cache.match(seq)
        seq.matched = match.length
        extend = seq.prompt_tokens + seq.generated - match.length
        max_new = min(seq.max_new_tokens - seq.generated, CLIP_MAX_NEW_TOKENS)
        cache.admit(seq, match)  # the check runs with the prefix locked (`_lock_node`)
        fits = extend + max_new + page < pools.full_capacity - pools.full_used(context()) - offset
        if window is not None and fits:
            need = estimate_swa_tokens(ceil_page(extend, page), max_new, window=window, page=page, chunk_limit=budget)
            fits = need < pools.swa_capacity - pools.swa_used(step) - swa_offset
        seq.kv_len = match.length
        take = _cut(seq, budget, extend, page)
        if (not fits and (running or prefilling)) or take <= 0:
            cache.release(seq, None, 0)
            break
        waiting.popleft()
        seq.state = SeqState.PREFILL
        seq.prefill_left, seq.chunk = extend, take
        if seq.admitted_at is None:
            seq.admitted_at = now
        if seq.retractions:  # its cached_tokens stay what its first admission found
            rehits += match.length
            reprocessed += take
        else:
            seq.cached_tokens = match.length
        hits += match.length
        prefilling.append(seq)
        pools.enter(seq, PREFILLING, step)
        total, budget = total + take, budget - take
        chunked = take < extend
        offset += ceil_page(take, page) + page + (0 if chunked else max_new)
        if window is not None:
            swa_offset += estimate_swa_tokens(
                ceil_page(take, page), 0 if chunked else max_new, window=window, page=page, chunk_limit=budget
            )
        if chunked:
            break
    return PrefillRound(total, reprocessed, hits, rehits)


def _cut(seq: Sequence, budget: int, left: int, page: int) -> int:
    """How much of the `left` prompt tokens a chunk of `budget` takes: all, or as much as ends on
    a page."""
    if left <= budget:
        return left
    return floor_page(seq.kv_len + budget, page) - seq.kv_len
