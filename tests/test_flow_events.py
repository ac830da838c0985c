"""The middle of an answer reaches the client as the same events whichever way it is read: a
plain streamed completion's chunks from the batch's columns (`CompletionAnswer.flowed`, no Chunk built)
are byte for byte what a whole delta's chunk makes (`Answer.add`, `chunk_events`), with the
same answer kept; any other answer (a chat, /generate, logprobs asked) takes the whole path and
comes out the same too."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core import wire
from federation.gateway.answers import answer_for
from federation.gateway.pieces import Chunk, Job

_chunks = st.lists(
    st.tuples(st.text(max_size=12), st.lists(st.integers(0, 201_087), max_size=3).map(tuple)), min_size=1, max_size=12
)


def _job(kind: str, *, continuous_usage: bool = False, logprobs: bool = False) -> Job:
    request = wire.GenerateRequest("req-1", 1_000, {"max_new_tokens": 100}, logprobs=logprobs)
    return Job(kind, request, 100, True, True, "openai/gpt-oss-120b", continuous_usage=continuous_usage)


_JOBS = {
    "completion": _job("completion"),
    "completion, usage on every chunk": _job("completion", continuous_usage=True),
    "completion with logprobs": _job("completion", logprobs=True),
    "generate": _job("generate"),
    "chat": _job("chat"),
}


@settings(deadline=None)  # the first chat loads openai-harmony
@given(_chunks, st.sampled_from(sorted(_JOBS)))
def test_the_middle_of_an_answer_is_the_same_events_read_from_the_columns(chunks, kind: str) -> None:
    flowed, whole = answer_for(_JOBS[kind]), answer_for(_JOBS[kind])
    whole.created = flowed.created
    produced = 0
    for text, ids in chunks:
        produced += len(ids)
        chunk = Chunk(text, ids, produced, None, "us-mi355x")
        whole.add(chunk)
        assert flowed.flowed(text, ids, produced, "us-mi355x", 0.0) == whole.chunk_events(chunk, 0.0)
    kept = ("text_parts", "output_ids", "completion_tokens", "site")
    assert [getattr(flowed, k, None) for k in kept] == [getattr(whole, k, None) for k in kept]
