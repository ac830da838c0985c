"""The agent's flush: however many streams wait, every one's tokens go exactly once, in the
order they began to wait, in messages of at most MAX_BATCH_BYTES (past by one record at most),
so that a flush of thousands leaves the loop free between its messages."""

from __future__ import annotations

import asyncio

from core import wire
from nodes.agent.relay import MAX_BATCH_BYTES, RelayCall, Relayed
from proto import federation_pb2 as pb


async def test_a_flush_of_thousands_goes_as_several_messages_each_stream_once() -> None:
    sent: list[bytes] = []

    async def write(message: pb.TokenBatch) -> None:
        sent.append(message.SerializeToString())

    relay = RelayCall(write, lambda record, tokens: None, coalesce_s=0.05, flow=True)
    task = asyncio.ensure_future(relay.write_forever())
    records = [Relayed(relay, number, every_event=False) for number in range(3_000)]
    for record in records:
        record.started = True  # their first tokens went earlier: these wait for the window
        record.event(" word" * 20, list(range(20)), 20, 1_000, None)
    await relay.drained()
    task.cancel()
    batches = [pb.TokenBatch.FromString(raw) for raw in sent]
    assert len(batches) > 1
    assert all(len(raw) <= MAX_BATCH_BYTES + 1_024 for raw in sent)  # a record here is ~200 bytes
    deltas = [d for batch in batches for d in wire.token_batch_from_pb(batch)]
    assert [d.stream for d in deltas] == list(range(3_000))
    assert all(d.text == " word" * 20 and d.output_ids == tuple(range(20)) for d in deltas)
