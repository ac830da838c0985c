"""The hop with nothing else running: one streamed completion at a time (a ~1,200-token prompt,
4 tokens asked), and the gateway's `Server-Timing` of each, by site: the hop (from the gateway
receiving the request to the site's agent taking it) and its route (to the route decided). What
the path costs a request when no loop is busy with streams: the floor under `fedctl bench
--datapath`'s `overhead_ms_p50` (docs/BENCHMARKS.md). Against `fedctl up` (or any endpoint of ours):

    python3 scripts/hop_idle.py [--url http://127.0.0.1:8080] [--requests 150]
"""

import argparse
import asyncio
import random
import statistics

import aiohttp

from federation.bench.client import HOP, ROUTE, SITE_HEADER

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "zeta", "kappa", "sigma")


async def main(url: str, requests: int) -> None:
    hops: dict[str, list[float]] = {}
    routes: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            prompt = " ".join(random.choice(WORDS) for _ in range(1000))
            body = {"model": "openai/gpt-oss-120b", "prompt": prompt, "max_tokens": 4, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as response:
                response.raise_for_status()
                timing = response.headers.get("Server-Timing", "")
                hop, route = HOP.search(timing), ROUTE.search(timing)
                site = response.headers.get(SITE_HEADER, "?")
                await response.read()
            if hop and route:
                hops.setdefault(site, []).append(float(hop.group(1)))
                routes.setdefault(site, []).append(float(route.group(1)))
            await asyncio.sleep(0.05)  # one at a time, with the loops idle in between
    for site, values in sorted(hops.items()):
        cuts = statistics.quantiles(values, n=10)
        print(
            f"{site}: {len(values)} requests, hop p10 {cuts[0]:.2f} / p50 {statistics.median(values):.2f} / "
            f"p90 {cuts[-1]:.2f} ms; of it the route p50 {statistics.median(routes[site]):.2f} ms"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--requests", type=int, default=150)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.requests))
