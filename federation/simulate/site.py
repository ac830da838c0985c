"""One site in the simulation: its GPUs' step model (core/gpus.py) applied to the requests it
holds, a tick at a time, with no sockets and no tokens.

A site's requests wait in its queue until a slot frees (its GPUs' `max_running_requests` each),
are prefilled in arrival order (SGLang's chunked prefill: up to `chunked_prefill_tokens` a GPU
per step, beside the decoding batch), then decode a token per step each. A step takes what the
GPU model says for the batch, the KV it attends and the prefill it carries, divided by the
site's true speed. What the model leaves out, and the simulation therefore does too: the KV
pool's limit (no retraction), the prefix cache (no hits), and the agent's choice among its
workers (the site's requests are spread evenly over its GPUs).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.gpus import PROFILES
from core.wire import WorkDone
from federation.simulate.world import SimSite


@dataclass(slots=True)
class Request:
    rid: int
    region: str  # the client's
    prompt: int  # the prompt as the client sent it
    target: int  # output tokens the answer has in all
    expected: int  # what the scheduler's ledger counts it as (core/work.py)
    sent_at: float  # when the client sent it
    said: int = 0  # output tokens the client has: a resumed answer starts from them
    first_at: float | None = None  # when the client saw its first token


class SiteModel:
    """A site's queue, prefill and decoding batch; `tick` advances them by `dt` seconds."""

    def __init__(self, spec: SimSite, rtt_s: Callable[[str, str], float]) -> None:
        self.spec = spec
        self.profile = PROFILES[spec.gpu]
        self.slots = spec.gpus * self.profile.max_running_requests
        self._rtt_s = rtt_s
        self.alive = True
        self.arriving: deque[tuple[float, Request]] = deque()  # on the wire to it, in arrival order
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[list] = deque()  # [request, prompt tokens still to prefill]
        self._backlog = 0.0  # prompt tokens still to prefill, over `prefilling`
        # The decoding batch, one entry per slot: output tokens so far, in all, and the prompt.
        self._said = np.zeros(self.slots)
        self._target = np.zeros(self.slots)
        self._prompt = np.zeros(self.slots)
        self._active = np.zeros(self.slots, dtype=bool)
        self._requests: list[Request | None] = [None] * self.slots
        self._free = list(range(self.slots - 1, -1, -1))
        self.ledger_tokens = 0  # Σ expected output over the requests it holds (the scheduler's unit)
        self.delivered = 0.0  # output tokens produced since it started
        # Its workers' own accounting, as SGLang's /metrics would say it (WorkDone's fields, summed
        # over its GPUs): busy seconds, passes, sequences decoded, KV thousands attended, prefill.
        self._work = np.zeros(5)
        self.first_tokens: list[tuple[float, float]] = []  # (sent at, TTFT) of first tokens, since taken

    # ---- what the scheduler sees ------------------------------------------------------

    @property
    def held(self) -> int:
        """Requests it holds: on the wire, waiting, prefilling or decoding."""
        return len(self.arriving) + len(self.waiting) + len(self.prefilling) + (self.slots - len(self._free))

    @property
    def running(self) -> int:
        """Requests in its batch: decoding, or prefilled into a slot."""
        return self.slots - len(self._free)

    @property
    def context_tokens(self) -> int:
        """KV tokens its batch holds: prompts and what they said so far."""
        active = self._active
        return int(self._prompt[active].sum() + self._said[active].sum())

    def outstanding_tokens(self, said: int | None = None) -> int:
        """The ledger less what its batch has said (`said`, if known: `said_in_batch()` since the
        last tick): its agent's report of the work it holds."""
        return max(self.held, self.ledger_tokens - (self.said_in_batch() if said is None else said))

    def said_in_batch(self) -> int:
        """Output tokens its batch has said so far."""
        return int(self._said[self._active].sum())

    def work_done(self) -> WorkDone:
        """What its workers did since it started, cumulative, as an agent reports it."""
        busy_s, passes, seqs, ktokens, prefill = self._work
        return WorkDone(float(busy_s), int(passes), float(seqs), float(ktokens), int(prefill))

    # ---- requests in and out ----------------------------------------------------------

    def send(self, request: Request, now: float) -> None:
        """`request` routed here at `now`: it arrives after half the round trip from its client."""
        self.arriving.append((now + self._rtt_s(request.region, self.spec.region) / 2, request))
        self.ledger_tokens += request.expected

    def fail(self) -> list[Request]:
        """The site dies: everything it held, each with what its client has been sent."""
        self.alive = False
        held = [r for _, r in self.arriving] + list(self.waiting) + [p[0] for p in self.prefilling]
        for slot in np.flatnonzero(self._active):
            request = self._requests[slot]
            assert request is not None
            request.said = int(self._said[slot])
            held.append(request)
        self.arriving.clear()
        self.waiting.clear()
        self.prefilling.clear()
        self._active[:] = False
        return held

    # ---- time -------------------------------------------------------------------------

    def tick(self, now: float, dt: float) -> list[Request]:
        """Advance from `now` by `dt`: arrivals queue, free slots take the queue's head, the
        prefill and the batch move on by the step model. The requests that finished."""
        end = now + dt
        while self.arriving and self.arriving[0][0] <= end:
            self.waiting.append(self.arriving.popleft()[1])
        while self.waiting and len(self.prefilling) < len(self._free):
            request = self.waiting.popleft()
            tokens = request.prompt + request.said  # a resumed answer re-prefills what it said
            self.prefilling.append([request, tokens])
            self._backlog += tokens
        gpus, p = self.spec.gpus, self.profile
        batch = self.slots - len(self._free)  # decoding (a prefilling request takes its slot when done)
        if batch == 0 and not self.prefilling:
            return []
        context = float(self._prompt[self._active].sum() + self._said[self._active].sum())
        chunk = min(self._backlog / gpus, p.chunked_prefill_tokens)
        step_ms = p.step_ms(batch / gpus, context / gpus, chunk) / self.spec.speed
        steps = dt * 1000.0 / step_ms
        self._work += (dt * gpus, steps * gpus, steps * batch, steps * context / 1000.0, steps * gpus * chunk)
        finished = self._decode(steps, batch)
        self._prefill(now, dt, gpus * steps * chunk)
        return finished

    def _decode(self, steps: float, batch: int) -> list[Request]:
        if batch == 0:
            return []
        active = self._active
        self._said[active] += steps
        over = active & (self._said >= self._target)
        done = np.flatnonzero(over)
        self.delivered += steps * batch - float((self._said[done] - self._target[done]).sum())
        finished = []
        for slot in done:
            request = self._requests[slot]
            assert request is not None
            request.said = request.target
            finished.append(request)
            self.ledger_tokens -= request.expected
            self._requests[slot] = None
            self._free.append(int(slot))
        active[done] = False
        return finished

    def _prefill(self, now: float, dt: float, tokens: float) -> None:
        """Up to `tokens` of the backlog, in order; a request whose prompt is done says its first
        token then (its client sees it half a round trip later) and joins the batch."""
        if tokens <= 0 or not self.prefilling:
            return
        rate = tokens / dt
        used = 0.0
        while self.prefilling and used + self.prefilling[0][1] <= tokens:
            request, left = self.prefilling.popleft()
            used += left
            self._backlog -= left
            at = now + used / rate
            if request.first_at is None:
                request.first_at = at + self._rtt_s(self.spec.region, request.region) / 2
                self.first_tokens.append((request.sent_at, request.first_at - request.sent_at))
            slot = self._free.pop()
            self._requests[slot] = request
            self._said[slot] = request.said + 1  # the first token comes with the prefill's last step
            self._target[slot] = request.target
            self._prompt[slot] = request.prompt
            self._active[slot] = True
            self.delivered += 1
        if self.prefilling and tokens > used:
            part = tokens - used
            self.prefilling[0][1] -= part
            self._backlog -= part
