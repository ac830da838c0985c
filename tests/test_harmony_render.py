"""A chat's prompt ids are the ones openai-harmony renders, in time linear in its text.

`harmony.render_chat` hands openai-harmony placeholders for the chat's free text and tokenizes
that text itself (see its docstring): here any chat, tools included, renders to exactly the ids
harmony gives for it directly, and a run of emoji that takes harmony seconds renders at once."""

from __future__ import annotations

import time

import openai_harmony as h
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core import harmony

# Text that stresses the splice: whitespace at the edges and alone, line breaks of every kind,
# special-token names (text in a content, never specials), emoji, CJK, placeholder look-alikes,
# and pieces long enough to be spliced.
EDGES = [
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "\n\n",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "💥",
    "中文",
    "q0x1q",
    "{}",
    "//",
]
LONG = ["x" * 40, "💥" * 33, " word" * 9]  # past harmony.SHORT_TEXT: spliced, not left to harmony
PIECES = st.sampled_from(EDGES) | st.sampled_from(LONG)
TEXT = st.lists(PIECES | st.text(max_size=12), max_size=8).map("".join)
NAME = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
TURNS = st.lists(
    st.one_of(
        st.builds(harmony.Turn, st.sampled_from(["system", "developer", "user"]), TEXT),
        st.builds(harmony.Turn, st.just("assistant"), TEXT, st.lists(st.tuples(NAME, TEXT), max_size=2).map(tuple)),
        st.builds(harmony.Turn, st.just("tool"), TEXT, st.just(()), NAME),
    ),
    max_size=5,
)
SCHEMA = st.fixed_dictionaries(
    {"type": st.just("object"), "properties": st.dictionaries(NAME, st.just({"type": "string"}), max_size=2)}
)
TOOLS = st.lists(st.builds(harmony.Tool, NAME, TEXT, SCHEMA), max_size=2)


def _direct(turns: list[harmony.Turn], tools: list[harmony.Tool], effort: str) -> list[int]:
    """What openai-harmony renders for the chat as it is, tokenizing every text itself."""
    conversation = harmony._conversation(h, turns, tools, effort, "2026-12-05")
    return harmony.encoding().render_conversation_for_completion(conversation, h.Role.ASSISTANT)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TURNS, TOOLS, st.sampled_from(harmony.EFFORTS))
def test_a_chat_renders_to_the_ids_harmony_gives(turns, tools, effort) -> None:
    assert harmony.render_chat(turns, tools, reasoning_effort=effort, today="2026-12-05") == _direct(
        turns, tools, effort
    )


def test_a_run_without_spaces_renders_in_linear_time() -> None:
    """4,000 emoji take openai-harmony's own BPE ~0.1 s (it is quadratic: 32,000 took 17 s, and
    60,000, a chat well inside the context, over a minute); the same ids come back spliced, and
    the run 15 times as long costs about 15 times as much, not 225 times."""
    short, long = "💥" * 4_000, "💥" * 60_000
    started = time.process_time()
    ids = harmony.render_chat([harmony.Turn("user", short)], [], reasoning_effort="low", today="2026-12-05")
    short_s = time.process_time() - started
    assert ids == _direct([harmony.Turn("user", short)], [], "low")
    started = time.process_time()
    harmony.render_chat([harmony.Turn("user", long)], [], reasoning_effort="low", today="2026-12-05")
    long_s = time.process_time() - started
    assert long_s < 50 * max(short_s, 0.001), (short_s, long_s)
