"""The middle of an answer reaches the client as the same events whichever way it is read: a
plain streamed completion's chunks from the batch's columns (`Answer.flowed`, no Chunk built)
are byte for byte what a whole delta's chunk makes (`Answer.add`, `chunk_events`), with the
same count of tokens and site kept; any other answer takes the whole path."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from core import wire
from federation.gateway.failover import Chunk
from federation.gateway.jobs import Job
from federation.gateway.responses import Answer

_chunks = st.lists(
    st.tuples(st.text(max_size=12), st.lists(st.integers(0, 201_087), max_size=3).map(tuple)), min_size=1, max_size=12
)


def _job(kind: str, *, continuous_usage: bool = False, logprobs: bool = False) -> Job:
    request = wire.GenerateRequest("req-1", 1_000, {"max_new_tokens": 100}, logprobs=logprobs)
    return Job(kind, request, 100, True, True, "openai/gpt-oss-120b", continuous_usage=continuous_usage)


def _both(job: Job) -> tuple[Answer, Answer]:
    flowed, whole = Answer(job), Answer(job)
    whole.created = flowed.created
    return flowed, whole


@given(_chunks, st.booleans())
def test_a_completions_middle_is_the_same_events_read_from_the_columns(chunks, continuous_usage: bool) -> None:
    flowed, whole = _both(_job("completion", continuous_usage=continuous_usage))
    produced = 0
    for text, ids in chunks:
        produced += len(ids)
        chunk = Chunk(text, ids, produced, None, "us-mi355x")
        whole.add(chunk)
        assert flowed.flowed(text, ids, produced, "us-mi355x", 0.0) == whole.chunk_events(chunk, 0.0)
        assert (flowed.completion_tokens, flowed.site) == (produced, "us-mi355x")


@settings(deadline=None)  # the first chat loads openai-harmony
@given(_chunks, st.sampled_from(["logprobs", "generate", "chat"]))
def test_any_other_answer_takes_the_whole_path(chunks, kind: str) -> None:
    job = _job("completion", logprobs=True) if kind == "logprobs" else _job(kind)
    flowed, whole = _both(job)
    produced = 0
    for text, ids in chunks:
        produced += len(ids)
        chunk = Chunk(text, ids, produced, None, "kr-mi300x")
        whole.add(chunk)
        assert flowed.flowed(text, ids, produced, "kr-mi300x", 0.0) == whole.chunk_events(chunk, 0.0)
    assert (flowed.text, flowed.output_ids, flowed.completion_tokens) == (whole.text, whole.output_ids, produced)
