"""The KV pools of one emulated GPU, counted as SGLang 0.5.23 counts them, in O(1) per request
event: a FULL pool (`--max-total-tokens`) and, for GPT-OSS's sliding-window layers, an SWA pool
of 0.8 of it (`model_executor/pool_configurator.py`, `--swa-full-tokens-ratio`).

Each pool's tokens are in use, evictable or available (`managers/scheduler_components/
pool_stats_observer.py`): in use is what requests hold alone plus the cached prefixes they lock
(a prefix locked by many counts once); evictable is cached KV nobody locks, which admission counts
as free and which is evicted only when an allocation finds too little available.

What requests hold alone, by where they are:
- running: their context (the engine's closed-form ΣL, which includes the slot each one writes in
  the next step) less the prefix the tree holds for them; in the SWA pool, that much up to one
  window and one 128-token jump (`prefix_cache.PrefixCache.swa_tail`): decode frees the rest;
- prefilling: what their chunks computed since their last checkpoint, in both pools;
- ended but not yet released (SGLang processes a step's result after scheduling the next one):
  what they had, less their prefix.

The running SWA sum, Σ min(own tokens, tail), grows by one per step for each request still under
its tail; `CappedSum` keeps it exact at every boundary with one heap entry per request. Within a
stretch it is reported as that growth, capped where every request would have reached its tail
(exact at both ends, a little high in between when requests reach it mid-stretch).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nodes.emulator.prefix_cache import PrefixCache, floor_page
from nodes.emulator.sequence import OUT, PREFILLING, RUNNING
from nodes.emulator.stretch import KvShape

if TYPE_CHECKING:
    from nodes.emulator.sequence import Sequence


class CappedSum:
    """Σ over members of min(a + sign·s, cap) at a step s that only grows. A member with sign +1
    grows until it reaches the cap; one with sign -1 stays at the cap until it falls below it.
    O(log n) per member added; stale heap entries are dropped when they outnumber the members."""

    def __init__(self, sign: int, cap: int) -> None:
        self.sign, self.cap = sign, cap
        self.linear_n = 0  # members on their linear part
        self._linear_a = 0  # Σ a over them
        self._capped_n = 0
        self._members: dict[Sequence, tuple[int, bool, int]] = {}  # member -> (a, linear, version)
        self._heap: list[tuple[int, int, Sequence, int]] = []  # (step it changes part, tiebreak, member, version)
        self._tiebreak = itertools.count()
        self._versions = itertools.count()

    def __len__(self) -> int:
        return len(self._members)

    def add(self, member: Sequence, a: int, step: int) -> None:
        change = self.cap - a if self.sign > 0 else a - self.cap  # the step it changes part
        linear = step < change if self.sign > 0 else step >= change
        version = next(self._versions)
        self._members[member] = (a, linear, version)
        if linear:
            self.linear_n += 1
            self._linear_a += a
        else:
            self._capped_n += 1
        if (self.sign > 0) == linear:  # it will change part
            heapq.heappush(self._heap, (change, next(self._tiebreak), member, version))
            if len(self._heap) > 2 * len(self._members) + 64:
                self._compact()

    def remove(self, member: Sequence) -> None:
        a, linear, _ = self._members.pop(member)
        if linear:
            self.linear_n -= 1
            self._linear_a -= a
        else:
            self._capped_n -= 1

    def value(self, step: int) -> int:
        """The sum at `step` (no earlier than any step asked before)."""
        self._advance(step)
        return self.cap * self._capped_n + self._linear_a + self.sign * self.linear_n * step

    def limit(self, step: int) -> int:
        """The value once every member has reached its cap (sign +1)."""
        return self.cap * (self._capped_n + self.linear_n) if self.sign > 0 else self.value(step)

    def _advance(self, step: int) -> None:
        heap = self._heap
        while heap and heap[0][0] <= step:
            _, _, member, version = heapq.heappop(heap)
            entry = self._members.get(member)
            if entry is None or entry[2] != version:
                continue
            a, linear, _ = entry
            self._members[member] = (a, not linear, version)
            if linear:
                self.linear_n -= 1
                self._linear_a -= a
                self._capped_n += 1
            else:
                self._capped_n -= 1
                self.linear_n += 1
                self._linear_a += a

    def _compact(self) -> None:
        live = {(member, version) for member, (_, _, version) in self._members.items()}
        self._heap = [e for e in self._heap if (e[2], e[3]) in live]
        heapq.heapify(self._heap)


@dataclass(frozen=True, slots=True)
class PoolUsage:
    """Both pools now, in SGLang's terms."""

    full_capacity: int
    swa_capacity: int
    full_used: int
    swa_used: int
    full_evictable: int
    swa_evictable: int

    @property
    def num_used_tokens(self) -> int:
        return max(self.full_used, self.swa_used)

    @property
    def usage(self) -> float:
        """The larger pool usage (SGLang's get_max_pool_usage)."""
        swa = self.swa_used / self.swa_capacity if self.swa_capacity else 0.0
        return max(self.full_used / self.full_capacity, swa)


