"""SGLang 0.5.23's prefix cache (RadixAttention) as it runs for GPT-OSS: one token radix tree over
the worker's KV pools, FULL attention plus sliding-window attention (SWA).

What runs in SGLang is `mem_cache/unified_radix_cache.py` (`UnifiedRadixCache`) with a FULL and an
SWA component (paths under `sglang/srt/`; `uc/` is `mem_cache/unified_cache/`). This module keeps
what decides hits, sharing and eviction, with the same rules:

- A node is a slice of token ids. Every node in the tree holds FULL KV; its SWA KV is live or a
  tombstone (`uc/components/swa.py`). Children are keyed by their first page of tokens, and at the
  root by the namespace (`extra_key`, `cache_salt`) too, so namespaces never share.
- A match walks down, splits the node the match ends in, and returns the deepest *legal* stop
  (`uc/unified_tree_core.py` `_match_prefix_helper`): with SWA, a stop is legal only where the W
  tokens before it hold live SWA (a tombstone resets the count), or where no tombstone lies on the
  path at all. It also returns how far FULL KV reached, and from that the SWA branch point
  (`finalize_match_result_in_tree_core`). The best node and its ancestors get a fresh access time.
- An insert walks and touches the nodes it shares (splitting where it diverges), revives the SWA of
  shared tombstones inside the inserting request's live window, and hangs the rest as a new leaf
  whose SWA is live only from the request's SWA cursor on, a leaf capped at one window so a lock
  pins no more than that (`commit_insert_component_data`, `_maybe_split_leaf_for_swa_lock`).
- A lock holds the FULL KV of a node and all its ancestors, and the SWA KV of the nodes covering the
  last W tokens (`uc/components/full.py`, `swa.py` `acquire_component_lock`). Locked KV is
  "protected", unlocked KV "evictable"; both counts are kept per pool.
- Eviction frees least-recently-used unlocked leaves, whole, until enough is free; a parent that
  becomes a leaf is a candidate too. Under SWA pressure the least recently used unlocked live SWA
  goes: a leaf whole, an internal node by becoming a tombstone.

Keys are bytes, four per token, so a node compares with one C call and its first mismatch is
found with one XOR of two integers: a request event costs O(prompt) in C, not a Python loop per
token. The tree's size is bounded by the KV pool it caches; each node sits at most once in each
eviction heap, so those are bounded by the nodes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections.abc import Iterable
from dataclasses import dataclass

TOKEN_BYTES = 4  # a token id as a little-endian uint32 inside a key
# A heap holds one entry per node at most, plus those of nodes deleted since (dropped when popped,
# or all at once when they would be more than the nodes and this many).
HEAP_SLACK = 1024


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as a key."""
    return array("I", ids).tobytes()


def unpack_ids(key: bytes) -> list[int]:
    ids = array("I")
    ids.frombytes(key)
    return ids.tolist()


def key_tokens(key: bytes) -> int:
    return len(key) // TOKEN_BYTES


class Node:
    __slots__ = (
        "atime",
        "children",
        "ckey",
        "dead",
        "in_heap",
        "in_swa_heap",
        "key",
        "lock",
        "mark",
        "n",
        "parent",
        "swa",
        "swa_lock",
    )

    def __init__(self, key: bytes, parent: Node | None, ckey: bytes, swa: bool, atime: float) -> None:
        self.key = key
        self.n = len(key) >> 2  # its tokens
        self.parent = parent
        self.children: dict[bytes, Node] = {}
        self.ckey = ckey  # the key its parent files it under
        self.lock = 0  # FULL lock_ref: requests whose prefix runs through here
        self.swa_lock = 0  # SWA lock_ref: requests whose last window covers this node
        self.swa = swa  # live SWA KV (False: a tombstone, or a tree with FULL attention only)
        self.atime = atime  # last access, from the tree's logical clock
        self.mark = 0  # the upper edge of a request's SWA lock, when not 0 (SGLang's lock uuid)
        self.in_heap = False
        self.in_swa_heap = False
        self.dead = False


@dataclass(frozen=True, slots=True)
class Match:
    """What a match found: the legal hit and the node it ends at, how far FULL KV reached, and the
    SWA branch point (None unless FULL reached a page past the legal hit)."""

    length: int
    node: Node
    full_length: int
    branch: int | None


