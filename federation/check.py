"""`fedctl check`: a deployment's config file checked before any process starts from it.

What `fedctl up` checks when it reads a file (every key's type and bounds, the links between the
regions in use, the recipes, two listeners on one port of one machine), and what only a real
deployment has: the certificates the file's `tls` names exist, are signed by its CA, and each
names the process that will present it (the schedulers, the gateway, each site); the gateway's
API keys file reads. Each fault is one line, so an operator fixes them all in one pass.
"""

from __future__ import annotations

from pathlib import Path

from core.config import Config, ConfigError, load
from core.mtls import load_tls
from core.pki import GATEWAY, SCHEDULER, Identity, PkiError, Role, signed_by
from federation.gateway.keys import KeyFileError, Keys


def faults(path: Path | None) -> tuple[Config | None, list[str]]:
    """The file's config (None when it cannot be read as one) and every fault found in it."""
    try:
        config = load(path)
    except ConfigError as exc:
        return None, [str(exc)]
    source = str(path) if path else "the built-in default"
    found = [f"{source}: {fault}" for fault in _certificates(config) + _keys(config)]
    return config, found


def _certificates(config: Config) -> list[str]:
    if config.tls is None:
        return []
    ca = config.tls.ca
    if not ca.is_file():
        return [f"tls.ca {ca}: no such file"]
    found = []
    for identity in (SCHEDULER, GATEWAY, *(Identity(Role.SITE, s.name) for s in config.sites)):
        cert, key = config.tls.files(identity)
        try:
            load_tls(ca, cert, key, identity)
            if not signed_by(ca.read_bytes(), cert.read_bytes()):
                found.append(f"tls: {cert} is not signed by the CA in {ca}")
        except PkiError as exc:
            found.append(f"tls: {exc}")
    return found


def _keys(config: Config) -> list[str]:
    if not config.gateway.api_keys:
        return []
    try:
        Keys(Path(config.gateway.api_keys))
    except KeyFileError as exc:
        return [f"gateway.api_keys: {exc}"]
    return []


def summary(config: Config) -> str:
    where = "across machines" if config.across_machines else f"on {config.host}"
    return (
        f"{len(config.sites)} sites ({', '.join(s.name for s in config.sites)}), "
        f"{config.scheduler.replicas} scheduler replicas, {where}"
        + (", certificates checked" if config.tls else ", no tls section: each process needs --ca/--cert/--key")
    )
