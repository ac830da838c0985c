"""One emulated GPU: SGLang's continuous batching with chunked prefill, event-driven.

Why event-driven: a real GPU at MLPerf load decodes ~1,000 sequences in ~75 ms steps,
i.e. ~13 k tokens/s per GPU; a Python loop per token per sequence could not keep up
with even one. Between two events (an arrival, a finish, a full KV pool, an abort, a
fault change) the batch does not change, so every step in that stretch has the same
shape: its duration grows linearly (each step attends to `B` more context tokens),
and the number of steps completed by any instant has a closed form. The engine
therefore wakes only at events, and anyone asking "how many tokens does this
sequence have now?" gets an exact answer in O(1).

What SGLang does that this keeps: FCFS waiting queue; admission limited by
`max_running_requests` and by the KV pool with a reserve for future output tokens
(`new_token_ratio`, decaying from 0.7 to 0.1 and reset by a retraction); chunked
prefill mixed into the decode step (`a + b·B + κ·ΣL/1000 + ρ·n_prefill`); the
prefill step emitting the first token; retraction of the sequence with the least
output when the pool runs out, which then re-prefills its prompt and output.

Streaming clients wait for steps, not for time: `call_at_tokens` turns "my next output
point" into the global step that produces it, and the engine keeps those callbacks by step
with a single timer at the completion of the earliest step that ends inside the current
stretch (the stretch's own end releases the rest). A full batch streaming per token thus
costs one timer per step, not one per stream per step.

Each stretch carries its `StepShape` (batch, context, prompt chunk, queue), and the listener
gets every stretch as it ends: that is all SGLang's own accounting of its work needs
(`nodes/emulator/reporter.py`), at O(1) per stretch rather than per step.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from core.gpus import GpuProfile
from nodes.emulator.wakeups import StepWakeups

INIT_NEW_TOKEN_RATIO = 0.7  # SGLang's init_new_token_ratio (schedule_conservativeness 1.0)
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLang's min_new_token_ratio
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLang decays from init to min over this many steps
CLIP_MAX_NEW_TOKENS = 4096  # SGLang clips max_new_tokens to this when estimating KV need


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Sequence:
    """A request inside the engine. `target_tokens` is decided up front by the caller
    (length limit, stop string or EOS position), as a real model's output would be."""

    rid: str
    prompt_tokens: int
    target_tokens: int
    max_new_tokens: int
    arrived_at: float  # when the request reached the server (TTFT counts from here)
    queued_at: float = 0.0  # when it entered this engine's waiting queue
    streaming: bool = False  # only for metrics labels (SGLang's is_streaming)
    state: SeqState = SeqState.WAITING
    generated: int = 0  # tokens emitted before `join_step` (banked)
    join_step: int = 0
    prefill_left: int = 0
    prefill_total: int = 0
    reserve_tokens: int = 0
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    abort_message: str | None = None
    aborted_tokens: int = 0  # what the client had when the abort came
    aborted_waiting: bool = False  # in the waiting queue then: never admitted, or retracted back to it
    finish_step: int = 0
    retractions: int = 0
    first_token: asyncio.Future[None] = field(default_factory=lambda: _new_future())
    done: asyncio.Future[None] = field(default_factory=lambda: _new_future())
    wake: Callable[[], None] | None = None  # a streaming client's call for `wake_tokens`
    wake_tokens: int = 0
    wake_step: float = math.inf  # the step it is filed under (inf: not filed, not running)


