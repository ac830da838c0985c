"""One emulated GPU: SGLang's continuous batching with chunked prefill, event-driven.

Why event-driven: a real GPU at MLPerf load decodes ~1,000 sequences in ~75 ms steps,
i.e. ~13 k tokens/s per GPU; a Python loop per token per sequence could not keep up
with even one. Between two events (an arrival, a finish, a full KV pool, an abort, a
fault change) the batch does not change, so every step in that stretch has the same
shape: its duration grows linearly (each step attends to `B` more context tokens),
and the number of steps completed by any instant has a closed form. The engine
therefore wakes only at events, and anyone asking "how many tokens does this
sequence have now?" gets an exact answer in O(1).

What SGLang does that this keeps: the waiting queue in its schedule policy's order (fcfs by
default; lof; lpm), each request matched against the prefix cache (nodes/emulator/prefix_cache.py)
when admission reaches it, so its hit costs no prefill compute and no chunk budget; admission under
`max_running_requests`, the chunk budget and the KV pools as SGLang's prefill adder charges them
(cached tokens free, evictable KV available, a reserve for the running requests' future output
scaled by `new_token_ratio`, which decays from 0.7 to 0.1); chunked prefill mixed into the decode
step (`a + b·B + κ·ΣL/1000 + ρ·n_prefill`); the prefill step emitting the first token; what a
step computes entering the cache after it (a prompt's end, and a finished request, only once the
next step has been scheduled: SGLang's overlap scheduler processes a result then); cached KV
evicted only when an allocation needs it; retraction, when the pools run out, of the sequence with
the least output, which goes to the back of the queue and later prefills its prompt and output
again (less what the cache still holds).

Streaming clients wait for steps, not for time: `call_at_tokens` turns "my next output
point" into the global step that produces it, and the engine keeps those callbacks by step
with a single timer at the completion of the earliest step that ends inside the current
stretch (the stretch's own end releases the rest). A full batch streaming per token thus
costs one timer per step, not one per stream per step.

Each stretch carries its `StepShape` (batch, context, prompt chunk, hits, queue, pools), and the
listener gets every stretch as it ends: that is all SGLang's own accounting of its work needs
(`nodes/emulator/reporter.py`), at O(1) per stretch rather than per step.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections import deque
from collections.abc import Callable

from core.gpus import GpuProfile
from nodes.emulator.kv_pools import CappedSum, KvPools, PoolUsage
from nodes.emulator.prefix_cache import CacheConfig, PrefixCache
from nodes.emulator.schedule_policy import CLIP_MAX_NEW_TOKENS, add_prefill, order_waiting, refresh_block
from nodes.emulator.sequence import HELD, PREFILLING, RUNNING, EngineListener, SeqState, Sequence
from nodes.emulator.stretch import StepShape, Stretch
from nodes.emulator.wakeups import StepWakeups

INIT_NEW_TOKEN_RATIO = 0.7  # SGLang's init_new_token_ratio (schedule_conservativeness 1.0)
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14  # SGLang's min_new_token_ratio
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # SGLang decays from init to min over this many steps
RETRACT_DECODE_STEPS = 20  # SGLANG_RETRACT_DECODE_STEPS: decode room a retraction makes per request kept


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _settle(fut: asyncio.Future[bool], value: bool) -> None:
    if not fut.done():
        fut.set_result(value)


class Engine:
    """The batch scheduler and clock of one emulated GPU."""

    def __init__(
        self,
        profile: GpuProfile,
        *,
        speed: float = 1.0,
        max_running_requests: int | None = None,
        kv_capacity_tokens: int | None = None,
        cache: CacheConfig | None = None,
        listener: EngineListener | None = None,
    ) -> None:
        if speed <= 0:
            raise ValueError("speed must be > 0")
        self.profile = profile
        self.speed = speed
        self.slowdown = 1.0  # brownout factor, set by faults
        self.max_running_requests = max_running_requests or profile.max_running_requests
        self.kv_capacity_tokens = kv_capacity_tokens or profile.kv_capacity_tokens
        self.cache = PrefixCache(cache or CacheConfig())
        self.pools = KvPools(self.kv_capacity_tokens, self.cache)
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: deque[Sequence] = deque()  # those the next step prefills; the first may be the chunked one
        self.running: set[Sequence] = set()
        self._finish_heap: list[tuple[int, int, Sequence]] = []
        self._heap_tiebreak = 0
        self.steps = 0  # global steps completed at `self.boundary_t`
        self.boundary_t = self.started_at = self._loop.time()
        self._join_sum = 0  # Σ join_step over running
        self._len_base_sum = 0  # Σ (prompt + generated) at join, over running
        self._generated_base = 0  # Σ (generated - join_step) over running
        self._max_new_sum = 0  # Σ max_new_tokens over running
        # Σ min(max_new - output, 4096) over running: what admission reserves for their output.
        self._reserve = CappedSum(-1, CLIP_MAX_NEW_TOKENS)
        self._emitted = 0  # tokens banked by sequences no longer counted in running
        self._new_token_ratio = INIT_NEW_TOKEN_RATIO
        # Checkpoints and releases of the step just run, applied after the next one is scheduled.
        self._deferred: list[tuple[Sequence, int, bool]] = []
        self._policy_rounds = 0  # scheduling rounds with a queue (the waiting-prefix refresh's clock)
        self._refresh_block = -1  # the block of rounds the last refresh fell in
        self._segment: Stretch | None = None
        self._event_t = math.inf
        self._waker: asyncio.Future[bool] | None = None
        self._aborted: list[Sequence] = []
        self.retractions = 0
        self.preemptions = 0  # running requests sent back to the queue for waiting ones of a higher priority
        self._preempted: list[Sequence] = []  # this round's, queued again once the adder is done
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
        seq.queued_at = seq.queue_entry_at = self._loop.time()
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
        """KV in use in the FULL pool (what requests hold alone and the prefixes they lock)."""
        steps = self.steps_at(self._loop.time())
        return self.pools.full_used(self._running_context(steps))

    def pool_usage(self, now: float | None = None) -> PoolUsage:
        """Both KV pools at `now` (the engine's clock by default): in use, evictable, capacity."""
        steps = self.steps_at(self._loop.time() if now is None else now)
        return self.pools.usage(self._running_context(steps), self.steps, steps - self.steps)

    def _running_context(self, steps: int) -> int:
        """ΣL over running sequences after `steps` global steps (each adds one token to each)."""
        return self._len_base_sum + len(self.running) * steps - self._join_sum

    @property
    def idle(self) -> bool:
        """Nothing running, prefilling, queued or waiting to be released (SGLang's is_fully_idle)."""
        return not (self.running or self.prefilling or self.waiting or self._deferred)

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache: empty the prefix cache, only when idle."""
        if not self.idle:
            return False
        self.cache.tree.reset()
        if self._listener is not None:
            self._listener.on_idle(self.pools.shape(0, self.steps), self._loop.time())
        return True

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
        """One scheduling round: admissions (SGLang's get_new_batch_prefill), then the previous
        step's results (checkpoints, releases), then the decode check (retraction)."""
        self._drop_aborted()
        preempts = self.cache.config.priority.preempts
        if self.waiting and (preempts or self.prefilling or len(self.running) < self.max_running_requests):
            self._policy_rounds += 1
            block = refresh_block(self._policy_rounds)
            order_waiting(self.cache, self.waiting, block != self._refresh_block)
            self._refresh_block = block
        # What the running requests' output may still take, and the mixed-in decode's slots.
        reserved = self._new_token_ratio * self._reserve.value(self.steps) + len(self.running)
        added = add_prefill(
            self.cache,
            self.pools,
            self.waiting,
            self.prefilling,
            running=len(self.running),
            max_running=self.max_running_requests,
            budget=self.profile.chunked_prefill_tokens,
            step=self.steps,
            context=lambda: self._running_context(self.steps),
            reserved=reserved,
            now=self.boundary_t,
            preempt=self._preempt_for if preempts else None,
        )
        self.waiting.extend(self._preempted)  # SGLang queues them again after the round
        self._preempted.clear()
        self._event_t = min(self._event_t, added.next_arrival)
        prefill = added.tokens
        self._apply_deferred()
        retracted = self._retract_for(prefill)
        batch = len(self.running)
        if batch == 0 and not self.prefilling:
            if self._listener is not None:
                self._listener.on_idle(self.pools.shape(0, self.steps), self.boundary_t)
            return None
        context = self._running_context(self.steps)
        kv = self.pools.shape(context, self.steps)
        shape = StepShape(
            batch=batch,
            context_tokens=context,
            prefill_tokens=prefill,
            reprocessed_tokens=added.reprocessed,
            cached_tokens=added.hits,
            reprocessed_cached_tokens=added.rehits,
            queued=len(self.waiting),
            retracted=retracted,
            kv=kv,
        )
        scale = self.slowdown / (1000.0 * self.speed)
        s0 = self.profile.step_ms(batch, context, prefill) * scale
        if prefill:
            return Stretch(self.boundary_t, s0, 0.0, 1, shape)
        while not self._is_live(self._finish_heap[0]):
            heapq.heappop(self._finish_heap)
        k_finish = self._finish_heap[0][0] - self.steps
        k_kv = (self.kv_capacity_tokens - kv.full_used) // batch
        if kv.swa_growth:  # every step writes a slot per sequence before decode frees its old ones
            k_kv = min(k_kv, (self.pools.swa_capacity - kv.swa_used - batch) // kv.swa_growth + 1)
        d = self.profile.kappa_ms * batch / 1000.0 * scale
        return Stretch(self.boundary_t, s0, d, max(1, min(k_finish, k_kv)), shape)

    def _retract_for(self, prefill: int) -> int:
        """SGLang's decode check: the step needs a slot per decoding sequence (and the prompt chunk)
        in both pools, evictable KV counting as free; short of that, retract, least output first,
        keeping one unless a prompt chunk needs the room."""
        retracted = 0
        swa = self.pools.swa_capacity
        while self.running:
            batch = len(self.running)
            need = batch + prefill
            full_free = self.kv_capacity_tokens - self.pools.full_used(self._running_context(self.steps))
            if full_free >= need and (not swa or swa - self.pools.swa_used(self.steps) >= need):
                break
            if batch == 1 and not prefill:
                break
            self._retract_one()
            retracted += 1
        if retracted:
            kept = len(self.running)
            generated = self._generated_base + kept * self.steps
            self._new_token_ratio = min(1.0, (generated + RETRACT_DECODE_STEPS * kept) / (self._max_new_sum + 1))
            context = self._running_context(self.steps)
            self.pools.evict_to_available(context, self.steps, RETRACT_DECODE_STEPS * kept)
        return retracted

    def _preempt_for(self, seq: Sequence, lacking: float) -> tuple[int, float] | None:
        """SGLang's `preempt_to_schedule`: the running requests of the least favoured priority
        (the newest in the queue first among equals), while each is more than the threshold below
        `seq`'s, until what they reserve for their output covers the KV tokens `seq` lacks (at
        least one). They leave the batch, their KV freed and nothing of it cached, as a retraction
        frees it, and are queued again after the round. Returns (how many, what they reserved),
        or None when that does not suffice."""
        priority = self.cache.config.priority

        def least_favoured_first(s: Sequence) -> tuple[int, float]:
            return (s.priority * -priority.sign, -s.queue_entry_at)

        least = min(self.running, key=least_favoured_first, default=None)
        if least is None or not priority.preempts_over(seq.priority, least.priority):
            return None  # most rounds of a full batch: no running request is far enough below
        steps, victims = self.steps, []
        for running in sorted(self.running, key=least_favoured_first):
            if not priority.preempts_over(seq.priority, running.priority):
                break
            victims.append(running)
            lacking -= self._reserved_for(running, steps)
            if lacking <= 0:
                break
        if not victims or lacking > 0:
            return None
        freed = 0.0
        for victim in victims:
            freed += self._reserved_for(victim, steps)
            self._send_back(victim)
            self._preempted.append(victim)
        self.preemptions += len(victims)
        kept = len(self.running)
        self.pools.evict_to_available(self._running_context(steps), steps, RETRACT_DECODE_STEPS * kept)
        return len(victims), freed

    def _reserved_for(self, seq: Sequence, steps: int) -> float:
        """What admission reserves for a running request's output still to come (SGLang's
        `_get_running_request_total_token_offset`, at the ratio the reserve is scaled by)."""
        left = seq.max_new_tokens - (seq.generated + steps - seq.join_step)
        return min(left, CLIP_MAX_NEW_TOKENS) * self._new_token_ratio

    def _send_back(self, seq: Sequence) -> None:
        """A running request out of the batch and waiting again (a retraction or a preemption):
        its KV freed, nothing of it entering the cache; it will prefill its prompt and output
        again, less what the cache still holds (SGLang's `release_req` and `reset_for_retract`)."""
        self._leave_running(seq)
        self.cache.release(seq, None, 0)
        seq.state = SeqState.WAITING
        seq.retractions += 1
        seq.queue_entry_at = self.boundary_t

    def _retract_one(self) -> None:
        """Out of KV: send back the running sequence with the least output (SGLang's order) to the
        back of the queue; its KV is freed, nothing of it enters the cache."""
        steps = self.steps
        victim = min(
            self.running,
            key=lambda s: (s.generated + steps - s.join_step, -s.prompt_tokens),
        )
        self._send_back(victim)
        self.waiting.append(victim)
        self.retractions += 1

    def _apply_deferred(self) -> None:
        """The previous step's results: prompts that finished their prefill enter the cache, and
        requests that ended give up their KV, keeping what has KV in the cache."""
        deferred, self._deferred = self._deferred, []
        for seq, tokens, release in deferred:
            group = seq.kv_group
            if group not in (RUNNING, HELD):
                continue
            self.pools.leave(seq)
            if release:
                self.cache.release(seq, tokens, seq.decode_from)
            else:
                self.cache.checkpoint(seq, tokens)
                self.pools.enter(seq, group, self.steps)

    # ---- applying a finished stretch --------------------------------------------

    def _finish_segment(self, seg: Stretch) -> None:
        if self._listener is not None:
            self._listener.on_stretch(seg)
        self.steps += seg.k_max
        self._clock = (math.nan, 0)
        self.boundary_t = seg.end()
        decay = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self._new_token_ratio - decay * seg.k_max)
        if seg.shape.queued and seg.shape.batch < self.max_running_requests:
            self._policy_rounds += seg.k_max - 1  # SGLang orders its queue before every step with room
        if seg.shape.prefill_tokens:
            self._consume_prefill()
        while self._finish_heap and self._finish_heap[0][0] <= self.steps:
            entry = heapq.heappop(self._finish_heap)
            if self._is_live(entry):
                self._leave_running(entry[2])
                self._finish(entry[2])
        # What the steps wrote came from free KV, or from cached KV evicted as it ran short.
        self.pools.evict_to_available(self._running_context(self.steps), self.steps, 0)
        self._release_wakes(self.steps)

    @staticmethod
    def _is_live(entry: tuple[int, int, Sequence]) -> bool:
        """Heap entries go stale when a sequence is retracted or aborted."""
        step, _, seq = entry
        return seq.state is SeqState.RUNNING and seq.finish_step == step and seq.abort_message is None

    def _consume_prefill(self) -> None:
        """The step computed each prefilling request's chunk: a request still short of its
        prompt's end has the chunk cached now (SGLang's stash of the chunked request, seen by the
        next round); one at its end emits its first token and runs, its prompt cached after the
        next round is scheduled."""
        left: deque[Sequence] = deque()
        for seq in self.prefilling:
            self.pools.leave(seq)
            seq.kv_len += seq.chunk
            seq.prefill_left -= seq.chunk
            seq.chunk = 0
            if seq.prefill_left:
                self.cache.checkpoint(seq, seq.kv_len)
                self.pools.enter(seq, PREFILLING, self.steps)
                left.append(seq)
                continue
            if seq.abort_message is not None:
                self.cache.release(seq, None, 0)
                seq.state = SeqState.FINISHED
                continue
            seq.decode_from = seq.kv_len + 1  # none, unless it goes on to decode (`_join_running`)
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
                self._deferred.append((seq, seq.kv_len, False))
        self.prefilling = left

    def _join_running(self, seq: Sequence) -> None:
        seq.state = SeqState.RUNNING
        seq.join_step = self.steps
        seq.decode_from = seq.prompt_tokens + seq.generated - 1  # the first token's KV
        self.running.add(seq)
        self._join_sum += seq.join_step
        self._len_base_sum += seq.prompt_tokens + seq.generated
        self._generated_base += seq.generated - seq.join_step
        self._max_new_sum += seq.max_new_tokens
        self._reserve.add(seq, seq.max_new_tokens - seq.generated + seq.join_step, self.steps)
        self.pools.enter(seq, RUNNING, self.steps)
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
        self.pools.leave(seq)
        self._reserve.remove(seq)
        produced = self.steps - seq.join_step
        self.running.discard(seq)
        self._join_sum -= seq.join_step
        self._len_base_sum -= seq.prompt_tokens + seq.generated
        self._generated_base -= seq.generated - seq.join_step
        self._max_new_sum -= seq.max_new_tokens
        self._emitted += produced
        seq.generated += produced
        seq.wake_step = math.inf  # a pending call waits to be filed again (`_join_running`)

    def _finish(self, seq: Sequence) -> None:
        seq.state = SeqState.FINISHED
        seq.finished_at = self.boundary_t
        self._hold(seq)
        _resolve(seq.first_token)
        _resolve(seq.done)
        self._call_wake(seq)
        if self._listener is not None:
            self._listener.on_finish(seq)

    def _hold(self, seq: Sequence) -> None:
        """An ended request keeps its KV until its result is processed: then what has KV (all but
        the last token) enters the cache and the rest is freed."""
        self.pools.leave(seq)
        seq.kv_len = seq.prompt_tokens + max(seq.generated, 1) - 1
        self.pools.enter(seq, HELD, self.steps)
        self._deferred.append((seq, seq.kv_len, True))

    def _drop_aborted(self) -> None:
        """Free what aborted requests held; they ended for their clients already. A running one
        keeps what it computed in the cache, as a finished one does."""
        aborted, self._aborted = self._aborted, []
        for seq in aborted:
            if seq.state is SeqState.WAITING:
                if seq in self.waiting:  # not yet there if aborted before submit()
                    self.waiting.remove(seq)
            elif seq.state is SeqState.PREFILL:
                self.prefilling.remove(seq)
                self.pools.leave(seq)
                self.cache.release(seq, None, 0)
            elif seq.state is SeqState.RUNNING:
                self._leave_running(seq)
                self._hold(seq)
            seq.state = SeqState.FINISHED
