"""A worker's own accounting of its work, read twice, says what it did in between and how long
it was busy; a read whose timing is uncertain, a stretch with idle time, or a worker that
restarted says nothing rather than something wrong (nodes/agent/accounting.py)."""

from __future__ import annotations

import dataclasses

from core.wire import WorkDone
from nodes.agent.accounting import LONG_PASS_FACTOR, LONG_PASS_MIN_S, WorkMeter
from nodes.agent.sglang import Accounting

START = Accounting(
    decode_passes=100,
    prefill_passes=10,
    decode_tokens=20_000,
    prefill_tokens=50_000,
    cached_tokens=0,
    idle_s=3.0,
    running_requests=200,
    decode_context_tokens=240_000,
    sent_at=10.0,
    received_at=10.01,
)


def _later(seconds: float, rtt_s: float = 0.01, **counted: float) -> Accounting:
    """START plus `counted` (increases), read `seconds` later with a round trip of `rtt_s`."""
    values = {name: getattr(START, name) + counted.get(name, 0) for name in counted}
    return dataclasses.replace(
        START, **values, sent_at=START.sent_at + seconds, received_at=START.sent_at + seconds + rtt_s
    )


def test_two_reads_bracket_the_work_between_them() -> None:
    """Between reads 1 s apart: 9 decode passes of 200 sequences and one prefill pass of 8,000
    prompt tokens, no idle. Under mixed chunks the prefill pass decoded the 200 running too (SGLang
    counts none of that), and each sequence attended its 1,200 tokens of KV."""
    meter = WorkMeter()
    assert meter.add(START, mixed_chunk=True) is None  # the first read starts a stretch
    done = meter.add(
        _later(1.0, decode_passes=9, prefill_passes=1, decode_tokens=1800, prefill_tokens=8000), mixed_chunk=True
    )
    assert done is not None and abs(done.busy_s - 1.0) < 1e-9
    assert dataclasses.replace(done, busy_s=1.0) == WorkDone(1.0, 10, 2000, 2400.0, 8000)


def test_without_mixed_chunks_a_prefill_pass_decodes_nothing() -> None:
    meter = WorkMeter()
    meter.add(START, mixed_chunk=False)
    done = meter.add(_later(1.0, decode_passes=9, prefill_passes=1, decode_tokens=1800, prefill_tokens=8000), False)
    assert done is not None and done.decode_seqs == 1800 and done.passes == 10


def test_a_read_whose_timing_is_uncertain_is_spanned_by_the_next() -> None:
    """A read that took 0.2 s (the agent's loop stalled around it) cannot time a 1-s stretch: it
    closes nothing, and the next read's stretch runs from the same earlier read."""
    meter = WorkMeter()
    meter.add(START, False)
    assert meter.add(_later(1.0, rtt_s=0.2, decode_passes=10, decode_tokens=2000), False) is None
    done = meter.add(_later(2.0, decode_passes=20, decode_tokens=4000), False)
    assert done is not None and done.passes == 20 and abs(done.busy_s - 2.0) < 1e-9


def test_a_stretch_with_idle_time_is_left_out() -> None:
    """A worker idle for 0.5 s of a 1-s stretch: SGLang may not have counted all its idle yet, so
    the stretch is not read, and the next starts afresh."""
    meter = WorkMeter()
    meter.add(START, False)
    assert meter.add(_later(1.0, decode_passes=5, decode_tokens=500, idle_s=0.5), False) is None
    done = meter.add(_later(2.0, decode_passes=15, decode_tokens=2500, idle_s=0.5), False)
    assert done is not None and done.passes == 10 and abs(done.busy_s - 1.0) < 1e-9