def _new_future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _settle(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


class EngineListener(Protocol):
    """Receives request milestones (the metrics collector implements it)."""

    def on_first_token(self, seq: Sequence) -> None: ...

    def on_finish(self, seq: Sequence) -> None: ...

    def on_stretch(self, stretch: Stretch) -> None:
        """A stretch has run all its `k_max` steps (called before their effects are applied)."""


@dataclass(frozen=True, slots=True)
class StepShape:
    """What every step of a stretch does, in the terms SGLang's scheduler reports it in."""

    batch: int  # sequences decoding in the step: SGLang's running batch when it scheduled the step
    context_tokens: int  # their ΣL in the stretch's first step; each step adds `batch`
    prefill_tokens: int = 0  # the prompt chunk the step also prefills (0: a decode-only step)
    reprocessed_tokens: int = 0  # of that chunk, tokens of retracted requests prefilled again
    prefill_kv_tokens: int = 0  # KV held before the step by prompts partly prefilled
    queued: int = 0  # requests in SGLang's waiting queue meanwhile: not admitted, or no chunk yet
    retracted: int = 0  # running requests sent back to the queue to make room for the stretch


@dataclass(slots=True)
class Stretch:
    """Steps with an unchanging batch: step k (0-based) lasts `s0 + d·k`."""

    t0: float
    s0: float
    d: float
    k_max: int
    shape: StepShape

    def duration(self, k: int) -> float:
        return k * self.s0 + self.d * k * (k - 1) / 2.0

    def end(self) -> float:
        return self.t0 + self.duration(self.k_max)

    def completed(self, t: float) -> int:
        """Steps finished by time `t` (never more than planned)."""
        elapsed = t - self.t0
        if elapsed <= 0.0:
            return 0
        if self.d <= 0.0:
            k = int(elapsed / self.s0)
        else:
            half = self.s0 - self.d / 2.0
            k = int((-half + math.sqrt(half * half + 2.0 * self.d * elapsed)) / self.d)
        while k > 0 and self.duration(k) > elapsed:
            k -= 1
        while k < self.k_max and self.duration(k + 1) <= elapsed:
            k += 1
        return min(k, self.k_max)


class Engine:
    """The batch scheduler and clock of one emulated GPU."""

    def __init__(
        self,
        profile: GpuProfile,
        *,
        speed: float = 1.0,
        max_running_requests: int | None = None,
        kv_capacity_tokens: int | None = None,
        listener: EngineListener | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.profile = profile
        self.speed = speed
        self.slowdown = 1.0  # brownout factor, set by faults
        self.max_running_requests = max_running_requests or profile.max_running_requests
        self.kv_capacity_tokens = kv_capacity_tokens or profile.kv_capacity_tokens
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()
        self.running: set[Sequence] = set()
        self._finish_heap: list[tuple[int, int, Sequence]] = []
        self._heap_tiebreak = 0
        self.steps = 0  # global steps completed at `self.boundary_t`
        self.boundary_t = self.started_at = self._loop.time()
        self._join_sum = 0  # Σ join_step over running
        self._len_base_sum = 0  # Σ (prompt + generated) at join, over running
        self._prefill_kv = 0  # KV held by prompts being prefilled
        self._reserved = 0  # KV reserved for future output of admitted sequences
        self._emitted = 0  # tokens banked by sequences no longer counted in running
        self._new_token_ratio = INIT_NEW_TOKEN_RATIO
        self._segment: Stretch | None = None
        self._event_t = math.inf
        self._waker: asyncio.Future[bool] | None = None
        self._aborted: list[Sequence] = []
        self.retractions = 0
        self._wakeups: StepWakeups[Sequence] = StepWakeups()
        self._wake_timer: asyncio.TimerHandle | None = None
        self._wake_step = 0  # the step `_wake_timer` releases
        self._rearm_below: float = -math.inf  # a call filed under an earlier step needs a new timer
        # Steps whose completion was announced to waiters: the clock never shows fewer,
        # even when a timer fires a little early (uvloop rounds them to the millisecond).
        self._announced_steps = 0
        # (loop time, steps_at it), kept until the plan or the announced steps change: the ~1,000
        # streams called at one step all ask at the same (millisecond, under uvloop) time.
        self._clock: tuple[float, int] = (math.nan, 0)

    # ---- what callers use -------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """Queue a request; it is admitted at the next step boundary."""
        seq.queued_at = self._loop.time()
        self.waiting.append(seq)
        self._notify(seq.queued_at)

    def abort(self, seq: Sequence, message: str) -> None:
        """End a request now; the engine frees its slot at the next boundary."""
        if seq.state is SeqState.FINISHED or seq.abort_message is not None:
            return
        seq.aborted_tokens = self.generated_tokens(seq)
        seq.aborted_waiting = seq.state is SeqState.WAITING
        seq.abort_message = message
        self._aborted.append(seq)
        _resolve(seq.first_token)
        _resolve(seq.done)
        self._call_wake(seq)
        self._notify(self._loop.time())

    def set_slowdown(self, factor: float) -> None:
        self.slowdown = factor
        self._notify(self._loop.time())

    def generated_tokens(self, seq: Sequence, now: float | None = None) -> int:
        """Tokens `seq` has emitted by `now` (exact, O(1))."""
        if seq.abort_message is not None:
            return seq.aborted_tokens
        if seq.state is not SeqState.RUNNING:
            return seq.generated
        steps = self.steps_at(self._loop.time() if now is None else now)
        return min(seq.generated + steps - seq.join_step, seq.target_tokens)

    def call_at_tokens(self, seq: Sequence, tokens: int, callback: Callable[[], None]) -> None:
        """Call `callback()` once, when the step that gives `seq` its `tokens`-th token completes
        or when `seq` ends (finished or aborted), whichever comes first; the last token counts
        only with the finish. One call is pending per sequence: a new one replaces it. The
        callback runs inside the engine, so it must not raise; it re-reads `generated_tokens`,
        since a retraction can make the call come before the token."""
        if seq.done.done():
            callback()
            return
        seq.wake, seq.wake_tokens, seq.wake_step = callback, tokens, math.inf
        if seq.state is SeqState.RUNNING:
            self._file_wake(seq)
        elif seq.generated >= tokens:
            self._call_wake(seq)
        # Otherwise waiting or prefilling: `_join_running` files it when the sequence is back.

    def steps_at(self, now: float) -> int:
        t, steps = self._clock
        if now != t:
            seg = self._segment
            steps = max(self.steps + (seg.completed(now) if seg is not None else 0), self._announced_steps)
            self._clock = (now, steps)
        return steps

    def steps_done(self) -> int:
        """Forward steps this GPU has completed so far (each decodes every running sequence)."""
        return self.steps_at(self._loop.time())

    def now(self) -> float:
        """The engine's clock (its event loop's)."""
        return self._loop.time()

    def stretch_in_progress(self, now: float) -> tuple[Stretch, int] | None:
        """The stretch being run and how many of its steps have completed by `now`; None while
        idle. Stretches that ended were given to the listener (`on_stretch`)."""
        seg = self._segment
        if seg is None:
            return None
        return seg, min(max(self.steps_at(now) - self.steps, 0), seg.k_max)

    def emitted_tokens_total(self) -> int:
        """All output tokens this GPU has produced so far."""
        return self._emitted + len(self.running) * self.steps_done() - self._join_sum

    @property
    def running_count(self) -> int:
        """SGLang's num_running_reqs: the decode batch. A prompt still being prefilled counts as
        waiting (`waiting_count`): in SGLang a request leaves the waiting queue only in the step
        whose prefill budget takes it, so a wave of arrivals shows as a queue, not as a batch
        that decodes slowly."""
        return len(self.running)

    @property
    def waiting_count(self) -> int:
        """SGLang's num_queue_reqs: not admitted yet, or admitted and still prefilling."""
        return len(self.waiting) + len(self.prefilling)

    def kv_used_tokens(self) -> int:
        return self._running_context(self.steps_at(self._loop.time())) + self._prefill_kv

    def _running_context(self, steps: int) -> int:
        """ΣL over running sequences after `steps` global steps (each adds one token to each)."""
        return self._len_base_sum + len(self.running) * steps - self._join_sum

    # ---- the clock --------------------------------------------------------------

    async def run(self) -> None:
        """Advance the emulated GPU forever; cancel to stop."""
        while True:
            seg = self._plan()
            if seg is None:  # idle until something arrives; the clock jumps to it
                if self._event_t == math.inf:
                    await self._sleep_until(math.inf)
                self.boundary_t = max(self.boundary_t, min(self._event_t, self._loop.time()))
                self._event_t = math.inf
                continue
            self._segment = seg
            self._clock = (math.nan, 0)
            self._arm_wake_timer()
            while True:
                if self._event_t < seg.end():
                    # The batch changes after the step in progress (never before an announced one).
                    seg.k_max = min(seg.k_max, self.steps_at(self._event_t) - self.steps + 1)
                    self._clock = (math.nan, 0)
                    self._event_t = math.inf
                    self._arm_wake_timer()
                if not await self._sleep_until(seg.end()):
                    break
            self._segment = None
            self._event_t = math.inf
            self._finish_segment(seg)
            self._arm_wake_timer()

    def _notify(self, t: float) -> None:
        self._event_t = min(self._event_t, t)
        if self._waker is not None and not self._waker.done():
            self._waker.set_result(True)

    async def _sleep_until(self, when: float) -> bool:
        """Sleep until `when` (loop time); True if an event woke us earlier. A timer that
        fired counts as `when` reached: uvloop may run it up to half a millisecond early,
        and re-reading its millisecond clock would spin until the next tick."""
        if when <= self._loop.time():
            return False
        fut: asyncio.Future[bool] = self._loop.create_future()
        self._waker = fut
        timer = self._loop.call_at(when, _settle, fut, False) if when < math.inf else None
        try:
            return await fut
        finally:
            self._waker = None
            if timer is not None:
                timer.cancel()

    # ---- streaming clients waiting for steps --------------------------------------

    def _file_wake(self, seq: Sequence) -> None:
        """File a running sequence's pending call under the step that makes its token."""
        step = seq.join_step + seq.wake_tokens - seq.generated
        if step >= seq.finish_step:
            return  # its finish calls it (`_finish`)
        seq.wake_step = step
        self._wakeups.add(step, seq)
        if step < self._rearm_below:
            self._arm_wake_timer()

    def _release_wakes(self, step: int) -> None:
        """Make the calls filed under steps up to `step`; entries left behind by a retraction or
        a replaced call no longer match their sequence's `wake_step` and are skipped."""
        for seq in self._wakeups.pop_due(step):
            if seq.wake_step <= step:
                self._call_wake(seq)

    @staticmethod
    def _call_wake(seq: Sequence) -> None:
        callback, seq.wake, seq.wake_step = seq.wake, None, math.inf
        if callback is not None:
            callback()

    def _arm_wake_timer(self) -> None:
        """One timer, at the completion of the earliest awaited step that ends inside the current
        stretch; the stretch's last step needs none (`_finish_segment` releases its waiters).
        Between stretches none is needed: `run` arms when the next one is planned."""
        step, seg = self._wakeups.first(), self._segment
        if seg is None:
            self._rearm_below = -math.inf
            step = None
        else:
            last = self.steps + seg.k_max
            if step is not None and step < last:
                self._rearm_below = step
                if self._wake_timer is not None and step == self._wake_step:
                    return
                when = seg.t0 + seg.duration(step - self.steps)
            else:
                self._rearm_below = last
                step = None
        if self._wake_timer is not None:
            self._wake_timer.cancel()
            self._wake_timer = None
        if step is not None:
            self._wake_step = step
            self._wake_timer = self._loop.call_at(when, self._on_wake_timer)

    def _on_wake_timer(self) -> None:
        self._wake_timer = None
        self._announced_steps = max(self._announced_steps, self._wake_step)
        self._clock = (math.nan, 0)
        self._release_wakes(self._wake_step)
        self._arm_wake_timer()

    # ---- planning a stretch of steps -------------------------------------------

    def _plan(self) -> Stretch | None:
        retracted = 0
        while True:
            self._drop_aborted()
            self._admit()
            batch = len(self.running)
            if batch == 0 and not self.prefilling:
                return None
            prefill, touched, reprocessed = self._next_prefill_chunk()
            context = self._running_context(self.steps)
            free = self.kv_capacity_tokens - (context + self._prefill_kv)
            if batch and free < batch + prefill:
                self._retract_one()
                retracted += 1
                continue
            break
        shape = StepShape(
            batch=batch,
            context_tokens=context,
            prefill_tokens=prefill,
            reprocessed_tokens=reprocessed,
            prefill_kv_tokens=self._prefill_kv,
            queued=len(self.waiting) + len(self.prefilling) - touched,
            retracted=retracted,
        )
        scale = self.slowdown / (1000.0 * self.speed)
        s0 = self.profile.step_ms(batch, context, prefill) * scale
        if prefill:
            return Stretch(self.boundary_t, s0, 0.0, 1, shape)
        while not self._is_live(self._finish_heap[0]):
            heapq.heappop(self._finish_heap)
        k_finish = self._finish_heap[0][0] - self.steps
        k_kv = free // batch
        d = self.profile.kappa_ms * batch / 1000.0 * scale
        return Stretch(self.boundary_t, s0, d, max(1, min(k_finish, k_kv)), shape)

    def _admit(self) -> None:
        """FCFS admission under the running-request limit and the KV pool."""
        while self.waiting:
            if len(self.running) + len(self.prefilling) >= self.max_running_requests:
                return
            seq = self.waiting[0]
            if seq.queued_at > self.boundary_t:
                self._event_t = min(self._event_t, seq.queued_at)
                return
            reserve = int(min(seq.max_new_tokens - seq.generated, CLIP_MAX_NEW_TOKENS) * self._new_token_ratio)
            need = seq.prompt_tokens + seq.generated + reserve
            if self._running_context(self.steps) + self._prefill_kv + self._reserved + need > self.kv_capacity_tokens:
                if self.running or self.prefilling:
                    return
                # An idle GPU takes the request anyway; retraction handles the rest.
            self.waiting.popleft()
            seq.state = SeqState.PREFILL
            seq.prefill_total = seq.prefill_left = seq.prompt_tokens + seq.generated
            seq.reserve_tokens = reserve
            self._reserved += reserve
            if seq.admitted_at is None:
                seq.admitted_at = self.boundary_t
            self.prefilling.append(seq)

    def _next_prefill_chunk(self) -> tuple[int, int, int]:
        """The next step's prompt chunk: its tokens, the requests it reaches (the first may be
        partly prefilled already) and the tokens among them of retracted requests."""
        budget = self.profile.chunked_prefill_tokens
        total = touched = reprocessed = 0
        for seq in self.prefilling:
            take = min(seq.prefill_left, budget - total)
            total += take
            touched += 1
            if seq.retractions:
                reprocessed += take
            if total >= budget:
                break
        return total, touched, reprocessed

    def _retract_one(self) -> None:
        """Out of KV: send back the running sequence with the least output (SGLang's order)."""
        steps = self.steps
        victim = min(
            self.running,
            key=lambda s: (s.generated + steps - s.join_step, -s.prompt_tokens),
        )
        self._leave_running(victim)
        self._reserved -= victim.reserve_tokens
        victim.state = SeqState.WAITING
        victim.retractions += 1
        self.waiting.appendleft(victim)
        self._new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.retractions += 1

    # ---- applying a finished stretch --------------------------------------------

    def _finish_segment(self, seg: Stretch) -> None:
        if self._listener is not None:
            self._listener.on_stretch(seg)
        self.steps += seg.k_max
        self._clock = (math.nan, 0)
        self.boundary_t = seg.end()
        decay = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self._new_token_ratio - decay * seg.k_max)
        if seg.shape.prefill_tokens:
            self._consume_prefill(seg.shape.prefill_tokens)
        while self._finish_heap and self._finish_heap[0][0] <= self.steps:
            entry = heapq.heappop(self._finish_heap)
            if self._is_live(entry):
                self._leave_running(entry[2])
                self._finish(entry[2])
        self._release_wakes(self.steps)

    @staticmethod
    def _is_live(entry: tuple[int, int, Sequence]) -> bool:
        """Heap entries go stale when a sequence is retracted or aborted."""
        step, _, seq = entry
        return seq.state is SeqState.RUNNING and seq.finish_step == step and seq.abort_message is None

    def _consume_prefill(self, tokens: int) -> None:
        while tokens and self.prefilling:
            seq = self.prefilling[0]
            take = min(seq.prefill_left, tokens)
            seq.prefill_left -= take
            self._prefill_kv += take
            tokens -= take
            if seq.prefill_left:
                return
            self.prefilling.popleft()
            self._prefill_kv -= seq.prefill_total
            if seq.abort_message is not None:
                self._reserved -= seq.reserve_tokens
                seq.state = SeqState.FINISHED
                continue
            if seq.generated >= seq.target_tokens:  # max_new_tokens = 0
                self._finish(seq)
                continue
            seq.generated += 1  # the prefill step emits the first token
            self._emitted += 1
            if seq.first_token_at is None:
                seq.first_token_at = self.boundary_t
                if self._listener is not None:
                    self._listener.on_first_token(seq)
            _resolve(seq.first_token)
            if seq.generated >= seq.target_tokens:
                self._finish(seq)
            else:
                self._join_running(seq)

    def _join_running(self, seq: Sequence) -> None:
        seq.state = SeqState.RUNNING
        seq.join_step = self.steps
        self.running.add(seq)
        self._join_sum += seq.join_step
        self._len_base_sum += seq.prompt_tokens + seq.generated
        seq.finish_step = seq.join_step + seq.target_tokens - seq.generated
        self._heap_tiebreak += 1
        heapq.heappush(self._finish_heap, (seq.finish_step, self._heap_tiebreak, seq))
        if seq.wake is not None:
            if seq.generated >= seq.wake_tokens:
                self._call_wake(seq)
            else:
                self._file_wake(seq)

    def _leave_running(self, seq: Sequence) -> None:
        """Bank a running sequence's tokens at the current boundary and remove it."""
        produced = self.steps - seq.join_step
        self.running.discard(seq)
        self._join_sum -= seq.join_step
        self._len_base_sum -= seq.prompt_tokens + seq.generated
        self._emitted += produced
        seq.generated += produced
        seq.wake_step = math.inf  # a pending call waits to be filed again (`_join_running`)

    def _finish(self, seq: Sequence) -> None:
        self._reserved -= seq.reserve_tokens
        seq.state = SeqState.FINISHED
        seq.finished_at = self.boundary_t
        _resolve(seq.first_token)
        _resolve(seq.done)
        self._call_wake(seq)
        if self._listener is not None:
            self._listener.on_finish(seq)

    def _drop_aborted(self) -> None:
        """Free what aborted requests held; they ended for their clients already."""
        aborted, self._aborted = self._aborted, []
        for seq in aborted:
            if seq.state is SeqState.WAITING:
                if seq in self.waiting:  # not yet there if aborted before submit()
                    self.waiting.remove(seq)
            elif seq.state is SeqState.PREFILL:
                self.prefilling.remove(seq)
                self._prefill_kv -= seq.prefill_total - seq.prefill_left
                self._reserved -= seq.reserve_tokens
            elif seq.state is SeqState.RUNNING:
                self._leave_running(seq)
                self._reserved -= seq.reserve_tokens
            seq.state = SeqState.FINISHED
