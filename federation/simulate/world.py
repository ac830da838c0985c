"""The federation a simulation runs: sites of mixed MI300X/MI355X, 8-16 GPUs each, spread over
eight regions with round trips between them, some of them slower than they declare.

The round trips are approximate public inter-region figures for the clouds' regions of these
names (not measured here); a region's own sites are a millisecond away. A site "slower than
declared" runs its GPUs at a fraction of the GPU model (a power cap, older firmware, a noisy
neighbour): the declared prior cannot know it, a measured capacity can.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from scheduler.capacity import prior_capacity_tok_s

REGIONS = (
    "us-west-2",
    "us-east-1",
    "eu-west-1",
    "eu-central-1",
    "ap-northeast-2",
    "ap-southeast-1",
    "ap-south-1",
    "sa-east-1",
)
_RTT_MS = {  # each pair once; the matrix is symmetric
    ("us-west-2", "us-east-1"): 65,
    ("us-west-2", "eu-west-1"): 125,
    ("us-west-2", "eu-central-1"): 145,
    ("us-west-2", "ap-northeast-2"): 130,
    ("us-west-2", "ap-southeast-1"): 165,
    ("us-west-2", "ap-south-1"): 215,
    ("us-west-2", "sa-east-1"): 175,
    ("us-east-1", "eu-west-1"): 70,
    ("us-east-1", "eu-central-1"): 90,
    ("us-east-1", "ap-northeast-2"): 180,
    ("us-east-1", "ap-southeast-1"): 215,
    ("us-east-1", "ap-south-1"): 185,
    ("us-east-1", "sa-east-1"): 115,
    ("eu-west-1", "eu-central-1"): 25,
    ("eu-west-1", "ap-northeast-2"): 235,
    ("eu-west-1", "ap-southeast-1"): 170,
    ("eu-west-1", "ap-south-1"): 120,
    ("eu-west-1", "sa-east-1"): 180,
    ("eu-central-1", "ap-northeast-2"): 225,
    ("eu-central-1", "ap-southeast-1"): 155,
    ("eu-central-1", "ap-south-1"): 110,
    ("eu-central-1", "sa-east-1"): 200,
    ("ap-northeast-2", "ap-southeast-1"): 75,
    ("ap-northeast-2", "ap-south-1"): 130,
    ("ap-northeast-2", "sa-east-1"): 290,
    ("ap-southeast-1", "ap-south-1"): 60,
    ("ap-southeast-1", "sa-east-1"): 330,
    ("ap-south-1", "sa-east-1"): 300,
}
SAME_REGION_RTT_MS = 1.0
GPUS_PER_SITE = (8, 16)  # a site's GPU count is drawn from this range
SLOWER_SPEEDS = (0.6, 0.95)  # a site slower than declared runs at a fraction drawn from this range


def rtt_s(regions: tuple[str, ...] = REGIONS) -> dict[tuple[str, str], float]:
    """Round trips in seconds between every ordered pair of `regions`, each region with itself."""
    out: dict[tuple[str, str], float] = {}
    for a in regions:
        for b in regions:
            ms = SAME_REGION_RTT_MS if a == b else _RTT_MS.get((a, b), _RTT_MS.get((b, a)))
            if ms is None:
                raise ValueError(f"no round trip known between {a} and {b}")
            out[(a, b)] = ms / 1000.0
    return out


@dataclass(frozen=True, slots=True)
class SimSite:
    name: str
    region: str
    gpu: str  # a key of core.gpus.PROFILES
    gpus: int
    speed: float = 1.0  # of the GPU model: what its GPUs truly run at (the prior assumes 1)

    @property
    def prior_tok_s(self) -> float:
        """What it declares: the GPU's prior (MLPerf per-GPU figure) times its GPUs."""
        return prior_capacity_tok_s(self.gpu, self.gpus)


def make_sites(count: int, seed: int, slower_share: float, regions: tuple[str, ...] = REGIONS) -> list[SimSite]:
    """`count` sites, round robin over `regions`, each MI300X or MI355X by a coin, 8-16 GPUs,
    `slower_share` of them slower than declared; the same `seed` gives the same sites."""
    rng = random.Random(seed)
    sites = []
    for i in range(count):
        region = regions[i % len(regions)]
        gpu = rng.choice(("mi300x", "mi355x"))
        gpus = rng.randint(*GPUS_PER_SITE)
        speed = rng.uniform(*SLOWER_SPEEDS) if rng.random() < slower_share else 1.0
        sites.append(SimSite(f"{region}-{gpu}-{i}", region, gpu, gpus, round(speed, 3)))
    return sites
