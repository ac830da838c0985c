"""What SGLang 0.5.23's scheduler does with the prefix cache for one request, over the worker's
`RadixTree` (nodes/emulator/radix_cache.py). Paths are under `sglang/srt/`; `sb` is
`managers/schedule_batch.py`, `mc/` is `mem_cache/`.

- At each admission attempt the request's tokens so far (prompt, then any output a retraction left
  it) are matched, capped at their length less one: the last token is always computed
  (`sb` `_compute_max_prefix_len`, `mc/common.py` `match_kv_cache`). Admitted, it locks the node
  the hit ends at; the hit's KV is the tree's, which it now protects (`cache_protected_len`).
- A checkpoint inserts what the request computed so far and moves its lock to the node the insert
  ended at (`mc/unified_radix_cache.py` `checkpoint_into_tree`): after each prefill chunk, at the
  end of its prefill, and when it ends (finished, or aborted while running) with what has KV:
  prompt and output but the last token. If its match found FULL KV deeper than its legal hit (the
  SWA branch point), its next checkpoint that reaches that point inserts only up to it.
- SWA: a request frees its own sliding-window KV behind a cursor (`mc/common.py`
  `free_swa_out_of_window_slots`, never below the prefix the tree holds for it): before a prefill
  checkpoint, to one window behind its end; while decoding, by jumps of 128 once a window and
  128 tokens lie behind the position it writes. What it inserts is live SWA only from its cursor
  on; the tree keeps the rest as tombstones. So a prompt cached at its prefill keeps live SWA for
  its last window only, and a finished answer for its last window and at most 128 more tokens.

A request whose prompt ids the emulator does not know (empty `ids`) neither matches nor inserts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nodes.emulator.radix_cache import TOKEN_BYTES, Match, RadixTree

if TYPE_CHECKING:
    from nodes.emulator.sequence import Sequence

GPT_OSS_SLIDING_WINDOW = 127  # models/gpt_oss.py: get_attention_sliding_window_size is sliding_window - 1
SWA_EVICTION_INTERVAL = 128  # SGLANG_SWA_EVICTION_INTERVAL: decode frees its SWA in jumps of this many tokens
SWA_FULL_TOKENS_RATIO = 0.8  # --swa-full-tokens-ratio: the SWA pool's size over the FULL pool's
SCHEDULE_POLICIES = ("fcfs", "lpm", "lof")  # of SGLang's --schedule-policy choices, those emulated


@dataclass(frozen=True, slots=True)
class PriorityScheduling:
    """SGLang 0.5.23's request priority (`--enable-priority-scheduling` and its flags,
    `arg_groups/fields/schedule.py`): the waiting queue sorted by each request's `priority`,
    larger first unless `--schedule-low-priority-values-first`."""

    enabled: bool = False
    low_values_first: bool = False
    default_value: int | None = None  # --default-priority-value
    # A waiting request preempts running ones of a priority more than `threshold` below its own
    # when the batch is full (on unless --disable-priority-preemption; the threshold is
    # --priority-scheduling-preemption-threshold, strictly exceeded).
    preemption: bool = True
    threshold: int = 10

    @property
    def preempts(self) -> bool:
        """SGLang's enable_priority_preemption."""
        return self.enabled and self.preemption

    def preempts_over(self, waiting: int, running: int) -> bool:
        """A request of priority `waiting` may preempt one of priority `running` (SGLang's
        priority_diff, in the favoured direction, past the threshold)."""
        return (waiting - running) * -self.sign > self.threshold

    def value_of(self, asked: int | None) -> int:
        """A request's priority in the queue: what it asked, else the server's default, else the
        least favoured of all (`TokenizerManager._set_default_priority`, then the scheduler's
        `_set_or_validate_priority`)."""
        if asked is not None:
            return asked
        if self.default_value is not None:
            return self.default_value
        return sys.maxsize if self.low_values_first else -sys.maxsize - 1

    @property
    def sign(self) -> int:
        """SGLang's priority_sign: a queue sorted by priority × sign serves the favoured first."""
        return 1 if self.low_values_first else -1


