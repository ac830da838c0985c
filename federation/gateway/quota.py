"""Per-key quotas held across every gateway of every region, with no cross-region call on the
request path (#45; docs/QUOTAS.md says the rules for operators).

- **A key's budget lives in its home region's store** (Redis): a token bucket per limit
  (`rpm` requests and `tpm` tokens a minute, a minute's worth at most), `fed:bucket:NAME`.
- **Each region spends from a slice it leased** (`fed:allow:NAME` in the region's own store):
  LEASE_FRACTION of the key's per-minute limits, valid LEASE_TTL_S. A request is admitted by one
  script on the region's store that takes its request and prompt tokens from the slice; its
  output tokens are taken as it ends (the slice may go below zero: the next lease pays that back
  first). Every gateway of the region shares the slice, so the region's gateways together hold
  to it.
- **A keeper in every gateway tops the slices up ahead of need**: when a slice it uses falls
  below half a lease, or half its time has passed, it takes what was spent back from the home's
  bucket (one gateway of the region at a time, by a lock in the region's store). The home
  region leases from its own store the same way, so every region is treated alike.
- **A region cut off from a key's home** spends what its slice holds; when that is gone or has
  expired it grants itself half a lease, once until the home answers again, and then refuses
  (429). So a partition overspends by less than one lease per region, even counting what the
  region's slice held when it was cut off (granted, but spent after the cut).
- **A region's own store down**: each gateway admits on its own. A key homed in another region
  (whose store answers) is spent from the gateway's own slice, leased from the home as the
  region's is, so the key's budget still holds; any other key at the gateway's share of its
  limits (÷ the region's gateways seen live, ÷ the regions; `limits.Limiter` in memory), so the
  gateways together stay under the limit. Running requests are never failed; what they owe the
  region's slices (output tokens, running counts) is kept per key and paid when it answers.

Only the first request of a key in a region (or after KEEP_S unused) waits for a lease, one
round trip to the key's home, at most LEASE_WAIT_S; every other request is decided on the
region's own store, one round trip when it starts (a pipelined write when it ends).
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
import redis.asyncio
import structlog
from redis.commands.core import AsyncScript

from core import supervise
from core.errors import RateLimited
from federation.gateway import metrics
from federation.gateway.keys import KeyLimits
from federation.gateway.keystore import STORE_TIMEOUT_S
from federation.gateway.limits import CONCURRENCY_RETRY_S, Limiter, Release, over_prompt

log = structlog.get_logger("gateway")

LEASE_FRACTION = 0.05  # a lease is 3 s of the key's budget at its full rate
LEASE_TTL_S = 10.0
LEASE_WAIT_S = 2.0  # the first request of a key in a region waits this long for its slice, at most
KEEP_S = 600.0  # a key used this recently keeps its slice topped up
TICK_S = 0.1
GATEWAY_STALE_S = 5.0  # a gateway not heard from this long counts no running requests, and no share
DOWN_RETRY_S = 1.0  # after a failed call the store is tried again this much later (meanwhile: on our own)
HOME_TIMEOUT_S = 1.0  # a key's home store, possibly across the WAN


# The key's budget, in its home store: take up to what is asked of each bucket, what there is.
_GRANT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local got = {}
for i, kind in ipairs({'r', 't'}) do
  local per_min, want, g = tonumber(ARGV[i]), tonumber(ARGV[i + 2]), 0
  if per_min > 0 and want > 0 then
    local level = tonumber(redis.call('HGET', KEYS[1], kind) or per_min)
    local at = tonumber(redis.call('HGET', KEYS[1], kind .. 'at') or now)
    level = math.min(per_min, level + math.max(0, now - at) * per_min / 60)
    g = math.max(0, math.min(want, level))
    if kind == 'r' then g = math.floor(g) end
    redis.call('HSET', KEYS[1], kind, tostring(level - g), kind .. 'at', tostring(now))
  end
  got[i] = tostring(g)
end
redis.call('PEXPIRE', KEYS[1], 120000)
return got
"""

# A region's slice topped up (ARGV: requests, tokens, ttl, self). An expired slice's credit is
# void (its debt is kept); a self-granted lease is refused if one is already out (returns 0).
_TOP_UP = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local h = redis.call('HMGET', KEYS[1], 'r', 't', 'exp')
local r, tk, exp = tonumber(h[1] or 0), tonumber(h[2] or 0), tonumber(h[3] or 0)
if exp < now then r, tk = math.min(r, 0), math.min(tk, 0) end
if ARGV[4] == '1' then
  if redis.call('HEXISTS', KEYS[1], 'self') == 1 then return 0 end
  redis.call('HSET', KEYS[1], 'self', 1)
