"""Calibrated performance models of one GPU serving GPT-OSS-120B under SGLang.

The constants come from REFERENCE.md §3: a step-time model fitted to measured sweeps
(MI355X) or to the MLPerf 6.1 result (MI300X). They are the only place the emulator
learns how fast a GPU is; everything else derives from them, so a benchmark that
disagrees with `predict_steady_state` is a bug in the engine, not in these numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

MODEL_CONTEXT_TOKENS = 131_072  # GPT-OSS-120B context window


@dataclass(frozen=True, slots=True)
class GpuProfile:
    """One GPU's step-time model and the scheduler limits SGLang would run it with."""

    name: str
    a_ms: float  # fixed cost of one forward step
    b_ms: float  # cost per sequence decoding in the step
    kappa_ms: float  # cost per 1,000 context tokens attended in the step
    rho_ms: float  # cost per prefill token in the step (chunked prefill)
    ttft_fixed_ms: float  # c0: tokenisation, scheduling and launch before the first step
    kv_capacity_tokens: int  # KV pool size with SGLang's default memory fraction
    # Where TPOT reaches the MLPerf Server limit (80 ms) at ~2k context: the setting
    # an operator tuning for MLPerf would pass as --max-running-requests.
    max_running_requests: int
    chunked_prefill_tokens: int = 16384  # SGLang's --chunked-prefill-size on GPUs with >= 160 GB

    def tensor_parallel(self, tp: int) -> GpuProfile:
        """One worker spanning `tp` GPUs, scaled ideally: the per-sequence, attention and prefill
        costs split `tp` ways, the KV pool and the batch limit `tp` times one GPU's, the fixed
        step cost unchanged. Not calibrated (no TP>1 measurement is in REFERENCE.md): the
        built-in recipes run TP1, one worker per GPU, which is what the models were fitted to."""
        if tp == 1:
            return self
        return replace(
            self,
            b_ms=self.b_ms / tp,
            kappa_ms=self.kappa_ms / tp,
            rho_ms=self.rho_ms / tp,
            kv_capacity_tokens=self.kv_capacity_tokens * tp,
            max_running_requests=self.max_running_requests * tp,
        )

    def step_ms(self, batch: float, context_tokens: float, prefill_tokens: float) -> float:
        """Duration of one step: `a + b·B + κ·ΣL/1000 + ρ·n_prefill` in milliseconds."""
        return self.a_ms + self.b_ms * batch + self.kappa_ms * context_tokens / 1000.0 + self.rho_ms * prefill_tokens

    def predict_steady_state(
        self,
        batch: int,
        prompt_tokens: float,
        output_tokens: float,
        output_tokens_sq: float | None = None,
    ) -> tuple[float, float]:
        """Analytic (output tokens/s, TPOT ms) with `batch` sequences always decoding.

        Requests finish at `batch/output` per step, so each step also prefills
        `batch·prompt/output` tokens. A running sequence is on average half way through
        its output; long outputs stay in the batch longer, so with varied lengths the
        mean context is `prompt + E[out²]/(2·E[out])` (pass `output_tokens_sq` = E[out²]).
        """
        out_sq = output_tokens**2 if output_tokens_sq is None else output_tokens_sq
        step = self.mixed_step_ms(batch, prompt_tokens + out_sq / (2.0 * output_tokens), prompt_tokens / output_tokens)
        return batch * 1000.0 / step, step

    def mixed_step_ms(self, batch: float, context_per_request: float, prompt_per_output: float) -> float:
        """A step of the steady state: `batch` requests decoding, each holding `context_per_request`
        of KV, and the prefill of the requests that replace those finishing (each output token's
        share of a prompt is `prompt_per_output` tokens)."""
        return self.step_ms(batch, batch * context_per_request, batch * prompt_per_output)


PROFILES: dict[str, GpuProfile] = {
    "mi300x": GpuProfile(
        name="mi300x",
        a_ms=23.1,
        b_ms=0.18,
        kappa_ms=0.0087,
        rho_ms=0.029,
        ttft_fixed_ms=50.0,
        kv_capacity_tokens=970_000,
        max_running_requests=256,
    ),
    "mi355x": GpuProfile(
        name="mi355x",
        a_ms=5.1,
        b_ms=0.057,
        kappa_ms=0.0029,
        rho_ms=0.0097,
        ttft_fixed_ms=77.0,
        kv_capacity_tokens=3_060_000,
        max_running_requests=1024,
    ),
}
