"""Tokens as GPT-OSS-120B sees them: o200k_harmony counting and exact synthetic output.

Prompt lengths decide prefill cost and KV use, so they are counted with the real
tokenizer (o200k_base shipped offline by `bpe-openai`, plus the Harmony special
tokens, each one token). Output is synthetic, but honest: it is built from words
that are single o200k tokens and that the tokenizer's pre-split keeps apart, so the
text holds exactly as many tokens as `completion_tokens` says, and every prefix a
stream sends is itself whole tokens.
"""

from __future__ import annotations

import array
import base64
import bisect
import contextlib
import gzip
import hashlib
import importlib.metadata
import importlib.util
import itertools
import random
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from importlib.machinery import EXTENSION_SUFFIXES, ExtensionFileLoader
from pathlib import Path
from typing import Any

from core import cachedir

# Harmony special tokens of o200k_harmony (ids from the gpt-oss tokenizer).
HARMONY_SPECIALS: Mapping[str, int] = {
    "<|startoftext|>": 199998,
    "<|endoftext|>": 199999,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
}
VOCAB_SIZE = 201_088  # gpt-oss embedding rows; input_ids must be below this
EOS_TOKEN_IDS = (200002, 200012, 199999)  # <|return|>, <|call|>, <|endoftext|>
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in HARMONY_SPECIALS) + ")")

SYNTHETIC_STREAM_TOKENS = 1 << 16  # length of the repeating synthetic output stream
_SYNTHETIC_WORD = re.compile(rb" [a-z]{3,9}")  # compiled once: it is tried on all ~200 k tokens


# A piece refused as bpe-openai's wrapper refuses it: this many characters (~250 k tokens of
# prose), or more tokens than this; both far past any context.
MAX_ENCODE_CHARS = 1_000_000
MAX_ENCODE_TOKENS = 200_000


class PromptTooLong(ValueError):
    """Text too long to tokenize at all (so surely longer than the model's context)."""


@cache
def _tokenizer() -> Any:
    """bpe-openai's compiled o200k_base tokenizer, loaded from its extension module alone.
    `import bpe_openai` runs its tiktoken-style wrapper, which builds the Python tables of three
    vocabularies at import, most of the package's import time (docs/BENCHMARKS.md, "a start
    without bpe-openai's wrapper"), and every emulated worker and every gateway process
    tokenizes: `fedctl up --launch` starts 32 of them."""
    package = _bpe_openai_dir()
    found = [package / f"_bindings{suffix}" for suffix in EXTENSION_SUFFIXES]
    path = next((f for f in found if f.is_file()), None)
    if path is None:
        raise RuntimeError(f"bpe-openai at {package} has no compiled tokenizer (_bindings)")
    loader = ExtensionFileLoader("bpe_openai._bindings", str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None  # a loader given: always a spec
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module.tokenizer_for_encoding("o200k_base")


def _bpe_openai_dir() -> Path:
    """bpe-openai's directory, found without importing the package (see `_tokenizer`)."""
    spec = importlib.util.find_spec("bpe_openai")
    if spec is None or spec.origin is None:
        raise RuntimeError("bpe-openai, which ships the o200k tokenizer, is not installed")
    return Path(spec.origin).parent


def packed_vocabulary() -> Path:
    """The o200k_base vocabulary bpe-openai ships (tiktoken's format, gzipped), found without
    importing the package (see `_tokenizer`)."""
    return _bpe_openai_dir() / "data" / "o200k_base.tiktoken.gz"


@cache
def _token_byte_values() -> list[bytes]:
    """Every o200k_base token's bytes, by id, from the vocabulary bpe-openai ships (read on first
    use, not at start: only logprobs and building the synthetic stream ask)."""
    lines = gzip.decompress(packed_vocabulary().read_bytes()).split()  # "<base64 bytes> <rank>" a line
    ranked = {int(rank): base64.b64decode(raw) for raw, rank in zip(lines[::2], lines[1::2], strict=True)}
    return [ranked.get(i, b"") for i in range(max(ranked) + 1)]


def encode(text: str, limit: int | None = None) -> list[int]:
    """Token ids of `text`, Harmony special tokens included (as the HF tokenizer does). With a
    `limit`, raises PromptTooLong as soon as the pieces encoded so far are over it: a chat of many
    long messages costs at most the limit and one message to refuse, not all of it."""
    ids: list[int] = []
    start = 0
    for special in itertools.chain(_SPECIAL_SPLIT.finditer(text), [None]):  # lazily: a refusal ends the scan
        end = len(text) if special is None else special.start()
        if end > start:
            ids.extend(_ordinary(text[start:end], len(text)))
        if special is not None:
            ids.append(HARMONY_SPECIALS[special.group()])
            start = special.end()
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(f"it has more than {limit} tokens")
    return ids


def encode_ordinary(text: str) -> list[int]:
    """Token ids of `text` with every special-token name in it as plain text (as Harmony renders
    a message's content), in time linear in its length; PromptTooLong past what bpe-openai takes."""
    return _ordinary(text, len(text))


def _ordinary(piece: str, text_chars: int) -> list[int]:
    """`piece` of a text of `text_chars` characters, as plain text; PromptTooLong (naming the whole
    text) for a piece bpe-openai would refuse (past its 200 k tokens at once) or spend long on."""
    if len(piece) >= MAX_ENCODE_CHARS:
        raise PromptTooLong(f"the text has {text_chars} characters, more than any context can hold")
    try:
        ids = _tokenizer().encode(piece)
    except UnicodeEncodeError:  # a lone surrogate (JSON allows "\\ud800"): U+FFFD, as bpe-openai's wrapper does
        ids = _tokenizer().encode(piece.encode("utf-16", "surrogatepass").decode("utf-16", "replace"))
    if len(ids) > MAX_ENCODE_TOKENS:
        raise PromptTooLong(f"the text has {text_chars} characters, more than any context can hold")
    return ids


_SPECIAL_NAMES = {i: name for name, i in HARMONY_SPECIALS.items()}


def token_bytes(token: int) -> bytes:
    """A token's bytes; a Harmony special (not in o200k_base) is its name."""
    name = _SPECIAL_NAMES.get(token)
    if name is not None:
        return name.encode()
    values = _token_byte_values()
    if not 0 <= token < len(values) or not values[token]:
        raise KeyError(f"token {token} is not in o200k_base")
    return values[token]


def count(text: str, limit: int | None = None) -> int:
    return len(encode(text, limit))


@dataclass(frozen=True, slots=True)
class SyntheticText:
    """A long repeating stream of single-token words; a request's output is a window of it."""

    ids: tuple[int, ...]
    text: str
    char_starts: tuple[int, ...]  # char offset of token i in `text` (len(ids) + 1 entries)

    @property
    def period(self) -> int:
        return len(self.ids) // 2

    def window(self, offset: int, n: int) -> tuple[str, list[int]]:
        """The `n` tokens starting at `offset` (mod the period): text and ids."""
        start = offset % self.period
        return (
            self.text[self.char_starts[start] : self.char_starts[start + n]],
            list(self.ids[start : start + n]),
        )

    def tokens_covering(self, offset: int, char_end: int) -> int:
        """How many tokens of the window at `offset` it takes to hold its first `char_end` chars."""
        start = offset % self.period
        return bisect.bisect_left(self.char_starts, self.char_starts[start] + char_end) - start


@cache
def synthetic_text(max_window: int = 140_000) -> SyntheticText:
    """The stream, from this machine's cache once a process of ours has built it: building it
    costs CPU, and `fedctl up --launch` starts 32 emulated workers that each need it at start."""
    try:
        path = cachedir.user_cache_dir() / f"synthetic-{_synthetic_key(max_window)}.bin"
    except OSError:  # this module's source unreadable: nothing to name the stream's file by
        return _build_synthetic(max_window)
    with contextlib.suppress(OSError):  # not built yet
        cached = _unpack(path.read_bytes())
        if cached is not None:
            return cached
    built = _build_synthetic(max_window)
    with contextlib.suppress(OSError):  # an unwritable cache costs each process the build, no more
        cachedir.write_atomically(path, _pack(built))
    return built


def _synthetic_key(max_window: int) -> str:
    """Names what the stream is built from: this module's code, the vocabulary's package, the window."""
    parts = (Path(__file__).read_bytes(), importlib.metadata.version("bpe-openai").encode(), str(max_window).encode())
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]


