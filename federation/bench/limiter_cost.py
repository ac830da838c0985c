"""What a key's limits cost a gateway's loop per request: its start (`admit`) and its end (the
release), with a region's quota store (Redis, `quota.RegionQuota`) and without (`limits.Limiter`
in memory, and on the SQLite file processes sharing a port use), in one process on uvloop as the
gateway runs them. Reports CPU microseconds per request of this process (the loop's cost; the
store's own CPU is the redis-server's, reported beside it) and the wall time of `admit`.

    python -m federation.bench.limiter_cost --requests 5000 --json limiter.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import uvloop

from core.processes import free_port_block
from federation.drills.stores import RedisServer
from federation.gateway.keys import KeyLimits
from federation.gateway.limits import KeyLimiter, Limiter
from federation.gateway.quota import RegionQuota

LIMITS = KeyLimits(rpm=10_000_000, tpm=1_000_000_000, max_concurrent=1_000_000)  # every limit counted, none reached
PROMPT_TOKENS, OUTPUT_TOKENS = 500, 200


async def _measure(limiter: KeyLimiter, requests: int, server: psutil.Process | None) -> dict[str, Any]:
    for _ in range(50):  # warm: the slice leased, the scripts loaded
        (await limiter.admit("bench", LIMITS, PROMPT_TOKENS))(OUTPUT_TOKENS)
    await asyncio.sleep(0.3)
    me = psutil.Process()
    cpu0, server0 = me.cpu_times(), server.cpu_times() if server else None
    waits, start_cpu = [], 0.0
    for _ in range(requests):
        started, started_cpu = time.perf_counter(), time.thread_time()
        release = await limiter.admit("bench", LIMITS, PROMPT_TOKENS)
        waits.append(time.perf_counter() - started)
        start_cpu += time.thread_time() - started_cpu
        release(OUTPUT_TOKENS)
        await asyncio.sleep(0)  # the loop runs on: the keeper pays what ended in batches
    await asyncio.sleep(0.3)  # the last batch paid
    cpu1 = me.cpu_times()
    waits.sort()
    total = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / requests
    result = {
        "cpu_us_per_request": round(total * 1e6, 1),
        # the loop's CPU while a request's admission was awaited (what else the loop ran meanwhile
        # included: here, little); the end is the rest (the release, and its payment in batches)
        "start_cpu_us": round(start_cpu / requests * 1e6, 1),
        "end_cpu_us": round((total - start_cpu / requests) * 1e6, 1),
        "admit_ms_p50": round(statistics.median(waits) * 1000, 3),
        "admit_ms_p99": round(waits[int(len(waits) * 0.99)] * 1000, 3),
    }
    if server and server0:
        s1 = server.cpu_times()
        result["store_cpu_us_per_request"] = round(
            (s1.user + s1.system - server0.user - server0.system) / requests * 1e6, 1
        )
    return result


async def _run(requests: int, where: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"requests": requests, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
    memory = Limiter()
    report["in_memory"] = await _measure(memory, requests, None)
    memory.close()
    shared = Limiter(where / "limits.sqlite")
    report["sqlite_file"] = await _measure(shared, requests, None)
    shared.close()
    store = RedisServer(free_port_block(1), where / "store")
    store.start()
    try:
        quota = RegionQuota("here", {"here": store.url}, lambda name: "")
        quota.start()
        assert store.process is not None
        report["redis"] = await _measure(quota, requests, psutil.Process(store.process.pid))
        await quota.close()
    finally:
        store.kill()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m federation.bench.limiter_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="limiter-cost-") as where:
        report = uvloop.run(_run(args.requests, Path(where)))
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
