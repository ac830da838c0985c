"""A stretch of steps with an unchanging batch, in closed form, and what its steps do.

Between two events the engine's batch does not change, so every step of the stretch has the same
shape and step k lasts `s0 + d·k` (each step attends to `batch` more context tokens): the steps
completed by any instant, and everything SGLang counts per step, follow without a loop per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class KvShape:
    """The KV pools as SGLang's pool observer reads them at a stretch's first step (FULL attention
    and, for GPT-OSS, sliding-window attention). "Used" is KV no request can give up: what the
    requests hold alone and the cached prefixes they lock; cached KV nobody locks is evictable."""

    full_used: int = 0  # with the slot each decoding sequence writes in the step; each step adds `batch`
    swa_used: int = 0
    swa_growth: int = 0  # SWA in use grows by up to this per step ...
    swa_used_limit: int = 0  # ... and no further: sequences keep one window of it
    full_evictable: int = 0
    swa_evictable: int = 0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What every step of a stretch does, in the terms SGLang's scheduler reports it in."""

    batch: int  # sequences decoding in the step: SGLang's running batch when it scheduled the step
    context_tokens: int  # their ΣL in the stretch's first step; each step adds `batch`
    prefill_tokens: int = 0  # the prompt chunk the step also prefills (0: a decode-only step)
    reprocessed_tokens: int = 0  # of that chunk, tokens of retracted requests prefilled again
    cached_tokens: int = 0  # prefix-cache hits of the requests the step admits (SGLang's log_hit_tokens)
    reprocessed_cached_tokens: int = 0  # of those hits, retracted requests' (not counted as device hits)
    queued: int = 0  # requests in SGLang's waiting queue meanwhile: not admitted, or no chunk yet
    retracted: int = 0  # running requests sent back to the queue to make room for the stretch
    kv: KvShape = field(default_factory=KvShape)


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
