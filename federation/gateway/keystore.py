"""API keys in a region's Redis, the store every gateway of the region shares (#45).

The same entries as the keys file (`keys.py`: a name, the key's SHA-256, its limits), plus the
region that is the key's home: where its per-minute budget lives and every other region leases
slices of it from (`quota.py`). They sit in one hash, `fed:keys` (name → JSON), beside a version
counter, `fed:keys:version`, that every change bumps. A gateway reads the version every
POLL_S and the whole hash when it moved, so a key added, revoked or given new limits by
`fedctl keys` is seen by every gateway of the region within a second, and a request never waits
on Redis to find its key. If Redis cannot be reached the gateway serves on with the last table it
read (a revocation then waits for Redis to come back: said in docs/QUOTAS.md).

`fedctl keys --redis REGION=URL` writes to every region's store it is given, one after another; a
region whose store it cannot reach is named, and the others are still written.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import Iterator

import pydantic
import redis
import redis.asyncio
import structlog

from federation.gateway.keys import (
    KEY_PREFIX,
    NAME_PATTERN,
    KeyFileError,
    KeyLimits,
    StoredKey,
    bearer_digest,
    changed,
    digest,
    limits_of,
)

log = structlog.get_logger("gateway")

KEYS = "fed:keys"
VERSION = "fed:keys:version"
POLL_S = 0.5  # a change is seen within a second: half of it polling, the rest the read
STORE_TIMEOUT_S = 0.5  # a region's store answers in a millisecond; this long means it is not there


class StoreKey(StoredKey):
    home: str = ""  # the region whose store holds the key's budget ("": this region's own)


def _entry(raw: bytes | str) -> StoreKey:
    return StoreKey.model_validate_json(raw)


class StoreError(Exception):
    """A store that could not be reached or read; the message names it."""


def region_store(item: str) -> tuple[str, str]:
    """`REGION=URL` as (region, URL); ValueError naming what was expected."""
    region, _, url = item.partition("=")
    if not region or not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"{item!r}: expected REGION=redis://HOST:PORT/DB")
    return region, url


def stores(given: list[str]) -> dict[str, redis.Redis]:
    """`REGION=URL` each, as blocking clients with bounded waits (the operator's commands)."""
    clients = {}
    for item in given:
        try:
            region, url = region_store(item)
        except ValueError as exc:
            raise KeyFileError(f"--redis {exc}") from None
        clients[region] = redis.Redis.from_url(
            url, socket_timeout=STORE_TIMEOUT_S, socket_connect_timeout=STORE_TIMEOUT_S
        )
    return clients


def async_client(url: str) -> redis.asyncio.Redis:
    """The gateway's client, with bounded waits: a store that does not answer is down."""
    return redis.asyncio.Redis.from_url(url, socket_timeout=STORE_TIMEOUT_S, socket_connect_timeout=STORE_TIMEOUT_S)


@contextlib.contextmanager
def _reaching(region: str) -> Iterator[None]:
    try:
        yield
    except (redis.RedisError, OSError) as exc:
        raise StoreError(f"the store of {region}: {exc}") from None


def _write(store: redis.Redis, name: str, entry: StoreKey | None) -> None:
    with store.pipeline(transaction=True) as pipe:
        if entry is None:
            pipe.hdel(KEYS, name)
        else:
            pipe.hset(KEYS, name, entry.model_dump_json())
        pipe.incr(VERSION)
        pipe.execute()


def _check_name(name: str) -> None:
    if not re.fullmatch(NAME_PATTERN, name):
        raise KeyFileError(f"{name!r}: a key's name is 1-64 letters, digits, '.', '_' or '-'")


def add(stores: dict[str, redis.Redis], name: str, limits: KeyLimits, home: str) -> str:
    """A new key named `name` in every store, its budget in `home`'s; returns the key, which is
    nowhere else. Refused when any store already has that name (nothing is written then)."""
    _check_name(name)
    if home not in stores:
        raise KeyFileError(f"--home {home!r} is not among the stores given ({', '.join(stores)})")
    for region, store in stores.items():
        with _reaching(region):
            if store.hexists(KEYS, name):
                raise KeyFileError(f"the store of {region}: a key named {name!r} exists")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = StoreKey(sha256=digest(key), home=home, **limits.model_dump())
    _write_all(stores, name, entry)
    return key


def revoke(stores: dict[str, redis.Redis], name: str) -> None:
    """The key refused from now on, by every gateway of these stores' regions within a second."""
    _entry_in(stores, name)
    _write_all(stores, name, None)


def set_limits(stores: dict[str, redis.Redis], name: str, changes: dict[str, int | str]) -> StoreKey:
    """The key's limits changed (only those named); returns the entry as it now is."""
    entry = changed(_entry_in(stores, name), changes)
    _write_all(stores, name, entry)
    return entry


def listed(stores: dict[str, redis.Redis]) -> dict[str, StoreKey]:
    """Every key of the first store, by name (hashes and limits; keys themselves are nowhere)."""
    region, store = next(iter(stores.items()))
    with _reaching(region):
        table = store.hgetall(KEYS)
    return {_text(name): _entry(raw) for name, raw in sorted(table.items())}


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _entry_in(stores: dict[str, redis.Redis], name: str) -> StoreKey:
    for region, store in stores.items():
        with _reaching(region):
            raw = store.hget(KEYS, name)
        if raw is not None:
            return _entry(raw)
    raise KeyFileError(f"no key named {name!r}")


def _write_all(stores: dict[str, redis.Redis], name: str, entry: StoreKey | None) -> None:
    """Written to every store; one that cannot be reached is named after the others are written."""
    unreached = []
    for region, store in stores.items():
        try:
            _write(store, name, entry)
        except (redis.RedisError, OSError) as exc:
            unreached.append(f"{region} ({exc})")
    if unreached:
        raise StoreError(f"not written to {', '.join(unreached)}: run the command again for it")


class StoreKeys:
    """The keys a gateway accepts, from its region's store, re-read when its version moves.
    `holder` answers from memory; `run` keeps the table fresh (a supervised task)."""

    def __init__(self, store: redis.asyncio.Redis) -> None:
        self._store = store
        self._by_digest: dict[str, tuple[str, KeyLimits]] = {}
        self._homes: dict[str, str] = {}
        self._version: bytes | str | None = None
        self.read_ok = False  # the table has been read at least once

    async def refresh(self) -> None:
        """Read the table if its version moved (raises redis' errors: the caller logs them)."""
        version = await self._store.get(VERSION)
        if version == self._version and self.read_ok:
            return
        table = await self._store.hgetall(KEYS)
        by_digest, homes = {}, {}
        for name, raw in table.items():
            try:
                entry = _entry(raw)
            except pydantic.ValidationError as exc:  # one bad entry (an older writer?) refuses that key only
                log.warning("keys.bad_entry", key=_text(name), error=str(exc.errors()[0]["msg"]))
                continue
            limits = limits_of(entry)
            by_digest[entry.sha256] = (_text(name), limits)
            homes[_text(name)] = entry.home
        self._by_digest, self._homes, self._version, self.read_ok = by_digest, homes, version, True

    async def run(self) -> None:
        failing = False
        while True:
            try:
                await self.refresh()
                if failing:
                    log.info("keys.store_back")
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    log.warning("keys.store_unreachable", error=str(exc), serving="the last table read")
                failing = True
            await asyncio.sleep(POLL_S)

    def holder(self, authorization: str) -> tuple[str, KeyLimits] | None:
        return self._by_digest.get(bearer_digest(authorization) or "")

    def home(self, name: str) -> str:
        """The key's home region ("" for this region's own)."""
        return self._homes.get(name, "")