else
  redis.call('HDEL', KEYS[1], 'self')
end
redis.call('HSET', KEYS[1], 'r', tostring(r + tonumber(ARGV[1])), 't', tostring(tk + tonumber(ARGV[2])),
  'exp', tostring(now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""

# A request of the key admitted on the region's slice, or why not. KEYS: slice, running, gateways.
# ARGV: requests, tokens, max_concurrent, gateway id, stale_s.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local need_r, need_t, maxc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r, tk, left = 0, 0, 0
if need_r > 0 or need_t > 0 then
  local h = redis.call('HMGET', KEYS[1], 'r', 't', 'exp')
  if not h[3] then return {'none'} end
  r, tk, left = tonumber(h[1]), tonumber(h[2]), tonumber(h[3]) - now
  if left <= 0 then return {'expired'} end
  if r < need_r then return {'rpm', tostring(need_r - r)} end
  if tk < need_t then return {'tpm', tostring(need_t - tk)} end
end
if maxc > 0 then
  local running, rows = 0, redis.call('HGETALL', KEYS[2])
  for i = 1, #rows, 2 do
    local seen = tonumber(redis.call('HGET', KEYS[3], rows[i]) or 0)
    if now - seen <= tonumber(ARGV[5]) then running = running + tonumber(rows[i + 1])
    else redis.call('HDEL', KEYS[2], rows[i]) end
  end
  if running >= maxc then return {'max_concurrent'} end
  redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
  redis.call('PEXPIRE', KEYS[2], 3600000)
end
if need_r > 0 or need_t > 0 then
  redis.call('HSET', KEYS[1], 'r', tostring(r - need_r), 't', tostring(tk - need_t))
end
return {'ok', tostring(r - need_r), tostring(tk - need_t), tostring(left)}
"""

# This gateway is alive (server time), and how many of the region's are.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('HSET', KEYS[1], ARGV[1], tostring(now))
local live, rows = 0, redis.call('HGETALL', KEYS[1])
for i = 1, #rows, 2 do
  local age = now - tonumber(rows[i + 1])
  if age <= tonumber(ARGV[2]) then live = live + 1 elseif age > 60 then redis.call('HDEL', KEYS[1], rows[i]) end
end
return live
"""

GATEWAYS = "fed:gateways"


def _slice(name: str) -> str:
    return f"fed:allow:{name}"


def _running(name: str) -> str:
    return f"fed:running:{name}"


def _bucket(name: str) -> str:
    return f"fed:bucket:{name}"


def own_lease_of(limits: KeyLimits) -> tuple[int, float]:
    """What a region cut off from the key's home grants itself, once: half a lease."""
    requests, tokens = lease_of(limits)
    return (max(1, requests // 2) if requests else 0), tokens / 2


def lease_of(limits: KeyLimits) -> tuple[int, float]:
    """A lease's requests and tokens for a key with these limits (0 where it has no such limit)."""
    requests = max(1, math.ceil(limits.rpm * LEASE_FRACTION)) if limits.rpm else 0
    tokens = max(1.0, limits.tpm * LEASE_FRACTION) if limits.tpm else 0.0
    return requests, tokens


@dataclass
class _Use:
    """What this gateway knows of a key's slice, from its last admission."""

    limits: KeyLimits
    home: str
    used_at: float = 0.0  # time.monotonic()
    requests: float = 0.0
    tokens: float = 0.0
    expires_at: float = 0.0  # time.monotonic()
    topping: asyncio.Task[None] | None = None
    cut_off: bool = False  # the key's home did not answer the last top-up
    owed_tokens: float = 0.0  # output tokens not yet taken from the slice
    owed_running: int = 0  # running requests ended, not yet counted down
    # While the region's store is down, a key homed elsewhere is spent from this gateway's own
    # slice, leased from the home as the region's would be.
    mine_requests: float = 0.0
    mine_tokens: float = 0.0
    mine_until: float = 0.0  # time.monotonic()
    mine_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class RegionQuota:
    """The key limiter of a gateway whose region has a store (see the module's docstring)."""

    def __init__(self, region: str, stores: dict[str, str], home_of: Callable[[str], str]) -> None:
        """`stores`: each region's store URL (this gateway's region among them); `home_of(name)`:
        a key's home region ("" for this region)."""
        if region not in stores:
            raise ValueError(f"no store for this gateway's region {region!r}: give --quota-store {region}=URL")
        self.region = region
        self._urls = stores
        self._clients: dict[str, redis.asyncio.Redis] = {}
        self._own = self._client(region)
        self._home_of = home_of
        self._id = uuid.uuid4().hex[:12]
        self._uses: dict[str, _Use] = {}
        self._down_until = 0.0
        self._live_gateways = 1
        self._on_own = Limiter()  # while the store is down
        self._grants: dict[str, AsyncScript] = {}
        self._top_up = self._own.register_script(_TOP_UP)
        self._admit = self._own.register_script(_ADMIT)
        self._heartbeat = self._own.register_script(_HEARTBEAT)
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()

    def _client(self, region: str) -> redis.asyncio.Redis:
        if region not in self._clients:
            timeout = STORE_TIMEOUT_S if region == self.region else HOME_TIMEOUT_S
            self._clients[region] = redis.asyncio.Redis.from_url(
                self._urls[region], socket_timeout=timeout, socket_connect_timeout=timeout
            )
        return self._clients[region]

    def _granting(self, region: str) -> AsyncScript:
        """The grant script on a key's home store."""
        if region not in self._grants:
            self._grants[region] = self._client(region).register_script(_GRANT)
        return self._grants[region]

    def start(self) -> None:
        self._tasks = [
            supervise.restarting("gateway.quota_keeper", self._keep_forever),
            supervise.restarting("gateway.quota_heartbeat", self._heartbeat_forever),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._pay_owed()
        for client in self._clients.values():
            await client.aclose()
        self._on_own.close()

    @property
    def store_up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _store_failed(self, exc: Exception) -> None:
        if self.store_up:
            log.warning("quota.store_down", region=self.region, error=str(exc), rule="each gateway on its own")
        self._down_until = time.monotonic() + DOWN_RETRY_S
        metrics.QUOTA_STORE_UP.set(0)

    # --- the request path ---------------------------------------------------------------

    async def admit(self, name: str, limits: KeyLimits, prompt_tokens: int) -> Release:
        """Count a request of key `name` starting, or raise RateLimited; returns what to call
        with its output tokens when it ends."""
        if not (limits.rpm or limits.tpm or limits.max_concurrent):
            return _nothing
        over_prompt(limits, prompt_tokens)
        use = self._use(name, limits)
        if not self.store_up:
            return await self._admit_on_own(name, use, prompt_tokens)
        try:
            verdict = await self._ask(name, limits, prompt_tokens)
            deadline = time.monotonic() + LEASE_WAIT_S
            while verdict[0] in (b"none", b"expired") and not use.cut_off and time.monotonic() < deadline:
                # this region has no slice of the key yet (or a lapsed one): the first request waits for it
                await asyncio.wait_for(asyncio.shield(self._topping(name, use)), deadline - time.monotonic())
                verdict = await self._ask(name, limits, prompt_tokens)
                if verdict[0] in (b"none", b"expired"):
                    await asyncio.sleep(TICK_S)
        except (redis.RedisError, OSError) as exc:
            self._store_failed(exc)
            return await self._admit_on_own(name, use, prompt_tokens)
        except TimeoutError:
            verdict = [b"none"]
        what = verdict[0].decode()
        if what == "ok":
            use.requests, use.tokens = float(verdict[1]), float(verdict[2])
            use.expires_at = time.monotonic() + float(verdict[3])
            if self._low(use):
                self._wake.set()
            return lambda output_tokens: self._ended(use, output_tokens)
        self._wake.set()
        if what == "max_concurrent":
            raise RateLimited(
                f"This key is over its limit (max_concurrent {limits.max_concurrent}); retry in "
                f"{CONCURRENCY_RETRY_S} s.",
                retry_after_s=CONCURRENCY_RETRY_S,
            )
        if what in ("rpm", "tpm"):
            per_minute = limits.rpm if what == "rpm" else limits.tpm
            wait_s = max(1, math.ceil(float(verdict[1]) * 60 / per_minute))
            raise RateLimited(
                f"This key is over its limit ({what} {per_minute}); retry in {wait_s} s.", retry_after_s=wait_s
            )
        raise RateLimited(
            "This key's budget could not be reached from this region, and what it may spend here on its own "
            "is spent; retry in 5 s.",
            retry_after_s=5,
        )

    async def _ask(self, name: str, limits: KeyLimits, prompt_tokens: int) -> list[bytes]:
        args = (1 if limits.rpm else 0, prompt_tokens if limits.tpm else 0, limits.max_concurrent, self._id)
        return await self._admit(keys=[_slice(name), _running(name), GATEWAYS], args=[*args, GATEWAY_STALE_S])

    def _use(self, name: str, limits: KeyLimits) -> _Use:
        use = self._uses.get(name)
        if use is None:
            use = self._uses[name] = _Use(limits, self._home_of(name) or self.region)
        use.limits, use.used_at = limits, time.monotonic()
        return use

    def _ended(self, use: _Use, output_tokens: int) -> None:
        if use.limits.tpm:
            use.owed_tokens += output_tokens
        if use.limits.max_concurrent:
            use.owed_running += 1  # paid with the others at the keeper's next tick, in one pipeline

    async def _admit_on_own(self, name: str, use: _Use, prompt_tokens: int) -> Release:
        """The region's store is down. A key homed in another region whose store answers is
        spent from this gateway's own slice of it; any other at this gateway's share of its
        limits (÷ the region's live gateways, ÷ the regions), counted here. Running requests
        are capped at this gateway's share either way."""
        limits, gateways = use.limits, self._live_gateways
        share = 1 / (gateways * len(self._urls))
        by_share = KeyLimits(
            rpm=max(1, math.floor(limits.rpm * share)) if limits.rpm else 0,
            tpm=max(1, math.floor(limits.tpm * share)) if limits.tpm else 0,
            max_concurrent=max(1, math.floor(limits.max_concurrent / gateways)) if limits.max_concurrent else 0,
        )
        if use.home != self.region and use.home in self._urls and (limits.rpm or limits.tpm):
            try:
                spent = await self._spend_own_slice(name, use, prompt_tokens)
            except (redis.RedisError, OSError, TimeoutError):
                pass  # the home is not there either: the share
            else:
                running = KeyLimits(max_concurrent=by_share.max_concurrent)
                counted = await self._on_own.admit(name, running, 0)

                def ended(output_tokens: int) -> None:
                    spent(output_tokens)
                    counted(output_tokens)

                return ended
        return await self._on_own.admit(name, by_share, min(prompt_tokens, by_share.tpm or prompt_tokens))

    async def _spend_own_slice(self, name: str, use: _Use, prompt_tokens: int) -> Release:
        """A request taken from this gateway's own slice of a key homed elsewhere, leased from the
        home when short (one lease at a time); raises RateLimited when the home has no more."""
        need_r, need_t = (1 if use.limits.rpm else 0), (prompt_tokens if use.limits.tpm else 0)
        async with use.mine_lock:
            if time.monotonic() >= use.mine_until:  # a lapsed slice's credit is void, its debt kept
                use.mine_requests, use.mine_tokens = min(use.mine_requests, 0.0), min(use.mine_tokens, 0.0)
            if use.mine_requests < need_r or use.mine_tokens < need_t:
                got = await self._from_home(name, use, use.mine_requests, use.mine_tokens)
                use.mine_requests += float(got[0])
                use.mine_tokens += float(got[1])
                use.mine_until = time.monotonic() + LEASE_TTL_S
                metrics.QUOTA_LEASES.labels("granted").inc()
            if use.mine_requests < need_r or use.mine_tokens < need_t:
                what = f"rpm {use.limits.rpm}" if use.mine_requests < need_r else f"tpm {use.limits.tpm}"
                raise RateLimited(f"This key is over its limit ({what}); retry in 1 s.", retry_after_s=1)
            use.mine_requests -= need_r
            use.mine_tokens -= need_t

        def ended(output_tokens: int) -> None:
            if use.limits.tpm:
                use.mine_tokens -= output_tokens

        return ended

    # --- the keeper ---------------------------------------------------------------------

    def _low(self, use: _Use) -> bool:
        requests, tokens = lease_of(use.limits)
        return (
            use.requests < requests / 2
            or use.tokens < tokens / 2
            or use.expires_at - time.monotonic() < LEASE_TTL_S / 2
        )

    async def _keep_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except TimeoutError:
                pass
            self._wake.clear()
            if not self.store_up:
                continue
            await self._pay_owed()
            now = time.monotonic()
            for name, use in list(self._uses.items()):
                if now - use.used_at > KEEP_S:
                    del self._uses[name]
                elif self._low(use) and (use.limits.rpm or use.limits.tpm):
                    self._topping(name, use)

    def _topping(self, name: str, use: _Use) -> asyncio.Task[None]:
        """The key's slice being topped up (one at a time per key in this gateway)."""
        if use.topping is None or use.topping.done():
            use.topping = asyncio.ensure_future(self._top_up_slice(name, use))
        return use.topping

    async def _top_up_slice(self, name: str, use: _Use) -> None:
        lock = f"fed:allowlock:{name}"
        try:
            if not await self._own.set(lock, self._id, nx=True, px=int(HOME_TIMEOUT_S * 2000)):
                await asyncio.sleep(TICK_S)  # another gateway of the region is at it
                return
            try:
                await self._lease(name, use)
            finally:
                await self._own.delete(lock)
        except (redis.RedisError, OSError) as exc:
            self._store_failed(exc)

    async def _lease(self, name: str, use: _Use) -> None:
        requests, tokens = lease_of(use.limits)
        raw = await self._own.hmget(_slice(name), ["r", "t", "exp"])
        expired = raw[2] is None or float(raw[2]) < float((await self._own.time())[0])
        have_r, have_t = (float(raw[0] or 0), float(raw[1] or 0))
        if expired:
            have_r, have_t = min(have_r, 0.0), min(have_t, 0.0)
        try:
            got = await self._from_home(name, use, have_r, have_t)
        except (redis.RedisError, OSError) as exc:
            use.cut_off = True
            if not (expired or (requests and have_r < 1) or (tokens and have_t <= 0)):
                return  # the slice still holds some: spend it, and ask again at the next tick
            requests, tokens = own_lease_of(use.limits)
            granted = await self._top_up(
                keys=[_slice(name)], args=[requests, tokens, LEASE_TTL_S, 1, int(KEEP_S * 1000)]
            )
            metrics.QUOTA_LEASES.labels("self" if granted else "refused").inc()
            if granted:
                log.warning(
                    "quota.self_lease", key=name, home=use.home, error=str(exc), requests=requests, tokens=tokens
                )
            return
        use.cut_off = False
        await self._top_up(keys=[_slice(name)], args=[got[0], got[1], LEASE_TTL_S, 0, int(KEEP_S * 1000)])
        metrics.QUOTA_LEASES.labels("granted").inc()
        use.requests, use.tokens = have_r + float(got[0]), have_t + float(got[1])
        use.expires_at = time.monotonic() + LEASE_TTL_S

    async def _from_home(self, name: str, use: _Use, have_r: float, have_t: float) -> list[bytes]:
        """What the key's home grants a slice holding `have_r` requests and `have_t` tokens, to
        make it one lease again (its requests and tokens); raises redis' errors or TimeoutError."""
        if use.home not in self._urls:
            raise redis.ConnectionError(f"no store is known for the key's home region {use.home!r}")
        requests, tokens = lease_of(use.limits)
        want_r = max(0, requests - math.floor(have_r)) if requests else 0
        want_t = max(0.0, tokens - have_t) if tokens else 0.0
        args = [use.limits.rpm, use.limits.tpm, want_r, want_t]
        return await asyncio.wait_for(self._granting(use.home)(keys=[_bucket(name)], args=args), HOME_TIMEOUT_S)

    async def _pay_owed(self) -> None:
        """What ended requests owe their slices (output tokens, running counts), in one pipeline."""
        owing = [(name, use) for name, use in self._uses.items() if use.owed_tokens or use.owed_running]
        if not owing:
            return
        try:
            async with self._own.pipeline(transaction=False) as pipe:
                for name, use in owing:
                    if use.owed_tokens:
                        pipe.hincrbyfloat(_slice(name), "t", -use.owed_tokens)
                    if use.owed_running:
                        pipe.hincrby(_running(name), self._id, -use.owed_running)
                await pipe.execute()
        except (redis.RedisError, OSError) as exc:
            self._store_failed(exc)
            return
        for _, use in owing:
            use.owed_tokens, use.owed_running = 0.0, 0

    async def _heartbeat_forever(self) -> None:
        while True:
            try:
                self._live_gateways = max(
                    1, int(await self._heartbeat(keys=[GATEWAYS], args=[self._id, GATEWAY_STALE_S]))
                )
                if not self.store_up:
                    log.info("quota.store_back", region=self.region)
                self._down_until = 0.0
                metrics.QUOTA_STORE_UP.set(1)
            except (redis.RedisError, OSError) as exc:
                self._store_failed(exc)
            await asyncio.sleep(1.0)


def _nothing(_output_tokens: int) -> None:
    """A key without limits: nothing to give back."""
