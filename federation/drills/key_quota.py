"""`fedctl drill key-quota`: one key driven at three times its tokens-per-minute limit through
two regions of two gateways each, its budget at home in the first region's store and leased by
the second across an emulated WAN link (130 ms); the second region's store is killed for a
while (and comes back), then the regions are partitioned (the link cut) for two minutes.

What it proves (#45): the key's limit holds across every gateway of both regions
(`overspend_ratio`: the most tokens any 60-s window delivered, over the limit); a partition
overspends by less than one lease (`partitioned_overspend_ratio`, windows inside the partition);
and nothing is lost when a store dies (`store_killed`: the rule in docs/QUOTAS.md held, every
admitted request finished). Every request is counted by what the client saw: admitted and
finished (`ok`), refused (429 with Retry-After, as the overload should be), failed (any other
answer), or lost (no answer at all).

The sites are the embedded default's two at one GPU each, at full speed: the load is the key's,
a few requests a second, far below what they serve, so that what limits it is the quota.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from core import tokens
from core.pki import Identity, Role
from core.processes import Child, free_port_block, start_python
from federation.bench.run import bench_config
from federation.drills.stores import RedisServer
from federation.embedded import Federation
from federation.gateway import keys, keystore, quota

HOME, AWAY = "ap-northeast-2", "us-west-2"
LIMIT_TPM = 60_000
OVERLOAD = 3.0
OUTPUT_TOKENS = 100
PROMPT = "Summarise the rules of a federation's quota in one paragraph. " * 8
WAN_RTT_MS = 130.0
WINDOW_S = 60.0
WINDOW_STEP_S = 5.0


@dataclass(frozen=True, slots=True)
class Phases:
    """Wall seconds from the start of the load."""

    warmup_s: float  # the key's first minute (its full bucket) spent, not measured
    measured_s: float  # the window the limit must hold in; the away store is killed inside it
    store_down_s: float
    partition_s: float
    after_s: float

    @property
    def kill_at(self) -> float:
        return self.warmup_s + self.measured_s / 3

    @property
    def cut_at(self) -> float:
        return self.warmup_s + self.measured_s

    @property
    def heal_at(self) -> float:
        return self.cut_at + self.partition_s

    @property
    def end(self) -> float:
        return self.heal_at + self.after_s


FULL = Phases(warmup_s=60.0, measured_s=180.0, store_down_s=20.0, partition_s=120.0, after_s=60.0)
# A smoke run: the key's first minute (its full bucket, spent at 3x in ~30 s) still shapes its
# short windows, which are scaled to a minute: its ratios are not the drill's measure.
QUICK = Phases(warmup_s=40.0, measured_s=30.0, store_down_s=5.0, partition_s=20.0, after_s=5.0)


@dataclass(frozen=True, slots=True)
class Outcome:
    region: str
    status: int  # 0: no answer (lost)
    ended_s: float
    tokens: int  # prompt + completion, as the answer's usage says
    retry_after: bool


def add_arguments(p: argparse.ArgumentParser) -> None:
    """key-quota's own options (beside the drills' --quick, --seed, --json)."""
    p.add_argument(
        "--limit-tpm", type=int, default=LIMIT_TPM, help=f"key-quota: the key's tokens a minute ({LIMIT_TPM:,})"
    )
    p.add_argument(
        "--partition-s",
        type=float,
        default=None,
        help=f"key-quota: how long the regions are cut apart ({FULL.partition_s:g})",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The drill with the run's options; returns its report."""
    phases = QUICK if args.quick else FULL
    if args.partition_s is not None:
        phases = Phases(phases.warmup_s, phases.measured_s, phases.store_down_s, args.partition_s, phases.after_s)
    with tempfile.TemporaryDirectory(prefix="key-quota-") as where:
        return _drill(args.limit_tpm, phases, args.seed, Path(where))


def summary(report: dict[str, Any]) -> str:
    r = report
    return (
        f"key-quota: limit {r['limit_tokens_per_min']:,} tokens/min, offered {r['offered_tokens_per_min']:,}; "
        f"delivered at most {r['delivered_tokens_per_min_max']:,}/min (overspend_ratio {r['overspend_ratio']}), "
        f"partitioned {r['partitioned_overspend_ratio']} (bar {r['partitioned_bar']}); lease {r['lease_tokens']:,} tokens\n"
        f"requests: {r['requests']['ok']:,} ok, {r['requests']['refused']:,} refused (429), "
        f"{r['requests']['failed']} failed, {r['requests']['lost']} lost; store killed: "
        f"{r['store_killed']['ok_during']} ok / {r['store_killed']['failed_during']} failed while down"
    )


