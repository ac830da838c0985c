"""GPT-OSS's Harmony format through OpenAI's own library (`openai-harmony`): a chat rendered
into the token ids the model reads, and the model's output ids read back into its channels
(`analysis`: reasoning; `final`: the answer; `commentary` to `functions.X`: a tool call).

openai-harmony fetches its o200k vocabulary from the internet unless told where a copy is. The
same file ships inside bpe-openai (our tokenizer), so it is unpacked once into a cache
directory, checked against its SHA-256, and the library is pointed there: nothing is
downloaded at run time.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal

from core import cachedir, tokens

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"

START, END, MESSAGE, CHANNEL, CONSTRAIN = 200006, 200007, 200008, 200005, 200003
RETURN, CALL = 200002, 200012  # how an answer ends, and how a tool call does
FIRST_SPECIAL = 199998  # ids from here on are Harmony's special tokens
TO = 316  # " to": a header may name its recipient right after the role (` to=functions.f`)
FINAL = 17196  # "final": the channel of the answer itself
EFFORTS = ("low", "medium", "high")
MAX_HEADER_TOKENS = 64  # a message header (role, channel, recipient, content type) is a few tokens

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Turn:
    """One chat message, validated: `calls` are an assistant's tool calls (name, JSON
    arguments); `function` names the function a tool message answers."""

    role: Role
    content: str
    calls: tuple[tuple[str, str], ...] = ()
    function: str = ""


def _vocab_dir() -> Path:
    """A directory holding the vocabulary, written once: the user's cache, or the temporary
    directory where that cannot be written (the file is checked against its SHA-256 either way)."""
    for root in (cachedir.user_cache_dir(), Path(tempfile.gettempdir()) / "inference-federation"):
        try:
            return _unpacked(root / "tiktoken")
        except OSError:
            continue
    raise RuntimeError("no writable directory for the o200k vocabulary openai-harmony reads")


def _unpacked(base: Path) -> Path:
    target = base / VOCAB_FILE
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == VOCAB_SHA256:
        return base
    packed = tokens.packed_vocabulary()
    data = gzip.decompress(packed.read_bytes())
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        raise RuntimeError(f"{packed} is not the o200k vocabulary openai-harmony expects")
    cachedir.write_atomically(target, data)
    return base


@cache
def encoding() -> Any:
    """The gpt-oss Harmony encoding (not cheap to load: once per process)."""
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(_vocab_dir())
    import openai_harmony as h  # after the vocabulary is in place: it is read at load

    return h.load_harmony_encoding(h.HarmonyEncodingName.HARMONY_GPT_OSS)


def encode(text: str) -> list[int]:
    """Plain text as ids (special-token names in it are text, not specials)."""
    return encoding().encode(text, allowed_special=set())


def render_chat(turns: Sequence[Turn], tools: Sequence[Tool], *, reasoning_effort: str, today: str) -> list[int]:
    """The prompt the model completes: the conversation in Harmony, ending with
    `<|start|>assistant`. The first system or developer message becomes the developer
    instructions (as gpt-oss's chat template does); tools are declared under `functions`.

    The chat's free text (contents, instructions, a call's arguments, a tool message's function,
    the words of a tool's description), each past `SHORT_TEXT` characters, reaches
    openai-harmony as a placeholder and is tokenized by bpe-openai when spliced back
    (`_Placeholders`): harmony's own BPE takes time quadratic in the length of a run without
    spaces and holds the GIL while it does (docs/SECURITY.md, "The edge"), so one request could
    stall every stream of the process that renders it. The same ids either way
    (tests/test_harmony_render.py). A tool's schema stays harmony's to render: the gateway
    bounds its size (federation/gateway/chat.py). PromptTooLong: a text past what the tokenizer
    takes at once."""
    import openai_harmony as h

    marks = _Placeholders()
    turns = [
        Turn(t.role, marks.mark(t.content), tuple((n, marks.mark(a)) for n, a in t.calls), marks.mark(t.function))
        for t in turns
    ]
    tools = [Tool(t.name, marks.mark_words(t.description), t.parameters) for t in tools]
    conversation = _conversation(h, turns, tools, reasoning_effort, today)
    return marks.spliced(encoding().render_conversation_for_completion(conversation, h.Role.ASSISTANT))


def _conversation(h: Any, turns: Sequence[Turn], tools: Sequence[Tool], reasoning_effort: str, today: str) -> Any:
    system = (
        h.SystemContent.new()
        .with_reasoning_effort(h.ReasoningEffort(reasoning_effort.capitalize()))
        .with_conversation_start_date(today)
    )
    messages = [h.Message.from_role_and_content(h.Role.SYSTEM, system)]
    instructions = turns[0].content if turns and turns[0].role in ("system", "developer") else None
    rest = turns[1:] if instructions is not None else turns
    if instructions is not None or tools:
        developer = h.DeveloperContent.new()
        if instructions is not None:
            developer = developer.with_instructions(instructions)
        if tools:
            developer = developer.with_function_tools(
                [h.ToolDescription.new(t.name, t.description, parameters=t.parameters) for t in tools]
            )
        messages.append(h.Message.from_role_and_content(h.Role.DEVELOPER, developer))
    for turn in rest:
        messages.extend(_messages(h, turn))
    return h.Conversation.from_messages(messages)


_WORD = re.compile(r"\S+")
SHORT_TEXT = 32  # characters: a run this short is still cheap for harmony's quadratic BPE, not worth a placeholder
_PLACEHOLDER = re.compile(r"q([0-9a-f]{16})x([0-9]+)q")  # compiled once: the nonce is matched, not built in


class _Placeholders:
    """Texts swapped for placeholders before rendering, and back after: each run of ordinary ids
    between two special tokens that holds a placeholder is decoded, its placeholders replaced (in
    one pass, so a text is never read for placeholders itself) and encoded again. Exact because
    Harmony encodes each such run as one plain text (special-token names in it are text). The
    nonce is new for each chat: no text can hold a placeholder by design."""

    def __init__(self) -> None:
        self._nonce = secrets.token_hex(8)
        self._texts: list[str] = []

    def mark(self, text: str) -> str:
        """A placeholder of `text`; a short text is left to harmony, which renders it in about the
        time it renders the placeholder (the empty text must stay empty: Harmony leaves out empty
        messages)."""
        if len(text) <= SHORT_TEXT:
            return text
        self._texts.append(text)
        return f"q{self._nonce}x{len(self._texts) - 1}q"

    def _text(self, match: re.Match[str]) -> str:
        """The text a placeholder of this chat stands for (another nonce's is left as it is)."""
        return self._texts[int(match[2])] if match[1] == self._nonce else match[0]

    def mark_words(self, text: str) -> str:
        """Each run of `text` without whitespace as a placeholder, the whitespace kept: harmony
        lays out a tool's description by its lines (each behind `// `), so it must see them."""
        return _WORD.sub(lambda m: self.mark(m[0]), text)

    def spliced(self, ids: list[int]) -> list[int]:
        if not self._texts:
            return ids
        out: list[int] = []
        start = 0
        for i, token in enumerate(ids):
            if token >= FIRST_SPECIAL:
                self._run(ids[start:i], out)
                out.append(token)
                start = i + 1
        self._run(ids[start:], out)
        return out

    def _run(self, run: list[int], out: list[int]) -> None:
        text = encoding().decode_utf8(run) if run else ""
        if self._nonce in text:
            out.extend(tokens.encode_ordinary(_PLACEHOLDER.sub(self._text, text)))
        else:
            out.extend(run)


def _messages(h: Any, turn: Turn) -> Iterable[Any]:
    if turn.role in ("system", "developer"):
        yield h.Message.from_role_and_content(
            h.Role.DEVELOPER, h.DeveloperContent.new().with_instructions(turn.content)
        )
    elif turn.role == "user":
        yield h.Message.from_role_and_content(h.Role.USER, turn.content)
    elif turn.role == "tool":
        author = h.Author.new(h.Role.TOOL, f"functions.{turn.function}")
        yield (
            h.Message.from_author_and_content(author, turn.content)
            .with_channel("commentary")
            .with_recipient("assistant")
        )
    else:
        if turn.content:
            yield h.Message.from_role_and_content(h.Role.ASSISTANT, turn.content).with_channel("final")
        for name, arguments in turn.calls:
            yield (
                h.Message.from_role_and_content(h.Role.ASSISTANT, arguments)
                .with_channel("commentary")
                .with_recipient(f"functions.{name}")
                .with_content_type("<|constrain|>json")
            )


PieceKind = Literal["reasoning", "content", "call", "arguments"]


class OutputReader:
    """The model's output ids, fed as they arrive, read into what an OpenAI client sees:
    `analysis` → reasoning, `final` (and commentary without a recipient) → content, and a
    message to `functions.X` → a tool call named X whose content is its JSON arguments.
    Output that is not Harmony (a model that strays from it) is passed on as content."""

    def __init__(self) -> None:
        import openai_harmony as h

        self._parser: Any = h.StreamableParser(encoding(), h.Role.ASSISTANT)
        self._begun = False
        self._broken = False
        # Kept here from the ids, not asked of the parser: its `state` is dear per call
        # (docs/DATAPATH.md, "Chats"), its `messages` grows with the answer.
        self._header: list[int] | None = []  # ids of the message header being read; None in content
        self._message = 0  # index of the message being read
        self._call_message = -1  # index of the message that is the latest tool call
        self.ended_with_call = False
        self.final_begun = False  # the answer's `final` message has begun (its header, at least)
        self.token_kinds: list[PieceKind | None] = []  # of each id of the latest feed

    def feed(self, ids: Iterable[int]) -> list[tuple[PieceKind, str]]:
        """What these ids add, as (kind, text) pieces, consecutive pieces of a kind merged;
        a `call` piece's text is the function's name. Its cost per id: docs/DATAPATH.md, "Chats"."""
        out: list[tuple[PieceKind, str]] = []
        kinds = self.token_kinds = []
        parser = self._parser
        for token in ids:
            kinds.append(None)
            if not self._begun:  # an answer opens with its header (`<|channel|>` or ` to=`), or is not Harmony
                self._begun = True
                self._broken = token < FIRST_SPECIAL and token != TO
            if self._broken:
                _add(out, "content", "" if token >= FIRST_SPECIAL else encoding().decode([token]))
                kinds[-1] = "content"
                continue
            try:
                parser.process(token)
            except Exception:
                self._broken = True
                continue
            if token == START:
                self._header = []
            elif token == MESSAGE:
                self._header = None
            elif token in (END, CALL, RETURN):
                self._message += 1
                self.ended_with_call = token == CALL
            elif self._header is not None:
                self._header.append(token)
                self.final_begun = self.final_begun or token == FINAL
                if len(self._header) > MAX_HEADER_TOKENS:  # no header is this long: plain text
                    self._broken = True
                    _add(out, "content", encoding().decode([t for t in self._header if t < FIRST_SPECIAL]))
            else:  # a token of a message's body; its text may wait for the rest of its character
                kinds[-1] = self._body(out, parser)
        return out

    def _body(self, out: list[tuple[PieceKind, str]], parser: Any) -> PieceKind:
        recipient = parser.current_recipient
        delta = parser.last_content_delta
        if recipient:
            if self._message != self._call_message:
                self._call_message = self._message
                out.append(("call", recipient.removeprefix("functions.")))
            _add(out, "arguments", delta)
            return "arguments"
        if parser.current_channel == "analysis":
            _add(out, "reasoning", delta)
            return "reasoning"
        _add(out, "content", delta)
        return "content"


def _add(out: list[tuple[PieceKind, str]], kind: PieceKind, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind and kind != "call":
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))