def test_a_stretch_from_a_read_where_the_worker_ran_nothing_is_left_out() -> None:
    """A worker idle at a read (its decode batch 0) whose first request came just after: SGLang
    publishes idle time at most once a second, so the idle before that request can be missing
    from the next read's counter, and the stretch would read it as a slow pass. It starts afresh
    at the next read instead, and the stretch after that is read."""
    meter = WorkMeter()
    meter.add(_later(0.0, running_requests=-200), False)  # idle: nothing decoding
    assert meter.add(_later(1.0, decode_passes=1, decode_tokens=1), False) is None
    done = meter.add(_later(2.0, decode_passes=11, decode_tokens=2001), False)
    assert done is not None and done.passes == 10 and done.decode_seqs == 2000


def test_a_stretch_to_a_read_where_the_worker_ran_nothing_is_left_out() -> None:
    """A worker whose streams were all aborted (a site back from a blackhole): its last pass is
    in the stretch, then it idled, and the read shows its idle log point (batch 0) before SGLang
    published that idle. The stretch would read the idle as a slow pass; it is left out."""
    meter = WorkMeter()
    meter.add(START, False)
    assert meter.add(_later(1.0, decode_passes=1, decode_tokens=144, running_requests=-200), False) is None


def test_the_kv_per_sequence_is_the_decode_log_points() -> None:
    """ΣL is renewed only at a decode log point, the running gauge also at each prefill pass:
    a batch of 200 with 240,000 tokens of KV that fell to 2 running (a prefill log point) still
    attends ~1,200 tokens a sequence, not 120,000; a new ΣL with its batch renews it."""
    meter = WorkMeter()
    meter.add(START, False)
    shrunk = _later(1.0, decode_passes=2, prefill_passes=1, decode_tokens=4, running_requests=-198)
    done = meter.add(shrunk, False)
    assert done is not None and done.decode_seqs == 4 and abs(done.context_ktokens - 4 * 1.2) < 1e-9
    renewed = _later(2.0, decode_passes=4, prefill_passes=1, decode_tokens=8, running_requests=-198)
    done = meter.add(dataclasses.replace(renewed, decode_context_tokens=5_000), False)
    assert done is not None and abs(done.context_ktokens - 4 * 2.5) < 1e-9


def test_a_pass_longer_than_a_read_interval_is_waited_for() -> None:
    """A pass that outlasts a read (a slowed-down emulator's): that read closes nothing, and the
    stretch ends at the read after the pass, with its whole time."""
    meter = WorkMeter()
    meter.add(START, False)
    assert meter.add(_later(1.0), False) is None
    done = meter.add(_later(2.0, decode_passes=1, decode_tokens=200), False)
    assert done is not None and done.passes == 1 and abs(done.busy_s - 2.0) < 1e-9


def test_a_worker_busy_without_a_pass_for_long_says_so() -> None:
    """A worker with requests that ends no pass for LONG_PASS_FACTOR times its recent pass (at
    least LONG_PASS_MIN_S) is that slow: its stretch closes with the time and no work. Its recent
    pass here is 1 s (an emulator slowed down), so 6 s without one is not yet that."""
    meter = WorkMeter()
    meter.add(START, False)
    meter.add(_later(1.0, decode_passes=1, decode_tokens=200), False)
    assert meter.add(_later(1.0 + LONG_PASS_MIN_S + 1, decode_passes=1, decode_tokens=200), False) is None
    done = meter.add(_later(1.0 + LONG_PASS_FACTOR + 0.1, decode_passes=1, decode_tokens=200), False)
    assert done is not None and done.passes == 0 and abs(done.busy_s - LONG_PASS_FACTOR - 0.1) < 1e-9


def test_a_restarted_worker_starts_afresh() -> None:
    """Counters lower than before: the worker restarted; nothing is read across the restart."""
    meter = WorkMeter()
    meter.add(_later(0.0, decode_passes=1000, decode_tokens=100_000), False)
    assert meter.add(_later(1.0, decode_passes=5, decode_tokens=1000), False) is None
    assert meter.add(_later(2.0, decode_passes=15, decode_tokens=3000), False) is not None
