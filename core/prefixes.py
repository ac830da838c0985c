"""Where a prompt's prefix is likely cached, known by hashes only.

SGLang keeps every prompt's KV in a radix tree, so a request whose prefix a worker holds skips
that prefill (docs/CACHE.md). To send a request where its prefix is, the federation must know
where each prefix went, without any prompt leaving the gateway that saw it: the gateway cuts
the prompt's token ids into blocks of BLOCK_TOKENS and sends only a chain of block hashes
(`prefix_hashes`: each block's hash covers every block before it, so equal hashes mean equal
prefixes). A `PrefixDirectory` remembers which places (sites at the schedulers, workers at an
agent) were recently sent which hashes, within a fixed number of entries, least recently used
first out, and says for a new request how many of its leading tokens each place holds.

It is an estimate, as the sglang-router's approximate tree is: a place may have evicted a
prefix since, and what a place computed for a request routed elsewhere is not known here.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

BLOCK_TOKENS = 64  # a prefix is known to a block's precision: a 2,048-token system prompt is 32 hashes
MAX_BLOCKS = 2048  # 131,072 tokens, the model's context: a request carries at most this many
HASH_BYTES = 8
# A directory's bound: (place, hash) pairs. ~460 bytes each in CPython with the pair and its
# two indexes (each hash's places, each place's hashes), ~60 MB at most: a site per GPU holds
# millions of tokens of KV, but what a directory must hold is what is hot (8 M tokens of distinct
# prefixes), and an entry least recently sent is the first a worker evicts too.
MAX_ENTRIES = 131_072


def prefix_hashes(token_ids: Sequence[int], key: bytes = b"") -> tuple[int, ...]:
    """The chain of hashes of the prompt's whole blocks (a partial last block is not hashed: a
    prefix is known to a block's precision). `key` keys the hash (a federation's secret), so a
    hash cannot be checked against a guessed prompt by whoever sees it without the key."""
    hashes: list[int] = []
    previous = b""
    whole = min(len(token_ids) // BLOCK_TOKENS, MAX_BLOCKS)
    for i in range(whole):
        block = token_ids[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        digest = hashlib.blake2b(
            previous + struct.pack(f"<{BLOCK_TOKENS}I", *block), digest_size=HASH_BYTES, key=key
        ).digest()
        hashes.append(int.from_bytes(digest, "little"))
        previous = digest
    return tuple(hashes)


class PrefixDirectory:
    """Which places were recently sent which prefix blocks, bounded to `max_entries`."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, int], None] = OrderedDict()
        # Each hash's places: who holds a prompt's first block is found without asking every
        # place (a scheduler with a thousand sites asks once per route). Most hashes are held by
        # one place, kept as the bare name: a set per hash would cost 200 bytes more an entry.
        self._places: dict[int, str | set[str]] = {}
        # And each place's hashes: a site that goes down is forgotten without a walk over every
        # entry (a thousand sites' directory is full, and sites go down by the hundred).
        self._hashes: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, place: str, hashes: Sequence[int]) -> None:
        """`place` was sent a request with these block hashes: it will hold them (most recent last)."""
        entries = self._entries
        for h in hashes:
            key = (place, h)
            if key in entries:
                entries.move_to_end(key)
            else:
                entries[key] = None
                self._add_place(h, place)
                self._hashes.setdefault(place, set()).add(h)
        while len(entries) > self.max_entries:
            self._drop(entries.popitem(last=False)[0])

    def _add_place(self, h: int, place: str) -> None:
        held = self._places.get(h)
        if held is None:
            self._places[h] = place
        elif isinstance(held, str):
            self._places[h] = {held, place}
        else:
            held.add(place)

    def _remove_place(self, h: int, place: str) -> None:
        held = self._places[h]
        if isinstance(held, str):
            del self._places[h]
            return
        held.discard(place)
        if len(held) == 1:
            self._places[h] = next(iter(held))

    def _places_of(self, h: int) -> set[str] | tuple[str, ...]:
        held = self._places.get(h)
        if held is None:
            return ()
        return (held,) if isinstance(held, str) else held

    def _drop(self, key: tuple[str, int]) -> None:
        place, h = key
        self._remove_place(h, place)
        hashes = self._hashes[place]
        hashes.discard(h)
        if not hashes:
            del self._hashes[place]

    def cached_tokens(self, places: Iterable[str], hashes: Sequence[int]) -> dict[str, int]:
        """For each place, how many of the request's leading tokens it likely holds: its longest
        run of the request's blocks from the first."""
        held = self.holders(hashes)
        return {place: held.get(place, 0) for place in places}

    def holders(self, hashes: Sequence[int]) -> dict[str, int]:
        """The places that hold at least the request's first block, each with how many of its
        leading tokens: its longest run of the request's blocks from the first."""
        first = self._places_of(hashes[0]) if hashes else ()
        if not first:
            return {}
        blocks = dict.fromkeys(first, 1)
        alive = list(first)
        for h in hashes[1:]:
            places = self._places_of(h)
            alive = [p for p in alive if p in places] if places else []
            if not alive:
                break
            for place in alive:
                blocks[place] += 1
        return {place: n * BLOCK_TOKENS for place, n in blocks.items()}

    def forget(self, place: str) -> None:
        """The place lost what it held (a site down or removed, a worker restarted)."""
        for h in self._hashes.pop(place, ()):
            del self._entries[(place, h)]
            self._remove_place(h, place)