_PACKED_MAGIC = b"SYNTEXT1"
_WORD = array.array("I").itemsize
_PACKED_HEAD = struct.Struct("<8s32sII")  # magic, SHA-256 of the rest, token count, text bytes


def _pack(synth: SyntheticText) -> bytes:
    text = synth.text.encode()
    body = array.array("I", synth.ids).tobytes() + array.array("I", synth.char_starts).tobytes() + text
    return _PACKED_HEAD.pack(_PACKED_MAGIC, hashlib.sha256(body).digest(), len(synth.ids), len(text)) + body


def _unpack(data: bytes) -> SyntheticText | None:
    """The stream `_pack` wrote; None for anything else (a torn or foreign file is rebuilt)."""
    if len(data) < _PACKED_HEAD.size:
        return None
    magic, digest, n, text_bytes = _PACKED_HEAD.unpack_from(data)
    body = data[_PACKED_HEAD.size :]
    numbers_end = _WORD * (2 * n + 1)  # the ids, then the n + 1 character offsets
    if magic != _PACKED_MAGIC or len(body) != numbers_end + text_bytes or hashlib.sha256(body).digest() != digest:
        return None
    numbers = array.array("I", body[:numbers_end])
    return SyntheticText(ids=tuple(numbers[:n]), text=body[numbers_end:].decode(), char_starts=tuple(numbers[n:]))


def _build_synthetic(max_window: int) -> SyntheticText:
    """Single-token words (one o200k token each, kept apart by its pre-split) in a seeded order."""
    words = [
        (token_id, raw.decode())
        for token_id, raw in enumerate(_token_byte_values())
        if _SYNTHETIC_WORD.fullmatch(raw) and _tokenizer().encode(raw.decode()) == [token_id]
    ]
    rng = random.Random(20_260_101)  # fixed: the same text on every worker and every run
    period = max(SYNTHETIC_STREAM_TOKENS, max_window)
    chosen = [rng.choice(words) for _ in range(period)]
    chosen += chosen[:max_window]  # a window may wrap past the period
    return SyntheticText(
        ids=tuple(t for t, _ in chosen),
        text="".join(p for _, p in chosen),
        char_starts=tuple(itertools.accumulate((len(p) for _, p in chosen), initial=0)),
    )
