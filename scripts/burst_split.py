"""40 concurrent streamed chat requests to the local endpoint: which site served each, and
the median time to first token per site. Run against `fedctl up` (docs/BENCHMARKS.md).
Superseded by `fedctl bench` once issue #4 lands."""

import asyncio
import collections
import statistics
import time

import openai

ENDPOINT = "http://127.0.0.1:8080/v1"
REQUESTS = 40


async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, float]:
    started, first = time.perf_counter(), None
    raw = await client.chat.completions.with_raw_response.create(
        model="openai/gpt-oss-120b",
        stream=True,
        messages=[{"role": "user", "content": f"question {i}"}],
        max_tokens=200,
        extra_body={"ignore_eos": True},
    )
    async for chunk in raw.parse():
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
    assert first is not None, "the stream carried no text"
    return raw.headers["x-federation-site"], first


async def main() -> None:
    async with openai.AsyncOpenAI(base_url=ENDPOINT, api_key="unused", max_retries=0) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(REQUESTS)))
    by_site = collections.defaultdict(list)
    for site, ttft_s in results:
        by_site[site].append(ttft_s * 1000)
    for site, ttfts in sorted(by_site.items()):
        print(f"{site}: {len(ttfts)} requests, median TTFT {statistics.median(ttfts):.0f} ms")


if __name__ == "__main__":
    asyncio.run(main())
