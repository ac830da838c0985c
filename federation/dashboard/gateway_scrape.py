"""What the dashboard reads from the gateway's /metrics once a second: the output tokens each
site delivered, the streams resumed elsewhere, and the TTFT/TPOT histograms per site (absent
from a gateway that does not export them yet: the page then shows "—").

Read with prometheus-client's own parser; names as docs/METRICS.md lists them.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import structlog
from prometheus_client.parser import text_string_to_metric_families

from federation.dashboard.latency import Histogram, from_samples

SITE_TOKENS = "federation_gateway_output_tokens_total"
RESUMED = "federation_gateway_resumed_total"
TTFT = "federation_gateway_ttft_seconds"
TPOT = "federation_gateway_tpot_seconds"

SCRAPE_INTERVAL_S = 1.0  # the timeline's resolution
SCRAPE_TIMEOUT_S = 2.0  # a gateway this slow to answer is drawn as a gap, not waited for
MAX_METRICS_BYTES = 8 * 1024**2  # per-key families grow with the keys; far past any real scrape

log = structlog.get_logger("dashboard")


@dataclass(frozen=True, slots=True)
class GatewaySample:
    at_unix_s: float
    site_tokens: dict[str, float]  # cumulative output tokens, by site
    resumed: float  # cumulative streams resumed on another site
    ttft: dict[str, Histogram] = field(default_factory=dict)  # by site; {}: not exported
    tpot: dict[str, Histogram] = field(default_factory=dict)


def parse(text: str, at_unix_s: float) -> GatewaySample:
    tokens: dict[str, float] = defaultdict(float)
    resumed = 0.0
    buckets: dict[str, dict[str, dict[float, float]]] = {TTFT: defaultdict(dict), TPOT: defaultdict(dict)}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == SITE_TOKENS:
                tokens[sample.labels.get("site", "")] += sample.value
            elif sample.name == RESUMED:
                resumed += sample.value
            elif sample.name.endswith("_bucket") and sample.name.removesuffix("_bucket") in buckets:
                by_site = buckets[sample.name.removesuffix("_bucket")][sample.labels.get("site", "")]
                bound = float(sample.labels["le"])
                by_site[bound] = by_site.get(bound, 0.0) + sample.value
    return GatewaySample(
        at_unix_s,
        dict(tokens),
        resumed,
        {site: from_samples(counts) for site, counts in buckets[TTFT].items()},
        {site: from_samples(counts) for site, counts in buckets[TPOT].items()},
    )


async def _fetch(session: aiohttp.ClientSession, metrics_url: str) -> str:
    async with session.get(metrics_url, timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as resp:
        resp.raise_for_status()
        body = await resp.content.read(MAX_METRICS_BYTES + 1)
    if len(body) > MAX_METRICS_BYTES:
        raise ValueError(f"more than {MAX_METRICS_BYTES} bytes")
    return body.decode()


async def scrape_forever(
    metrics_url: str, on_sample: Callable[[GatewaySample], None], on_failure: Callable[[str], None]
) -> None:
    """Scrape every SCRAPE_INTERVAL_S until cancelled; a failed scrape is reported and the next
    one tried on time."""
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        failing = False
        while True:
            started = loop.time()
            try:
                sample = parse(await _fetch(session, metrics_url), time.time())
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                reason = str(exc) or type(exc).__name__
                if not failing:
                    log.warning("dashboard.gateway_unreachable", url=metrics_url, reason=reason)
                failing = True
                on_failure(reason)
            else:
                if failing:
                    log.info("dashboard.gateway_reachable", url=metrics_url)
                failing = False
                on_sample(sample)
            await asyncio.sleep(max(0.0, SCRAPE_INTERVAL_S - (loop.time() - started)))
