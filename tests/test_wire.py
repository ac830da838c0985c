"""The token batch's two forms on the wire: whatever the mix of deltas, what the gateway reads is
what the agent sent (a flow delta's prompt_tokens aside: the stream's earlier deltas carry them),
and columns that do not add up are refused, not misread."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core import wire
from proto import federation_pb2 as pb

_ids = st.lists(st.integers(0, 2**32 - 1), max_size=4).map(tuple)
_text = st.text(max_size=8)
_plain = st.builds(
    lambda *fields: wire.TokenDelta(*fields),
    st.integers(0, 2**64 - 1),
    _text,
    _ids,
    st.integers(0, 2**32 - 1),
    st.integers(0, 9),
)
_first = st.builds(
    lambda d, worker, at: d._replace(worker=worker, accepted_unix_s=at),
    _plain,
    st.text(min_size=1, max_size=8),
    st.floats(1.0, 2e9),
)
_last = st.builds(lambda d: d._replace(finish_reason={"type": "length", "length": 3}), _plain)
_failed = st.builds(lambda d, why: d._replace(error=wire.StreamError.WORKER_FAILED, error_message=why), _plain, _text)


def _plain_delta(d: wire.TokenDelta) -> bool:
    """Only new text and ids: what the agent's relay puts in the columns for a gateway that reads them."""
    return d.finish_reason is None and not d.worker and d.error is wire.StreamError.NONE and not d.logprobs


def _read(deltas: list[wire.TokenDelta], columns: list[wire.TokenDelta]) -> list[wire.TokenDelta]:
    flow = wire.TokenFlow.empty()
    for d in columns:
        flow.streams.append(d.stream)
        flow.texts.append(d.text)
        flow.id_counts.append(len(d.output_ids))
        flow.ids.extend(d.output_ids)
        flow.completion_tokens.append(d.completion_tokens)
    raw = wire.token_batch_to_pb(deltas, flow).SerializeToString()
    return wire.token_batch_from_pb(pb.TokenBatch.FromString(raw))


@given(st.lists(st.one_of(_plain, _first, _last, _failed), max_size=20), st.booleans())
def test_every_delta_arrives_as_sent(deltas: list[wire.TokenDelta], flow: bool) -> None:
    columns = [d for d in deltas if flow and _plain_delta(d)]
    messages = [d for d in deltas if not (flow and _plain_delta(d))]
    assert _read(messages, columns) == messages + [d._replace(prompt_tokens=0) for d in columns]


def test_columns_that_do_not_add_up_are_refused() -> None:
    batch = wire.token_batch_to_pb([], wire.TokenFlow([1], ["a"], [2], [5, 6], [2]))
    batch.flow.ids.append(7)  # an id no delta counts
    with pytest.raises(ValueError):
        wire.token_batch_from_pb(batch)
    batch.flow.ids.pop()
    batch.flow.texts.append("b")  # a text without its stream
    with pytest.raises(ValueError):
        wire.token_batch_from_pb(batch)