@dataclass(frozen=True, slots=True)
class Lock:
    """A request's hold on the tree: the node its prefix ends at, and where its SWA lock stops."""

    node: Node
    swa_mark: int


@dataclass(frozen=True, slots=True)
class Inserted:
    """The node an insert ended at and how many tokens it added to the tree."""

    node: Node
    new_tokens: int


class RadixTree:
    """One worker's token radix tree. `window` is the SWA window W the tree keeps (None: a model
    with FULL attention only, where every stop is legal); `disabled` is --disable-radix-cache:
    nothing matches, nothing is kept."""

    def __init__(self, *, page_size: int = 1, window: int | None = None, disabled: bool = False) -> None:
        self.page = page_size
        self.window = window
        self.disabled = disabled
        # SWA kept behind a cut: the window rounded up to whole pages (`mc/common.py`).
        self.window_pages = 0 if window is None else -(-max(window, page_size) // page_size) * page_size
        self._tiebreak = itertools.count()
        self._marks = itertools.count(1)
        self._empty()

    def _empty(self) -> None:
        self.root = Node(b"", None, b"", False, 0.0)
        self.root.lock = 1  # never evicted
        self.full_protected = self.full_evictable = 0
        self.swa_protected = self.swa_evictable = 0
        self.evicted_tokens_total = 0
        self.nodes = 0  # in the tree, root aside: what bounds the eviction heaps
        self._time = 0.0
        self._heap: list[tuple[float, int, Node]] = []
        # Built at the first SWA shortfall, kept from then on: most workloads never run short of
        # SWA, and filing every live window would cost each insert for nothing.
        self._swa_heap: list[tuple[float, int, Node]] | None = None

    # ---- sizes ---------------------------------------------------------------------

    @property
    def full_tokens(self) -> int:
        return self.full_protected + self.full_evictable

    def reset(self) -> None:
        """Empty the tree (SGLang's flush_cache, which runs only when nothing holds a lock)."""
        assert self.full_protected == 0, "reset with locked prefixes"
        evicted = self.evicted_tokens_total
        self._empty()
        self.evicted_tokens_total = evicted  # a counter: a flush frees, it does not evict

    # ---- matching ------------------------------------------------------------------

    def match(self, namespace: bytes, key: bytes, limit: int) -> Match:
        """The longest legal cached prefix of `key`'s first `limit` tokens (floored to a page)."""
        n = min(key_tokens(key), limit) // self.page * self.page
        if self.disabled or n <= 0:
            return Match(0, self.root, 0, None)
        window = self.window
        node, pos, full = self.root, 0, 0
        best, best_len = self.root, 0
        run = math.inf  # live SWA tokens since the last tombstone on the path
        child = node.children.get(namespace + key[: self.page * TOKEN_BYTES])
        while child is not None:
            common = self._common(key, pos, n, child)
            full += common
            whole = common == child.n
            if not whole:
                child = self._split(child, common)
            if window is not None:
                if child.swa:
                    run += common
                else:
                    run = 0
            if window is None or (child.swa and run >= window):
                best, best_len = child, pos + common
            node, pos = child, pos + common
            if not whole or pos >= n:
                break
            child = node.children.get(key[pos * TOKEN_BYTES : (pos + self.page) * TOKEN_BYTES])
        self._touch_path(best)
        branch = None
        if window is not None:
            aligned = full // self.page * self.page
            branch = aligned if aligned > best_len else None
        return Match(best_len, best, full, branch)

    def _common(self, key: bytes, pos: int, n: int, node: Node) -> int:
        """Tokens `key[pos:n]` shares with `node`'s slice, floored to a page."""
        start = pos * TOKEN_BYTES
        width = min(len(node.key), (n - pos) * TOKEN_BYTES)
        if key.startswith(node.key[:width] if width < len(node.key) else node.key, start):
            common = width >> 2
        else:
            x = int.from_bytes(key[start : start + width], "big") ^ int.from_bytes(node.key[:width], "big")
            common = (width - 1 - ((x.bit_length() - 1) >> 3)) >> 2
        return common // self.page * self.page

    def _split(self, child: Node, tokens: int) -> Node:
        """Cut `child` after `tokens` tokens; the new upper node takes its place and its locks,
        liveness, access time and SWA-lock edge (`redistribute_on_node_split`)."""
        cut = tokens * TOKEN_BYTES
        parent = child.parent
        assert parent is not None
        upper = Node(child.key[:cut], parent, child.ckey, child.swa, child.atime)
        self.nodes += 1
        upper.lock, upper.swa_lock = child.lock, child.swa_lock
        upper.mark, child.mark = child.mark, 0
        child.key = child.key[cut:]
        child.n -= tokens
        child.ckey = child.key[: self.page * TOKEN_BYTES]
        child.parent = upper
        upper.children[child.ckey] = child
        parent.children[upper.ckey] = upper
        self._offer_swa(upper)  # live and unlocked: an SWA eviction candidate of its own
        return upper

    def _touch_path(self, node: Node) -> None:
        """A match's access: the node and its ancestors, more recent deeper (`_match_post_processor`)."""
        self._time += 1.0
        t = self._time
        while node is not self.root:
            node.atime = t
            t -= 1e-5
            node = node.parent  # type: ignore[assignment]

    def _touch(self, node: Node) -> None:
        self._time += 1.0
        node.atime = self._time

    # ---- inserting -----------------------------------------------------------------

    def insert(self, namespace: bytes, key: bytes, *, protected: int, swa_from: int) -> Inserted:
        """Cache `key` (its whole pages) for a request whose first `protected` tokens the tree
        already holds for it and whose SWA KV is live from `swa_from` on."""
        n = key_tokens(key) // self.page * self.page
        node, pos = self.root, 0
        if self.disabled or n == 0:
            return Inserted(node, 0)
        window = self.window
        child = node.children.get(namespace + key[: self.page * TOKEN_BYTES])
        while child is not None:
            self._touch(child)
            common = self._common(key, pos, n, child)
            if common < child.n:
                child = self._split(child, common)
            end = pos + common
            live_from = max(pos, swa_from, protected)
            if window is not None and not child.swa and live_from < end:
                # A shared tombstone inside the request's live window gets its SWA back from the
                # KV the request computed (`update_component_on_insert_overlap`).
                if live_from > pos:
                    self._split(child, live_from - pos)
                self._set_swa(child, True)
            node, pos = child, end
            if pos >= n:
                return Inserted(node, 0)
            child = node.children.get(key[pos * TOKEN_BYTES : (pos + self.page) * TOKEN_BYTES])
        leaf_key = key[pos * TOKEN_BYTES : n * TOKEN_BYTES]
        ckey = (namespace if node is self.root else b"") + leaf_key[: self.page * TOKEN_BYTES]
        self._time += 1.0
        leaf = Node(leaf_key, node, ckey, False, self._time)
        self.nodes += 1
        node.children[ckey] = leaf
        self.full_evictable += n - pos
        if window is not None:
            live_from = max(pos, swa_from)
            if live_from < n:
                live = leaf if live_from == pos else self._split_below(leaf, live_from - pos)
                tail = self.window_pages
                if live.n > tail:  # a lock pins one window, not the whole leaf
                    self._set_swa(self._split(live, live.n - tail), True)
                self._set_swa(live, True)
        self._offer(leaf)
        return Inserted(leaf, n - pos)

    def _split_below(self, node: Node, tokens: int) -> Node:
        """Split and return the lower part (the node itself, now shorter)."""
        self._split(node, tokens)
        return node

    def _set_swa(self, node: Node, live: bool) -> None:
        if node.swa == live:
            return
        node.swa = live
        delta = node.n if live else -node.n
        if node.swa_lock:
            self.swa_protected += delta
        else:
            self.swa_evictable += delta
            if live:
                self._offer_swa(node)

    # ---- locks -----------------------------------------------------------------------

    def lock(self, node: Node) -> Lock:
        """Hold `node`'s prefix: FULL up to the root, SWA over its last window."""
        if node is self.root:
            return Lock(node, 0)
        cur: Node | None = node
        while cur is not self.root:
            assert cur is not None
            if cur.lock == 0:
                self.full_evictable -= cur.n
                self.full_protected += cur.n
            cur.lock += 1
            cur = cur.parent
        if self.window is None:
            return Lock(node, 0)
        cur, covered, mark = node, 0, 0
        while cur is not self.root and covered < self.window:
            assert cur is not None
            if cur.swa_lock == 0 and cur.swa:
                self.swa_evictable -= cur.n
                self.swa_protected += cur.n
            cur.swa_lock += 1
            covered += cur.n
            if covered >= self.window:
                if not cur.mark:
                    cur.mark = next(self._marks)
                mark = cur.mark
            cur = cur.parent
        return Lock(node, mark)

    def unlock(self, lock: Lock) -> None:
        node = lock.node
        if node is self.root:
            return
        cur: Node | None = node
        while cur is not self.root:
            assert cur is not None and cur.lock > 0
            cur.lock -= 1
            if cur.lock == 0:
                self.full_protected -= cur.n
                self.full_evictable += cur.n
                self._offer(cur)
            cur = cur.parent
        if self.window is None:
            return
        cur = node
        while cur is not self.root:
            assert cur is not None and cur.swa_lock > 0
            cur.swa_lock -= 1
            if cur.swa_lock == 0:
                if cur.swa:
                    self.swa_protected -= cur.n
                    self.swa_evictable += cur.n
                    self._offer_swa(cur)
                self._offer(cur)
            if lock.swa_mark and cur.mark == lock.swa_mark:
                break
            cur = cur.parent

    # ---- eviction --------------------------------------------------------------------

    def _offer(self, node: Node) -> None:
        """A node that may have become an evictable leaf joins the FULL heap (once)."""
        if not node.in_heap and not node.children and not node.lock and not node.swa_lock:
            node.in_heap = True
            heapq.heappush(self._heap, (node.atime, next(self._tiebreak), node))
            if len(self._heap) > 2 * self.nodes + HEAP_SLACK:
                self._heap = _without_dead(self._heap)

    def _offer_swa(self, node: Node) -> None:
        """A node with live SWA nobody locks joins the SWA heap (once), if it is kept."""
        if self._swa_heap is not None and not node.in_swa_heap and node.swa and not node.swa_lock:
            node.in_swa_heap = True
            heapq.heappush(self._swa_heap, (node.atime, next(self._tiebreak), node))
            if len(self._swa_heap) > 2 * self.nodes + HEAP_SLACK:
                self._swa_heap = _without_dead(self._swa_heap)

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` FULL tokens, least recently used whole leaves first, as far as
        unlocked KV allows; the FULL tokens freed."""
        freed = 0
        heap = self._heap
        while freed < tokens and heap:
            atime, _, node = heapq.heappop(heap)
            node.in_heap = False
            if node.dead or node.children or node.lock or node.swa_lock:
                continue
            if atime != node.atime:  # touched since it was filed: file it again, in order
                self._offer(node)
                continue
            freed += self._delete(node)
        return freed

    def evict_swa(self, tokens: int) -> int:
        """Free at least `tokens` SWA tokens, least recently used first: an unlocked leaf whole, a
        node that keeps descendants or a FULL lock by becoming a tombstone; the SWA tokens freed."""
        freed = 0
        if self._swa_heap is None:
            self._swa_heap = []
            stack = [self.root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                self._offer_swa(node)
        heap = self._swa_heap
        while freed < tokens and heap:
            atime, _, node = heapq.heappop(heap)
            node.in_swa_heap = False
            if node.dead or not node.swa or node.swa_lock:
                continue
            if atime != node.atime:
                self._offer_swa(node)
                continue
            freed += node.n
            if not node.children and not node.lock:
                self._delete(node)
            else:
                self._set_swa(node, False)
        return freed

    def _delete(self, node: Node) -> int:
        parent = node.parent
        assert parent is not None
        del parent.children[node.ckey]
        node.dead = True
        self.nodes -= 1
        self.full_evictable -= node.n
        if node.swa:
            self.swa_evictable -= node.n
        self.evicted_tokens_total += node.n
        if parent is not self.root:
            self._offer(parent)
        return node.n


def _without_dead(heap: list[tuple[float, int, Node]]) -> list[tuple[float, int, Node]]:
    """A heap without the entries of deleted nodes (the SWA heap is popped only under SWA
    pressure, so without this it would keep every node ever deleted)."""
    kept = [entry for entry in heap if not entry[2].dead]
    heapq.heapify(kept)
    return kept
