"""A seeded, MLPerf-like synthetic workload: prompts of token ids and answer lengths.

MLPerf's gpt-oss-120b performance set has answers of ~1,278 tokens on average (at most
10,240) after prompts of ~1k. No data set is downloaded: prompt and answer lengths are
drawn from log-normal distributions with those means (spread configurable, 0 = fixed),
from a seed, so two runs — federated and standalone, ours and a peer's — send the same
work. Each sample asks for exactly its length (`ignore_eos`), as MLPerf's reference does
by replaying its recorded output lengths.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from core import tokens

MLPERF_MEAN_OUTPUT_TOKENS = 1278
MLPERF_MAX_OUTPUT_TOKENS = 10_240
MEAN_PROMPT_TOKENS = 1000


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal with the given mean; `sigma` 0 gives every sample the mean."""

    mean: int
    sigma: float
    low: int = 1
    high: int = MLPERF_MAX_OUTPUT_TOKENS

    def draw(self, rng: random.Random) -> int:
        if self.sigma <= 0:
            return self.mean
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that E[x] = mean
        return min(self.high, max(self.low, round(rng.lognormvariate(mu, self.sigma))))


@dataclass(frozen=True, slots=True)
class Sample:
    """Prompts are text, not token ids: the sglang-router (0.3.2) refuses id prompts on
    /v1/completions, and every endpoint must be sent the same thing."""

    index: int
    prompt: str  # exactly `prompt_tokens` o200k tokens
    prompt_tokens: int
    output_tokens: int
    service_tier: str | None = None  # asked as OpenAI's `service_tier` (None: not asked)


# SGLang's bench_serving --dataset-name generated-shared-prefix, at its defaults (sglang
# 0.5.23, benchmark/datasets/generated_shared_prefix.py): 64 groups of 16 questions, each group
# after its own system prompt; lengths fixed (--gsp-range-ratio 1.0); the prompts shuffled.
GSP_GROUPS, GSP_PROMPTS_PER_GROUP, GSP_SYSTEM_TOKENS, GSP_QUESTION_TOKENS, GSP_OUTPUT_TOKENS = 64, 16, 2048, 128, 256

MLPERF_LIKE_PROMPTS = LengthDistribution(MEAN_PROMPT_TOKENS, 0.5, 16, 8192)
MLPERF_LIKE_OUTPUTS = LengthDistribution(MLPERF_MEAN_OUTPUT_TOKENS, 0.8)
# Short answers, the drills' and the tiers bench's: requests end and new ones are routed all the
# time, so shares, recovery and queues show within seconds (an MLPerf-length answer lives
# minutes of GPU time, hours at the per-token pace this machine emulates them at).
SHORT_OUTPUTS = LengthDistribution(200, 0.3)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int
    seed: int = 0
    prompt: LengthDistribution = MLPERF_LIKE_PROMPTS
    output: LengthDistribution = MLPERF_LIKE_OUTPUTS

    def samples(self) -> list[Sample]:
        """Each prompt is a window at a random offset of one long text of single-token words, so
        its token count is exact and no two prompts share a prefix by accident."""
        rng = random.Random(self.seed)
        synth = tokens.synthetic_text()
        out = []
        for i in range(self.requests):
            n_prompt = self.prompt.draw(rng)
            text, _ = synth.window(rng.randrange(synth.period), n_prompt)
            out.append(Sample(i, text, n_prompt, self.output.draw(rng)))
        return out


def shared_prefix_samples(
    seed: int = 0,
    groups: int = GSP_GROUPS,
    per_group: int = GSP_PROMPTS_PER_GROUP,
    system_tokens: int = GSP_SYSTEM_TOKENS,
    question_tokens: int = GSP_QUESTION_TOKENS,
    output_tokens: int = GSP_OUTPUT_TOKENS,
) -> list[Sample]:
    """The shape of SGLang's generated-shared-prefix set: `groups` system prompts, each followed
    by `per_group` questions of their own, shuffled from `seed`. Windows of the synthetic text,
    so every count is exact and nothing is shared but each group's system prompt."""
    rng = random.Random(seed)
    synth = tokens.synthetic_text()
    out = []
    for _ in range(groups):
        system, _ = synth.window(rng.randrange(synth.period), system_tokens)
        for _ in range(per_group):
            question, _ = synth.window(rng.randrange(synth.period), question_tokens)
            out.append(Sample(0, system + question, system_tokens + question_tokens, output_tokens))
    rng.shuffle(out)
    return [dataclasses.replace(s, index=i) for i, s in enumerate(out)]