PRIORITY_POLICIES = ("fcfs", "lof")  # SGLang allows priority scheduling with these only


def priority_policy_refused(policy: str) -> str:
    """SGLang's own refusal of priority scheduling under another policy, in its words
    (arg_groups/validation_hook.py)."""
    return f"To use priority scheduling, schedule_policy must be 'fcfs' or 'lof'. '{policy}' is not supported."


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The server arguments that shape the prefix cache and the admission order."""

    disable_radix_cache: bool = False
    page_size: int = 1  # SGLang's --page-size (None resolves to 1 on AMD GPUs)
    schedule_policy: str = "fcfs"
    sliding_window: int | None = GPT_OSS_SLIDING_WINDOW  # None: a model with FULL attention only
    swa_full_tokens_ratio: float = SWA_FULL_TOKENS_RATIO
    priority: PriorityScheduling = PriorityScheduling()

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be at least 1")
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(
                f"schedule_policy {self.schedule_policy!r} is not emulated; use one of {SCHEDULE_POLICIES}"
            )
        if self.priority.enabled and self.schedule_policy not in PRIORITY_POLICIES:
            raise ValueError(priority_policy_refused(self.schedule_policy))


def namespace(extra_key: str | None, cache_salt: str | None) -> bytes:
    """The part of a request's cache key besides its tokens: requests with different extra_key or
    cache_salt never share a prefix (`mem_cache/radix_cache.py` RadixKey.child_key)."""
    if not extra_key and not cache_salt:
        return b""
    return repr((extra_key or None, cache_salt or None)).encode()


def floor_page(tokens: int, page: int) -> int:
    return tokens // page * page


def ceil_page(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


def estimate_swa_tokens(extend: int, max_new: int, *, window: int, page: int, chunk_limit: int) -> int:
    """SGLang's SWA charge for admitting a request (`mem_cache/prefill_budget.py`
    estimate_swa_kv_tokens): its extend past one window, plus the window, plus a page."""
    allocated = min(extend, chunk_limit)
    return max(allocated - window, 0) + min(extend + max_new, window) + page


class PrefixCache:
    """The tree and the per-request operations SGLang's scheduler performs on it."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.page = config.page_size
        self.window = config.sliding_window
        self.tree = RadixTree(page_size=self.page, window=self.window, disabled=config.disable_radix_cache)
        # A request's own live SWA never exceeds one window (rounded to pages) and one jump.
        self.swa_tail = self.tree.window_pages + SWA_EVICTION_INTERVAL if self.window is not None else 0

    @property
    def enabled(self) -> bool:
        return not self.tree.disabled

    def fill_key(self, seq: Sequence, tokens: int) -> bytes:
        """The first `tokens` of the request's prompt and output, as a key."""
        prompt = len(seq.ids)
        if tokens * TOKEN_BYTES <= prompt:
            return seq.ids[: tokens * TOKEN_BYTES]
        assert seq.output_ids is not None
        return seq.ids + seq.output_ids(tokens - prompt // TOKEN_BYTES)

    def match(self, seq: Sequence) -> Match:
        """Match at an admission attempt: the tokens so far, less the last."""
        fill = seq.prompt_tokens + seq.generated
        if not seq.ids or not self.enabled:
            return Match(0, self.tree.root, 0, None)
        return self.tree.match(seq.namespace, self.fill_key(seq, fill), fill - 1)

    def touch(self, seq: Sequence) -> None:
        """SGLang's waiting-prefix refresh: a match for its access times only (`touch_prefix`)."""
        if seq.ids and self.enabled:
            fill = seq.prompt_tokens + seq.generated
            self.tree.match(seq.namespace, self.fill_key(seq, fill), fill)

    def admit(self, seq: Sequence, match: Match) -> None:
        """The request takes its hit: it locks the prefix, which is its KV up to there."""
        seq.cache_lock = self.tree.lock(match.node) if match.length else None
        seq.hit = seq.kv_prot = match.length
        seq.branch = match.branch
        seq.swa_cursor = 0

    def unlock(self, seq: Sequence) -> None:
        if seq.cache_lock is not None:
            self.tree.unlock(seq.cache_lock)
            seq.cache_lock = None

    def checkpoint(self, seq: Sequence, up_to: int) -> None:
        """Insert the first `up_to` tokens a running or prefilling request has computed and hold
        them (a prefill chunk or the prompt's end)."""
        if not seq.ids or not self.enabled:
            return
        length, branched = self._branch_cut(seq, up_to)
        if self.window is not None:
            self._free_window(seq, length - 1, 1)
        aligned = floor_page(length, self.page)
        if aligned > seq.kv_prot:
            inserted = self.tree.insert(
                seq.namespace, self.fill_key(seq, aligned), protected=seq.kv_prot, swa_from=seq.swa_cursor
            )
            old, seq.cache_lock = seq.cache_lock, self.tree.lock(inserted.node)
            if old is not None:
                self.tree.unlock(old)
            seq.kv_prot = aligned
        if branched:
            seq.branch = None
            if self.window is not None:  # the window behind the whole computed length goes too
                self._free_window(seq, seq.prompt_tokens + seq.generated - 1, 1)

    def release(self, seq: Sequence, committed: int | None, decode_from: int) -> None:
        """The request ends: with `committed` tokens of KV to keep (finished, or aborted while
        running), or None (retracted, or aborted before it ran: nothing is inserted). Its decode
        wrote positions `decode_from` up to `committed` - 1."""
        if committed is not None and seq.ids and self.enabled:
            length, _ = self._branch_cut(seq, committed)
            aligned = floor_page(length, self.page)
            if aligned > seq.kv_prot:
                swa_from = self._decode_cursor(seq, decode_from, committed - 1) if self.window is not None else 0
                self.tree.insert(seq.namespace, self.fill_key(seq, aligned), protected=seq.kv_prot, swa_from=swa_from)
        self.unlock(seq)
        seq.hit = seq.kv_prot = seq.swa_cursor = 0
        seq.branch = None

    def _branch_cut(self, seq: Sequence, up_to: int) -> tuple[int, bool]:
        """The insert stops at the SWA branch point the first time it reaches it
        (`uc/components/swa.py` `prepare_for_caching_req`)."""
        branch = seq.branch
        if branch is not None and seq.kv_prot < branch <= up_to:
            return branch, True
        return up_to, False

    def _free_window(self, seq: Sequence, pre_len: int, interval: int) -> None:
        """Move the request's SWA cursor as `free_swa_out_of_window_slots(req, pre_len)` does."""
        assert self.window is not None
        cursor = seq.swa_cursor
        if pre_len - self.window < cursor + interval:
            return
        cursor = max(cursor, seq.kv_prot)  # the tree's part is not the request's to free
        seq.swa_cursor = max(cursor, floor_page(pre_len - self.tree.window_pages, self.page))

    def _decode_cursor(self, seq: Sequence, first: int, last: int) -> int:
        """The SWA cursor after decode wrote positions `first`..`last` (`sb` `prepare_for_decode`:
        once the position is a window and 128 tokens past the cursor, the cursor jumps to a window
        behind it, but never below the prefix the tree holds): the first jump, then the same jump
        again every so many positions, in closed form."""
        assert self.window is not None
        cursor, reach = seq.swa_cursor, SWA_EVICTION_INTERVAL + self.window
        position = max(first, cursor + reach)
        if position > last:
            return cursor
        cursor = max(cursor, seq.kv_prot, floor_page(position - self.tree.window_pages, self.page))
        jump = floor_page(reach - self.tree.window_pages, self.page)
        position = cursor + reach
        if position <= last and jump > 0:
            cursor += ((last - position) // jump + 1) * jump
        return cursor