def _drill(limit_tpm: int, phases: Phases, seed: int, where: Path) -> dict[str, Any]:
    config = bench_config(None, 1.0, None, 1, {"kr-mi300x": 1, "us-mi355x": 1})
    with open(where / "federation.log", "w") as log:
        return _drill_on(Federation(config, log=log), limit_tpm, phases, seed, where)


def _drill_on(fed: Federation, limit_tpm: int, phases: Phases, seed: int, where: Path) -> dict[str, Any]:
    config = fed.config
    first = free_port_block(2)
    stores = {HOME: RedisServer(first, where / "home"), AWAY: RedisServer(first + 1, where / "away")}
    children: list[Child] = []
    try:
        for store in stores.values():
            store.start()
        fed.up()
        link = start_python(
            "link away->home store",
            "federation.linkproxy",
            ["--listen", "127.0.0.1:0", "--target", f"127.0.0.1:{stores[HOME].port}", "--rtt-ms", str(WAN_RTT_MS)],
        )
        children.append(link)
        reached = {HOME: {HOME: stores[HOME].url, AWAY: stores[AWAY].url}}
        reached[AWAY] = {HOME: f"redis://{link.ready['listen']}/0", AWAY: stores[AWAY].url}
        limits = keys.KeyLimits(tpm=limit_tpm)
        key = keystore.add(keystore.stores([f"{r}={s.url}" for r, s in stores.items()]), "drill", limits, HOME)
        gateways: list[tuple[str, int]] = []
        for region in (HOME, AWAY, HOME, AWAY):
            port = free_port_block(1)
            args = ["--port", str(port), "--model", config.model, "--region", region]
            args += [a for r, url in reached[region].items() for a in ("--quota-store", f"{r}={url}")]
            args += [a for s in fed.config.scheduler_addresses for a in ("--scheduler", s)]
            args += fed.tls_flags(Identity(Role.GATEWAY))
            children.append(start_python(f"gateway {region} {port}", "federation.gateway", args, log=fed.log))
            gateways.append((region, port))
        outcomes, marks = asyncio.run(_load(gateways, key, limit_tpm, phases, seed, stores[AWAY], link))
        metrics = _self_leases([port for region, port in gateways if region == AWAY])
    finally:
        for child in reversed(children):
            child.stop()
        fed.down()
        for store in stores.values():
            store.kill()
    return _report(outcomes, marks, limit_tpm, phases, metrics)


async def _load(
    gateways: list[tuple[str, int]], key: str, limit_tpm: int, phases: Phases, seed: int, away: RedisServer, link: Child
) -> tuple[list[Outcome], dict[str, float]]:
    """Open-loop arrivals at OVERLOAD times the limit, spread over the gateways, with the store
    killed and the link cut on the phases' clock."""
    per_request = tokens.count(PROMPT) + OUTPUT_TOKENS
    rate = OVERLOAD * limit_tpm / 60 / per_request
    rng = random.Random(seed)
    outcomes: list[Outcome] = []
    marks: dict[str, float] = {}
    start = time.monotonic()
    body = {"model": "", "prompt": PROMPT, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=120)

    async def one(session: aiohttp.ClientSession, region: str, port: int) -> None:
        status, used, retry_after = 0, 0, False
        try:
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, headers=headers) as resp:
                status = resp.status
                answer = await resp.json(content_type=None)
                retry_after = resp.headers.get("Retry-After", "").isdigit()
                if status == 200:
                    used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        except (aiohttp.ClientError, TimeoutError, ValueError):
            status = status or 0
        outcomes.append(Outcome(region, status, time.monotonic() - start, used, retry_after))

    async def faults() -> None:
        await asyncio.sleep(phases.kill_at)
        away.kill()
        marks["store_killed_s"] = time.monotonic() - start
        await asyncio.sleep(phases.store_down_s)
        away.start()
        marks["store_back_s"] = time.monotonic() - start
        await asyncio.sleep(max(0.0, phases.cut_at - (time.monotonic() - start)))
        os.kill(link.pid, signal.SIGUSR1)  # the link resets every connection, and keeps refusing
        marks["cut_s"] = time.monotonic() - start
        await asyncio.sleep(phases.partition_s)
        os.kill(link.pid, signal.SIGUSR2)
        marks["healed_s"] = time.monotonic() - start

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        model = await (await session.get(f"http://127.0.0.1:{gateways[0][1]}/v1/models", headers=headers)).json()
        body["model"] = model["data"][0]["id"]
        injecting = asyncio.create_task(faults())
        sent: set[asyncio.Task[None]] = set()
        n = 0
        while time.monotonic() - start < phases.end:
            region, port = gateways[n % len(gateways)]
            task = asyncio.create_task(one(session, region, port))
            sent.add(task)
            task.add_done_callback(sent.discard)
            n += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*sent)
        await injecting
    marks["sent"] = n
    return outcomes, marks


