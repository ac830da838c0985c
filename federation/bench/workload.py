"""A seeded, MLPerf-like synthetic workload: prompts of token ids and answer lengths.

MLPerf's gpt-oss-120b performance set has answers of ~1,278 tokens on average (at most
10,240) after prompts of ~1k. No data set is downloaded: prompt and answer lengths are
drawn from log-normal distributions with those means (spread configurable, 0 = fixed),
from a seed, so two runs — federated and standalone, ours and a peer's — send the same
work. Each sample asks for exactly its length (`ignore_eos`), as MLPerf's reference does
by replaying its recorded output lengths.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

MLPERF_MEAN_OUTPUT_TOKENS = 1278
MLPERF_MAX_OUTPUT_TOKENS = 10_240
MEAN_PROMPT_TOKENS = 1000
TOKEN_ID_RANGE = (1000, 100_000)  # ordinary o200k tokens: no special tokens in synthetic prompts
# Prompts are windows at random offsets into one seeded pool of ids: 20 k prompts of ~1k
# tokens in well under a second, each still different from the others.
PROMPT_POOL_TOKENS = 1 << 20


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
    index: int
    prompt: tuple[int, ...]  # token ids
    output_tokens: int


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    requests: int
    seed: int = 0
    prompt: LengthDistribution = LengthDistribution(MEAN_PROMPT_TOKENS, 0.5, 16, 8192)
    output: LengthDistribution = LengthDistribution(MLPERF_MEAN_OUTPUT_TOKENS, 0.8)

    def samples(self) -> list[Sample]:
        rng = random.Random(self.seed)
        pool = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(PROMPT_POOL_TOKENS)]
        out = []
        for i in range(self.requests):
            n_prompt = min(self.prompt.draw(rng), PROMPT_POOL_TOKENS)
            start = rng.randrange(PROMPT_POOL_TOKENS - n_prompt + 1)
            out.append(Sample(i, tuple(pool[start : start + n_prompt]), self.output.draw(rng)))
        return out
