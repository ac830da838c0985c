"""Fidelity and scale of the SGLang stand-in, measured beside the model's own prediction.

    python3 -m federation.bench.emulator fidelity --json bench-results/emulator-fidelity.json
    python3 -m federation.bench.emulator scale --json bench-results/emulator-scale.json

`fidelity` keeps one emulated GPU of each profile saturated (closed loop, a few more
clients than the running-request limit) and compares delivered output tokens/s and
mean TPOT, both measured by the client, with `GpuProfile.predict_steady_state`.
`scale` does the same with 16 MI355X workers in one process, streaming off, and
measures the requests/s it sustains and the CPU the emulator process used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from core import runtime
from core.gpus import PROFILES
from nodes.emulator.launch import EmulatorProcess, launch

QUEUE_MARGIN = 1.03  # clients per running slot: a short queue keeps every slot busy
PROGRESS_EVERY_S = 15.0


@dataclass(frozen=True, slots=True)
class Workload:
    """MLPerf-like lengths: fixed prompt, output uniform in mean·[1-spread, 1+spread]."""

    prompt_tokens: int = 1000
    output_mean: int = 1278
    output_spread: float = 0.5

    def draw_output(self, rng: random.Random) -> int:
        lo = round(self.output_mean * (1 - self.output_spread))
        hi = round(self.output_mean * (1 + self.output_spread))
        return rng.randint(lo, hi)

    @property
    def output_sq_mean(self) -> float:
        """E[out²] of the uniform length distribution."""
        return self.output_mean**2 * (1 + self.output_spread**2 / 3)


@dataclass(slots=True)
class Completion:
    started: float
    first_token: float | None
    finished: float
    tokens: int


@dataclass(slots=True)
class Window:
    """What completed between `start` and `end` (client clock, time.monotonic)."""

    start: float
    end: float
    completions: list[Completion] = field(default_factory=list)

    def add(self, c: Completion) -> None:
        if self.start <= c.finished <= self.end:
            self.completions.append(c)

    def tokens_per_s(self) -> float:
        return sum(c.tokens for c in self.completions) / (self.end - self.start)

    def requests_per_s(self) -> float:
        return len(self.completions) / (self.end - self.start)

    def mean_tpot_ms(self) -> float | None:
        tpots = [
            (c.finished - c.first_token) / (c.tokens - 1)
            for c in self.completions
            if c.first_token is not None and c.tokens > 1
        ]
        return 1000 * sum(tpots) / len(tpots) if tpots else None


async def _one_request(http: aiohttp.ClientSession, url: str, body: bytes, stream: bool) -> Completion:
    started, first = time.monotonic(), None
    async with http.post(url + "/generate", data=body, headers={"Content-Type": "application/json"}) as resp:
        resp.raise_for_status()
        if not stream:
            out = orjson.loads(await resp.read())
            return Completion(started, None, time.monotonic(), out["meta_info"]["completion_tokens"])
        last = None
        async for line in resp.content:
            if line.startswith(b"data: {"):
                first = first or time.monotonic()
                last = line
        assert last is not None, "stream ended without events"
        meta = orjson.loads(last[len(b"data: ") :])["meta_info"]
        return Completion(started, first, time.monotonic(), meta["completion_tokens"])


async def closed_loop(
    http: aiohttp.ClientSession,
    url: str,
    clients: int,
    workload: Workload,
    *,
    stream: bool,
    stop_at: float,
    window: Window,
    seed: int,
) -> None:
    """`clients` users, each sending its next request as soon as the last one finished."""
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 100_000) for _ in range(workload.prompt_tokens)]

    async def user(i: int) -> None:
        user_rng = random.Random(seed * 100_003 + i)
        await asyncio.sleep(user_rng.uniform(0, 1.0))  # don't open every connection at once
        while True:
            body = orjson.dumps(
                {
                    "input_ids": prompt,
                    "stream": stream,
                    "sampling_params": {"max_new_tokens": workload.draw_output(user_rng), "ignore_eos": True},
                }
            )
            window.add(await _one_request(http, url, body, stream))

    try:
        async with asyncio.timeout(stop_at - time.monotonic()):
            await asyncio.gather(*(user(i) for i in range(clients)))
    except TimeoutError:
        pass  # the window is over: requests still open are dropped, and the emulator aborts them


def _session() -> aiohttp.ClientSession:
    """No connection limit (one per open request) and no total timeout (answers take minutes)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def _emitted(http: aiohttp.ClientSession, url: str) -> int:
    async with http.get(url + "/_emulator/state") as resp:
        return (await resp.json())["engine"]["emitted_tokens"]