def _self_leases(ports: list[int]) -> float:
    """The leases the away region's gateways granted their region on their own (their /metrics)."""
    total = 0.0
    for port in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name == "federation_gateway_quota_leases":
                total += sum(
                    s.value for s in family.samples if s.labels.get("outcome") == "self" and s.name.endswith("_total")
                )
    return total


def _windows(outcomes: list[Outcome], begin: float, end: float) -> list[float]:
    """Tokens a minute delivered in each window of WINDOW_S (or the span, if shorter) inside [begin, end)."""
    span = min(WINDOW_S, end - begin)
    rates = []
    at = begin
    while at + span <= end + 1e-9:
        delivered = sum(o.tokens for o in outcomes if o.status == 200 and at <= o.ended_s < at + span)
        rates.append(delivered * 60 / span)
        at += WINDOW_STEP_S
    return rates


def _report(
    outcomes: list[Outcome], marks: dict[str, float], limit_tpm: int, phases: Phases, self_leases: float
) -> dict[str, Any]:
    lease_tokens = round(quota.lease_of(keys.KeyLimits(tpm=limit_tpm))[1])
    measured = _windows(outcomes, phases.warmup_s, phases.cut_at)
    partitioned = _windows(outcomes, marks["cut_s"], marks["healed_s"])
    ok = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    down = [o for o in outcomes if marks["store_killed_s"] <= o.ended_s < marks["store_back_s"]]
    per_request = tokens.count(PROMPT) + OUTPUT_TOKENS
    return {
        "scenario": "key-quota",
        "limit_tokens_per_min": limit_tpm,
        "offered_tokens_per_min": round(OVERLOAD * limit_tpm),
        "delivered_tokens_per_min_max": round(max(measured, default=0)),
        "overspend_ratio": round(max(measured, default=0) / limit_tpm, 4),
        "partitioned_delivered_tokens_per_min_max": round(max(partitioned, default=0)),
        "partitioned_overspend_ratio": round(max(partitioned, default=0) / limit_tpm, 4),
        "lease_tokens": lease_tokens,
        "partitioned_bar": round(1 + lease_tokens / limit_tpm, 4),
        "requests": {
            "sent": int(marks["sent"]),
            "ok": len(ok),
            "refused": len(refused),
            "refused_without_retry_after": sum(1 for o in refused if not o.retry_after),
            "failed": sum(1 for o in outcomes if o.status not in (0, 200, 429)),
            "lost": int(marks["sent"]) - len(outcomes) + sum(1 for o in outcomes if o.status == 0),
        },
        "delivered_by_region": {region: sum(o.tokens for o in ok if o.region == region) for region in (HOME, AWAY)},
        "store_killed": {
            "region": AWAY,
            "at_s": round(marks["store_killed_s"], 1),
            "down_s": round(marks["store_back_s"] - marks["store_killed_s"], 1),
            "ok_during": sum(1 for o in down if o.status == 200),
            "refused_during": sum(1 for o in down if o.status == 429),
            "failed_during": sum(1 for o in down if o.status not in (200, 429)),
        },
        "partition": {"cut_s": round(marks["cut_s"], 1), "healed_s": round(marks["healed_s"], 1)},
        "self_leases": self_leases,
        "tokens_per_request": per_request,
        "windows_s": {"window": WINDOW_S, "step": WINDOW_STEP_S, "measured_from": phases.warmup_s},
        "tokens_per_min_measured": [round(r) for r in measured],
        "tokens_per_min_partitioned": [round(r) for r in partitioned],
    }
