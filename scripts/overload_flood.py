"""Flood an endpoint's /generate with closed-loop clients and count how requests ended.

Reproduces the overload finding of issue #3's closing note: with far more clients than
the sites have running slots, some requests fail instead of waiting. Usage:

    fedctl up --config tiny.yaml &    # one GPU per site
    python3 scripts/overload_flood.py --endpoint http://127.0.0.1:18080 --clients 1700 --seconds 15
"""

import argparse
import asyncio
import collections
import random
import time

import aiohttp


async def main(args: argparse.Namespace) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    stop = time.monotonic() + args.seconds
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:

        async def client(i: int) -> None:
            rng = random.Random(i)
            prompt = [rng.randrange(1000, 90_000) for _ in range(500)]
            while time.monotonic() < stop:
                params = {"max_new_tokens": rng.randint(200, 600), "ignore_eos": True}
                started = time.monotonic()
                async with http.post(
                    args.endpoint + "/generate", json={"input_ids": prompt, "sampling_params": params}
                ) as r:
                    body = await r.json()
                took = f"{time.monotonic() - started:.0f}s"
                if r.status == 200:
                    outcomes[f"ok from {r.headers.get('X-Federation-Site')}"] += 1
                else:
                    outcomes[f"{r.status} {body['error']['message']} after ~{took}"] += 1

        await asyncio.gather(*(client(i) for i in range(args.clients)))
    for outcome, n in outcomes.most_common():
        print(f"{n:6d}  {outcome}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=1700)
    p.add_argument("--seconds", type=float, default=15.0)
    asyncio.run(main(p.parse_args()))