class KvPools:
    """The FULL and SWA pools of one GPU and what is held in them."""

    def __init__(self, full_capacity: int, cache: PrefixCache) -> None:
        self.cache = cache
        self.tree = cache.tree
        self.full_capacity = full_capacity
        ratio = cache.config.swa_full_tokens_ratio
        self.swa_capacity = floor_page(int(full_capacity * ratio), cache.page) if cache.window is not None else 0
        self._full_fixed = 0  # Σ held alone by prefilling and ended requests, less Σ prefix of running ones
        self._swa_fixed = 0  # SWA held alone by prefilling and ended requests
        self._swa_running = CappedSum(+1, cache.swa_tail)
        self.on_eviction: Callable[[int, float], None] | None = None  # (FULL tokens freed, seconds) per pass

    # ---- membership ----------------------------------------------------------------

    def enter(self, seq: Sequence, group: int, step: int) -> None:
        """Count `seq` in `group` (its kv_len, kv_prot, and for RUNNING its join_step, set)."""
        assert seq.kv_group == OUT
        seq.kv_group = group
        if group == RUNNING:
            self._full_fixed -= seq.kv_prot
            if self.swa_capacity:
                own = seq.prompt_tokens + seq.generated - seq.kv_prot  # at its join step
                self._swa_running.add(seq, own - seq.join_step, step)
        else:
            own = seq.kv_len - seq.kv_prot
            self._full_fixed += own
            self._swa_fixed += self._swa_alone(own, group)

    def leave(self, seq: Sequence) -> None:
        group, seq.kv_group = seq.kv_group, OUT
        if group == RUNNING:
            self._full_fixed += seq.kv_prot
            if self.swa_capacity:
                self._swa_running.remove(seq)
        elif group != OUT:
            own = seq.kv_len - seq.kv_prot
            self._full_fixed -= own
            self._swa_fixed -= self._swa_alone(own, group)

    def _swa_alone(self, own: int, group: int) -> int:
        if not self.swa_capacity:
            return 0
        return own if group == PREFILLING else min(own, self.cache.swa_tail)

    # ---- reading -------------------------------------------------------------------

    def full_used(self, context: int) -> int:
        """FULL KV in use, given the running sequences' ΣL."""
        return self.tree.full_protected + context + self._full_fixed

    def swa_used(self, step: int) -> int:
        if not self.swa_capacity:
            return 0
        return self.tree.swa_protected + self._swa_running.value(step) + self._swa_fixed

    def usage(self, context: int, boundary: int, steps: int) -> PoolUsage:
        """The pools `steps` steps into the stretch that started at step `boundary` (`context`:
        the running ΣL then): SWA as the stretch's shape says it grows, so that a read in the
        middle of a stretch moves nothing past its boundary."""
        kv = self.shape(context, boundary)
        swa_used = min(kv.swa_used + kv.swa_growth * steps, kv.swa_used_limit) if self.swa_capacity else 0
        return PoolUsage(
            self.full_capacity,
            self.swa_capacity,
            kv.full_used,
            swa_used,
            kv.full_evictable,
            kv.swa_evictable,
        )

    def shape(self, context: int, step: int) -> KvShape:
        """The pools at the first step of a stretch starting at `step`."""
        swa_used = self.swa_used(step)
        return KvShape(
            full_used=self.full_used(context),
            swa_used=swa_used,
            swa_growth=self._swa_running.linear_n if self.swa_capacity else 0,
            swa_used_limit=swa_used + self._swa_running.limit(step) - self._swa_running.value(step)
            if self.swa_capacity
            else 0,
            full_evictable=self.tree.full_evictable,
            swa_evictable=self.tree.swa_evictable if self.swa_capacity else 0,
        )

    # ---- eviction ------------------------------------------------------------------

    def evict_to_available(self, context: int, step: int, full_tokens: int, swa_tokens: int = 0) -> None:
        """Evict until `full_tokens` FULL and `swa_tokens` SWA slots are available, as far as
        evictable KV allows (SGLang's evict_to_free_tokens: lazy, only for a shortfall)."""
        short = full_tokens - (self.full_capacity - self.full_used(context) - self.tree.full_evictable)
        swa_short = 0
        if self.swa_capacity:
            swa_short = swa_tokens - (self.swa_capacity - self.swa_used(step) - self.tree.swa_evictable)
        if short <= 0 and swa_short <= 0:
            return
        started, before = time.perf_counter(), self.tree.evicted_tokens_total
        if short > 0:
            self.tree.evict(short)
        if swa_short > 0:  # what the FULL eviction freed of it counts
            swa_short = swa_tokens - (self.swa_capacity - self.swa_used(step) - self.tree.swa_evictable)
            if swa_short > 0:
                self.tree.evict_swa(swa_short)
        freed = self.tree.evicted_tokens_total - before
        if freed and self.on_eviction is not None:
            self.on_eviction(freed, time.perf_counter() - started)
