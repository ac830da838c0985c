"""What a request costs each process before its tokens: CPU per request per process kind.

Streamed completions (a 1,000-token prompt, `--max-tokens` tokens asked, 1 by default), sent by
`fedctl bench`'s client a few at a time, against `fedctl up` (or any federation of ours on this machine), and the CPU time (user +
system, psutil) every gateway, scheduler and agent process spent meanwhile, divided by the
requests, less what the same processes spend idle over as long (reports, watches, health checks).
With one token asked, that is the per-request part of the data path (parse, tokenize, route,
start, end), which `fedctl bench --datapath` spreads over each answer's tokens. Against `fedctl up`:

    python3 scripts/cpu_per_request.py [--url http://127.0.0.1:8080] [--requests 400] [--concurrency 8]
"""

import argparse
import asyncio
import time

import psutil

from federation.bench import client
from federation.bench.workload import LengthDistribution, WorkloadSpec

KINDS = {
    "gateway": "-m federation.gateway",
    "scheduler": "-m scheduler",
    "agent": "-m nodes.agent",
    "emulator": "-m nodes.emulator",  # the GPUs' stand-in: on real hardware, no CPU of the host's
}
IDLE_S = 10.0  # long enough to see the periodic work (reports every 0.25 s) many times over


def _processes() -> dict[str, list[psutil.Process]]:
    """This machine's processes of each kind; an agent's reporter (a `multiprocessing` child) is
    counted as the agent's."""
    found: dict[str, list[psutil.Process]] = {kind: [] for kind in KINDS}
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or ())
        for kind, marker in KINDS.items():
            if marker in line:
                found[kind].append(proc)
        parent = proc.parent() if "multiprocessing" in line else None
        if parent is not None and "-m nodes.agent" in " ".join(parent.cmdline()):
            found["agent"].append(proc)
    return found


def _cpu_s(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    return {kind: sum(sum(p.cpu_times()[:2]) for p in group) for kind, group in procs.items()}


async def main(url: str, requests: int, concurrency: int, max_tokens: int) -> None:
    procs = _processes()
    before = _cpu_s(procs)
    await asyncio.sleep(IDLE_S)
    idle_per_s = {kind: (used - before[kind]) / IDLE_S for kind, used in _cpu_s(procs).items()}
    endpoint, slots, warm = url + "/v1", asyncio.Semaphore(concurrency), 2 * concurrency
    fixed = WorkloadSpec(warm + requests, prompt=LengthDistribution(1000, 0), output=LengthDistribution(max_tokens, 0))
    samples = fixed.samples()

    async with client.session(endpoint) as http:
        model = await client.served_model(http, endpoint)

        async def one(sample) -> None:
            async with slots:
                result = await client.send(http, endpoint, model, sample)
            if not result.ok:
                raise RuntimeError(f"request {sample.index} failed: {result.error}")

        await asyncio.gather(*map(one, samples[:warm]))  # connections and caches warm
        before, started = _cpu_s(procs), time.monotonic()
        await asyncio.gather(*map(one, samples[warm:]))
        wall_s, after = time.monotonic() - started, _cpu_s(procs)
    print(f"{requests} requests ({max_tokens} tokens each) in {wall_s:.1f} s, {concurrency} at a time")
    for kind, used in after.items():
        per_request = (used - before[kind] - idle_per_s[kind] * wall_s) / requests
        print(f"  {kind:9s} {len(procs[kind]):2d} processes: {per_request * 1e3:6.2f} ms of CPU per request")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.url, args.requests, args.concurrency, args.max_tokens))
