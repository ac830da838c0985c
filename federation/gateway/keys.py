"""API keys: who may use the endpoint, and how much each may take.

A key is 32 random bytes (`fed-` and URL-safe base64), shown once when it is made (`fedctl keys
add`) and stored only as its SHA-256: a key that random needs no slow hash, since no one can
guess one to match a stolen file. The file (JSON, mode 0600) names each key and its limits:
requests and tokens per minute and requests at once (0: no limit; see `limits.py`), and its
service tiers: its default and the highest it may ask for (core/tiers.py). A gateway
re-reads it within a second of a change, so keys added or removed take effect without a
restart. A client presents its key as the OpenAI client does: `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import time
from pathlib import Path
from typing import Annotated, Protocol, TypeVar

import pydantic
import structlog
from pydantic import Field, StrictInt

from core import tiers
from core.tiers import Tier, TierName

log = structlog.get_logger("gateway")

KEY_PREFIX = "fed-"
RELOAD_CHECK_S = 1.0
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"  # it labels metrics and log lines


class KeyFileError(ValueError):
    """A keys file that cannot be read or written; the message says which and why."""


class KeyLimits(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    rpm: Annotated[StrictInt, Field(ge=0)] = 0  # requests per minute
    tpm: Annotated[StrictInt, Field(ge=0)] = 0  # prompt and output tokens per minute
    max_concurrent: Annotated[StrictInt, Field(ge=0)] = 0  # requests at once
    # Service tiers (core/tiers.py): the one a request asking `auto` (or nothing) gets, and the
    # highest it may ask for; a key may ask for priority only when allowed.
    default_tier: TierName = "default"
    max_tier: TierName = "default"

    @pydantic.model_validator(mode="after")
    def _default_within_ceiling(self) -> KeyLimits:
        if Tier.named(self.default_tier) < Tier.named(self.max_tier):
            raise ValueError(f"default_tier {self.default_tier!r} is above max_tier {self.max_tier!r}")
        return self

    def tier(self, asked: str | None) -> Tier:
        """The tier a request of this key asking `asked` is served in (core/tiers.resolve)."""
        return tiers.resolve(asked, Tier.named(self.default_tier), Tier.named(self.max_tier))


class StoredKey(KeyLimits):
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


EntryT = TypeVar("EntryT", bound=KeyLimits)


class _KeysFile(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    keys: dict[Annotated[str, Field(pattern=NAME_PATTERN)], StoredKey] = {}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def bearer_digest(authorization: str) -> str | None:
    """The digest of the key an `Authorization: Bearer KEY` header presents (None: no key of ours)."""
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.startswith(KEY_PREFIX):
        return None
    return digest(key.strip())


def _read(path: Path) -> _KeysFile:
    try:
        return _KeysFile.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no such file (make one with `fedctl keys add NAME --file {path}`)") from None
    except OSError as exc:
        raise KeyFileError(f"{path}: {exc.strerror}") from None
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise KeyFileError(f"{path}: {where or 'the file'}: {first['msg']}") from None


def add(path: Path, name: str, limits: KeyLimits) -> str:
    """A new key named `name` in the file at `path` (made if missing); returns the key, which is
    nowhere else. Refused for a name already there (remove it from the file first)."""
    stored = _read(path) if path.exists() else _KeysFile()
    if name in stored.keys:
        raise KeyFileError(f"{path}: a key named {name!r} exists")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    entry = StoredKey(sha256=digest(key), **limits.model_dump())
    try:
        updated = _KeysFile.model_validate({"keys": {**stored.keys, name: entry}})
    except pydantic.ValidationError:
        raise KeyFileError(f"{name!r}: a key's name is 1-64 letters, digits, '.', '_' or '-'") from None
    _save(path, updated)
    return key


def listed(path: Path) -> dict[str, StoredKey]:
    """Every key of the file, by name (hashes and limits; keys themselves are nowhere)."""
    return dict(sorted(_read(path).keys.items()))


def revoke(path: Path, name: str) -> None:
    """The key gone from the file: every gateway reading it refuses it within a second."""
    stored = _read(path)
    if name not in stored.keys:
        raise KeyFileError(f"{path}: no key named {name!r}")
    _save(path, _KeysFile(keys={n: k for n, k in stored.keys.items() if n != name}))


def changed(entry: EntryT, changes: dict[str, int | str]) -> EntryT:
    """`entry` with `changes`, checked as a new entry would be (a default tier above the ceiling
    is refused)."""
    try:
        return type(entry).model_validate({**entry.model_dump(), **changes})
    except pydantic.ValidationError as exc:
        raise KeyFileError(str(exc.errors()[0]["msg"]).removeprefix("Value error, ")) from None


def set_limits(path: Path, name: str, changes: dict[str, int | str]) -> StoredKey:
    """The key's limits changed (only those named); returns the entry as it now is."""
    stored = _read(path)
    if name not in stored.keys:
        raise KeyFileError(f"{path}: no key named {name!r}")
    entry = changed(stored.keys[name], changes)
    _save(path, _KeysFile(keys={**stored.keys, name: entry}))
    return entry


def _save(path: Path, keys: _KeysFile) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # `--file keys/federation-keys.json` in a fresh checkout
    temporary = path.with_name(path.name + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(keys.model_dump(), indent=2) + "\n")
    os.replace(temporary, path)  # a gateway reading it sees the old file or the new one


def limits_of(entry: StoredKey) -> KeyLimits:
    """What a gateway serves a key by: its entry less where it is kept."""
    return KeyLimits(**entry.model_dump(include=set(KeyLimits.model_fields)))


class KeyTable(Protocol):
    """Where a gateway finds a request's key: this file's `Keys`, or a region's store (`keystore`)."""

    def holder(self, authorization: str) -> tuple[str, KeyLimits] | None: ...


class Keys:
    """The keys a gateway accepts, from its file, re-read when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._by_digest: dict[str, tuple[str, KeyLimits]] = {}
        self._mtime_ns = -1
        self._checked_at = 0.0
        self._load()  # a bad file is an error at start; later, the last good one serves on

    def _load(self) -> None:
        mtime_ns = self.path.stat().st_mtime_ns if self.path.exists() else -1
        stored = _read(self.path)
        self._by_digest = {k.sha256: (name, limits_of(k)) for name, k in stored.keys.items()}
        self._mtime_ns = mtime_ns

    def holder(self, authorization: str) -> tuple[str, KeyLimits] | None:
        """The name and limits of the key an `Authorization` header presents; None if none is known."""
        now = time.monotonic()
        if now - self._checked_at >= RELOAD_CHECK_S:
            self._checked_at = now
            self._reload_if_changed()
        return self._by_digest.get(bearer_digest(authorization) or "")

    def _reload_if_changed(self) -> None:
        try:
            if self.path.stat().st_mtime_ns != self._mtime_ns:
                self._load()
        except (OSError, KeyFileError) as exc:  # the last good keys serve on; the next change is tried
            log.warning("keys.reload_failed", path=str(self.path), error=str(exc))
            self._mtime_ns = -2  # tried: not again until the file changes
            with contextlib.suppress(OSError):
                self._mtime_ns = self.path.stat().st_mtime_ns
