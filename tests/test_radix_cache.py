"""SGLang 0.5.23's prefix cache (RadixAttention) in the emulator, against cases worked out by hand
from SGLang's rules (nodes/emulator/radix_cache.py, prefix_cache.py) and, where the notes ran
SGLang's own tree, against what it gave: the tree alone, then requests through the engine, then a
real emulator process through aiohttp and the official `openai` client.

GPT-OSS keeps a sliding window of W = 127 tokens beside its full attention: a cached prefix is a
legal hit only where the 127 tokens before it still hold live sliding-window KV, which the tree
keeps only at the ends of what requests inserted."""

from __future__ import annotations

import random

from nodes.emulator.radix_cache import RadixTree, pack_ids

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