async def _progress(label: str, window: Window, until: float) -> None:
    """A line every PROGRESS_EVERY_S while the run has longer than that to go (it returns
    then: the runs wait for it, and a short run must not wait out a whole period)."""
    while until - time.monotonic() > PROGRESS_EVERY_S:
        await asyncio.sleep(PROGRESS_EVERY_S)
        print(f"[{label}] {len(window.completions)} completed in the window so far", file=sys.stderr, flush=True)


async def run_fidelity(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload()
    results: dict[str, Any] = {
        "speed": args.speed,
        "stream_interval": args.stream_interval,  # coarser than a real site's 1: this measures pace, not relaying
        "workload": asdict(workload),
        "profiles": {},
    }
    emulators: dict[str, EmulatorProcess] = {}
    try:
        for name in ("mi300x", "mi355x"):
            emulators[name] = launch(
                [
                    "--profile",
                    name,
                    "--workers",
                    "1",
                    "--speed",
                    str(args.speed),
                    "--stream-interval",
                    str(args.stream_interval),
                ]
            )
        start = time.monotonic()
        windows = {n: Window(start + args.warmup_s, start + args.warmup_s + args.window_s) for n in emulators}
        stop_at = start + args.warmup_s + args.window_s
        async with _session() as http:
            loops = []
            for i, (name, emu) in enumerate(emulators.items()):
                clients = round(PROFILES[name].max_running_requests * QUEUE_MARGIN)
                loops.append(
                    closed_loop(
                        http,
                        emu.urls[0],
                        clients,
                        workload,
                        stream=True,
                        stop_at=stop_at,
                        window=windows[name],
                        seed=i + 1,
                    )
                )
            counters = asyncio.gather(*(_engine_rate(http, e.urls[0], windows[n]) for n, e in emulators.items()))
            await asyncio.gather(*loops, _progress("fidelity", windows["mi355x"], stop_at))
            engine_rates = await counters
        for (name, window), engine_rate in zip(windows.items(), engine_rates, strict=True):
            profile = PROFILES[name]
            batch = profile.max_running_requests
            tok_s, tpot = profile.predict_steady_state(
                batch, workload.prompt_tokens, workload.output_mean, workload.output_sq_mean
            )
            measured = window.tokens_per_s() / args.speed
            measured_tpot = (window.mean_tpot_ms() or 0.0) * args.speed
            results["profiles"][name] = {
                "batch": batch,
                "requests_completed": len(window.completions),
                "predicted_output_tokens_per_s": round(tok_s, 1),
                "measured_output_tokens_per_s": round(measured, 1),
                "engine_output_tokens_per_s": round(engine_rate / args.speed, 1),
                "throughput_ratio": round(measured / tok_s, 4),
                "predicted_tpot_ms": round(tpot, 2),
                "measured_tpot_ms": round(measured_tpot, 2),
                "tpot_ratio": round(measured_tpot / tpot, 4),
            }
        p = results["profiles"]
        results["mi355x_to_mi300x_throughput"] = round(
            p["mi355x"]["measured_output_tokens_per_s"] / p["mi300x"]["measured_output_tokens_per_s"], 3
        )
        return results
    finally:
        for emu in emulators.values():
            emu.stop()


async def _engine_rate(http: aiohttp.ClientSession, url: str, window: Window) -> float:
    """The engine's own token counter over the window: a cross-check of the client's count."""
    await asyncio.sleep(max(0.0, window.start - time.monotonic()))
    n0, t0 = await _emitted(http, url), time.monotonic()
    await asyncio.sleep(max(0.0, window.end - time.monotonic()))
    return (await _emitted(http, url) - n0) / (time.monotonic() - t0)


async def run_scale(args: argparse.Namespace) -> dict[str, Any]:
    workload = Workload(output_mean=args.output_mean)
    profile = PROFILES["mi355x"]
    emu = launch(["--profile", "mi355x", "--workers", str(args.workers), "--speed", str(args.speed)])
    try:
        proc = psutil.Process(emu.pid)
        start = time.monotonic()
        window = Window(start + args.warmup_s, start + args.warmup_s + args.window_s)
        clients = round(profile.max_running_requests * QUEUE_MARGIN)
        cpu: dict[str, float] = {}

        async def sample_cpu() -> None:
            await asyncio.sleep(max(0.0, window.start - time.monotonic()))
            t = proc.cpu_times()
            cpu["start"] = t.user + t.system
            await asyncio.sleep(max(0.0, window.end - time.monotonic()))
            t = proc.cpu_times()
            cpu["end"] = t.user + t.system

        async with _session() as http:
            await asyncio.gather(
                *(
                    closed_loop(
                        http,
                        url,
                        clients,
                        workload,
                        stream=False,
                        stop_at=window.end,
                        window=window,
                        seed=i + 1,
                    )
                    for i, url in enumerate(emu.urls)
                ),
                sample_cpu(),
                _progress("scale", window, window.end),
            )
        tok_s, _ = profile.predict_steady_state(
            profile.max_running_requests,
            workload.prompt_tokens,
            workload.output_mean,
            workload.output_sq_mean,
        )
        predicted = tok_s * args.workers * args.speed
        measured = window.tokens_per_s()
        return {
            "workers": args.workers,
            "speed": args.speed,
            "workload": asdict(workload),
            "stream": False,
            "requests_completed": len(window.completions),
            "requests_per_s": round(window.requests_per_s(), 1),
            "predicted_output_tokens_per_s": round(predicted, 1),
            "measured_output_tokens_per_s": round(measured, 1),
            "throughput_ratio": round(measured / predicted, 4),
            "emulator_cpu_cores": round((cpu["end"] - cpu["start"]) / args.window_s, 3),
        }
    finally:
        emu.stop()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python3 -m federation.bench.emulator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="benchmark", required=True)
    fid = sub.add_parser("fidelity", help="one saturated GPU of each profile vs the model")
    fid.add_argument("--speed", type=runtime.positive_float, default=1.0)
    fid.add_argument("--warmup-s", type=runtime.positive_float, default=240.0, help="past two output lifetimes")
    fid.add_argument("--window-s", type=runtime.positive_float, default=240.0)
    fid.add_argument(
        "--stream-interval",
        type=runtime.positive_int,
        default=128,
        help="decode steps per stream event: the client measures TTFT and the end, not every token",
    )
    sc = sub.add_parser("scale", help="16 MI355X in one process, streaming off")
    sc.add_argument("--workers", type=int, default=16)
    sc.add_argument("--speed", type=runtime.positive_float, default=1.0)
    sc.add_argument("--output-mean", type=int, default=1300)
    sc.add_argument("--warmup-s", type=runtime.positive_float, default=200.0)
    sc.add_argument("--window-s", type=runtime.positive_float, default=120.0)
    for parser in (fid, sc):
        parser.add_argument("--json", type=Path, default=None, help="write the result here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per open request
    runner = run_fidelity if args.benchmark == "fidelity" else run_scale
    result = {"benchmark": args.benchmark, **asyncio.run(runner(args))}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
